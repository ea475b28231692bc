"""The reader-side bound on PENDING, per request tag. Pure; imports only the shared records.

An engine request that keeps finding its prefix blocked by one PENDING key
should not defer forever: with ``max_pending_wait`` set, the tag's state
remembers the first blocking PENDING key and when the request began waiting
on it. The same key accrues; a different blocking key re-arms; a lookup
with nothing pending disarms. Once the bound passes, that key counts as
MISS for this request, so the prefix is truncated there and never counted
as a hit. RETRY never expires by this rule.

A released tag leaves a tombstone: a lookup answered by the lookup process
before the release, and heard of after it (``reported``), changes no state,
so a finished request leaves none behind. Tombstones are bounded as tags
are (count and idle time); a lookup the daemon answers itself clears its
tag's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.model import MISS, PENDING


@dataclass(slots=True)
class TagState:
    key: bytes | None  # the blocking PENDING key; None when disarmed
    since: float
    last_seen: float
    expired: bool = False


@dataclass(slots=True, frozen=True)
class BoundResult:
    """What one lookup's evaluation decided."""

    expired_index: int | None  # the key to answer MISS, if the bound passed
    newly_expired: bool  # the bound passed on this lookup (count it once)
    ends_deferral: float | None  # seconds the request was deferred, when a wait ended
    expires_at: float | None  # when the bound will pass, if armed and not yet passed


def blocking_pending(states: Sequence[int]) -> int | None:
    """Index of the first PENDING key before any MISS (the one blocking the prefix)."""
    for i, state in enumerate(states):
        if state == PENDING:
            return i
        if state == MISS:
            return None
    return None


class DeferralTracker:
    """Per-tag state, bounded in count and dropped after ``idle_ttl``."""

    def __init__(self, idle_ttl: float, max_tags: int) -> None:
        self.idle_ttl = idle_ttl
        self.max_tags = max_tags
        self._tags: OrderedDict[bytes, TagState] = OrderedDict()
        #: tags released, and when, oldest first
        self._released: OrderedDict[bytes, float] = OrderedDict()

    def __repr__(self) -> str:
        return f"<DeferralTracker tags={len(self._tags)} released={len(self._released)}>"

    def __len__(self) -> int:
        return len(self._tags)

    def get(self, tag: bytes) -> TagState | None:
        return self._tags.get(tag)

    def observe(
        self,
        tag: bytes,
        keys: Sequence[bytes],
        states: Sequence[int],
        bound: float,
        now: float,
        *,
        reported: bool = False,
    ) -> BoundResult:
        """Update ``tag``'s state from one lookup's states (``bound > 0``).
        ``reported``: a lookup answered elsewhere, heard of now; one of a tag
        released meanwhile changes nothing."""
        if reported and tag in self._released:
            return _UNCHANGED
        self._released.pop(tag, None)
        idx = blocking_pending(states)
        state = self._tags.get(tag)
        if state is None:
            state = TagState(None, now, now)
            self._tags[tag] = state
            while len(self._tags) > self.max_tags:
                self._tags.popitem(last=False)
        self._tags.move_to_end(tag)
        state.last_seen = now
        ended: float | None = None
        if idx is None:
            if state.key is not None:
                ended = now - state.since
            state.key, state.since, state.expired = None, now, False
            return BoundResult(None, False, ended, None)
        key = keys[idx]
        if state.key != key:
            if state.key is not None:
                ended = now - state.since
            state.key, state.since, state.expired = key, now, False
        if now - state.since >= bound:
            newly = not state.expired
            state.expired = True
            return BoundResult(idx, newly, ended, None)
        return BoundResult(None, False, ended, state.since + bound)

    def release(self, tag: bytes, now: float) -> float | None:
        """Forget ``tag``; returns how long it had been deferred, if it was."""
        self._released[tag] = now
        self._released.move_to_end(tag)
        while len(self._released) > self.max_tags:
            self._released.popitem(last=False)
        state = self._tags.pop(tag, None)
        if state is None or state.key is None:
            return None
        return now - state.since

    def expire(self, now: float) -> int:
        """Drop tags idle for ``idle_ttl``; oldest are first in the order."""
        dropped = 0
        while self._tags:
            tag, state = next(iter(self._tags.items()))
            if now - state.last_seen < self.idle_ttl:
                break
            del self._tags[tag]
            dropped += 1
        released = self._released
        while released and now - next(iter(released.values())) >= self.idle_ttl:
            released.popitem(last=False)
        return dropped


_UNCHANGED = BoundResult(None, False, None, None)

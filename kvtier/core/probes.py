"""Single-flight existence probes for one remote tier, with a verdict cache.

A :class:`ProbeMap` maps key -> the in-flight probe of that key (an
``asyncio.Future`` of its :class:`Verdict`) and key -> the last verdict, kept
for a bounded time and count. Invariants:

* at most one probe per key is in flight; every other caller joins it;
* only the probe that owns a map entry may write it: a probe superseded by
  :meth:`ProbeMap.invalidate` resolves its own future but writes nothing;
* every probe handed out by :meth:`begin` is resolved by :meth:`complete`
  (callers do that in ``finally``), so no key stays in flight;
* with no traffic, the in-flight map is empty and verdicts age out.

No I/O happens here; the service runs the backend calls and reports back.
Imports nothing of kvtier.
"""

from __future__ import annotations

import asyncio
import enum
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field


class Verdict(enum.Enum):
    PRESENT = "present"
    ABSENT = "absent"
    ERROR = "error"  # the backend failed or timed out: answered as MISS


@dataclass(slots=True, eq=False)
class Probe:
    """One in-flight probe of one key. Identity is ownership."""

    key: bytes
    future: asyncio.Future[Verdict] = field(repr=False)


@dataclass(slots=True)
class _Cached:
    verdict: Verdict
    expires: float


class ProbeMap:
    def __init__(
        self,
        name: str,
        *,
        verdict_ttl: float,
        error_ttl: float,
        max_verdicts: int,
    ) -> None:
        self.name = name
        self.verdict_ttl = verdict_ttl
        self.error_ttl = error_ttl
        self.max_verdicts = max_verdicts
        self._inflight: dict[bytes, Probe] = {}
        #: the probe of a key in flight, or None: the dict's own ``get``, as
        #: every lookup of a key no local tier holds asks it
        self.inflight: Callable[[bytes], Probe | None] = self._inflight.get
        self._verdicts: OrderedDict[bytes, _Cached] = OrderedDict()

    def __repr__(self) -> str:
        return (
            f"<ProbeMap {self.name} inflight={len(self._inflight)} verdicts={len(self._verdicts)}>"
        )

    @property
    def inflight_count(self) -> int:
        return len(self._inflight)

    @property
    def verdict_count(self) -> int:
        return len(self._verdicts)

    # -- reads

    def verdict(self, key: bytes, now: float) -> Verdict | None:
        """The cached verdict of ``key``, if still fresh."""
        cached = self._verdicts.get(key)
        if cached is None:
            return None
        if cached.expires <= now:
            del self._verdicts[key]
            return None
        return cached.verdict

    # -- probe lifecycle

    def begin(self, key: bytes, loop: asyncio.AbstractEventLoop) -> Probe:
        """Register a new probe of ``key``; the caller must :meth:`complete` it."""
        assert key not in self._inflight, "join the probe in flight instead"
        probe = Probe(key, loop.create_future())
        self._inflight[key] = probe
        return probe

    def complete(self, probe: Probe, verdict: Verdict, now: float) -> bool:
        """Resolve ``probe``. Returns False when it was superseded (nothing cached)."""
        if not probe.future.done():
            probe.future.set_result(verdict)
        if self._inflight.get(probe.key) is not probe:
            return False
        del self._inflight[probe.key]
        self._remember(probe.key, verdict, now)
        return True

    def _remember(self, key: bytes, verdict: Verdict, now: float) -> None:
        ttl = self.error_ttl if verdict is Verdict.ERROR else self.verdict_ttl
        if ttl <= 0:
            self._verdicts.pop(key, None)
            return
        self._verdicts[key] = _Cached(verdict, now + ttl)
        self._verdicts.move_to_end(key)
        while len(self._verdicts) > self.max_verdicts:
            self._verdicts.popitem(last=False)

    # -- truth changed

    def invalidate(self, key: bytes) -> None:
        """Forget everything about ``key``; a probe in flight becomes superseded."""
        self._verdicts.pop(key, None)
        self._inflight.pop(key, None)

    def force(self, key: bytes, verdict: Verdict, now: float) -> None:
        """Set ``key``'s verdict (a failed load forces ABSENT), superseding any probe."""
        self._inflight.pop(key, None)
        self._remember(key, verdict, now)

    def abandon_all(self) -> int:
        """Resolve every probe in flight as ERROR and forget it (shutdown)."""
        probes, self._inflight = list(self._inflight.values()), {}
        for probe in probes:
            if not probe.future.done():
                probe.future.set_result(Verdict.ERROR)
        return len(probes)

    def expire(self, now: float) -> int:
        """Drop stale verdicts; returns how many went."""
        stale = [k for k, c in self._verdicts.items() if c.expires <= now]
        for key in stale:
            del self._verdicts[key]
        return len(stale)

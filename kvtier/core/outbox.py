"""The writes a remote tier is owed: blocks written through to it that it
has not taken yet (its store was down, slow or refused them). Pure.

A write that fails, or that finds the tier behind already, is owed instead
of dropped: the outbox keeps its key, its size and, where no local copy
outlives the daemon, its value, oldest first, and the propagation sends
them again, oldest first, once the tier answers (:mod:`kvtier.core.propagation`
acts on it). The outbox is bounded by the bytes of the blocks it owes; past
the bound the oldest are given up (a cache keeps its newest blocks first).

Invariants: each key is owed at most once; ``bytes`` is the sum of the
owed sizes and, after any call, at most ``max_bytes``; the keys sent
(:meth:`take`) are owed until :meth:`sent` or :meth:`failed` ends them;
:meth:`failed` puts an entry back at its age (it keeps its place in line);
every entry that leaves, by any method, is returned to the caller once, so
what it holds (a value kept for it) is let go exactly once. Imports the
shared records only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvtier.model import Buffer


@dataclass(slots=True, eq=False)
class Owed:
    """One block a tier is owed."""

    key: bytes
    size: int
    #: the block's bytes, kept while only this daemon's memory holds them;
    #: None: read again from the local tiers when sent (the disk has it)
    value: Buffer | None
    #: sent now (:meth:`Outbox.take`): not taken again until it ends
    sending: bool = False
    #: RAM evicted it (a write-back tier's demotion), counted as one when sent
    demoted: bool = False


class Outbox:
    """The blocks one remote tier is owed, oldest first (see the module)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"an outbox needs max_bytes >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        #: owed blocks by key, in the order they were owed
        self._owed: dict[bytes, Owed] = {}
        self.bytes = 0
        #: entries being sent now
        self.sending = 0

    def __repr__(self) -> str:
        return (
            f"<Outbox owed={len(self._owed)} bytes={self.bytes}/{self.max_bytes} "
            f"sending={self.sending}>"
        )

    def __len__(self) -> int:
        return len(self._owed)

    def __contains__(self, key: object) -> bool:
        return key in self._owed

    @property
    def waiting(self) -> int:
        """Owed blocks not being sent now."""
        return len(self._owed) - self.sending

    def owe(
        self, key: bytes, size: int, value: Buffer | None, *, demoted: bool = False
    ) -> list[Owed]:
        """Owe ``key``'s block (``value``: its bytes, or None where a local
        tier keeps them). Returns the entries given up to stay within the
        bound, oldest first, and ``key``'s own new entry last when it does
        not fit. A key owed already stays as it is (the same block)."""
        if key in self._owed:
            return []
        if size > self.max_bytes:
            return [Owed(key, size, value, demoted=demoted)]
        dropped: list[Owed] = []
        excess = self.bytes + size - self.max_bytes
        if excess > 0:
            # The oldest first; one being sent ends by sent() or failed().
            for old in self._owed.values():
                if excess <= 0:
                    break
                if not old.sending:
                    dropped.append(old)
                    excess -= old.size
            for old in dropped:
                self._remove(old)
            if excess > 0:
                return [*dropped, Owed(key, size, value, demoted=demoted)]
        self._owed[key] = Owed(key, size, value, demoted=demoted)
        self.bytes += size
        return dropped

    def take(self, most: int) -> list[Owed]:
        """Up to ``most`` of the oldest entries not being sent, now being sent."""
        taken: list[Owed] = []
        if most <= 0:
            return taken
        for owed in self._owed.values():
            if not owed.sending:
                owed.sending = True
                taken.append(owed)
                if len(taken) == most:
                    break
        self.sending += len(taken)
        return taken

    def sent(self, owed: Owed) -> Owed | None:
        """``owed`` reached its tier: it leaves (returned; None if it had left)."""
        if self._owed.get(owed.key) is not owed:
            return None
        self._end_sending(owed)
        return self._remove(owed)

    def failed(self, owed: Owed) -> None:
        """``owed`` did not reach its tier: still owed, at its place in line."""
        if self._owed.get(owed.key) is owed:
            self._end_sending(owed)

    def forget(self, keys: Iterable[bytes]) -> list[Owed]:
        """No longer owe ``keys`` (deleted): the entries that left. One being
        sent now leaves too; its sending ends without it."""
        gone: list[Owed] = []
        for key in keys:
            owed = self._owed.get(key)
            if owed is not None:
                self._end_sending(owed)
                gone.append(self._remove(owed))
        return gone

    def clear(self) -> list[Owed]:
        """Every entry leaves (the daemon stops): returned, oldest first."""
        gone = list(self._owed.values())
        self._owed.clear()
        self.bytes = self.sending = 0
        for owed in gone:
            owed.sending = False
        return gone

    def _end_sending(self, owed: Owed) -> None:
        if owed.sending:
            owed.sending = False
            self.sending -= 1

    def _remove(self, owed: Owed) -> Owed:
        del self._owed[owed.key]
        self.bytes -= owed.size
        return owed

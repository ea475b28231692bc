"""Leases on RAM blocks in motion: the acting half of :mod:`kvtier.core.shared.leases`.

A client that opted in reads RAM blocks in place: GET_SHARED pins the
blocks (the GET path's own pins) and hands the pins of those in the arena
to one lease, whose id every one of them carries; it ends when the client
releases it, when its connection closes, or at the lease deadline
(revoked, counted and logged).

Invariants: a block under a lease keeps its bytes (its pin is the lease's,
given back exactly once when the lease ends, however it ends); one
GET_SHARED grants at most one lease, and ending it gives back every pin it
holds in one call; a value not in the arena gets no lease (its bytes are
answered, still pinned, and the caller unpins them once sent). Imports the
pure lease table, the RAM tier and the shared records.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from kvtier.core.shared.leases import Lease, LeaseEnd, LeaseTable
from kvtier.model import Buffer, ConnId, Leased
from kvtier.tiers.ram import Slots

log = logging.getLogger("kvtier.shared")


class Leasing:
    """Leases granted on pinned RAM blocks, and the pins they hold."""

    def __init__(
        self,
        slots: Slots,
        unpin: Callable[[Sequence[bytes], Sequence[Buffer | None]], None],
        now: Callable[[], float],
        timeout: float,
    ) -> None:
        self.slots = slots
        self._unpin = unpin
        self._now = now
        #: how long a lease granted from now on lasts (reloadable)
        self.timeout = timeout
        self.table = LeaseTable(on_end=self._ended)
        #: the values each live lease pins (their pins are given back when it ends)
        self._leased: dict[int, list[Buffer]] = {}
        #: bytes of the blocks leased (read by clients without crossing the socket)
        self.leased_bytes = 0

    def __repr__(self) -> str:
        return f"<Leasing {self.table!r} timeout={self.timeout}>"

    def grant(
        self, owner: ConnId, keys: Sequence[bytes], values: Sequence[Buffer | None]
    ) -> list[Leased | Buffer | None]:
        """Answers for pinned ``values``: for the blocks in the arena, one
        lease for them all (their pins are now its), each answered with its
        place and the lease's id; the bytes for the others, still pinned (the
        caller unpins them once sent)."""
        slot_of = self.slots.slot_of
        slots = [slot_of(value) if value is not None else None for value in values]
        leased = [i for i, slot in enumerate(slots) if slot is not None]
        if not leased:
            return list(values)
        lease = self.table.grant(owner, tuple(keys[i] for i in leased), self._now() + self.timeout)
        lease_id = lease.lease_id
        out: list[Leased | Buffer | None] = list(values)
        pinned: list[Buffer] = []
        nbytes = 0
        for i in leased:
            slot, value = slots[i], values[i]
            assert slot is not None and value is not None
            pinned.append(value)
            out[i] = Leased(lease_id, slot.offset, slot.length)
            nbytes += slot.length
        self._leased[lease_id] = pinned
        self.leased_bytes += nbytes
        return out

    def unlease(self, owner: ConnId, ids: Sequence[int]) -> int:
        """End ``owner``'s leases among ``ids``; returns how many ended."""
        release = self.table.release
        return sum(release(owner, i) for i in ids)

    def _ended(self, lease: Lease, end: LeaseEnd) -> None:
        self._unpin(lease.keys, self._leased.pop(lease.lease_id))
        if end is LeaseEnd.REVOKED:
            log.warning(
                "lease %d on %d block(s) (the first: key %s) held by %s past %.1fs; revoked",
                lease.lease_id,
                len(lease.keys),
                lease.keys[0].hex(),
                lease.owner,
                self.timeout,
            )

    def connection_closed(self, owner: ConnId) -> None:
        self.table.close(owner)

    def expire(self, now: float) -> None:
        self.table.expire(now)

    def close(self) -> None:
        """End every lease (shutdown)."""
        for owner in {lease.owner for lease in self.table.live()}:
            self.table.close(owner)

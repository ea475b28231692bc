"""Leases on RAM blocks in motion: the acting half of :mod:`kvtier.core.shared.leases`.

A client that opted in reads a RAM block in place: GET_SHARED pins the
block (the GET path's own pin) and hands the pin to a lease, which ends
when the client releases it, when its connection closes, or at the lease
deadline (revoked, counted and logged).

Invariants: a block under a lease keeps its bytes (its pin is the lease's,
given back exactly once when the lease ends, however it ends); a value not
in the arena gets no lease (its bytes are answered, still pinned, and the
caller unpins them once sent). Imports the pure lease table, the RAM tier
and the shared records.
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
        #: the value each live lease pins (its pin is given back when it ends)
        self._leased: dict[int, Buffer] = {}
        #: bytes of the blocks leased (read by clients without crossing the socket)
        self.leased_bytes = 0

    def __repr__(self) -> str:
        return f"<Leasing {self.table!r} timeout={self.timeout}>"

    def grant(
        self, owner: ConnId, keys: Sequence[bytes], values: Sequence[Buffer | None]
    ) -> list[Leased | Buffer | None]:
        """Answers for pinned ``values``: a lease for each block in the arena (the
        pin is now the lease's); the bytes for the others, still pinned (the
        caller unpins them once sent)."""
        deadline = self._now() + self.timeout
        out: list[Leased | Buffer | None] = []
        for key, value in zip(keys, values, strict=True):
            slot = self.slots.slot_of(value) if value is not None else None
            if slot is None:
                out.append(value)
                continue
            assert value is not None
            lease = self.table.grant(owner, key, deadline)
            self._leased[lease.lease_id] = value
            out.append(Leased(lease.lease_id, slot.offset, slot.length))
            self.leased_bytes += slot.length
        return out

    def unlease(self, owner: ConnId, ids: Sequence[int]) -> int:
        """End ``owner``'s leases among ``ids``; returns how many ended."""
        release = self.table.release
        return sum(release(owner, i) for i in ids)

    def _ended(self, lease: Lease, end: LeaseEnd) -> None:
        value = self._leased.pop(lease.lease_id)
        self._unpin([lease.key], [value])
        if end is LeaseEnd.REVOKED:
            log.warning(
                "lease %d on key %s held by %s past %.1fs; revoked",
                lease.lease_id,
                lease.key.hex(),
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

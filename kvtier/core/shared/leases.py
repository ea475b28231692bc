"""Leases: a client reading a block in place holds it until it says it is done. Pure.

A lease names the blocks a connection may read from the shared arena: the
blocks of one GET_SHARED, granted and given back together. While a lease
is held its blocks are pinned (eviction skips them, and a writer storing a
key again gets a new allocation instead of overwriting it). A lease ends
when its holder releases it, when its holder's connection closes (every
lease of that connection at once), or at its deadline, when it is
*revoked* and counted: a client that forgets to release cannot pin memory
for ever.

Invariants: every lease ends exactly once, by exactly one of release,
close or revoke, and ``on_end(lease)`` runs once per lease then; granting
and ending cost the same for one block or a thousand; nothing is left
after every holder has closed. Leases are granted with non-decreasing deadlines (one
timeout), so the oldest live lease is the next to expire and an ended
lease leaves nothing behind.
"""

from __future__ import annotations

import enum
import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.model import ConnId


class LeaseEnd(enum.Enum):
    RELEASED = "released"
    CLOSED = "closed"  # the holder's connection went away
    REVOKED = "revoked"  # past its deadline


@dataclass(slots=True)
class Lease:
    lease_id: int
    owner: ConnId
    #: the blocks it pins
    keys: tuple[bytes, ...]
    deadline: float


@dataclass
class LeaseTable:
    #: runs once for each lease that ends: the block's pin is dropped
    on_end: Callable[[Lease, LeaseEnd], None] = lambda lease, end: None
    #: live leases in the order granted, hence of their deadlines
    _leases: OrderedDict[int, Lease] = field(default_factory=OrderedDict)
    _by_owner: dict[ConnId, set[int]] = field(default_factory=dict)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    ended: dict[LeaseEnd, int] = field(default_factory=lambda: dict.fromkeys(LeaseEnd, 0))

    def __repr__(self) -> str:
        return (
            f"<LeaseTable live={len(self._leases)} owners={len(self._by_owner)} "
            f"revoked={self.ended[LeaseEnd.REVOKED]}>"
        )

    def __len__(self) -> int:
        return len(self._leases)

    def live(self) -> list[Lease]:
        return list(self._leases.values())

    def grant(self, owner: ConnId, keys: tuple[bytes, ...], deadline: float) -> Lease:
        lease = Lease(next(self._ids), owner, keys, deadline)
        self._leases[lease.lease_id] = lease
        self._by_owner.setdefault(owner, set()).add(lease.lease_id)
        return lease

    def release(self, owner: ConnId, lease_id: int) -> bool:
        """End one of ``owner``'s leases; False if it is not (or no longer) theirs."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.owner != owner:
            return False
        self._end(lease, LeaseEnd.RELEASED)
        return True

    def close(self, owner: ConnId) -> int:
        """``owner``'s connection closed: all its leases end. Returns how many."""
        ids = list(self._by_owner.get(owner, ()))
        for lease_id in ids:
            self._end(self._leases[lease_id], LeaseEnd.CLOSED)
        return len(ids)

    def expire(self, now: float) -> int:
        """Revoke every lease whose deadline has passed. Returns how many."""
        revoked = 0
        leases = self._leases
        while leases:
            lease = leases[next(iter(leases))]
            if lease.deadline > now:
                break
            self._end(lease, LeaseEnd.REVOKED)
            revoked += 1
        return revoked

    def _end(self, lease: Lease, end: LeaseEnd) -> None:
        del self._leases[lease.lease_id]
        owned = self._by_owner[lease.owner]
        owned.discard(lease.lease_id)
        if not owned:
            del self._by_owner[lease.owner]
        self.ended[end] += 1
        self.on_end(lease, end)

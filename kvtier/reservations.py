"""Pending writes: reservations by clients and promotions into RAM.

A key with a :class:`Reservation` reads PENDING. Each reservation has an
owner, a write deadline and a ``done`` future that waiters await; the
future is resolved however the reservation ends (completed by a store,
aborted, owner gone, deadline passed), so nothing is pending forever. The
table only decides and records; the service frees space, resolves metrics
and logs. Imports nothing of kvtier.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


class End(enum.Enum):
    COMPLETED = "completed"
    ABORTED = "aborted"
    RELEASED = "released"  # the owner's connection closed
    EXPIRED = "expired"


@dataclass(slots=True, eq=False)
class Reservation:
    key: bytes
    owner: str  # "conn#12" for clients, "promotion:<tier>" for promotions
    owner_id: int  # connection id; 0 for promotions
    deadline: float
    size: int
    started: float
    done: asyncio.Future[End] = field(repr=False)
    timer: Any = field(default=None, repr=False)  # the scheduler's deadline timer
    task: asyncio.Task[Any] | None = field(default=None, repr=False)  # a promotion's task


class ReservationTable:
    def __init__(self) -> None:
        self._by_key: dict[bytes, Reservation] = {}
        self._by_owner: dict[int, set[bytes]] = {}

    def __repr__(self) -> str:
        return f"<ReservationTable pending={len(self._by_key)} owners={len(self._by_owner)}>"

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: bytes) -> bool:
        return key in self._by_key

    def get(self, key: bytes) -> Reservation | None:
        return self._by_key.get(key)

    def add(
        self,
        key: bytes,
        owner: str,
        owner_id: int,
        deadline: float,
        size: int,
        now: float,
        loop: asyncio.AbstractEventLoop,
    ) -> Reservation:
        assert key not in self._by_key, "a key has at most one pending write"
        res = Reservation(key, owner, owner_id, deadline, size, now, loop.create_future())
        self._by_key[key] = res
        if owner_id:
            self._by_owner.setdefault(owner_id, set()).add(key)
        return res

    def end(self, res: Reservation, how: End) -> bool:
        """Remove ``res`` and resolve its waiters. False if it had already ended."""
        if self._by_key.get(res.key) is not res:
            return False
        del self._by_key[res.key]
        if res.owner_id:
            keys = self._by_owner.get(res.owner_id)
            if keys is not None:
                keys.discard(res.key)
                if not keys:
                    del self._by_owner[res.owner_id]
        if not res.done.done():
            res.done.set_result(how)
        return True

    def owned_by(self, owner_id: int) -> list[Reservation]:
        return [self._by_key[k] for k in self._by_owner.get(owner_id, ())]

    def all(self) -> Iterable[Reservation]:
        return list(self._by_key.values())

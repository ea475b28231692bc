"""Pending writes: reservations by clients and promotions into RAM.

A key with a :class:`Reservation` reads PENDING. Each reservation has a
typed owner (a client connection, or a promotion from a named tier), a
write deadline and a ``done`` future that waiters await. Invariants:

* a key has at most one pending write;
* ``done`` is resolved however the reservation ends (completed by a store,
  aborted, owner gone, deadline passed), so nothing is pending forever;
* only the reservation that holds a key's entry can end it (a stale handle
  ends nothing);
* the watcher hears every change of a key's pending state once, in the
  order they were made: at once, or, within :meth:`ReservationTable.held_back`,
  all together when the outermost block ends.

The table only decides and records; the service frees space, arms timers,
counts and logs. Imports only the shared records.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.model import ConnId


class End(enum.Enum):
    COMPLETED = "completed"
    ABORTED = "aborted"
    RELEASED = "released"  # the owner's connection closed
    EXPIRED = "expired"


@dataclass(slots=True, frozen=True)
class Promotion:
    """A load from a lower tier into RAM, owned by no client."""

    source: str  # the tier the block comes from

    def __str__(self) -> str:
        return f"promotion from {self.source}"


#: who will complete a pending write
Owner = ConnId | Promotion


@dataclass(slots=True, eq=False)
class Reservation:
    key: bytes
    owner: Owner
    deadline: float
    size: int  # bytes of RAM held for the block (0: none)
    started: float
    done: asyncio.Future[End] = field(repr=False)
    timer: Any = field(default=None, repr=False)  # the scheduler's deadline timer
    task: asyncio.Task[Any] | None = field(default=None, repr=False)  # a promotion's task


class ReservationTable:
    def __init__(self) -> None:
        self._by_key: dict[bytes, Reservation] = {}
        #: the pending write of a key, or None: the dict's own ``get``, as every
        #: lookup asks it of every key it cannot find in RAM or on disk
        self.get: Callable[[bytes], Reservation | None] = self._by_key.get
        #: keys reserved by each client connection (promotions are not indexed)
        self._by_owner: dict[ConnId, set[bytes]] = {}
        #: while watched (:meth:`watch`): told of keys' changes of pending
        #: state (each key, and whether it is pending now)
        self._watcher: Callable[[Sequence[tuple[bytes, bool]]], None] | None = None
        #: the changes held back for the watcher (:meth:`held_back`), or None
        self._held: list[tuple[bytes, bool]] | None = None

    def __repr__(self) -> str:
        watched = " watched" if self._watcher is not None else ""
        return (
            f"<ReservationTable pending={len(self._by_key)} owners={len(self._by_owner)}{watched}>"
        )

    def watch(self, watcher: Callable[[Sequence[tuple[bytes, bool]]], None]) -> None:
        """Tell ``watcher`` of every key's change of pending state from now on."""
        self._watcher = watcher

    @contextlib.contextmanager
    def held_back(self) -> Iterator[None]:
        """The changes made within are told to the watcher all at once, in
        their order, when the outermost such block ends (a batch's: one
        word for many keys, and after whatever the block's caller tells
        first, such as the batch's blocks now held)."""
        if self._held is not None:
            yield  # (nested: the outermost block tells)
            return
        self._held = []
        try:
            yield
        finally:
            held, self._held = self._held, None
            if held and self._watcher is not None:
                self._watcher(held)

    def _changed(self, key: bytes, pending: bool) -> None:
        if self._held is not None:
            self._held.append((key, pending))
        elif self._watcher is not None:
            self._watcher(((key, pending),))

    def unwatch(self) -> None:
        self._watcher = None

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: bytes) -> bool:
        return key in self._by_key

    def add(
        self,
        key: bytes,
        owner: Owner,
        deadline: float,
        size: int,
        now: float,
        loop: asyncio.AbstractEventLoop,
    ) -> Reservation:
        assert key not in self._by_key, "a key has at most one pending write"
        res = Reservation(key, owner, deadline, size, now, loop.create_future())
        self._by_key[key] = res
        if isinstance(owner, ConnId):
            self._by_owner.setdefault(owner, set()).add(key)
        if self._watcher is not None:
            self._changed(key, True)
        return res

    def end(self, res: Reservation, how: End) -> bool:
        """Remove ``res`` and resolve its waiters. False if it had already ended."""
        if self._by_key.get(res.key) is not res:
            return False
        del self._by_key[res.key]
        if isinstance(res.owner, ConnId):
            keys = self._by_owner.get(res.owner)
            if keys is not None:
                keys.discard(res.key)
                if not keys:
                    del self._by_owner[res.owner]
        if self._watcher is not None:
            self._changed(res.key, False)
        if not res.done.done():
            res.done.set_result(how)
        return True

    def owned_by(self, owner: ConnId) -> list[Reservation]:
        return [self._by_key[k] for k in self._by_owner.get(owner, ())]

    def all(self) -> Iterable[Reservation]:
        return list(self._by_key.values())

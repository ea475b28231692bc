"""Pending writes in motion: the acting half of :mod:`kvtier.core.writes`.

:mod:`kvtier.core.writes` decides (the table of pending writes, one a key,
its owner and its ``done``); :class:`PendingWrites` acts: a deadline timer
for each, the RAM each holds, ending them. Imports the pure table, the
scheduler, the RAM tier and the counters; the service owns one.
"""

from __future__ import annotations

import asyncio
import logging

from kvtier.core.counts import CoreCounters
from kvtier.core.timers import Scheduler, Timer
from kvtier.core.writes import End, Owner, Reservation, ReservationTable
from kvtier.model import ConnId
from kvtier.tiers.ram import HeldKind, RamTier

log = logging.getLogger("kvtier.service")


class Deadline:
    """One deadline timer for a batch's reservations, all of one deadline (a
    store's keys): armed with the first, cancelled once the last has ended
    (armed again for one made after that), so a batch pays for one timer,
    not one a key. At the deadline, each of them still pending expires as
    if it had its own."""

    __slots__ = ("left", "members", "timer")

    def __init__(self) -> None:
        self.timer: Timer | None = None
        #: the batch's reservations, and how many of them have not ended
        self.members: list[Reservation] = []
        self.left = 0

    def __repr__(self) -> str:
        return f"<Deadline {self.left}/{len(self.members)} pending>"


class PendingWrites:
    """Pending writes in motion: the acting half of
    :class:`~kvtier.core.writes.ReservationTable`.

    It arms one scheduler timer per pending key and gives back the RAM a
    reservation holds. Invariants (the second seed lesson):

    * every reservation it creates has a deadline timer, its own or its
      batch's (a :class:`Deadline`); however it ends, its own timer is
      cancelled (a batch's once the last of its reservations has ended), the
      RAM held for it is given back and its waiters are woken (``done``
      resolved) - nothing is pending forever;
    * at the deadline the write is aborted, counted
      (``pending_deadline_expired``) and logged with the key and the writer;
      a promotion's task is cancelled with it;
    * the room a reservation holds yields, oldest first, to a block that
      needs it now (a :class:`~kvtier.tiers.ram.Keeper` of the RAM tier):
      the reservation stays pending, and its PUT makes its room on arrival.
    """

    def __init__(self, ram: RamTier, scheduler: Scheduler, counters: CoreCounters) -> None:
        self.table = ReservationTable()
        self._ram = ram
        self._scheduler = scheduler
        self._counters = counters
        #: bytes of reservations' room given to blocks that needed it
        self.yielded = 0
        ram.keepers.append(self)

    def __repr__(self) -> str:
        return f"<PendingWrites {self.table!r} timers={self._scheduler.timer_count}>"

    def reserve(
        self,
        key: bytes,
        owner: Owner,
        deadline: float,
        size: int,
        now: float,
        batch: Deadline | None = None,
    ) -> Reservation:
        """A pending write of ``key`` for ``deadline`` seconds, holding ``size``
        bytes of RAM; timed by ``batch``'s one timer where given (each of a
        batch's reservations is made with the same ``deadline`` and ``now``)."""
        res = self.table.add(key, owner, now + deadline, size, now, asyncio.get_running_loop())
        if batch is None:
            res.timer = self._scheduler.call_at(res.deadline, lambda: self._expire(res))
            return res
        if not batch.left:  # its first, or all before it have ended (their timer with them)
            batch.timer = self._scheduler.call_at(res.deadline, lambda: self._expire_all(batch))
        batch.members.append(res)
        batch.left += 1
        res.timer = batch
        return res

    def hold(self, res: Reservation, size: int) -> None:
        """``res`` holds ``size`` bytes of RAM again (room given back by
        :meth:`claim` for a slot that could not be had), without evicting:
        the bytes were free a moment ago."""
        self._ram.hold_room(size)
        res.size = size

    # -- the room reservations hold (a Keeper of the RAM tier)

    yields = HeldKind.RESERVATIONS

    def held(self) -> dict[HeldKind, int]:
        return {}  # (the RAM tier counts its reservations' bytes itself)

    def reclaim(self, need: int) -> int:
        """Take the room of the oldest reservations, ``need`` bytes or more
        where they hold it, for a block that is here now: they stay pending
        (readers still wait for their PUT), which makes its room when it
        arrives."""
        freed = 0
        for res in self.table.all():
            if freed >= need:
                break
            if res.size:
                freed += res.size
                self.claim(res)
        self.yielded += freed
        return freed

    def claim(self, res: Reservation) -> None:
        """A store is completing ``res``: the RAM it held is given back now."""
        if res.size:
            self._ram.release(res.size)
            res.size = 0

    def end(self, res: Reservation, how: End) -> bool:
        """End ``res`` (resolving its waiters); False if it had already ended."""
        if not self.table.end(res, how):
            return False
        timer = res.timer
        if isinstance(timer, Deadline):
            timer.left -= 1
            if not timer.left:  # the batch's last
                self._scheduler.cancel(timer.timer)
                timer.members.clear()
        else:
            self._scheduler.cancel(timer)
        if res.size:
            self._ram.release(res.size)
        if isinstance(res.owner, ConnId):
            self._counters.reservations.inc(how.value)
        return True

    def end_owned_by(self, owner: ConnId, how: End) -> int:
        owned = self.table.owned_by(owner)
        for res in owned:
            self.end(res, how)
        return len(owned)

    def end_all(self) -> None:
        for res in self.table.all():
            self.end(res, End.ABORTED)

    def _expire_all(self, batch: Deadline) -> None:
        for res in list(batch.members):
            self._expire(res)

    def _expire(self, res: Reservation) -> None:
        if not self.end(res, End.EXPIRED):
            return
        self._counters.pending_deadline_expired.inc()
        log.warning(
            "pending write of key %s by %s missed its deadline after %.3fs; aborted",
            res.key.hex(),
            res.owner,
            res.deadline - res.started,
        )
        if res.task is not None:
            res.task.cancel()

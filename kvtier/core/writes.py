"""Pending writes in motion: reservations with deadline timers, and promotions.

:class:`PendingWrites` owns the reservation table and arms one scheduler
timer per pending key. Invariants (the second seed lesson):

* every reservation it creates has a deadline timer; however it ends, the
  timer is cancelled, the RAM held for it is given back and its waiters are
  woken (``done`` resolved) - nothing is pending forever;
* at the deadline the write is aborted, counted
  (``pending_deadline_expired``) and logged with the key and the writer;
  a promotion's task is cancelled with it;
* a promotion stores its block only if its reservation still holds the key
  (a client's PUT may have completed it first), and ends its reservation in
  ``finally`` whatever the load did.

Imports the core's pure maps, the tiers and the shared records.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from kvtier.core.counts import CoreCounters, Promoted
from kvtier.core.pending import End, Owner, Promotion, Reservation, ReservationTable
from kvtier.core.scheduler import Scheduler
from kvtier.model import Buffer, ConnId
from kvtier.tiers.ram import RamTier

log = logging.getLogger("kvtier.service")


class PendingWrites:
    def __init__(
        self,
        ram: RamTier,
        scheduler: Scheduler,
        counters: CoreCounters,
        *,
        load_timeout: float,
        task: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
        complete: Callable[[bytes, Buffer, str], object],
    ) -> None:
        self.table = ReservationTable()
        self._ram = ram
        self._scheduler = scheduler
        self._counters = counters
        self._load_timeout = load_timeout
        self._task = task
        #: stores a promoted block into RAM (completing its reservation)
        self._complete = complete

    def __repr__(self) -> str:
        return f"<PendingWrites {self.table!r} timers={self._scheduler.timer_count}>"

    def reserve(
        self, key: bytes, owner: Owner, deadline: float, size: int, now: float
    ) -> Reservation:
        """A pending write of ``key`` for ``deadline`` seconds, holding ``size`` bytes of RAM."""
        res = self.table.add(key, owner, now + deadline, size, now, asyncio.get_running_loop())
        res.timer = self._scheduler.call_at(res.deadline, lambda: self._expire(res))
        return res

    def claim(self, key: bytes) -> Reservation | None:
        """The pending write a store of ``key`` completes; its held RAM is given back."""
        res = self.table.get(key)
        if res is not None and res.size:
            self._ram.release(res.size)
            res.size = 0
        return res

    def end(self, res: Reservation, how: End) -> bool:
        """End ``res`` (resolving its waiters); False if it had already ended."""
        if not self.table.end(res, how):
            return False
        self._scheduler.cancel(res.timer)
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

    # -- promotions

    def promote(
        self,
        source: str,
        key: bytes,
        deadline: float,
        now: float,
        load: Callable[[], Awaitable[Buffer | None]],
        failed: Callable[[], None],
    ) -> Reservation:
        """Load ``key`` into RAM as a pending write: concurrent readers share it."""
        res = self.reserve(key, Promotion(source), deadline, 0, now)
        self._counters.promotions.inc(source, Promoted.STARTED.value)
        res.task = self._task(self._run_promotion(source, res, load, failed))
        return res

    async def _run_promotion(
        self,
        source: str,
        res: Reservation,
        load: Callable[[], Awaitable[Buffer | None]],
        failed: Callable[[], None],
    ) -> None:
        """The reservation ends whatever happens; a miss or failure calls ``failed``."""
        key = res.key
        outcome = Promoted.FAILED
        try:
            async with asyncio.timeout(self._load_timeout):
                value = await load()
            if value is None:
                outcome = Promoted.ABSENT
            elif self.table.get(key) is res:
                self._complete(key, value, source)  # completes res
                outcome = Promoted.COMPLETED
            else:
                outcome = Promoted.SUPERSEDED
        except asyncio.CancelledError:
            outcome = Promoted.CANCELLED
            raise
        except Exception as exc:
            log.warning("%s: loading key %s failed: %s", source, key.hex(), exc)
        finally:
            if outcome in (Promoted.FAILED, Promoted.ABSENT):
                failed()
            self._counters.promotions.inc(source, outcome.value)
            self.end(res, End.ABORTED)  # no-op when completed

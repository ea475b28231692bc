"""Time in the core: many deadlines, one wake-up.

:class:`TimerHeap` is the pure half: a deadline heap with lazy
cancellation. ``push`` is O(log n), ``cancel`` is O(1) (a cancelled entry
is skipped when it reaches the top), ``pop_due`` returns what has expired.
Invariant: cancelled entries never outnumber live ones by more than
``COMPACT_MIN`` - past that, the heap is rebuilt without them (amortised
O(1) per cancel), so a client that reserves and aborts in a loop with long
deadlines cannot grow it; a cancelled timer drops its callback at once.

:class:`Scheduler` is the acting half: one long-lived task that owns every
timer. It fires per-key write deadlines, flushes probe batches (probes
that arrive within one ``batch_window`` go to the backend in one call per
tier; each probe queued is dispatched once, whatever became of its key)
and runs periodic sweeps. Timer callbacks are synchronous and short;
anything that does I/O is spawned as a task by the callback's owner. The
loop never blocks: it waits on one future, woken by the earliest deadline
or by a new, earlier timer.

Imports nothing of kvtier; no sockets, no Prometheus.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

#: a probe as its prober knows it (the scheduler only queues it)
T = TypeVar("T")

#: cancelled entries tolerated in the heap before it is compacted
COMPACT_MIN = 1024


def _nothing() -> None:
    return None


@dataclass(order=True, slots=True)
class Timer:
    deadline: float
    seq: int
    callback: Callable[[], object] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)  # also set once fired


class TimerHeap:
    def __init__(self) -> None:
        self._heap: list[Timer] = []
        self._seq = itertools.count()
        self._live = 0

    def __repr__(self) -> str:
        nxt = self.next_deadline()
        return f"<TimerHeap live={self._live} held={len(self._heap)} next={nxt}>"

    def __len__(self) -> int:
        """Timers that are neither cancelled nor fired."""
        return self._live

    @property
    def held(self) -> int:
        """Entries in the heap, cancelled ones not yet reclaimed included."""
        return len(self._heap)

    def push(self, deadline: float, callback: Callable[[], object]) -> Timer:
        timer = Timer(deadline, next(self._seq), callback)
        heapq.heappush(self._heap, timer)
        self._live += 1
        return timer

    def cancel(self, timer: Timer) -> None:
        if not timer.cancelled:
            timer.cancelled = True
            timer.callback = _nothing  # let go of what the callback holds
            self._live -= 1
            dead = len(self._heap) - self._live
            if dead > COMPACT_MIN and dead > self._live:
                self._heap = [t for t in self._heap if not t.cancelled]
                heapq.heapify(self._heap)

    def next_deadline(self) -> float | None:
        heap = self._heap
        while heap and heap[0].cancelled:
            heapq.heappop(heap)
        return heap[0].deadline if heap else None

    def pop_due(self, now: float) -> list[Timer]:
        """Remove and return every live timer whose deadline is ``<= now``, earliest first."""
        due: list[Timer] = []
        heap = self._heap
        while heap and (heap[0].cancelled or heap[0].deadline <= now):
            timer = heapq.heappop(heap)
            if not timer.cancelled:
                timer.cancelled = True  # fired: a later cancel() is a no-op
                self._live -= 1
                due.append(timer)
        return due


log = logging.getLogger("kvtier.scheduler")


class _Batch:
    __slots__ = ("dispatch", "probes", "timer")

    def __init__(self, dispatch: Callable[[list[Any]], None]) -> None:
        self.dispatch = dispatch
        self.probes: list[Any] = []
        self.timer: Timer | None = None


class Scheduler:
    def __init__(
        self,
        *,
        batch_window: float,
        max_batch: int,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.batch_window = batch_window
        self.max_batch = max_batch
        #: the clock every deadline is read on: the one given (tests), else the
        #: monotonic clock; the loop's own timer only measures how long to sleep
        self.now: Callable[[], float] = clock if clock is not None else time.monotonic
        self._timers = TimerHeap()
        self._batches: dict[str, _Batch] = {}
        self._wake: asyncio.Future[None] | None = None
        #: the deadline the loop is woken for, while it waits
        self._armed_for: float | None = None
        #: that deadline, once the loop's timer said it came
        self._reached: float | None = None
        self._stopping = False
        #: timers that re-arm themselves for the scheduler's life (sweeps)
        self._periodic = 0

    def __repr__(self) -> str:
        queued = sum(len(b.probes) for b in self._batches.values())
        return f"<Scheduler {self._timers!r} periodic={self._periodic} queued_probes={queued}>"

    @property
    def timer_count(self) -> int:
        return len(self._timers)

    @property
    def deadline_count(self) -> int:
        """Timers armed for one-off deadlines (periodic sweeps not counted): 0 when idle."""
        return len(self._timers) - self._periodic

    # -- timers

    def call_at(self, deadline: float, callback: Callable[[], Any]) -> Timer:
        timer = self._timers.push(deadline, callback)
        if self._armed_for is None or deadline < self._armed_for:
            self._poke()
        return timer

    def cancel(self, timer: Timer | None) -> None:
        if timer is not None:
            self._timers.cancel(timer)

    def every(self, interval: float, callback: Callable[[], Any]) -> None:
        """Run ``callback`` every ``interval`` seconds for the scheduler's life."""
        self._periodic += 1

        def tick() -> None:
            try:
                callback()
            finally:
                self.call_at(self.now() + interval, tick)

        self.call_at(self.now() + interval, tick)

    # -- probe batching

    def add_prober(self, name: str, dispatch: Callable[[list[T]], None]) -> None:
        """``dispatch(probes)`` is called with each batch of ``name``'s probes."""
        self._batches[name] = _Batch(dispatch)

    def enqueue_probe(self, name: str, probe: T) -> None:
        """Queue ``probe`` for ``name``'s next batch: it is dispatched once."""
        batch = self._batches[name]
        batch.probes.append(probe)
        if len(batch.probes) >= self.max_batch:
            self.cancel(batch.timer)
            self._flush(batch)
        elif batch.timer is None:
            batch.timer = self.call_at(self.now() + self.batch_window, partial(self._flush, batch))

    def _flush(self, batch: _Batch) -> None:
        """Send ``batch``'s probes (its window timer has fired, or been cancelled)."""
        batch.timer = None
        probes, batch.probes = batch.probes, []
        if probes:
            batch.dispatch(probes)

    # -- the loop

    def _poke(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def run_due(self, now: float) -> int:
        """Fire every timer due at ``now``; returns how many fired."""
        fired = self._timers.pop_due(now)
        for timer in fired:
            try:
                timer.callback()
            except Exception:
                log.exception("scheduler callback failed")
        return len(fired)

    def _deadline_reached(self) -> None:
        # The loop's timer resolution may wake us a little before the
        # deadline (uvloop's is a millisecond): what it woke us for is due.
        self._reached = self._armed_for
        self._poke()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            reached, self._reached = self._reached, None
            now = self.now()
            self.run_due(now if reached is None else max(now, reached))
            self._wake = loop.create_future()
            deadline = self._timers.next_deadline()
            self._armed_for = deadline
            handle = None
            if deadline is not None:
                handle = loop.call_later(max(0.0, deadline - self.now()), self._deadline_reached)
            try:
                await self._wake
            finally:
                self._armed_for = None
                if handle is not None:
                    handle.cancel()

    def stop(self) -> None:
        self._stopping = True
        self._poke()

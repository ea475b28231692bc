"""A deadline heap: many timers, one wake-up. Pure; imports nothing of kvtier.

The scheduler loop keeps one of these instead of one sleeping task per key:
``push`` is O(log n), ``cancel`` is O(1) (lazy: a cancelled entry is skipped
when it reaches the top), ``pop_due`` returns what has expired.

Invariant: cancelled entries never outnumber live ones by more than
``COMPACT_MIN`` - past that, the heap is rebuilt without them (amortised
O(1) per cancel), so a client that reserves and aborts in a loop with long
deadlines cannot grow it; a cancelled timer drops its callback at once.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

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

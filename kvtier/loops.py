"""The one place that chooses the event loop (uvloop where it is installed),
and how a loop waits for its next request: :class:`IdlePoll`.

The daemon, the command line and the blocking client all run on what this
module returns; the plain asyncio loop is the fallback (it is far slower at
moving large blocks). Imports nothing of kvtier.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


#: seconds tasks still running when ``run``'s coroutine returns get to end
LEFTOVER_TIMEOUT = 1.0


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on a new loop of the chosen kind.

    Tasks it leaves running are cancelled and waited for ``LEFTOVER_TIMEOUT``
    seconds at most: one that ignores its cancellation cannot hold the
    process from exiting (``asyncio.run`` would wait for it forever)."""
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(coro)
    finally:
        try:
            leftover = asyncio.all_tasks(loop)
            for task in leftover:
                task.cancel()
            if leftover:
                loop.run_until_complete(asyncio.wait(leftover, timeout=LEFTOVER_TIMEOUT))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


#: polls in a row whose awaited reply came only after the window, before an
#: :class:`IdlePoll` awaiting replies rests
POLL_MISSES = 3
#: touches a resting :class:`IdlePoll` lets pass without polling
POLL_REST = 32


class IdlePoll:
    """Keeps an event loop polling for I/O, instead of sleeping in the
    kernel, for ``window`` seconds after the last :meth:`touch`, and with
    ``busy`` only while ``busy()`` is true.

    A loop asleep in epoll is woken by the kernel when bytes arrive. Where an
    idle CPU halts (a virtual machine's vCPU above all), that wake-up goes
    through an interrupt to the halted CPU and costs tens of microseconds,
    once on each side of a round trip: more than the daemon's own work on a
    request. A loop with a callback ready polls without blocking, so one
    callback that schedules itself again until the window has passed keeps
    the loop awake, and the next request (or reply) is read as it arrives.
    The price is CPU: at most ``window`` seconds of one core after each
    touch, spent only while the loop has nothing else to do (ScyllaDB's
    reactor polls the same way before it sleeps). Each poll first offers the
    CPU to any other thread waiting for it (``sched_yield``), so polling
    takes only a CPU nobody else wants: where the writers, the readers and
    the daemon outnumber the cores, polling without it slowed them all.
    Without ``yields``, polls keep the CPU: for a wait known to be short (a
    reply from memory), where giving the CPU away means waiting a whole
    scheduler slice to get it back once the reply is there.

    A poller awaiting replies (``busy``) adapts, as an adaptive lock spins
    before it sleeps: a poll that ran its whole window before the reply came
    was CPU spent for nothing, and where the machine is so busy that replies
    take longer than the window, every poll is. Worse, a thread that polls
    uses more than its share of the CPU, and the fair scheduler then makes
    it wait when it wakes: measured here, a caller polling for lookup
    replies while writers kept both cores busy spent 270-320 µs of CPU a
    lookup, and was woken a writer's slice late. So after ``POLL_MISSES``
    polls in a row whose reply came after the window, such a poller *rests*:
    the next ``POLL_REST`` touches do not poll (the loop sleeps in the kernel
    at once), and the one after tries again. A poller waiting for the next
    request (no ``busy``: the daemon's) never rests: were both ends of a
    round trip to rest, each one's sleeping would make the other's polls
    miss, and both could stay asleep on an idle machine.

    Invariants: at most one poll callback is scheduled at any time; none is
    once ``window`` has passed since the last touch, or ``busy()`` is false,
    or while resting; a window of 0 schedules nothing; only a poller with
    ``busy`` rests, and a reply caught within the window ends its run of
    misses. Polling never blocks the loop: its other callbacks and its I/O
    run between two polls.
    """

    def __init__(
        self,
        window: float,
        busy: Callable[[], bool] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        *,
        yields: bool = True,
    ) -> None:
        if not window >= 0:
            raise ValueError(f"an idle poll window is 0 or more seconds, not {window!r}")
        #: seconds of polling after a touch; 0: never poll
        self.window = window
        self._busy = busy
        self._clock = clock
        #: each poll first offers the CPU to other threads (``sched_yield``)
        self.yields = yields
        #: the clock's time at which polling stops
        self._until = 0.0
        #: the loop the poll callback is scheduled on; None: none is scheduled
        self._loop: asyncio.AbstractEventLoop | None = None
        #: loop steps spent polling, since the start
        self.polls = 0
        #: polls in a row (with ``busy``) that ran out of window before the reply
        self._misses = 0
        #: touches still to let pass without polling
        self._resting = 0
        #: times the poller began resting, since the start
        self.rests = 0

    def __repr__(self) -> str:
        if self._loop is not None:
            state = "polling"
        else:
            state = f"resting={self._resting}" if self._resting else "idle"
        keeps = "" if self.yields else " keeps-cpu"
        return (
            f"<IdlePoll window={self.window * 1e6:.0f}us {state}{keeps}"
            f" polls={self.polls} rests={self.rests}>"
        )

    @property
    def polling(self) -> bool:
        return self._loop is not None

    def touch(self) -> None:
        """Something arrived (or was sent, whose answer is awaited): keep
        polling for ``window`` seconds from now. Called from the loop."""
        if not self.window:
            return
        self._until = self._clock() + self.window
        if self._loop is not None and not self._loop.is_closed():
            return
        if self._resting:
            self._resting -= 1
            return
        self._loop = asyncio.get_running_loop()
        self._loop.call_soon(self._poll)

    def _poll(self) -> None:
        loop = self._loop
        assert loop is not None
        awaited = self._busy is None or self._busy()
        if awaited and self._clock() < self._until:
            self.polls += 1
            if self.yields:
                os.sched_yield()  # a thread that wants this CPU gets it first
            loop.call_soon(self._poll)
            return
        self._loop = None
        if self._busy is None:
            return  # (waiting for a request: never rests)
        if not awaited:  # the reply came within the window
            self._misses = 0
            return
        self._misses += 1
        if self._misses >= POLL_MISSES:
            self._misses = 0
            self._resting = POLL_REST
            self.rests += 1

"""Where the copies between clients' regions and RAM run: on the event loop
in steps, or whole in worker threads.

A copy is a generator of steps (:data:`Steps`), each moving at most
:data:`~kvtier.model.LOOP_STEP` bytes; its return value is the copy's.
:class:`Copier` runs it (the invariants are the class's). Imports anyio
and the shared records only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import anyio.lowlevel

from kvtier.model import LOOP_TURN

T = TypeVar("T")

#: a copy's steps: each moves at most LOOP_STEP bytes; its return value is the copy's
Steps = Generator[None, None, T]


class Copier:
    """Where region copies run: on the event loop, in turns of as many steps
    (of at most :data:`~kvtier.model.LOOP_STEP` bytes) as fit in ``turn``
    seconds (``threads`` 0: other requests are answered between turns, and
    a step's fixed cost is paid once a turn, not once a step), or each copy
    whole in one of ``threads`` worker threads.

    On a machine of few cores the loop is the better place (docs/shared-memory.md,
    7.): a worker thread is one more thread wanting a core while writers
    keep them busy, and each copy costs two wake-ups, so a lookup's caller
    waits longer for its turn; on the loop the copies of all clients take
    one core at most, and other requests are answered between steps.

    Invariants: a copy that does not return runs its ``abandoned`` exactly
    once, and never while a step of it may still touch its memory (a copy on
    the loop takes no step after it is cancelled; a cancelled copy in a
    thread runs it once the thread ends); ``steps`` counts the steps taken
    on the loop and ``turns`` the loop turns they ended; a turn takes one
    step at least and no more once ``turn`` seconds have passed since it
    began; ``running`` counts the copies begun and not ended. Raises what a
    step raises; never swallows a cancellation.
    """

    def __init__(
        self,
        threads: int,
        *,
        turn: float = LOOP_TURN,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        #: worker threads copies run in (0: on the loop)
        self.threads = threads
        self._executor = (
            ThreadPoolExecutor(threads, thread_name_prefix="kvtier-copy") if threads else None
        )
        #: seconds of steps a loop turn runs (0: one step a turn)
        self.turn = turn
        self._clock = clock
        self.running = 0
        self.steps = 0
        self.turns = 0

    def __repr__(self) -> str:
        where = (
            f"threads={self.threads}" if self.threads else f"on-loop turn={self.turn * 1e6:.0f}us"
        )
        return f"<Copier {where} running={self.running} steps={self.steps} turns={self.turns}>"

    async def run(self, steps: Steps[T], abandoned: Callable[[], None]) -> T:
        """The copy's result once its every step has run; see the class."""
        self.running += 1
        try:
            if self._executor is None:
                return await self._on_loop(steps, abandoned)
            return await self._in_thread(steps, abandoned)
        finally:
            self.running -= 1

    async def _on_loop(self, steps: Steps[T], abandoned: Callable[[], None]) -> T:
        result: list[T] = []
        clock, turn = self._clock, self.turn
        try:
            began = clock()
            for _ in _collect(steps, result):
                self.steps += 1
                if clock() - began >= turn:
                    self.turns += 1
                    await anyio.lowlevel.checkpoint()  # other requests between turns
                    began = clock()
        except BaseException:
            steps.close()
            abandoned()
            raise
        return result[0]

    async def _in_thread(self, steps: Steps[T], abandoned: Callable[[], None]) -> T:
        done = asyncio.get_running_loop().run_in_executor(self._executor, _all_of, steps)
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:

            def ended(fut: asyncio.Future[T]) -> None:
                if not fut.cancelled():
                    fut.exception()  # read: nobody is left to report it to
                abandoned()

            done.add_done_callback(ended)
            raise
        except BaseException:
            abandoned()
            raise

    def close(self) -> None:
        """Stop the threads, once the copies they run have ended (shutdown)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)


def _collect(steps: Steps[T], result: list[T]) -> Iterator[None]:
    """``steps``, their result appended to ``result`` after the last."""
    result.append((yield from steps))


def _all_of(steps: Steps[T]) -> T:
    """Every step of a copy, one after another (a worker thread's work)."""
    result: list[T] = []
    for _ in _collect(steps, result):
        pass
    return result[0]

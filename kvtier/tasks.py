"""The daemon's background tasks: started in one set, stopped in bounded time.

Requests that wait, probes, promotions and writes behind run as tasks of
one :class:`TaskSet` the daemon owns. Unlike ``asyncio.TaskGroup``, a task
that fails is logged, not a reason to stop the daemon, and stopping is
bounded: every task is cancelled, given ``timeout`` seconds to end, and
one that ignores its cancellation longer is abandoned, logged by name,
rather than holding shutdown forever.

Invariants: a task is in the set from :meth:`TaskSet.spawn` until it is
done; after :meth:`TaskSet.stop` the set is empty (what is left running
is abandoned and counted) and spawning raises; :meth:`TaskSet.settle`
waits for every task but those named :data:`LASTING_TASK` (a stream that
ends with its connection). Imports nothing of kvtier.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger("kvtier.tasks")

T = TypeVar("T")

#: names a task that lasts as long as its connection (a SUBSCRIBE stream):
#: waiting for the daemon to settle does not wait for it
LASTING_TASK = "kvtier-lasting:"


class TaskSet:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopped = False
        #: tasks left running at stop because they ignored cancellation
        self.abandoned = 0

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else "running"
        return f"<TaskSet {state} tasks={len(self._tasks)} abandoned={self.abandoned}>"

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        if self._stopped:
            coro.close()
            raise RuntimeError("the daemon's tasks have been stopped")
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("background task %s failed", task.get_name(), exc_info=exc)

    async def settle(self) -> None:
        """Wait until every task started so far (and any they start) is done,
        streams that last as long as their connection aside."""
        me = asyncio.current_task()
        while pending := [
            t for t in self._tasks if t is not me and not t.get_name().startswith(LASTING_TASK)
        ]:
            await asyncio.wait(pending)

    async def stop(self, timeout: float) -> list[asyncio.Task[Any]]:
        """Cancel every task and wait ``timeout`` seconds at most; returns the
        tasks still running then (abandoned, each logged)."""
        self._stopped = True
        running = [t for t in self._tasks if t is not asyncio.current_task()]
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running, timeout=timeout)
        left = [t for t in running if not t.done()]
        for task in left:
            log.warning(
                "abandoned background task %s: it ignored cancellation for %.1fs (%r)",
                task.get_name(),
                timeout,
                task.get_coro(),
            )
            self._tasks.discard(task)
        self.abandoned += len(left)
        return left

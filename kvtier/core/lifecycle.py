"""Whether the service runs: the task group its work is spawned in, and shutdown.

Every part of the service (answers, loads, stores, probes) starts its
background work through :meth:`Lifecycle.task`, in the daemon's task group,
and waits through :meth:`Lifecycle.until`, which also ends at shutdown.

Invariants: no task starts before :meth:`start` (the coroutine is closed and
the call raises) or once shutdown has begun, where a caller asks
``closing`` first; ``closing`` turns True once and stays; :meth:`until`
never cancels what it waits on (shared futures outlive their waiters) and
returns once shutdown has begun. Imports nothing of the service.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from kvtier.model import Spawn


class Lifecycle:
    """The service's task spawner and its shutdown flag and future."""

    __slots__ = ("_closed", "_spawn", "closing")

    def __init__(self) -> None:
        self._spawn: Spawn | None = None
        self._closed: asyncio.Future[None] | None = None
        #: shutdown has begun: waits end, no new backend work starts
        self.closing = False

    def __repr__(self) -> str:
        state = "closing" if self.closing else "running" if self._spawn else "new"
        return f"<Lifecycle {state}>"

    def start(self, spawn: Spawn) -> None:
        """Attach to the daemon's task group."""
        self._spawn = spawn
        self._closed = asyncio.get_running_loop().create_future()

    def begin_shutdown(self) -> None:
        self.closing = True
        if self._closed is not None and not self._closed.done():
            self._closed.set_result(None)

    def task(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``coro`` in the daemon's task group."""
        if self._spawn is None:
            coro.close()
            raise RuntimeError("service not started")
        task: asyncio.Task[None] = self._spawn(coro)
        return task

    def waits(self, *futures: asyncio.Future[Any]) -> list[asyncio.Future[Any]]:
        """``futures`` and the shutdown future: what a wait that must end at shutdown waits on."""
        out = list(futures)
        if self._closed is not None:
            out.append(self._closed)
        return out

    async def until(self, fut: asyncio.Future[Any]) -> None:
        """Wait for ``fut`` (never cancelling it: it is shared) or for shutdown."""
        await asyncio.wait(self.waits(fut), return_when=asyncio.FIRST_COMPLETED)

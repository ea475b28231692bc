"""The one place that chooses the event loop: uvloop where it is installed.

The daemon, the command line and the blocking client all run on what this
module returns; the plain asyncio loop is the fallback (it is far slower at
moving large blocks). Imports nothing of kvtier.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
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

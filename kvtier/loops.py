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


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on a new loop of the chosen kind."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(coro)

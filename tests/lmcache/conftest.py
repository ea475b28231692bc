"""Fixtures for the LMCache connector tests: real kvtier daemon processes and
LMCache's own config, metadata and CPU backend.

These tests run in .venv-lmcache (``make test-lmcache``), where LMCache is
installed and kvtier only as a client; the daemon is the main venv's
``kvtier serve`` (``KVTIER_SERVE``), started here on a private socket.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest

from tests.enginedaemon import EngineDaemon, daemon, workdir

T = TypeVar("T")

Daemon = EngineDaemon
#: the shared fixtures (daemon, workdir), for this directory's tests
__all__ = ["daemon", "workdir"]


class Loop:
    """LMCache's event loop: a loop in a thread of its own, as the engine runs it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@pytest.fixture
def lmcache_loop() -> Iterator[Loop]:
    loop = Loop()
    yield loop
    loop.close()

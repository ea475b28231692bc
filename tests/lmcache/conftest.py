"""Fixtures for the LMCache connector tests: real kvtier daemon processes and
LMCache's own config, metadata and CPU backend.

These tests run in .venv-lmcache (``make test-lmcache``), where LMCache is
installed and kvtier only as a client; the daemon is the main venv's
``kvtier serve`` (``KVTIER_SERVE``), started here on a private socket.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.enginedaemon import EngineDaemon, start

T = TypeVar("T")

Daemon = EngineDaemon


def start_daemon(tmp: Path) -> Daemon:
    return start(tmp, "--data-dir", str(tmp / "data"), "--ram-capacity", "256MiB")


def stop_daemon(d: Daemon) -> None:
    d.stop()


@pytest.fixture
def workdir() -> Iterator[Path]:
    tmp = Path(tempfile.mkdtemp(prefix="kvt-lmc-", dir="/tmp"))
    yield tmp
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def daemon(workdir: Path) -> Iterator[Daemon]:
    d = start_daemon(workdir)
    try:
        yield d
    finally:
        stop_daemon(d)


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

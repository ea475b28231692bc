"""Fixtures for the LMCache connector tests: real kvtier daemon processes and
LMCache's own config, metadata and CPU backend.

These tests run in .venv-lmcache (``make test-lmcache``), where LMCache is
installed and kvtier only as a client; the daemon is the main venv's
``kvtier serve`` (``KVTIER_SERVE``), started here on a private socket.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import urllib.request
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


@dataclass
class Daemon:
    socket_path: Path
    metrics_url: str
    proc: subprocess.Popen[bytes]
    args: list[str]

    def stats(self) -> dict[str, Any]:
        out = subprocess.run(
            [_serve(), "stats", "--json", "--socket", str(self.socket_path)],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
        result: dict[str, Any] = json.loads(out.stdout)
        return result

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as resp:
            text = resp.read().decode()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.split("{")[0].split(" ")[0] == name
        )


def _serve() -> str:
    return os.environ.get("KVTIER_SERVE", str(ROOT / ".venv" / "bin" / "kvtier"))


def start_daemon(tmp: Path) -> Daemon:
    args = [
        _serve(),
        "serve",
        "--socket",
        str(tmp / "d.sock"),
        "--metrics-port",
        "0",
        "--data-dir",
        str(tmp / "data"),
        "--ram-capacity",
        "256MiB",
    ]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    url = None
    for raw in proc.stderr:
        line = raw.decode(errors="replace")
        if "kvtier ready" in line:
            url = re.search(r"metrics=(\S+)", line).group(1)  # type: ignore[union-attr]
            break
    assert url is not None, "the daemon did not start"
    threading.Thread(target=lambda: [None for _ in proc.stderr or ()], daemon=True).start()
    return Daemon(tmp / "d.sock", url, proc, args)


def stop_daemon(d: Daemon) -> None:
    if d.proc.poll() is None:
        d.proc.terminate()
        assert d.proc.wait(30) == 0


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

"""Fixtures for the SGLang HiCache backend tests: real kvtier daemon processes
and SGLang's own storage config, backend factory and host KV pool.

These tests run in .venv-sglang (``make test-sglang``), where SGLang is
installed and kvtier only as a client; the daemon is the main venv's
``kvtier serve`` (``KVTIER_SERVE``), started here on a private socket.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.enginedaemon import EngineDaemon, start

Daemon = EngineDaemon


def start_daemon(tmp: Path) -> Daemon:
    return start(tmp, "--data-dir", str(tmp / "data"), "--ram-capacity", "256MiB")


@pytest.fixture
def workdir() -> Iterator[Path]:
    tmp = Path(tempfile.mkdtemp(prefix="kvt-sgl-", dir="/tmp"))
    yield tmp
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def daemon(workdir: Path) -> Iterator[Daemon]:
    d = start_daemon(workdir)
    try:
        yield d
    finally:
        d.stop()

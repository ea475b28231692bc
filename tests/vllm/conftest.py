"""Fixtures for the vLLM tier tests: a real kvtier daemon process.

These tests run in .venv-vllm (``make test-vllm``), where vLLM is installed
and kvtier only as a client; the daemon is the main venv's ``kvtier serve``
(``KVTIER_SERVE``), started here on a private socket.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Daemon:
    socket_path: Path
    metrics_url: str
    proc: subprocess.Popen[bytes]

    def metric(self, name: str, labels: str = "") -> float:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as resp:
            text = resp.read().decode()
        needle = f"{name}{{{labels}}}" if labels else name
        for line in text.splitlines():
            if line.startswith(needle + " "):
                return float(line.split()[-1])
        return 0.0


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    tmp = Path(tempfile.mkdtemp(prefix="kvt-vllm-", dir="/tmp"))
    config = tmp / "kvtier.toml"
    config.write_text('[[remote_tiers]]\nkind = "memory"\nname = "mem"\n')
    serve = os.environ.get("KVTIER_SERVE", str(ROOT / ".venv" / "bin" / "kvtier"))
    proc = subprocess.Popen(
        [
            serve,
            "serve",
            "--config",
            str(config),
            "--socket",
            str(tmp / "d.sock"),
            "--metrics-port",
            "0",
            "--no-disk",
            "--ram-capacity",
            "256MiB",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    assert proc.stderr is not None
    url = None
    for raw in proc.stderr:
        line = raw.decode(errors="replace")
        if "kvtier ready" in line:
            url = re.search(r"metrics=(\S+)", line).group(1)  # type: ignore[union-attr]
            break
    assert url is not None, "the daemon did not start"
    drain = threading.Thread(target=lambda: [None for _ in proc.stderr or ()], daemon=True)
    drain.start()
    try:
        yield Daemon(tmp / "d.sock", url, proc)
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
        shutil.rmtree(tmp, ignore_errors=True)

"""A real ``kvtier serve`` process for the engine tests (tests/vllm,
tests/lmcache, tests/sglang), and the fixtures they share.

Those tests run in an engine's own venv, where kvtier is installed as a
client only; the daemon is the main venv's ``kvtier serve`` (``KVTIER_SERVE``).
The standard library and pytest only: nothing here may need the daemon's
dependencies.
"""

from __future__ import annotations

import json
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
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def serve_command() -> str:
    return os.environ.get("KVTIER_SERVE", str(ROOT / ".venv" / "bin" / "kvtier"))


@dataclass
class EngineDaemon:
    socket_path: Path
    metrics_url: str
    proc: subprocess.Popen[bytes]

    def scrape(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as resp:
            text: str = resp.read().decode()
            return text

    def metric(self, name: str, labels: str = "") -> float:
        """One sample's value (0 when absent)."""
        needle = f"{name}{{{labels}}}" if labels else name
        for line in self.scrape().splitlines():
            if line.startswith(needle + " "):
                return float(line.split()[-1])
        return 0.0

    def total(self, name: str, **labels: str) -> float:
        """Sum of a metric's samples whose labels include these."""
        wanted = [f'{k}="{v}"' for k, v in labels.items()]
        total = 0.0
        for line in self.scrape().splitlines():
            series, _, value = line.rpartition(" ")
            if series.split("{")[0] == name and all(w in series for w in wanted):
                total += float(value)
        return total

    def total_reaching(self, name: str, value: float, tries: int = 10_000, **labels: str) -> float:
        """:meth:`total` once it has reached ``value`` (scraped again until
        then, ``tries`` times at most): a count the daemon takes from its
        lookup process's reports lands a few milliseconds after the answer."""
        total = self.total(name, **labels)
        for _ in range(tries):
            if total >= value:
                break
            total = self.total(name, **labels)
        return total

    def stats(self) -> dict[str, Any]:
        out = subprocess.run(
            [serve_command(), "stats", "--json", "--socket", str(self.socket_path)],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
        result: dict[str, Any] = json.loads(out.stdout)
        return result

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            assert self.proc.wait(30) == 0


def start(tmp: Path, *args: str) -> EngineDaemon:
    """``kvtier serve`` on a socket in ``tmp`` (with ``args``), once it is
    ready; its disk tier in ``tmp`` too, unless ``args`` say otherwise."""
    private = [] if {"--no-disk", "--data-dir"} & set(args) else ["--data-dir", str(tmp / "data")]
    proc = subprocess.Popen(
        [
            serve_command(),
            "serve",
            "--socket",
            str(tmp / "d.sock"),
            "--metrics-port",
            "0",
            *private,
            *args,
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
    threading.Thread(target=lambda: [None for _ in proc.stderr or ()], daemon=True).start()
    return EngineDaemon(tmp / "d.sock", url, proc)


def start_with_disk(tmp: Path) -> EngineDaemon:
    """A daemon with 256 MiB of RAM and a disk tier in ``tmp``."""
    return start(tmp, "--data-dir", str(tmp / "data"), "--ram-capacity", "256MiB")


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A private directory for a daemon's socket and data."""
    tmp = Path(tempfile.mkdtemp(prefix="kvt-eng-", dir="/tmp"))
    yield tmp
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def daemon(workdir: Path) -> Iterator[EngineDaemon]:
    """A daemon with a disk tier (:func:`start_with_disk`), stopped after the test."""
    d = start_with_disk(workdir)
    try:
        yield d
    finally:
        d.stop()

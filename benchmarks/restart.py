"""make bench-restart: how soon a restarted daemon answers from its whole disk index.

Writes ``--blocks`` block files (16-byte values) straight into a data
directory, then starts a daemon on it twice, in one run: first without
index files (it scans the block files, as a daemon of an older version
or with damaged files does), then again after a clean stop (it loads the
snapshot and journal the first run wrote). For each start: seconds from
the process's start to its ready line, and to the moment every key of a
random sample of 2,000 answers HIT (a scan answers the keys of buckets
not yet scanned RETRY). Prints a table; ``--markdown`` writes it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.report import publish
from kvtier import Client, LookupMode
from kvtier.daemon import READY_MESSAGE
from kvtier.model import HIT
from kvtier.tiers.base import block_checksum
from kvtier.tiers.disk.format import FORMAT_VERSION, HEADER, MAGIC, block_path

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = 2000


def write_blocks(data: Path, n: int, rng: random.Random) -> list[bytes]:
    for i in range(256):
        (data / f"{i:02x}").mkdir(parents=True, exist_ok=True)
    keys = []
    value = b"v" * 16
    for _ in range(n):
        key = b"k" + rng.randbytes(31)  # (a default-namespace key never starts with 0xFF)
        head = HEADER.pack(
            MAGIC, FORMAT_VERSION, 0, len(key), len(value), block_checksum(key, value)
        )
        fd = os.open(block_path(data, key), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, head + key + value)
        finally:
            os.close(fd)
        keys.append(key)
    return keys


class Started:
    """A daemon process and the lines of its log, as they come."""

    def __init__(self, tmp: Path, data: Path) -> None:
        serve = os.environ.get("KVTIER_SERVE", str(ROOT / ".venv" / "bin" / "kvtier"))
        self.socket = tmp / "d.sock"
        self.began = time.monotonic()
        self.proc = subprocess.Popen(
            [
                serve,
                "serve",
                "--socket",
                str(self.socket),
                "--metrics-port",
                "0",
                "--data-dir",
                str(data),
                "--disk-capacity",
                "100GiB",
                "--log-level",
                "info",
            ],
            stderr=subprocess.PIPE,
            text=True,
            # (compiled bytecode cached, as an installed daemon has it)
            env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},
        )
        self.lines: list[tuple[float, str]] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append((time.monotonic() - self.began, line.rstrip()))
            if READY_MESSAGE in line:
                self.ready.set()
        self.ready.set()

    def at(self, needle: str) -> tuple[float, str] | None:
        return next(((t, line) for t, line in self.lines if needle in line), None)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(600)


async def all_hit(socket: Path, sample: list[bytes]) -> None:
    """Return once every key of ``sample`` answers HIT."""
    async with await Client.connect(socket) as c:
        while True:
            reply = await c.lookup(sample, mode=LookupMode.KEYS)
            if all(s == HIT for s in reply.raw_states):
                return
            await asyncio.sleep(0.05)  # allow-sleep: polling how soon, the figure itself


def start(tmp: Path, data: Path, sample: list[bytes]) -> tuple[float, float, Started]:
    daemon = Started(tmp, data)
    daemon.ready.wait(3600)
    ready = daemon.at(READY_MESSAGE)
    if ready is None:
        raise RuntimeError("\n".join(line for _, line in daemon.lines))
    asyncio.run(all_hit(daemon.socket, sample))
    return ready[0], time.monotonic() - daemon.began, daemon


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.restart")
    parser.add_argument("--blocks", type=int, default=2_000_000)
    parser.add_argument("--markdown", type=Path, help="write the table here")
    args = parser.parse_args()
    rng = random.Random(7)
    with tempfile.TemporaryDirectory(prefix="kvt-bench-restart-", dir="/tmp") as d:
        tmp = Path(d)
        data = tmp / "data"
        t = time.monotonic()
        keys = write_blocks(data, args.blocks, rng)
        print(f"{args.blocks} block files written in {time.monotonic() - t:.1f}s", flush=True)
        sample = rng.sample(keys, min(SAMPLE, len(keys)))
        rows = []
        for label in ("scan (no index files)", "index files"):
            ready, whole, daemon = start(tmp, data, sample)
            loaded = daemon.at("disk index loaded") or daemon.at("no usable index files")
            if label.startswith("scan"):  # the snapshot the scan ends with, before stopping
                while daemon.at("disk index rebuilt") is None:
                    time.sleep(0.1)  # allow-sleep: waiting for the rebuild's last log line
            daemon.stop()
            rows.append((label, ready, whole, loaded[1].split(": ", 1)[-1] if loaded else ""))
            print(
                f"{label:24s} ready {ready:7.2f}s  every sampled key HIT {whole:7.2f}s", flush=True
            )
    out = [
        "## Restart: how soon the disk index answers",
        "",
        f"Measured with `make bench-restart`: {args.blocks:,} block files on disk,",
        "a daemon started on them without index files (it scans the files) and",
        "again after a clean stop (it loads the snapshot and journal the first",
        "start wrote); seconds from the process's start (its bytecode cached,",
        "as an installed daemon's is), one run.",
        "",
        "| start | ready line | every sampled key HIT |",
        "|---|---:|---:|",
        *(f"| {label} | {ready:.2f} s | {whole:.2f} s |" for label, ready, whole, _ in rows),
    ]
    publish(out, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())

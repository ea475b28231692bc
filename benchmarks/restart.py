"""make bench-restart: how soon a restarted daemon answers from its whole disk index.

First as users fill a data directory: ``--blocks`` PUTs of 1 KiB through
a daemon (written through to its disk tier), the daemon killed (SIGKILL)
once every block is on disk, then started on the directory (it loads the
index files the killed one left), stopped cleanly and started again.
Then as a directory written straight: ``--blocks`` block files (16-byte
values), a daemon started on it without index files (it scans the block
files, as a daemon of an older version or with damaged files does), then
again after a clean stop (it loads the snapshot and journal the first
start wrote). For each start: seconds from the process's start to its
ready line, and to the moment every key of a random sample of 2,000
answers HIT (a scan answers the keys of buckets not yet scanned RETRY).
Prints a table; ``--markdown`` writes it.
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


async def fill(socket: Path, n: int, rng: random.Random) -> list[bytes]:
    """``n`` blocks of 1 KiB PUT through the daemon at ``socket``, a batch
    at a time from a few connections; returns once its disk tier holds
    every one (written through, nothing in flight)."""
    keys = [b"p" + rng.randbytes(31) for _ in range(n)]
    value = b"v" * 1024
    batches = [keys[i : i + 512] for i in range(0, n, 512)]

    async def writer(mine: list[list[bytes]]) -> None:
        async with await Client.connect(socket, shared=False) as c:
            for batch in mine:
                await c.put_many(batch, [value] * len(batch))

    await asyncio.gather(*(writer(batches[w::4]) for w in range(4)))
    async with await Client.connect(socket, shared=False) as c:
        while True:
            disk = (await c.stats())["tiers"]["disk"]
            if disk["blocks"] >= n and disk["writes_in_flight"] == 0:
                return keys
            await asyncio.sleep(0.2)  # allow-sleep: polling the write-through's progress


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
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvt-bench-restart-", dir="/tmp") as d:
        tmp = Path(d)
        data = tmp / "data"
        t = time.monotonic()
        filler = Started(tmp, data)
        filler.ready.wait(3600)
        keys = asyncio.run(fill(filler.socket, args.blocks, rng))
        filler.proc.kill()  # (a crash: the index files as a killed daemon leaves them)
        filler.proc.wait(600)
        print(f"{args.blocks} blocks PUT in {time.monotonic() - t:.1f}s", flush=True)
        sample = rng.sample(keys, min(SAMPLE, len(keys)))
        for label in ("PUTs, after a kill -9", "PUTs, after a clean stop"):
            ready, whole, daemon = start(tmp, data, sample)
            daemon.stop()
            rows.append((label, ready, whole))
            print(
                f"{label:24s} ready {ready:7.2f}s  every sampled key HIT {whole:7.2f}s", flush=True
            )
    with tempfile.TemporaryDirectory(prefix="kvt-bench-restart-", dir="/tmp") as d:
        tmp = Path(d)
        data = tmp / "data"
        t = time.monotonic()
        keys = write_blocks(data, args.blocks, rng)
        print(f"{args.blocks} block files written in {time.monotonic() - t:.1f}s", flush=True)
        sample = rng.sample(keys, min(SAMPLE, len(keys)))
        for label in ("files, scan (no index)", "files, index files"):
            ready, whole, daemon = start(tmp, data, sample)
            if "scan" in label:  # the snapshot the scan ends with, before stopping
                while daemon.at("disk index rebuilt") is None:
                    time.sleep(0.1)  # allow-sleep: waiting for the rebuild's last log line
            daemon.stop()
            rows.append((label, ready, whole))
            print(
                f"{label:24s} ready {ready:7.2f}s  every sampled key HIT {whole:7.2f}s", flush=True
            )
    out = [
        "## Restart: how soon the disk index answers",
        "",
        f"Measured with `make bench-restart`: {args.blocks:,} blocks, first PUT",
        "through a daemon (1 KiB each, written through to its disk), the daemon",
        "killed (SIGKILL) once all were on disk, then started on its directory,",
        "stopped cleanly and started again; then as many block files written",
        "straight into a directory, a daemon started on them without index files",
        "(it scans the files) and again after a clean stop. Seconds from the",
        "process's start (its bytecode cached, as an installed daemon's is) to",
        "its ready line and until a sample of 2,000 keys all answer HIT; one run.",
        "",
        "| start | ready line | every sampled key HIT |",
        "|---|---:|---:|",
        *(f"| {label} | {ready:.2f} s | {whole:.2f} s |" for label, ready, whole in rows),
    ]
    publish(out, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""make bench: LOOKUP latency while writers stream blocks into a full daemon.

A RAM-only daemon of 512 MiB is filled first, so every store evicts (the
steady state an engine produces); a 512-block chain stays resident (each
lookup touches it). In one run: p50/p99/max of a prefix LOOKUP of the chain
from this process, idle, then while another process streams fresh 1 MiB
blocks from 8 concurrent writers, once over the socket (one block per PUT),
once through staging (one block per PUT) and once written in place (one
block per PUT, the client's default for a large block; each writer a fresh
process, so it faults the arena's pages in as it goes). Each lookup path in turn: through the
lookup process (the default; docs/lookup-process.md), the same with this
process's thread asking for a scheduler slice of 0.1 ms as the lookup
process does (``kvtier.schedule``: woken by the reply, it runs before a
busy writer instead of after its slice), and through the daemon's own
socket (a client with ``lookup_process=False``). Five rounds,
each measuring idle again right before its writers (this machine's quiet
moments move): prints the medians over the rounds of p50, p99, max, the
p99's ratio to its round's idle p99 (same path), the writers' GB/s, and
the lookups answered per second. The measuring process and the writers run
on the loop kvtier's own programs run on (:mod:`kvtier.loops`: uvloop), as
the suite's client does.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from kvtier import loops
from kvtier.client.aio import Client
from kvtier.model import LookupMode
from kvtier.schedule import MIN_SLICE, request_slice
from tests.enginedaemon import start

MiB = 1024 * 1024
RAM = 512 * MiB
CHAIN = 512
IDLE_LOOKUPS = 1000
ROUNDS = 5
MODES = ("socket", "staged", "in-place")
#: lookup paths: the client option that picks each, and the scheduler slice
#: the measuring thread asks for (0: the kernel's default; kvtier.schedule)
PATHS = {
    "lookup process": (True, 0.0),
    "lookup process, caller's slice 0.1 ms": (True, MIN_SLICE),
    "daemon socket": (False, 0.0),
}

_WRITER = """
import asyncio, os, sys, time
from kvtier import loops
from kvtier.client.aio import Client

async def main(path, mode, blocks):
    value = os.urandom(1 << 20)
    clients = [
        await Client.connect(
            path, stage_writes=None if mode in ("staged", "in-place") else False,
            write_in_place=mode == "in-place",
        )
        for _ in range(8)
    ]
    print("go", flush=True)
    started = time.perf_counter()
    async def write(w, c):
        for n in range(blocks // 8):
            await c.put(f"s-{mode}-{w}-{n}".encode(), value)
    await asyncio.gather(*(write(w, c) for w, c in enumerate(clients)))
    print(f"{blocks * (1 << 20) / (time.perf_counter() - started) / 1e9:.2f}", flush=True)

loops.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


def percentiles(samples: list[float]) -> tuple[float, float, float]:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return statistics.median(ordered), p99, ordered[-1]


async def lookups_until(client: Client, chain: list[bytes], done: asyncio.Event) -> list[float]:
    out: list[float] = []
    while not done.is_set() or len(out) < 50:
        started = time.perf_counter()
        reply = await client.lookup(chain, mode=LookupMode.PREFIX)
        out.append((time.perf_counter() - started) * 1e6)
        assert reply.prefix_hits == CHAIN
    return out


async def under_writers(
    sock: str, client: Client, chain: list[bytes], mode: str
) -> tuple[list[float], str, float]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        textwrap.dedent(_WRITER),
        sock,
        mode,
        str(1024),
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None
    assert (await proc.stdout.readline()).strip() == b"go"
    done = asyncio.Event()
    started = time.perf_counter()
    measuring = asyncio.ensure_future(lookups_until(client, chain, done))
    rate = (await proc.stdout.readline()).decode().strip()
    done.set()
    samples = await measuring
    per_second = len(samples) / (time.perf_counter() - started)
    await proc.wait()
    return samples, rate, per_second


#: one round of one path: the idle samples, then each mode's samples, its
#: writers' GB/s and the lookups answered per second
Round = tuple[list[float], dict[str, tuple[list[float], float, float]]]


async def fill(sock: str, namespace: str = "") -> list[bytes]:
    """Fill the daemon at ``sock`` (every later store evicts) and store the
    chain the lookups ask for, in ``namespace``; the chain's keys."""
    async with await Client.connect(sock) as filling:
        filler = os.urandom(MiB)
        for n in range(0, RAM // MiB, 16):
            keys = [f"fill-{n + i}".encode() for i in range(16)]
            await filling.put_many(keys, [filler] * 16)
    chain = [f"chain-{i:04d}".encode() for i in range(CHAIN)]
    async with await Client.connect(sock, namespace=namespace) as owner:
        await owner.put_many(chain, [b"c" * 4096] * CHAIN)
    return chain


async def idle_lookups(client: Client, chain: list[bytes]) -> list[float]:
    """IDLE_LOOKUPS prefix lookups of the chain, one after another: each one's µs."""
    out: list[float] = []
    for _ in range(IDLE_LOOKUPS):
        started = time.perf_counter()
        reply = await client.lookup(chain, mode=LookupMode.PREFIX)
        out.append((time.perf_counter() - started) * 1e6)
        assert reply.prefix_hits == len(chain)
    return out


async def measure(sock: str) -> dict[str, list[Round]]:
    chain = await fill(sock)
    rounds: dict[str, list[Round]] = {path: [] for path in PATHS}
    for _ in range(ROUNDS):
        for path, (lookup_process, caller_slice) in PATHS.items():
            if caller_slice and not request_slice(caller_slice):
                continue  # (a kernel without slices of a thread's own)
            async with await Client.connect(sock, lookup_process=lookup_process) as client:
                assert client.lookups_process == lookup_process, path
                idle = await idle_lookups(client, chain)
                busy: dict[str, tuple[list[float], float, float]] = {}
                for mode in MODES:
                    samples, rate, per_second = await under_writers(sock, client, chain, mode)
                    busy[mode] = (samples, float(rate), per_second)
                rounds[path].append((idle, busy))
            request_slice(0)
    return rounds


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="kvt-stream-", dir="/tmp") as tmp:
        daemon = start(Path(tmp), "--no-disk", "--ram-capacity", str(RAM))
        try:
            rounds = loops.run(measure(str(daemon.socket_path)))
        finally:
            daemon.stop()
    med = statistics.median
    for path, path_rounds in rounds.items():
        if not path_rounds:
            continue
        print(f"prefix LOOKUP of {CHAIN} blocks through the {path}, medians of {ROUNDS} rounds")
        print(
            f"{'':28} {'p50 us':>8} {'p99 us':>8} {'max us':>8} {'p99/idle':>9}"
            f" {'writers GB/s':>13} {'lookups/s':>10}"
        )
        idle = [percentiles(samples) for samples, _ in path_rounds]
        print(
            f"{'idle':28} {med(p[0] for p in idle):8.0f} {med(p[1] for p in idle):8.0f}"
            f" {med(p[2] for p in idle):8.0f} {'1.00x':>9}"
        )
        for mode in MODES:
            figures = [percentiles(busy[mode][0]) for _, busy in path_rounds]
            ratios = [f[1] / i[1] for f, i in zip(figures, idle, strict=True)]
            rate = med(busy[mode][1] for _, busy in path_rounds)
            per_second = med(busy[mode][2] for _, busy in path_rounds)
            print(
                f"{'8 writers, ' + mode:28} {med(f[0] for f in figures):8.0f}"
                f" {med(f[1] for f in figures):8.0f} {med(f[2] for f in figures):8.0f}"
                f" {med(ratios):8.2f}x {rate:13.2f} {per_second:10.0f}"
            )
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

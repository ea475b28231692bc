"""make bench: what publishing KV events for routers costs LOOKUP.

Two RAM-only daemons, one after the other in the same run: one publishing
KV events on ZMQ (``[events]``, with a subscriber draining them) and one
not. Against each, another process stores 4 KiB blocks in batches of 1000,
two batches in flight, into a 256 MiB RAM tier (each a STORED event, and an
EVICTED one once RAM is full; each under its own block hash) as fast as the
daemon takes them, while this
process looks up a resident 512-block chain (prefix LOOKUP) every 2 ms,
as a router looks at a node. Prints the blocks stored and (publisher on)
the block events published per second, the lookup's p50/p99 with the
publisher on and off, and their ratio.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import zmq

from benchmarks.streaming import percentiles
from kvtier import loops
from kvtier.client.aio import Client
from kvtier.model import LookupMode
from tests.enginedaemon import start

CHAIN = 512
BLOCKS = 400_000
#: bytes per block the writer stores
BLOCK = 4096
RAM = "256MiB"
#: seconds between two lookups: a router looking at a node, not a second
#: writer's worth of load on this 2-core machine
PACE = 0.002

_WRITER = """
import asyncio, sys, time
from kvtier import loops
from kvtier.client.aio import Client

async def main(path, blocks, size):
    async with await Client.connect(path) as c:
        print("go", flush=True)
        started = time.perf_counter()

        async def store(first, last):
            for n in range(first, last, 1000):
                # Keys as the vLLM tier names blocks (a 32-byte hash, a group
                # index): each block its own hash on the event stream.
                keys = [(n + i).to_bytes(32, "big") + bytes(4) for i in range(1000)]
                await c.put_many(keys, [b"x" * size] * 1000)

        # Two batches in flight, as an engine's tier has several stores out:
        # the daemon is never idle waiting for the next batch.
        half = blocks // 2
        await asyncio.gather(store(0, half), store(half, blocks))
        print(f"{blocks / (time.perf_counter() - started):.0f}", flush=True)

loops.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
"""


async def measure(sock: str) -> tuple[list[float], str]:
    async with await Client.connect(sock) as client:
        chain = [f"chain-{i:04d}".encode() for i in range(CHAIN)]
        await client.put_many(chain, [b"c" * 4096] * CHAIN)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            textwrap.dedent(_WRITER),
            sock,
            str(BLOCKS),
            str(BLOCK),
            stdout=subprocess.PIPE,
        )
        assert proc.stdout is not None
        assert (await proc.stdout.readline()).strip() == b"go"
        samples: list[float] = []
        done = asyncio.ensure_future(proc.stdout.readline())
        while not done.done() or len(samples) < 50:
            started = time.perf_counter()
            await client.lookup(chain, mode=LookupMode.PREFIX)
            samples.append((time.perf_counter() - started) * 1e6)
            await asyncio.sleep(PACE)  # allow-sleep: paces the prober, as a router's looks
        rate = (await done).decode().strip()
        await proc.wait()
        return samples, rate


def run(tmp: Path, publish: bool) -> tuple[list[float], str, float]:
    """The lookup's latencies, the writer's blocks/s, and (publishing) the
    block events the publisher sent per second."""
    args = ["--no-disk", "--ram-capacity", RAM]
    if publish:
        (tmp / "kvtier.toml").write_text(f'[events]\nendpoint = "ipc://{tmp}/events"\n')
        args += ["--config", str(tmp / "kvtier.toml")]
    daemon = start(tmp, *args)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    if publish:
        sub.connect(f"ipc://{tmp}/events")
    try:
        samples, rate = loops.run(measure(str(daemon.socket_path)))
        events = daemon.total("kvtier_kv_events_blocks_total")
        while sub.poll(500):  # drain what the subscriber was sent (bounded)
            sub.recv_multipart()
    finally:
        sub.close()
        ctx.term()
        daemon.stop()
    return samples, rate, events / (BLOCKS / float(rate))


def main() -> int:
    rows = []
    for publish in (False, True, True, False) * 2:
        with tempfile.TemporaryDirectory(prefix="kvt-kvev-", dir="/tmp") as tmp:
            samples, rate, events = run(Path(tmp), publish)
            rows.append((publish, samples, rate, events))
    print("KV events      blocks/s stored   events/s published   LOOKUP p50 us   p99 us")
    for publish, samples, rate, events in rows:
        p50, p99, _ = percentiles(samples)
        shown = f"{events:,.0f}" if publish else "-"
        print(
            f"{'on ' if publish else 'off'}            {int(rate):>15,}   {shown:>18}"
            f"   {p50:13.0f}   {p99:6.0f}"
        )
    off = statistics.median(percentiles(s)[1] for p, s, _, _ in rows if not p)
    on = statistics.median(percentiles(s)[1] for p, s, _, _ in rows if p)
    print(f"p99 with the publisher on / off: {on / off:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

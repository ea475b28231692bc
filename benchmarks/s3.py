"""make bench-s3: the S3 tier against real object stores, in one run.

The tier itself (aiobotocore, its deadlines, checksums and breaker; no
daemon around it) against three stores on this machine's loopback, each
started here: Ceph 16's RADOS Gateway over one OSD in memory (memstore),
the same over one OSD on a file (bluestore, where a disk matters), and
moto's emulator, the one the tests used before Ceph. For blocks of 256 KiB
and 1 MiB: a PUT, a GET and a HEAD one at a time (median and p99 latency),
and PUTs and GETs 16 at once (throughput). Every GET is checked against
what was put. Ratios are against Ceph memstore, in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from benchmarks.report import machine
from kvtier import Client, loops
from kvtier.config import S3TierConfig
from kvtier.sizes import KiB, MiB
from kvtier.tiers.s3 import S3Tier
from tests.ceph import CephS3
from tests.helpers import DaemonProcess, short_tmpdir
from tests.s3server import ProxiedS3, S3Server

SIZES = (256 * KiB, MiB)
AT_ONCE = 16


def tier_of(s3: ProxiedS3) -> S3Tier:
    """A tier straight at the store (not through the tests' counting proxy)."""
    cfg = s3.tier_config(s3.new_bucket(), endpoint_url=s3.endpoint)
    return S3Tier(S3TierConfig.model_validate(cfg))


async def timed(n: int, op: Callable[[int], Awaitable[Any]]) -> list[float]:
    out = []
    for i in range(n):
        started = time.perf_counter()
        await op(i)
        out.append(time.perf_counter() - started)
    return out


async def measure(s3: ProxiedS3, blocks: int) -> dict[str, float]:
    tier = tier_of(s3)
    await tier.open()
    row: dict[str, float] = {}
    try:
        for size in SIZES:
            await measure_size(tier, size, blocks, row)
    finally:
        await tier.close()
    return row


async def measure_size(tier: S3Tier, size: int, blocks: int, row: dict[str, float]) -> None:
    tag = f"{size // KiB} KiB"
    values = [bytes([i % 251]) * size for i in range(blocks)]
    keys = [b"bench-%d-%d" % (size, i) for i in range(blocks)]
    one = blocks // 2  # one at a time: the first half; at once: the second

    async def put(i: int) -> None:
        await tier.batch_store([keys[i]], [values[i]])

    async def get(i: int) -> None:
        (got,) = await tier.batch_load([keys[i]])
        assert got is not None and bytes(got) == values[i], "a GET brought other bytes"

    async def head(i: int) -> None:
        assert await tier.batch_lookup([keys[i]]) == [True]

    puts = await timed(one, put)
    gets = await timed(one, get)
    heads = await timed(one, head)
    for name, xs in (("put", puts), ("get", gets), ("head", heads)):
        row[f"{name} {tag} p50 ms"] = statistics.median(xs) * 1000
        row[f"{name} {tag} p99 ms"] = statistics.quantiles(xs, n=100)[98] * 1000
    rest = list(range(one, blocks))
    for name, op in (("put", put), ("get", get)):
        started = time.perf_counter()
        for lo in range(0, len(rest), AT_ONCE):
            await asyncio.gather(*(op(i) for i in rest[lo : lo + AT_ONCE]))
        elapsed = time.perf_counter() - started
        row[f"{name} {tag} x{AT_ONCE} MB/s"] = len(rest) * size / elapsed / 1e6


#: the outage: RGW killed for this long while a writer keeps its pace
OUTAGE_SECONDS = 30.0
#: blocks the outage's writer puts: their size, and blocks a second
OUTAGE_BLOCK = 64 * KiB
OUTAGE_RATES = (100, 200)


async def until(done: Callable[[int], bool], owed: Callable[[], Awaitable[int]]) -> float:
    """When ``done(owed())`` first held, polled every 50 ms for up to 10 minutes."""
    for _ in range(12_000):
        if done(await owed()):
            return time.monotonic()
        await asyncio.sleep(0.05)  # allow-sleep: polling the daemon's STATS
    raise RuntimeError("the daemon never got there")


async def outage(s3: CephS3, rate: int) -> dict[str, float]:
    """A daemon with a disk tier writes through to the bucket while a client
    puts ``rate`` blocks a second; RGW is killed for ``OUTAGE_SECONDS`` and
    started again. Returns the blocks owed at the peak, the seconds from
    RGW's return until the daemon owes no more than it did before the
    outage, and the blocks written during it that the bucket lacks."""
    bucket = s3.new_bucket()
    tier = s3.tier_config(bucket, endpoint_url=s3.endpoint, breaker_reset=2.0)
    work = Path(tempfile.mkdtemp(prefix="kvt-bench-outage-", dir="/tmp"))
    config = work / "kvtier.toml"
    config.write_text(
        "[[remote_tiers]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in tier.items())
    )
    proc = DaemonProcess(short_tmpdir(), "--config", str(config)).start()
    written: list[bytes] = []
    during: list[bytes] = []
    down = False
    stop = asyncio.Event()
    try:
        async with await Client.connect(proc.socket_path) as c:

            async def owed() -> int:
                return int((await c.stats())["writes"]["s3"]["owed_blocks"])

            async def writer() -> None:
                n = 0
                started = time.monotonic()
                while not stop.is_set():
                    key = b"outage-%d" % n
                    await c.put(key, key.ljust(OUTAGE_BLOCK, b"."))
                    written.append(key)
                    if down:
                        during.append(key)
                    n += 1
                    pause = started + n / rate - time.monotonic()
                    if pause > 0:
                        await asyncio.sleep(pause)  # allow-sleep: the writer's pace

            task = asyncio.ensure_future(writer())
            calm = 0
            for _ in range(50):  # 5 s of writes before the outage
                await asyncio.sleep(0.1)  # allow-sleep: sampling the calm
                calm = max(calm, await owed())
            down = True
            await asyncio.to_thread(s3.cluster.rgw_signal, signal.SIGKILL)
            await asyncio.sleep(OUTAGE_SECONDS)  # allow-sleep: the outage's length
            down = False
            peak = await owed()
            await asyncio.to_thread(s3.cluster.start_rgw)
            back = time.monotonic()
            drained = await until(lambda n: n <= calm, owed) - back
            stop.set()
            await task
            await until(lambda n: n == 0, owed)  # the last writes land
    finally:
        proc.stop()
        shutil.rmtree(work, ignore_errors=True)
    boto = s3.boto()
    names: set[str] = set()
    for page in boto.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        names.update(o["Key"] for o in page.get("Contents", []))
    missing = sum(1 for k in written if f"{tier['prefix']}{k.hex()}" not in names)
    return {
        "written during the outage": len(during),
        "owed at its end": peak,
        "owed before it (most)": calm,
        "seconds until owed again as before": drained,
        "blocks missing from the bucket": missing,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=400, help="blocks per size and store")
    parser.add_argument("--markdown", help="write the table here")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument(
        "--no-outage",
        dest="outage",
        action="store_false",
        help="leave out the outage (a daemon, RGW killed for 30 s)",
    )
    args = parser.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # (moto's request log)
    rows: dict[str, dict[str, float]] = {}
    for name, start in (
        ("Ceph RGW, memstore", lambda: CephS3("memstore")),
        ("Ceph RGW, bluestore on a file", lambda: CephS3("bluestore")),
        ("moto", S3Server),
    ):
        s3: ProxiedS3 = start()
        try:
            rows[name] = loops.run(measure(s3, args.blocks))
        finally:
            s3.close()
        print(name, json.dumps({k: round(v, 2) for k, v in rows[name].items()}), flush=True)
    base = rows["Ceph RGW, memstore"]
    metrics = list(base)
    lines = ["| | " + " | ".join(rows) + " |", "|---|" + "---:|" * len(rows)]
    for metric in metrics:
        cells = []
        for row in rows.values():
            v = row[metric]
            ratio = v / base[metric] if base[metric] else 0.0
            cells.append(f"{v:,.1f}" + ("" if row is base else f" ({ratio:.2f}x)"))
        lines.append(f"| {metric} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    outages: dict[int, dict[str, float]] = {}
    if args.outage:
        s3 = CephS3("bluestore")
        try:
            for rate in OUTAGE_RATES:
                outages[rate] = loops.run(outage(s3, rate))
                print(f"outage at {rate} blocks/s", outages[rate], flush=True)
        finally:
            s3.close()
    outage_lines: list[str] = []
    if outages:
        heads = [f"{rate} blocks/s ({rate * OUTAGE_BLOCK / 1e6:.1f} MB/s)" for rate in outages]
        outage_lines = ["| | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(heads)]
        for metric in next(iter(outages.values())):
            cells = [f"{row[metric]:,.1f}" for row in outages.values()]
            outage_lines.append(f"| {metric} | " + " | ".join(cells) + " |")
        print("\n".join(outage_lines))
    if args.markdown:
        outage_text = (
            "\n\nAn outage, through a daemon (`kvtier serve`, a disk tier, the S3 tier "
            "straight at RGW over bluestore, `breaker_reset = 2`): a client puts "
            f"{OUTAGE_BLOCK // KiB} KiB blocks at a steady pace; after 5 s RGW is killed for "
            f"{OUTAGE_SECONDS:.0f} s, then started again while the client keeps its pace. "
            "Every block written is owed to the store until it has it; the time until the "
            "daemon owes no more than before the outage is the time the blocks written during "
            "it took to reach the bucket. The bucket is listed at the end.\n\n"
            + "\n".join(outage_lines)
            if outages
            else ""
        )
        Path(args.markdown).write_text(
            "## The S3 tier on real object stores\n\n"
            f"Measured with `make bench-s3` on {time.strftime('%Y-%m-%d')} ({machine()}): the "
            "S3 tier itself (aiobotocore, deadlines, checksums), no daemon around it, against "
            "three stores on loopback started in the same run: Ceph 16's RADOS Gateway over one "
            "OSD in memory (memstore, as the tests start it), the same over one OSD on a file "
            "(bluestore), and moto's emulator. "
            f"{args.blocks // 2} blocks of each size one at a time (p50 and p99 of each request), "
            f"then {args.blocks // 2} more {AT_ONCE} at once (MB/s). In brackets: the ratio to "
            "Ceph memstore (for latencies, above 1 is slower; for MB/s, below 1 is).\n\n"
            + table
            + outage_text
            + "\n"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"stores": rows, "outage": outages}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

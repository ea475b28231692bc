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
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from benchmarks.report import machine
from kvtier import loops
from kvtier.config import S3TierConfig
from kvtier.sizes import KiB, MiB
from kvtier.tiers.s3 import S3Tier
from tests.ceph import CephS3
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=400, help="blocks per size and store")
    parser.add_argument("--markdown", help="write the table here")
    parser.add_argument("--json", help="also write the figures here")
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
    if args.markdown:
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
            + "\n"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

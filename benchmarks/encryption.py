"""make bench-encryption: what sealing blocks at rest costs, and what zstd saves.

Same run, each pair alternated (plain, sealed, plain, sealed ...) and the
median of the rounds taken, so the machine's noise falls on both sides:

* the disk tier: 1 MiB blocks written (``fsync = "none"``: the page cache,
  so the figure is the tier's own cost, not the device's) and read back,
  in a namespace without a key and in one with a key;
* the S3 tier against Ceph's RADOS Gateway on loopback (memstore, as the
  tests start it), 1 MiB objects put and got, plain and sealed;
* AES-256-GCM alone on 1 MiB;
* zstd (levels 1 and 3), block by block as a tier packs them: on bf16
  and fp16 tensors of normally distributed values (a stand-in for a
  model's K and V: near-random signs and mantissas, clustered exponents),
  and with ``--kv-blocks`` on real KV blocks a vLLM engine stored through
  kvtier (:mod:`benchmarks.kv_blocks`, run in .venv-e2e), its ratio and
  speed.

Prints a table; ``--markdown`` writes it (docs/bench-encryption.md, which
``make bench`` includes in docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from backports import zstd

from benchmarks.report import publish
from kvtier.config import S3TierConfig
from kvtier.model import namespace_prefix
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.s3 import S3Tier
from kvtier.tiers.sealing import Keyring, Keys, Sealer
from tests.ceph import CephS3

MiB = 1 << 20
NS = b"tenant"


def kv_bytes(n: int, kind: str, seed: int = 1) -> bytes:
    """``n`` bytes of bf16 or fp16 values drawn from N(0, 1)."""
    import random

    rng = random.Random(seed)
    count = n // 2
    if kind == "fp16":
        return struct.pack(f"<{count}e", *(rng.gauss(0, 1) for _ in range(count)))
    floats = struct.pack(f"<{count}f", *(rng.gauss(0, 1) for _ in range(count)))
    view = memoryview(floats).cast("H")
    return memoryview(bytes(view[1::2])).tobytes()  # each float's upper half: bf16


async def timed(op: Callable[[int], Awaitable[object]], n: int) -> float:
    start = time.perf_counter()
    for i in range(n):
        await op(i)
    return time.perf_counter() - start


async def pair(
    plain: Callable[[int], Awaitable[object]],
    sealed: Callable[[int], Awaitable[object]],
    n: int,
    rounds: int,
) -> tuple[float, float]:
    """GB/s of 1 MiB operations, plain and sealed, alternated; medians."""
    a, b = [], []
    for _ in range(rounds):
        a.append(n * MiB / await timed(plain, n) / 1e9)
        b.append(n * MiB / await timed(sealed, n) / 1e9)
    return statistics.median(a), statistics.median(b)


async def disk_rows(tmp: Path, n: int, rounds: int) -> list[tuple[str, float, float]]:
    keys = Keys({NS: Keyring.of(os.urandom(32))})
    tier = DiskTier(tmp / "disk", 3 * n * MiB * rounds, fsync="none", sealer=Sealer(keys))
    tier.prepare()
    await tier.load_index()
    await tier.rebuild_index()
    value = kv_bytes(MiB, "bf16")
    plain_key = [b"plain-%d" % i for i in range(n)]
    sealed_key = [namespace_prefix(NS) + b"sealed-%d" % i for i in range(n)]
    round_no = [0]

    def writer(names: list[bytes]) -> Callable[[int], Awaitable[object]]:
        async def write(i: int) -> None:
            await tier.write(names[i] + b"/%d" % round_no[0], value)  # a new block each round

        return write

    def reader(names: list[bytes]) -> Callable[[int], Awaitable[object]]:
        async def read(i: int) -> None:
            got = await tier.read(names[i] + b"/0")
            assert got is not None and len(got) == MiB

        return read

    puts = []
    for r in range(rounds):
        round_no[0] = r
        puts.append(await pair(writer(plain_key), writer(sealed_key), n, 1))
    put = (statistics.median(p for p, _ in puts), statistics.median(s for _, s in puts))
    get = await pair(reader(plain_key), reader(sealed_key), n, rounds)
    await tier.close()
    return [("disk put 1MiB", *put), ("disk get 1MiB", *get)]


async def s3_rows(n: int, rounds: int) -> list[tuple[str, float, float]]:
    server = CephS3()
    try:
        cfg = S3TierConfig(**server.tier_config(server.new_bucket()))
        keys = Keys({NS: Keyring.of(os.urandom(32))})
        tier = S3Tier(cfg, sealer=Sealer(keys))
        await tier.open()
        value = kv_bytes(MiB, "bf16")
        plain_key = [b"plain-%d" % i for i in range(n)]
        sealed_key = [namespace_prefix(NS) + b"sealed-%d" % i for i in range(n)]

        def putter(names: list[bytes]) -> Callable[[int], Awaitable[object]]:
            return lambda i: tier.batch_store([names[i]], [value])

        def getter(names: list[bytes]) -> Callable[[int], Awaitable[object]]:
            async def get(i: int) -> None:
                (got,) = await tier.batch_load([names[i]])
                assert got is not None and len(got) == MiB

            return get

        put = await pair(putter(plain_key), putter(sealed_key), n, rounds)
        get = await pair(getter(plain_key), getter(sealed_key), n, rounds)
        await tier.close()
    finally:
        server.close()
    return [("s3 put 1MiB (Ceph RGW)", *put), ("s3 get 1MiB (Ceph RGW)", *get)]


def aead_row(rounds: int) -> tuple[str, float, float]:
    sealer = Sealer(Keys({NS: Keyring.of(os.urandom(32))}))
    key = namespace_prefix(NS) + b"k"
    value = kv_bytes(MiB, "bf16")
    seals, opens = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(50):
            sealed = sealer.seal(key, value)
        seals.append(50 * MiB / (time.perf_counter() - start) / 1e9)
        start = time.perf_counter()
        for _ in range(50):
            sealer.admit(key, sealed)
        opens.append(50 * MiB / (time.perf_counter() - start) / 1e9)
    return ("AES-256-GCM 1MiB: seal / open", statistics.median(seals), statistics.median(opens))


def codec_rows(real: Path | None) -> list[tuple[str, float, float, float]]:
    """zstd on each KV-like input, block by block as a tier packs them."""
    inputs = [
        (f"{kind} normal values, 1 MiB blocks", kv_bytes(4 * MiB, kind), MiB)
        for kind in ("bf16", "fp16")
    ]
    if real is not None:
        data = real.read_bytes()
        inputs.append(("vLLM's own KV blocks (fp32, 64 KiB)", data, 64 * 1024))
    rows = []
    for name, data, block in inputs:
        blocks = [data[i : i + block] for i in range(0, len(data), block)]
        for level in (1, 3):
            start = time.perf_counter()
            packed = [zstd.compress(b, level=level) for b in blocks]
            pack_s = time.perf_counter() - start
            start = time.perf_counter()
            for p in packed:
                zstd.decompress(p)
            unpack_s = time.perf_counter() - start
            rows.append(
                (
                    f"zstd level {level}, {name}",
                    len(data) / sum(map(len, packed)),
                    len(data) / pack_s / 1e9,
                    len(data) / unpack_s / 1e9,
                )
            )
    return rows


async def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.encryption")
    parser.add_argument("--blocks", type=int, default=32, help="1 MiB blocks per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--markdown", type=Path, help="write the tables here")
    parser.add_argument(
        "--kv-blocks", type=Path, help="a file of real KV blocks (benchmarks/kv_blocks.py)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvt-bench-sealing-") as d:
        rows = await disk_rows(Path(d), args.blocks, args.rounds)
    rows += await s3_rows(max(8, args.blocks // 4), args.rounds)
    aead = aead_row(args.rounds)
    codecs = codec_rows(args.kv_blocks)
    out = [
        "## Sealing blocks at rest: what it costs",
        "",
        "Measured with `make bench-encryption`: through each tier in process, 1 MiB",
        "blocks of bf16 KV-like bytes, a namespace without a key (plain) and one",
        f"with a key (sealed: AES-256-GCM), alternated, medians of {args.rounds} rounds;",
        'the disk with `fsync = "none"` (the page cache: the tier\'s own cost),',
        "S3 against Ceph's RADOS Gateway on loopback, whose own cost dominates.",
        "",
        "| operation | plain GB/s | sealed GB/s | sealed / plain |",
        "|---|---:|---:|---:|",
        *(f"| {name} | {p:.2f} | {s:.2f} | {s / p:.2f}x |" for name, p, s in rows),
        f"| {aead[0]} | | {aead[1]:.2f} / {aead[2]:.2f} | |",
        "",
        "zstd, block by block: on normally distributed bf16 and fp16 values, and on",
        "the KV blocks a vLLM engine (its CPU build, the end-to-end tests' tiny",
        "model, fp32) stored through kvtier:",
        "",
        "| codec | ratio | compress GB/s | decompress GB/s |",
        "|---|---:|---:|---:|",
        *(f"| {name} | {r:.2f}x | {c:.2f} | {u:.2f} |" for name, r, c, u in codecs),
    ]
    publish(out, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))

"""``make bench``: kvtier, Redis 7 and the raw socket limit, measured in one run.

Every system runs on this machine over a Unix socket with persistence off,
driven by the same client process; each figure is a median of several runs
after a warm-up, and every ratio compares two figures of the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from importlib.metadata import version
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from benchmarks.raw import RawStore
from kvtier import BlockingClient, Client, blockcopy, loops
from kvtier._version import __version__
from kvtier.bench import (
    BLOCK_SIZES,
    BatchStore,
    Figure,
    KvtierStore,
    MiB,
    Store,
    block_key,
    format_table,
    lookup_batch,
    measure,
    measure_side_by_side,
    ops_for,
    percentile,
    prefix_lookup,
    put_get,
    put_get_batched,
    read_in_place,
)
from kvtier.config import load_config
from kvtier.daemon import Daemon
from kvtier.tiers.memory import MemoryRemoteTier

ROOT = Path(__file__).resolve().parent.parent


class RedisStore:
    name = "redis"

    def __init__(self, clients: list[aioredis.Redis]) -> None:
        self.clients = clients

    async def put(self, worker: int, key: bytes, value: bytes) -> None:
        await self.clients[worker].set(key, value)

    async def get(self, worker: int, key: bytes) -> Any:
        value = await self.clients[worker].get(key)
        if value is None:
            raise RuntimeError("redis lost a block during the benchmark")
        return value

    async def clear(self, keys: Sequence[bytes]) -> None:
        await self.clients[0].delete(*keys)

    async def put_many(self, worker: int, keys: Sequence[bytes], value: bytes) -> None:
        await self.clients[worker].mset(dict.fromkeys(keys, value))

    async def get_many(self, worker: int, keys: Sequence[bytes]) -> Any:
        values = await self.clients[worker].mget(keys)
        if None in values:
            raise RuntimeError("redis lost a block during the benchmark")
        return values


class MemcpyStore:
    """The floor of any data path: copying the same bytes once, in this process.

    Each block has its own buffer (the same working set as the stores'), so
    the copies run at memory speed, not from a cache-hot source.
    """

    name = "memcpy"

    def __init__(self, workers: int) -> None:
        self._dests = [memoryview(bytearray(max(BLOCK_SIZES))) for _ in range(workers)]
        self._blocks: dict[bytes, memoryview] = {}

    async def put(self, worker: int, key: bytes, value: bytes) -> None:
        block = self._blocks.get(key)
        if block is None or len(block) != len(value):
            block = self._blocks[key] = memoryview(bytearray(len(value)))
        block[:] = value

    async def get(self, worker: int, key: bytes) -> Any:
        block = self._blocks[key]
        self._dests[worker][: len(block)] = block
        return len(block)

    async def clear(self, keys: Sequence[bytes]) -> None:
        pass  # the buffers are reused: a copy, not an allocation, is measured

    async def put_many(self, worker: int, keys: Sequence[bytes], value: bytes) -> None:
        for key in keys:
            await self.put(worker, key, value)

    async def get_many(self, worker: int, keys: Sequence[bytes]) -> Any:
        return [await self.get(worker, key) for key in keys]


class SteadyMemcpy:
    """The steady rows' floor: each block copied once into the next of a
    ring of buffers as large as the stores (pre-touched: a full store's
    memory, not fresh pages), in this process: with memcpy, or ``streamed``
    as kvtier's writers copy (kvtier.blockcopy)."""

    def __init__(self, count: int, size: int, *, streamed: bool = False) -> None:
        self._ring = [memoryview(bytearray(b"\x01" * size)) for _ in range(count)]
        self._next = 0
        self._streamed = streamed
        self.name = "streamed copy" if streamed else "memcpy"

    async def put(self, worker: int, key: bytes, value: bytes) -> None:
        self._next = (self._next + 1) % len(self._ring)
        if self._streamed:
            blockcopy.copy_into(self._ring[self._next], value)
        else:
            self._ring[self._next][: len(value)] = value


def wait_for_line(proc: subprocess.Popen[bytes], needle: str, timeout: float = 60) -> None:
    assert proc.stderr is not None or proc.stdout is not None
    stream = proc.stderr if proc.stderr is not None else proc.stdout
    assert stream is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = stream.readline().decode(errors="replace")
        if needle in line:
            return
        if not line and proc.poll() is not None:
            break
    raise RuntimeError(f"process did not print {needle!r}")


def kvtier_command(sock: str, ram: str) -> list[str]:
    """``kvtier serve`` from RAM only on ``sock``, with ``ram`` of it."""
    return [
        sys.executable,
        "-m",
        "kvtier",
        "serve",
        "--socket",
        sock,
        "--no-disk",
        "--ram-capacity",
        ram,
        "--metrics-port",
        "0",
        "--log-level",
        "warning",
    ]


def redis_command(redis_bin: str, sock: str, maxmemory: int = 0) -> list[str]:
    """Redis on ``sock`` without persistence; with ``maxmemory``, evicting LRU."""
    limit = ["--maxmemory", str(maxmemory)]
    if maxmemory:
        limit += ["--maxmemory-policy", "allkeys-lru"]
    return [
        redis_bin,
        "--port",
        "0",
        "--unixsocket",
        sock,
        "--unixsocketperm",
        "700",
        "--save",
        "",
        "--appendonly",
        "no",
        *limit,
        "--loglevel",
        "warning",
    ]


def start_processes(tmp: Path) -> tuple[list[subprocess.Popen[bytes]], dict[str, str]]:
    redis_bin = shutil.which("redis-server")
    if redis_bin is None:
        raise SystemExit("redis-server not found: `make bench` installs it (Debian: redis-server)")
    paths = {
        "kvtier": str(tmp / "kvtier.sock"),
        "redis": str(tmp / "redis.sock"),
        "raw": str(tmp / "raw.sock"),
    }
    kv = subprocess.Popen(kvtier_command(paths["kvtier"], "4GiB"), stderr=subprocess.PIPE)
    rd = subprocess.Popen(redis_command(redis_bin, paths["redis"]), stdout=subprocess.PIPE)
    raw = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.raw", paths["raw"]], stdout=subprocess.PIPE, cwd=ROOT
    )
    wait_for_line(raw, "raw ready")
    deadline = time.monotonic() + 60
    while not (Path(paths["kvtier"]).exists() and Path(paths["redis"]).exists()):
        if time.monotonic() > deadline:
            raise RuntimeError("kvtier or redis did not start")
        time.sleep(0.05)  # allow-sleep: waiting for the sockets to appear
    wait_until_prepared(paths["kvtier"])
    return [kv, rd, raw], paths


def wait_until_prepared(sock: str, timeout: float = 120) -> None:
    """Until the daemon on ``sock`` has allocated its shared memory up front
    (STATS ``shared.preparing``): requests are slower while it does, and the
    figures are of a daemon serving, not starting."""
    deadline = time.monotonic() + timeout
    with BlockingClient(sock, shared=False, lookup_process=False) as c:
        while c.stats().get("shared", {}).get("preparing"):
            if time.monotonic() > deadline:
                raise RuntimeError("the daemon did not finish allocating its memory")
            time.sleep(0.05)  # allow-sleep: the daemon's worker thread allocating memory


async def redis_lookups(
    r: aioredis.Redis, n: int, fraction: float, runs: int, quick: bool
) -> list[Figure]:
    keys = [b"L" + block_key(i)[1:] for i in range(n)]
    stored = keys[: int(n * fraction)]
    await r.delete(b"kvset")
    if stored:
        await r.mset({k: b"x" for k in stored})
        await r.sadd(b"kvset", *stored)
    label = "all hit" if fraction == 1 else f"{int(fraction * 100)}% hit"

    async def exists(_i: int, _w: int) -> Any:
        pipe = r.pipeline(transaction=False)
        for k in keys:
            pipe.exists(k)
        return await pipe.execute()

    ops = 50 if quick else 200
    smis = await measure(
        f"lookup {n} keys ({label})",
        "redis SMISMEMBER",
        lambda _i, _w: r.smismember(b"kvset", keys),
        ops=ops,
        concurrency=1,
        work_per_op=n,
        unit="keys/s",
        runs=runs,
    )
    pipe = await measure(
        f"lookup {n} keys ({label})",
        "redis pipelined EXISTS",
        exists,
        ops=max(10, ops // 5),
        concurrency=1,
        work_per_op=n,
        unit="keys/s",
        runs=runs,
    )
    return [smis, pipe]


async def in_process_daemon(
    socket_path: Path, remote_tiers: list[MemoryRemoteTier] | None = None, **sections: Any
) -> tuple[Daemon, asyncio.Task[None]]:
    """A RAM-only daemon on this event loop (for workloads that gate a fake tier)."""
    config = load_config(
        None,
        {
            "server": {"socket_path": socket_path},
            "metrics": {"enabled": False},
            "ram": {"capacity": "64MiB"},
            "disk": {"enabled": False},
            **sections,
        },
    )
    daemon = Daemon(config, remote_tiers=remote_tiers)
    task = asyncio.create_task(daemon.run())
    await daemon.ready.wait()
    return daemon, task


#: the capacity both stores have in the steady-state rows
STEADY_BYTES = 512 * MiB


async def steady_state(tmp: Path, quick: bool, runs: int) -> list[Figure]:
    """1 MiB PUTs into stores already full at the same capacity: every PUT is a
    fresh key and evicts, the state an engine's store runs in (an empty store
    measures page faults instead, which Redis pays more of)."""
    kv_sock, redis_sock = tmp / "steady-kv.sock", tmp / "steady-redis.sock"
    kv = await asyncio.create_subprocess_exec(*kvtier_command(str(kv_sock), str(STEADY_BYTES)))
    redis_bin = shutil.which("redis-server")
    assert redis_bin is not None
    rd = await asyncio.create_subprocess_exec(
        *redis_command(redis_bin, str(redis_sock), STEADY_BYTES), stdout=subprocess.DEVNULL
    )
    figures: list[Figure] = []
    try:
        deadline = time.monotonic() + 60
        while not (kv_sock.exists() and redis_sock.exists()):
            if time.monotonic() > deadline:
                raise RuntimeError("kvtier or redis did not start")
            await asyncio.sleep(0.05)  # allow-sleep: waiting for two sockets to appear
        await asyncio.to_thread(wait_until_prepared, str(kv_sock))
        async with AsyncExitStack() as stack:
            kv_clients = [await Client.connect(str(kv_sock)) for _ in range(8)]
            staged_clients = [
                await Client.connect(str(kv_sock), stage_writes=True, write_in_place=False)
                for _ in range(8)
            ]
            socket_clients = [await Client.connect(str(kv_sock), shared=False) for _ in range(8)]
            redis_clients = [aioredis.Redis(unix_socket_path=str(redis_sock)) for _ in range(8)]
            for c in kv_clients + staged_clients + socket_clients:
                stack.push_async_callback(c.close)
            for r in redis_clients:
                stack.push_async_callback(r.aclose)
            value = bytes(range(256)) * (MiB // 256)
            stores: list[Store] = [
                KvtierStore(kv_clients),
                KvtierStore(staged_clients, "kvtier-staged"),
                KvtierStore(socket_clients, "kvtier-socket"),
                RedisStore(redis_clients),
            ]
            # Full: a third more than fits. Every client of the default path
            # fills it once, as a long-running engine's writers have: a
            # client writing in place faults each arena page into its own
            # mapping the first time it writes there (docs/shared-memory.md).
            fill = iter(range(1 << 62))
            for worker in range(8):
                for _ in range(STEADY_BYTES * 4 // 3 // MiB):
                    await stores[0].put(worker, b"fill-%d" % next(fill), value)
            for _ in range(STEADY_BYTES * 4 // 3 // MiB):
                await stores[-1].put(0, b"fill-%d" % next(fill), value)
            measured: list[Store | SteadyMemcpy] = [
                *stores,
                SteadyMemcpy(STEADY_BYTES // MiB, MiB),
                SteadyMemcpy(STEADY_BYTES // MiB, MiB, streamed=True),
            ]
            fresh = iter(range(1 << 62))

            def put_fresh(store: Store | SteadyMemcpy) -> Callable[[int, int], Awaitable[Any]]:
                def op(_i: int, worker: int) -> Awaitable[Any]:
                    return store.put(worker, b"s-%d" % next(fresh), value)

                return op

            for concurrency in (1, 8):
                print(f"  steady 1MiB x{concurrency}", file=sys.stderr)
                figures += await measure_side_by_side(
                    f"steady put 1MiB x{concurrency}",
                    [(store.name, put_fresh(store)) for store in measured],
                    ops=ops_for(MiB, quick),
                    concurrency=concurrency,
                    work_per_op=MiB,
                    unit="GB/s",
                    runs=runs,
                )
    finally:
        for p in (kv, rd):
            p.terminate()
            await p.wait()
    return figures


async def probe_sharing(tmp: Path) -> Figure:
    """N concurrent lookups of the same unknown keys: backend calls per key."""
    tier = MemoryRemoteTier("gated")
    tier.lookup_gate = asyncio.Event()
    daemon, task = await in_process_daemon(tmp / "probe.sock", remote_tiers=[tier])
    keys = [b"P" + block_key(i)[1:] for i in range(100)]
    clients = [await Client.connect(daemon.socket_path) for _ in range(8)]
    started = time.perf_counter()
    lookups = [asyncio.create_task(c.lookup(keys, wait=30.0)) for c in clients for _ in range(8)]
    await tier.lookup_started.wait()
    joined = {"tier": "gated", "outcome": "joined"}
    sample = daemon.metrics.registry.get_sample_value
    for _ in range(1_000_000):  # until every lookup has joined the one probe
        if sample("kvtier_probes_total", joined) == 63 * len(keys):
            break
        await asyncio.sleep(0)  # allow-sleep: one loop turn, no wait
    tier.lookup_gate.set()
    await asyncio.gather(*lookups)
    elapsed = time.perf_counter() - started
    probed = sum(len(call) for call in tier.lookup_calls)
    for c in clients:
        await c.close()
    daemon.stop()
    await task
    return Figure(
        f"probe sharing: 64 lookups x {len(keys)} unknown keys",
        "kvtier",
        "calls/key",
        probed / len(keys),
        elapsed * 1e6,
        elapsed * 1e6,
        [probed / len(keys)],
    )


async def deferred_writes(tmp: Path, quick: bool) -> Figure:
    """Readers behind a stalled reservation: delay from the deadline to their MISS."""
    deadline = 0.2
    daemon, task = await in_process_daemon(
        tmp / "defer.sock", lookup={"pending_deadline": deadline}
    )
    writer = await Client.connect(daemon.socket_path)
    readers = [await Client.connect(daemon.socket_path) for _ in range(8)]
    lags: list[float] = []

    async def read(c: Client, key: bytes) -> float:
        reply = await c.lookup([key], wait=10.0)
        assert reply.raw_states == b"\x00"
        return time.perf_counter()

    for trial in range(5 if quick else 15):
        key = b"D" + block_key(trial)[1:]
        reserved_at = time.perf_counter()
        await writer.reserve([key])
        answered = await asyncio.gather(*(read(c, key) for c in readers))
        lags.extend(t - (reserved_at + deadline) for t in answered)
    for c in (writer, *readers):
        await c.close()
    daemon.stop()
    await task
    lags.sort()
    return Figure(
        "deferred write: deadline -> MISS (8 readers)",
        "kvtier",
        "ms",
        statistics.median(lags) * 1e3,
        percentile(lags, 0.5) * 1e6,
        percentile(lags, 0.99) * 1e6,
        [x * 1e3 for x in lags],
    )


#: each kvtier path, and the other kvtier paths it is compared with (every
#: other system of the same workload is compared with each of them)
SUBJECTS = {
    "kvtier": ("kvtier-socket",),
    "kvtier-staged": ("kvtier-socket",),
    "kvtier-socket": (),
}


def ratios(figures: list[Figure]) -> list[dict[str, Any]]:
    by_workload: dict[str, dict[str, Figure]] = {}
    for f in figures:
        by_workload.setdefault(f.workload, {})[f.system] = f
    rows = []
    for workload, systems in by_workload.items():
        for subject, others in SUBJECTS.items():
            kv = systems.get(subject)
            if kv is None:
                continue
            row: dict[str, Any] = {
                "workload": workload,
                "system": subject,
                "rate": kv.rate,
                "unit": kv.unit,
                "against": {},
            }
            compared = [*others, *(n for n in systems if not n.startswith("kvtier"))]
            for name in compared:
                other = systems.get(name)
                if other is not None and other.rate:
                    row["against"][name] = {"rate": other.rate, "ratio": kv.rate / other.rate}
            rows.append(row)
    return rows


#: the summary's rows: the operations engines use, each system side by side
#: (lookups: Redis's faster way to ask)
SUMMARY = (
    "get 256KiB x1",
    "put 256KiB x1",
    "get 1MiB x1",
    "put 1MiB x1",
    "get 2MiB x1",
    "put 2MiB x1",
    "get 1MiB x8",
    "put 1MiB x8",
    "get 1MiB batch16 x1",
    "put 1MiB batch16 x1",
    "steady put 1MiB x1",
    "lookup 1000 keys (50% hit)",
    "prefix lookup 512-block chain",
)
#: the summary's columns: (heading, the systems whose best figure fills it)
SUMMARY_COLUMNS = (
    ("kvtier", ("kvtier",)),
    ("kvtier, socket only", ("kvtier-socket",)),
    ("Redis", ("redis", "redis SMISMEMBER", "redis pipelined EXISTS")),
    ("raw stream", ("raw",)),
    ("memcpy", ("memcpy",)),
)


def summary(figures: list[Figure]) -> str:
    """At most 15 rows: kvtier's default path, the same over the socket
    only, Redis, a raw stream and memcpy on the operations engines use, with
    kvtier's ratio to Redis and to memcpy (the full grid follows)."""
    by_workload: dict[str, dict[str, Figure]] = {}
    for f in figures:
        by_workload.setdefault(f.workload, {})[f.system] = f
    heads = [name for name, _ in SUMMARY_COLUMNS]
    lines = [
        "| operation | unit | " + " | ".join(heads) + " | kvtier / Redis | kvtier / memcpy |",
        "|---|---|" + "---:|" * (len(heads) + 2),
    ]
    for workload in SUMMARY:
        systems = by_workload.get(workload)
        if not systems or "kvtier" not in systems:
            continue
        cells: list[float | None] = []
        for _, names in SUMMARY_COLUMNS:
            rates = [systems[n].rate for n in names if n in systems]
            cells.append(max(rates) if rates else None)
        kv, redis, memcpy = cells[0], cells[2], cells[4]
        shown = ["—" if c is None else f"{c:,.2f}" if c < 100 else f"{c:,.0f}" for c in cells]
        by_redis = f"**{kv / redis:.2f}x**" if kv and redis else "—"
        by_memcpy = f"{kv / memcpy:.2f}x" if kv and memcpy else "—"
        row = [workload, systems["kvtier"].unit, *shown, by_redis, by_memcpy]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def format_ratios(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| workload | path | rate | compared with | their figure | path / them |",
        "|---|---|---:|---|---:|---:|",
    ]
    for row in rows:
        head = f"| {row['workload']} | {row['system']} | {row['rate']:,.2f} {row['unit']} |"
        if not row["against"]:
            lines.append(f"{head} — | — | — |")
        for name, cmp in row["against"].items():
            lines.append(f"{head} {name} | {cmp['rate']:,.2f} | **{cmp['ratio']:.2f}x** |")
    return "\n".join(lines)


def engine_section() -> str:
    """``make bench-e2e``'s, ``make bench-engines``', ``make bench-restart``'s
    and ``make bench-encryption``'s tables (docs/bench-*.md), those that were
    run: what an engine feels comes first."""
    names = (
        "bench-e2e.md",
        "bench-engines.md",
        "bench-restart.md",
        "bench-budget.md",
        "bench-hedging.md",
        "bench-encryption.md",
        "bench-s3.md",
    )
    paths = [ROOT / "docs" / name for name in names]
    return "".join(path.read_text() + "\n" for path in paths if path.exists())


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    redis_version = subprocess.run(
        ["redis-server", "--version"], capture_output=True, text=True
    ).stdout.split()[2]
    return (
        f"{os.cpu_count()} cores ({cpu}), Linux {platform.release()}, Python "
        f"{platform.python_version()}, uvloop {version('uvloop')}, Redis {redis_version} "
        f"(redis-py with hiredis), kvtier {__version__}"
    )


def chart(figures: list[Figure], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    labels = ["4KiB", "256KiB", "1MiB", "2MiB"]
    for ax, op in zip(axes, ("put", "get"), strict=True):
        for system, style in (
            ("kvtier", "o-"),
            ("kvtier-socket", "d-"),
            ("kvtier-staged", "v-"),
            ("redis", "s--"),
            ("raw", "^:"),
            ("memcpy", "x:"),
        ):
            ys = []
            for label in labels:
                match = [
                    f for f in figures if f.workload == f"{op} {label} x1" and f.system == system
                ]
                ys.append(match[0].rate if match else float("nan"))
            ax.plot(labels, ys, style, label=system)
        ax.set_title(f"{op.upper()}, one client")
        ax.set_xlabel("block size")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main(args: argparse.Namespace) -> tuple[list[Figure], int]:
    runs = 3 if args.quick else 5
    sizes = BLOCK_SIZES
    figures: list[Figure] = []
    with tempfile.TemporaryDirectory(prefix="kvtb-", dir="/tmp") as tmpdir:
        tmp = Path(tmpdir)
        procs, paths = start_processes(tmp)
        try:
            async with AsyncExitStack() as stack:
                kv_clients = [await Client.connect(paths["kvtier"]) for _ in range(8)]
                socket_clients = [
                    await Client.connect(paths["kvtier"], shared=False) for _ in range(8)
                ]
                staged_clients = [
                    await Client.connect(paths["kvtier"], stage_writes=True, write_in_place=False)
                    for _ in range(8)
                ]
                for c in kv_clients + socket_clients + staged_clients:
                    stack.push_async_callback(c.close)
                if not all(c.shared for c in kv_clients):
                    raise SystemExit("the daemon did not offer shared memory")
                redis_clients = [aioredis.Redis(unix_socket_path=paths["redis"]) for _ in range(8)]
                for r in redis_clients:
                    stack.push_async_callback(r.aclose)
                raw = await RawStore.connect(paths["raw"], 8)
                stack.callback(raw.close)
                for concurrency in (1, 4, 8):
                    stores: list[Store] = [
                        KvtierStore(kv_clients[:concurrency]),
                        KvtierStore(socket_clients[:concurrency], "kvtier-socket"),
                        KvtierStore(staged_clients[:concurrency], "kvtier-staged"),
                        RedisStore(redis_clients[:concurrency]),
                        raw,
                        MemcpyStore(concurrency),
                    ]
                    for size in sizes:
                        for store in stores:
                            print(f"  {store.name} {size} x{concurrency}", file=sys.stderr)
                            figures.extend(
                                await put_get(store, size, concurrency, quick=args.quick, runs=runs)
                            )
                        keys = [block_key(i) for i in range(ops_for(size, args.quick))]
                        await kv_clients[0].delete_many(keys)
                        await redis_clients[0].delete(*keys)
                batched: list[BatchStore] = [
                    KvtierStore(kv_clients[:1]),
                    KvtierStore(socket_clients[:1], "kvtier-socket"),
                    KvtierStore(staged_clients[:1], "kvtier-staged"),
                    RedisStore(redis_clients[:1]),
                    MemcpyStore(1),
                ]
                for store in batched:
                    print(f"  {store.name} 1MiB batch16", file=sys.stderr)
                    figures.extend(
                        await put_get_batched(store, MiB, 16, quick=args.quick, runs=runs)
                    )
                await kv_clients[0].delete_many([block_key(i) for i in range(ops_for(MiB, False))])
                for size in (*BLOCK_SIZES[1:], 4 * MiB):
                    print(f"  in place {size}", file=sys.stderr)
                    figures.append(
                        await read_in_place(kv_clients[0], size, quick=args.quick, runs=runs)
                    )
                for n in (1000, 10000):
                    for fraction in (1.0, 0.5):
                        print(f"  lookup {n} {fraction}", file=sys.stderr)
                        figures.append(
                            await lookup_batch(
                                kv_clients[0], n, fraction, quick=args.quick, runs=runs
                            )
                        )
                        figures.extend(
                            await redis_lookups(redis_clients[0], n, fraction, runs, args.quick)
                        )
                prefix = await prefix_lookup(kv_clients[0], quick=args.quick, runs=runs)
                figures.append(prefix)
                chain = [b"C" + block_key(i)[1:] for i in range(512)]
                await redis_clients[0].mset({k: b"x" for k in chain})

                async def exists_chain(_i: int, _w: int) -> Any:
                    pipe = redis_clients[0].pipeline(transaction=False)
                    for k in chain:
                        pipe.exists(k)
                    return await pipe.execute()

                figures.append(
                    await measure(
                        prefix.workload,
                        "redis pipelined EXISTS",
                        exists_chain,
                        ops=100 if args.quick else 300,
                        concurrency=1,
                        work_per_op=1,
                        unit="ops/s",
                        runs=runs,
                    )
                )
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(30)
        print("  steady state", file=sys.stderr)
        figures.extend(await steady_state(tmp, args.quick, runs))
        print("  probe sharing", file=sys.stderr)
        figures.append(await probe_sharing(tmp))
        print("  deferred writes", file=sys.stderr)
        figures.append(await deferred_writes(tmp, args.quick))

    return figures, runs


NOTES = """## Reading the figures

* Paths: **kvtier** is the Python client as it comes (reads through shared
  memory: a lease, then one copy out of the arena into the caller's buffer;
  blocks of 512 KiB and more written in place, one copy by the client
  straight into the block's RAM slot, none in the daemon; smaller ones over
  the socket, received straight into the slot). **kvtier-staged** writes
  every block of 64 KiB or more through the staging region instead (a
  staging room, then COMMIT: the daemon copies and checks it), as a client
  of another user than the daemon's does. **kvtier-socket** is a client
  that does not opt in (`shared=False`). *memcpy* copies the same working
  set once in the client process with glibc's memcpy. In the steady rows
  *streamed copy* copies it as kvtier's writer does into its slot, with
  streaming stores that write each line without first reading it
  (kvtier.blockcopy): the floor of a PUT in place, faster than memcpy into
  memory no cache holds.
* Every PUT run stores new keys (they are deleted before each run), for
  Redis as for kvtier. The *steady* rows store into stores already full at
  the same capacity (512 MiB; Redis with `allkeys-lru`): every PUT is a
  fresh key and evicts, as in an engine's long run. Their runs are taken
  in turn (one run of each system, then the next round), so that a spell
  of noise from the machine's other tenants slows each system alike.
* One block per request from one client pays a full request round trip per
  block, of the order of a 1 MiB copy here, so single-client rows are far
  from memcpy; the batched rows (16 blocks per request, `MGET`/`MSET` for
  Redis) and the 4- and 8-client rows show the data path itself.
* A PUT in place passes over the bytes once (the client's streamed copy
  into the slot); a staged PUT four times (the client's copy and checksum, the
  daemon's copy into the arena and its checksum); a socket PUT twice (two
  kernel copies, received in place). In the steady rows every client of
  the default path has filled the store once first, as an engine's
  long-running writers have (a client faults each arena page into its
  mapping the first time it writes there).
* Reading in place (`get in place`) costs one lease round trip whatever the
  block size.
* Probe sharing is measured against a gated in-memory remote tier: 64 lookups
  of the same 100 unknown keys from 8 connections make one backend call per
  key. Deferred writes: the time from a stalled reservation's deadline to its
  readers' MISS.
"""


def report(
    args: argparse.Namespace, figures: list[Figure], runs: int, measured: dict[str, str]
) -> None:
    """Print the figures and write the outputs asked for; ``measured``: the
    run's date and machine."""
    table = format_table(figures)
    rows = ratios(figures)
    print(table)
    print()
    print(format_ratios(rows))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"measured": measured, "figures": [f.as_dict() for f in figures], "ratios": rows},
                indent=2,
            )
        )
    if args.chart:
        chart(figures, Path(args.chart))
    if args.markdown:
        command = "make bench" + (" BENCH_ARGS=--quick" if args.quick else "")
        Path(args.markdown).write_text(
            "# Benchmarks\n\n"
            f"Measured with `{command}` on {measured['date']}: {measured['machine']}.\n\n"
            "All systems run on this machine over Unix sockets, driven by one client process "
            "(Python, uvloop). kvtier serves from RAM (`--no-disk`); Redis runs with persistence "
            "off; *raw* is a minimal uvloop `BufferedProtocol` stream with no protocol but a "
            "length. Rates are medians of "
            f"{runs} runs after a warm-up; p50/p99 are per operation. Every ratio compares two "
            "figures of the same run.\n\n"
            + engine_section()
            + "## Summary\n\n"
            + "Rates of the operations engines use (medians; lookups in keys or chains a "
            + "second, Redis's faster way to ask), on kvtier's default path (shared memory "
            + "where the client is on the same host), over its socket only, on Redis, a raw "
            + "stream and memcpy. Every figure is in the grid below and in "
            + "[benchmarks.json](benchmarks.json).\n\n"
            + summary(figures)
            + "\n\n## kvtier against the alternatives\n\n"
            + format_ratios(rows)
            + "\n\n"
            "![throughput by block size](benchmarks.png)\n\n" + NOTES + "\n"
            "## All figures\n\n```\n" + table + "\n```\n"
        )


def cli() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer, shorter runs")
    parser.add_argument("--json", help="write figures and ratios as JSON")
    parser.add_argument("--chart", help="write a PNG of throughput by block size")
    parser.add_argument("--markdown", help="write the results page (docs/benchmarks.md)")
    parser.add_argument("--from-json", help="re-render the outputs of an earlier --json run")
    args = parser.parse_args()
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        figures = [Figure(**f) for f in saved["figures"]]
        runs = len(figures[0].runs) if figures else 0
        measured = saved["measured"]
    else:
        figures, runs = loops.run(main(args))
        measured = {"date": time.strftime("%Y-%m-%d"), "machine": machine()}
    report(args, figures, runs, measured)
    return 0


if __name__ == "__main__":
    sys.exit(cli())

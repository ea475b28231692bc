"""Benchmark harness and the kvtier workloads (``kvtier bench``).

Each figure is the median of several timed runs after a warm-up run; every
operation's latency is recorded so p50/p99 come from the same runs. The
comparative suite (``make bench``: Redis and the raw socket limit side by
side) lives in ``benchmarks/`` and reuses this harness.

Imports only the client and the shared records: it measures a daemon from outside.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from kvtier.client import Client
from kvtier.model import LookupMode

KiB = 1024
MiB = 1024 * KiB
BLOCK_SIZES = (4 * KiB, 256 * KiB, 1 * MiB, 2 * MiB)


@dataclass
class Figure:
    """One workload on one system: the median rate and latency percentiles."""

    workload: str
    system: str
    unit: str  # "GB/s", "keys/s", "ops/s"
    rate: float
    p50_us: float
    p99_us: float
    runs: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    idx = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[idx]


#: op(i, worker): the i-th operation, run by worker number ``worker``
Op = Callable[[int, int], Awaitable[Any]]


async def measure(
    workload: str,
    system: str,
    op: Op,
    *,
    ops: int,
    concurrency: int,
    work_per_op: float,
    unit: str,
    runs: int = 5,
    before_run: Callable[[], Awaitable[None]] | None = None,
) -> Figure:
    """Run ``op(i, worker)`` ``ops`` times on ``concurrency`` workers, ``runs`` + 1 times.

    ``work_per_op`` converts operations into the unit (bytes for GB/s, keys
    for keys/s); ``before_run`` runs untimed before each run.
    """
    rates: list[float] = []
    latencies: list[float] = []
    for run in range(runs + 1):
        if before_run is not None:
            await before_run()
        rate, lat = await _timed_run(op, ops, concurrency, work_per_op, unit)
        if run:  # (the first is the warm-up)
            rates.append(rate)
            latencies.extend(lat)
    return _figure(workload, system, unit, rates, latencies)


async def measure_side_by_side(
    workload: str,
    systems: Sequence[tuple[str, Op]],
    *,
    ops: int,
    concurrency: int,
    work_per_op: float,
    unit: str,
    runs: int = 5,
) -> list[Figure]:
    """:func:`measure` of each ``(system, op)`` with their runs taken in
    turn (a warm-up round, then ``runs`` rounds of one run of each): a
    spell of noise on a shared machine slows a run of each system alike,
    not all the runs of one, so their ratio holds better than when each
    system's runs come one after another."""
    rates: list[list[float]] = [[] for _ in systems]
    latencies: list[list[float]] = [[] for _ in systems]
    for run in range(runs + 1):
        for i, (_, op) in enumerate(systems):
            rate, lat = await _timed_run(op, ops, concurrency, work_per_op, unit)
            if run:
                rates[i].append(rate)
                latencies[i].extend(lat)
    return [
        _figure(workload, system, unit, rates[i], latencies[i])
        for i, (system, _) in enumerate(systems)
    ]


async def _timed_run(
    op: Op, ops: int, concurrency: int, work_per_op: float, unit: str
) -> tuple[float, list[float]]:
    """One run: its rate in ``unit`` and each operation's latency (seconds)."""
    lat: list[float] = []
    counter = iter(range(ops))
    started = time.perf_counter()
    await asyncio.gather(*(_worker(op, w, counter, lat) for w in range(concurrency)))
    elapsed = time.perf_counter() - started
    return ops * work_per_op / elapsed / (1e9 if unit == "GB/s" else 1.0), lat


def _figure(
    workload: str, system: str, unit: str, rates: list[float], latencies: list[float]
) -> Figure:
    latencies.sort()
    return Figure(
        workload,
        system,
        unit,
        statistics.median(rates),
        percentile(latencies, 0.50) * 1e6,
        percentile(latencies, 0.99) * 1e6,
        rates,
    )


async def _worker(op: Op, w: int, counter: Iterator[int], lat: list[float]) -> None:
    for i in counter:  # shared: workers take the next operation as they free up
        t0 = time.perf_counter()
        await op(i, w)
        lat.append(time.perf_counter() - t0)


class Store(Protocol):
    """What the put/get workloads need from a system under test."""

    name: str

    async def put(self, worker: int, key: bytes, value: bytes) -> None: ...

    async def get(self, worker: int, key: bytes) -> Any: ...

    async def clear(self, keys: Sequence[bytes]) -> None: ...


class BatchStore(Store, Protocol):
    """A store that moves many blocks per request (an engine loading a prefix)."""

    async def put_many(self, worker: int, keys: Sequence[bytes], value: bytes) -> None: ...

    async def get_many(self, worker: int, keys: Sequence[bytes]) -> Any: ...


def block_key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def ops_for(size: int, quick: bool) -> int:
    """Enough operations for a stable figure: ~256 MiB per run for big blocks."""
    volume = (64 if quick else 256) * MiB
    return max(200 if quick else 1000, min(5000, volume // size))


async def put_get(
    store: Store, size: int, concurrency: int, *, quick: bool = False, runs: int = 5
) -> tuple[Figure, Figure]:
    """PUT then GET of ``size``-byte blocks with ``concurrency`` clients.

    Every PUT run stores new blocks: the keys are deleted before each run.
    """
    ops = ops_for(size, quick)
    value = bytes(range(256)) * (size // 256)
    label = f"{_size(size)} x{concurrency}"
    keys = [block_key(i) for i in range(ops)]

    async def clear() -> None:
        await store.clear(keys)

    put = await measure(
        f"put {label}",
        store.name,
        lambda i, w: store.put(w, keys[i], value),
        ops=ops,
        concurrency=concurrency,
        work_per_op=size,
        unit="GB/s",
        runs=runs,
        before_run=clear,
    )
    get = await measure(
        f"get {label}",
        store.name,
        lambda i, w: store.get(w, block_key(i)),
        ops=ops,
        concurrency=concurrency,
        work_per_op=size,
        unit="GB/s",
        runs=runs,
    )
    return put, get


async def put_get_batched(
    store: BatchStore, size: int, batch: int, *, quick: bool = False, runs: int = 5
) -> tuple[Figure, Figure]:
    """PUT then GET of ``batch`` blocks of ``size`` bytes per request, one client."""
    ops = max(8, ops_for(size, quick) // batch)
    value = bytes(range(256)) * (size // 256)
    keys = [block_key(i) for i in range(ops * batch)]
    label = f"{_size(size)} batch{batch} x1"

    async def clear() -> None:
        await store.clear(keys)

    put = await measure(
        f"put {label}",
        store.name,
        lambda i, w: store.put_many(w, keys[i * batch : (i + 1) * batch], value),
        ops=ops,
        concurrency=1,
        work_per_op=size * batch,
        unit="GB/s",
        runs=runs,
        before_run=clear,
    )
    get = await measure(
        f"get {label}",
        store.name,
        lambda i, w: store.get_many(w, keys[i * batch : (i + 1) * batch]),
        ops=ops,
        concurrency=1,
        work_per_op=size * batch,
        unit="GB/s",
        runs=runs,
    )
    return put, get


def _size(n: int) -> str:
    return f"{n // MiB}MiB" if n >= MiB else f"{n // KiB}KiB"


class KvtierStore:
    """kvtier through its own async client: one connection per concurrent client.

    A GET lands in the worker's own buffer (``get_into``), as an engine's
    does: through shared memory when the clients have it, else the socket.
    """

    def __init__(self, clients: list[Client], name: str = "kvtier") -> None:
        self.clients = clients
        self.name = name
        self._dests = [bytearray(max(BLOCK_SIZES)) for _ in clients]
        #: destinations of batched GETs (one client), by batch size
        self._batch_dests: dict[int, list[bytearray]] = {}

    async def put(self, worker: int, key: bytes, value: bytes) -> None:
        await self.clients[worker].put(key, value)

    async def get(self, worker: int, key: bytes) -> Any:
        n = await self.clients[worker].get_into(key, self._dests[worker])
        if n is None:
            raise RuntimeError(f"kvtier lost block {key.hex()} during the benchmark")
        return n

    async def clear(self, keys: Sequence[bytes]) -> None:
        await self.clients[0].delete_many(keys)

    async def put_many(self, worker: int, keys: Sequence[bytes], value: bytes) -> None:
        await self.clients[worker].put_many(keys, [value] * len(keys))

    async def get_many(self, worker: int, keys: Sequence[bytes]) -> Any:
        dests = self._batch_dests.get(len(keys))
        if dests is None:
            dests = self._batch_dests[len(keys)] = [bytearray(max(BLOCK_SIZES)) for _ in keys]
        got = await self.clients[worker].get_many_into(keys, dests)
        if None in got:
            raise RuntimeError("kvtier lost a block during the benchmark")
        return got


async def read_in_place(client: Client, size: int, *, quick: bool, runs: int) -> Figure:
    """Lease a block and read its first and last byte where it lies: O(1) in its size."""
    keys = [b"I" + block_key(i)[1:] for i in range(64)]
    value = bytes(range(256)) * (size // 256)
    await client.put_many(keys, [value] * len(keys))

    async def read(i: int, _w: int) -> int:
        async with client.lease(keys[i % len(keys)]) as view:
            if view is None:
                raise RuntimeError("kvtier lost a block during the benchmark")
            return view[0] + view[-1]

    figure = await measure(
        f"get in place {_size(size)} x1",
        "kvtier",
        read,
        ops=500 if quick else 2000,
        concurrency=1,
        work_per_op=1,
        unit="ops/s",
        runs=runs,
    )
    await client.delete_many(keys)
    return figure


async def lookup_batch(
    client: Client, n: int, hit_fraction: float, *, quick: bool = False, runs: int = 5
) -> Figure:
    """One LOOKUP of ``n`` keys (per-key states); ``hit_fraction`` of them stored."""
    keys = [b"L" + block_key(i)[1:] for i in range(n)]
    stored = keys[: int(n * hit_fraction)]
    if stored:
        await client.put_many(stored, [b"x"] * len(stored))
    label = "all hit" if hit_fraction == 1 else f"{int(hit_fraction * 100)}% hit"
    return await measure(
        f"lookup {n} keys ({label})",
        "kvtier",
        lambda i, w: client.lookup(keys),
        ops=50 if quick else 200,
        concurrency=1,
        work_per_op=n,
        unit="keys/s",
        runs=runs,
    )


async def prefix_lookup(
    client: Client, length: int = 512, *, quick: bool = False, runs: int = 5
) -> Figure:
    keys = [b"C" + block_key(i)[1:] for i in range(length)]
    await client.put_many(keys, [b"x"] * length)
    return await measure(
        f"prefix lookup {length}-block chain",
        "kvtier",
        lambda i, w: client.lookup(keys, mode=LookupMode.PREFIX),
        ops=200 if quick else 1000,
        concurrency=1,
        work_per_op=1,
        unit="ops/s",
        runs=runs,
    )


def format_table(figures: Sequence[Figure]) -> str:
    rows = [("workload", "system", "rate", "unit", "p50 us", "p99 us")]
    for f in figures:
        rows.append(
            (f.workload, f.system, f"{f.rate:,.2f}", f.unit, f"{f.p50_us:,.0f}", f"{f.p99_us:,.0f}")
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


async def run_against_daemon(
    path: str | None, *, quick: bool, sizes: Sequence[int]
) -> list[Figure]:
    """The kvtier-only workloads against an already-running daemon (``kvtier bench``)."""
    runs = 3 if quick else 5
    figures: list[Figure] = []
    clients = [await Client.connect(path) for _ in range(8)]
    try:
        for concurrency in (1, 8):
            store = KvtierStore(clients[:concurrency])
            for size in sizes:
                figures.extend(await put_get(store, size, concurrency, quick=quick, runs=runs))
                await clients[0].delete_many([block_key(i) for i in range(ops_for(size, quick))])
        for n in (1000, 10000):
            for fraction in (1.0, 0.5):
                figures.append(await lookup_batch(clients[0], n, fraction, quick=quick, runs=runs))
        figures.append(await prefix_lookup(clients[0], quick=quick, runs=runs))
    finally:
        for c in clients:
            await c.close()
    return figures

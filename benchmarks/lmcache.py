"""make bench-lmcache: loads and stores through kvtier's LMCache storage plugin.

Runs in .venv-lmcache. For chunks of 256 KiB to 2 MiB (64 MiB per run,
median of 5 runs after a warm-up), in one run: GB/s of loads
(``batched_get_blocking``, in the caller's thread, as LMCache's storage
manager calls it) and of stores (``batched_submit_put_task``, waited for)
through the ``KvtierBackend`` LMCache's own ``CreateStorageBackends``
builds from the documented config, beside its ``LocalCPUBackend`` (chunks
land in, and leave from, the ``MemoryObj``s LMCache allocates; a RAM-only
daemon on a Unix socket for each chunk size, its RAM filled first with
chunks of that size, every run storing its chunks under keys no run stored
before), and of a plain memcpy of the same bytes into the same kind of
buffers (the ceiling). A load also takes LMCache's buffers and lets them go
(LMCache frees them once on the GPU): the floor LMCache leaves any backend
is timed too, a load that costs nothing: the same chunks copied into
buffers ``batched_allocate`` gives, let go by the caller. And the loads of
the connector alone as a remote plugin, each on LMCache's event loop.
Prints the figures and the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from lmcache.utils import CacheEngineKey

from benchmarks.engines import Figures, warm
from tests.enginedaemon import start
from tests.lmcache.test_backend import Plugged
from tests.lmcache.test_connector import KV_SHAPE

TOTAL = 64 * 1024 * 1024
RUNS = 5
KiB, MiB = 1024, 1024 * 1024
BATCH = 16


def gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def measure(
    chunk: int, socket: Path, loop: asyncio.AbstractEventLoop, figures: Figures
) -> dict[str, float]:
    # (layers, K and V, tokens, kv heads, head size) of float16: ``chunk`` bytes
    layers, kv, tokens, _, head = KV_SHAPE
    heads = chunk // (layers * kv * tokens * head * 2)
    plugged = Plugged(loop, socket, kv_shape=(layers, kv, tokens, heads, head))
    ours, backend = plugged.ours, plugged.local
    conn = ours.connector

    def run(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(120)

    count = TOTAL // chunk

    def fresh(attempt: int) -> list[CacheEngineKey]:
        """Keys no run stored before: every put stores its chunks anew."""
        first = (chunk * 100 + attempt) * count
        return [CacheEngineKey("bench", 1, 0, first + i, torch.float16) for i in range(count)]

    shapes, dtypes, fmt = conn.meta_shapes, conn.meta_dtypes, conn.meta_fmt
    objs = [backend.allocate(shapes, dtypes, fmt) for _ in range(count)]
    for obj in objs:
        memoryview(obj.byte_array).cast("B")[:] = os.urandom(64) * (chunk // 64)

    def floor(sources: list[Any]) -> list[Any]:
        """What a backend that costs nothing returns, called as LMCache calls
        its backends' loads: LMCache's buffers for the chunks, filled with a
        memcpy each, in the caller's thread."""
        bufs = backend.batched_allocate(shapes, dtypes, len(sources), fmt, eviction=False)
        assert bufs is not None
        for buf, obj in zip(bufs, sources, strict=True):
            memoryview(buf.byte_array).cast("B")[:] = memoryview(obj.byte_array).cast("B")
        return list(bufs)

    puts, gets, loop_gets, copies, floors = [], [], [], [], []
    dests = [bytearray(chunk) for _ in range(BATCH)]
    for attempt in range(RUNS + 1):
        keys = fresh(attempt)
        started = time.perf_counter()
        for i in range(0, count, BATCH):
            plugged.store(keys[i : i + BATCH], objs[i : i + BATCH])
        put_s = time.perf_counter() - started
        # the storage plugin's loads: in this thread
        started = time.perf_counter()
        for i in range(0, count, BATCH):
            for got in ours.batched_get_blocking(keys[i : i + BATCH]):
                assert got is not None
                got.ref_count_down()
        get_s = time.perf_counter() - started
        # the connector alone as a remote plugin: each load on LMCache's loop
        started = time.perf_counter()
        for i in range(0, count, BATCH):
            for got in run(conn.batched_get(keys[i : i + BATCH])):
                got.ref_count_down()
        loop_get_s = time.perf_counter() - started
        started = time.perf_counter()
        for i in range(0, count, BATCH):
            for j, obj in enumerate(objs[i : i + BATCH]):
                dests[j][:] = memoryview(obj.byte_array).cast("B")
        copy_s = time.perf_counter() - started
        started = time.perf_counter()
        for i in range(0, count, BATCH):
            for got in floor(objs[i : i + BATCH]):
                got.ref_count_down()
        floor_s = time.perf_counter() - started
        if attempt:  # the first run warms up
            puts.append(put_s)
            gets.append(get_s)
            loop_gets.append(loop_get_s)
            copies.append(copy_s)
            floors.append(floor_s)
    reader = ours.reader
    assert reader is not None and reader.blocks_read == (RUNS + 1) * count  # all read directly
    for obj in objs:
        obj.ref_count_down()
    plugged.close()
    figures.add(f"get {chunk // KiB} KiB / memcpy", gets, copies)
    figures.add(f"put {chunk // KiB} KiB / memcpy", puts, copies)
    figures.add(f"get {chunk // KiB} KiB / LMCache's floor", gets, floors)
    figures.add(f"get on LMCache's loop {chunk // KiB} KiB / memcpy", loop_gets, copies)
    return {
        "get": gbps(TOTAL, gets),
        "loop_get": gbps(TOTAL, loop_gets),
        "put": gbps(TOTAL, puts),
        "memcpy": gbps(TOTAL, copies),
        "floor": gbps(TOTAL, floors),
    }


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lmcache")
    parser.add_argument("--json", type=Path, help="merge the rows into this figures file")
    args = parser.parse_args()
    figures = Figures("lmcache")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    print(
        "chunk    get GB/s  put GB/s  memcpy GB/s  get/memcpy  put/memcpy  floor GB/s  get/floor"
        "  loop get/memcpy"
    )
    for chunk in (256 * KiB, 512 * KiB, 1 * MiB, 2 * MiB):
        with tempfile.TemporaryDirectory(prefix="kvt-bench-lmc-", dir="/tmp") as tmp:
            # RAM only: what is measured is the engine-facing path, not a
            # disk; a daemon a chunk size, its RAM filled first (its steady
            # state: every page of its arena touched, chunks of the size evicted)
            daemon = start(Path(tmp), "--no-disk", "--ram-capacity", "512MiB")
            try:
                warm(daemon.socket_path, chunk)
                r = measure(chunk, daemon.socket_path, loop, figures)
            finally:
                daemon.stop()
        print(
            f"{chunk // KiB:5d} KiB {r['get']:8.2f}  {r['put']:8.2f}  {r['memcpy']:11.2f}"
            f"  {r['get'] / r['memcpy']:9.2f}x  {r['put'] / r['memcpy']:9.2f}x"
            f"  {r['floor']:10.2f}  {r['get'] / r['floor']:8.2f}x"
            f"  {r['loop_get'] / r['memcpy']:14.2f}x"
        )
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    if args.json is not None:
        figures.write(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

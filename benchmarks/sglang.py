"""make bench-sglang: pages loaded and stored through kvtier's SGLang backend.

Runs in .venv-sglang. For pages of 256 KiB to 2 MiB (a page is its K and its
V half, one block each; 64 MiB per run, median of 5 runs after a warm-up),
in one run: GB/s of ``batch_get_v1`` and ``batch_set_v1`` (called with
``STORAGE_BATCH_SIZE`` pages at a time, as SGLang's cache controller
slices its prefetches and backups) on the backend
SGLang's own ``StorageBackendFactory`` builds, moving pages of SGLang's real
host KV pool (page-first, on the CPU; a RAM-only daemon on a Unix socket
for each page size, its RAM filled first with blocks of a page's half, every
run storing fresh blocks), and of a
plain memcpy of the same pages between the same pool's pages (the ceiling).
Each size runs twice: the pool in process memory (pages cross the socket)
and the pool in a memfd (``allocator: shm``: the daemon copies the pages
itself, as a region). Prints the figures and the ratios.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from benchmarks.engines import Figures, warm
from tests.enginedaemon import start
from tests.sglang.test_storage import HEAD_DIM, host_pool, storage_config

TOTAL = 64 * 1024 * 1024
RUNS = 5
KiB, MiB = 1024, 1024 * 1024
TOKENS, LAYERS = 16, 4
#: pages a storage call moves: SGLang's own batch (its cache controller
#: prefetches and backs up a request's pages in slices of this many)
BATCH = STORAGE_BATCH_SIZE


def gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def pool(page_bytes: int, pages: int, allocator: str) -> MHATokenToKVPoolHost:
    """A host pool whose pages are ``page_bytes`` (K and V halves of bf16)."""
    heads = page_bytes // (2 * LAYERS * TOKENS * HEAD_DIM * 2)
    return host_pool(allocator, device_pages=pages, tokens=TOKENS, heads=heads, layers=LAYERS)


def measure(page_bytes: int, socket: Path, allocator: str, figures: Figures) -> dict[str, float]:
    count = TOTAL // page_bytes
    host = pool(page_bytes, count, allocator)
    storage = StorageBackendFactory.create_backend(
        "dynamic", storage_config(socket, timeout=60.0), host
    )
    storage.register_mem_pool_host(host)
    assert bool(storage.files) == (allocator == "shm"), storage.files
    src = host.alloc(count * TOKENS)
    dst = host.alloc(count * TOKENS)
    host.kv_buffer.view(torch.uint8).random_()
    keys = [f"{page_bytes:016x}{i:048x}" for i in range(count)]
    step = BATCH * TOKENS
    gets, sets, copies = [], [], []
    for attempt in range(RUNS + 1):
        started = time.perf_counter()
        for i in range(0, count, BATCH):
            pages = src[i * TOKENS : i * TOKENS + step]
            assert all(storage.batch_set_v1(keys[i : i + BATCH], pages))
        set_s = time.perf_counter() - started
        started = time.perf_counter()
        for i in range(0, count, BATCH):
            pages = dst[i * TOKENS : i * TOKENS + step]
            assert all(storage.batch_get_v1(keys[i : i + BATCH], pages))
        get_s = time.perf_counter() - started
        started = time.perf_counter()
        for i in range(0, count, BATCH):
            froms, sizes = host.get_page_buffer_meta(src[i * TOKENS : i * TOKENS + step])
            tos, _ = host.get_page_buffer_meta(dst[i * TOKENS : i * TOKENS + step])
            for a, b, n in zip(tos, froms, sizes, strict=True):
                ctypes.memmove(a, b, n)
        copy_s = time.perf_counter() - started
        storage.clear()  # every run stores fresh blocks (a block present is not read again)
        if attempt:  # the first run warms up
            sets.append(set_s)
            gets.append(get_s)
            copies.append(copy_s)
    storage.close()
    path = "region" if allocator == "shm" else "socket"
    figures.add(f"get {page_bytes // KiB} KiB {path} / memcpy", gets, copies)
    figures.add(f"set {page_bytes // KiB} KiB {path} / memcpy", sets, copies)
    return {"get": gbps(TOTAL, gets), "set": gbps(TOTAL, sets), "memcpy": gbps(TOTAL, copies)}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sglang")
    parser.add_argument("--json", type=Path, help="merge the rows into this figures file")
    args = parser.parse_args()
    figures = Figures("sglang")
    print("page      path     get GB/s  set GB/s  memcpy GB/s  get/memcpy  set/memcpy")
    for page in (256 * KiB, 512 * KiB, 1 * MiB, 2 * MiB):
        with tempfile.TemporaryDirectory(prefix="kvt-bench-sgl-", dir="/tmp") as tmp:
            # RAM only: what is measured is the engine-facing path, not a
            # disk; a daemon a page size, its RAM filled first with blocks
            # of a page's half (its steady state, as make bench-vllm's and
            # make bench-lmcache's daemons)
            daemon = start(Path(tmp), "--no-disk", "--ram-capacity", "512MiB")
            try:
                warm(daemon.socket_path, page // 2)
                for path, allocator in (("socket", "default"), ("region", "shm")):
                    r = measure(page, daemon.socket_path, allocator, figures)
                    print(
                        f"{page // KiB:5d} KiB {path:8s} {r['get']:8.2f}  {r['set']:8.2f}"
                        f"  {r['memcpy']:11.2f}  {r['get'] / r['memcpy']:9.2f}x"
                        f"  {r['set'] / r['memcpy']:9.2f}x"
                    )
            finally:
                daemon.stop()
    if args.json is not None:
        figures.write(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

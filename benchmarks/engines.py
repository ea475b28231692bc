"""The engine benchmarks' figures as JSON, and the report that compares them
with the committed ones (``make bench-engines``).

Each engine benchmark (benchmarks/vllm.py, lmcache.py, sglang.py) records
its rows with :class:`Figures`: per row, the ratio of kvtier's speed to the
ceiling's (memcpy of the same bytes, or vLLM's own file reads) in each run,
both timed in that run. Ratios, not GB/s: the machine's speed drifts from
one sitting to the next, the ratio of two figures of the same moments much
less. ``python -m benchmarks.engines compare`` reads the figures just
written (docs/engines.json) and the ones committed (``git show
HEAD:docs/engines.json``) and says which rows fell by more than the noise:
a row's noise is the larger half-spread of its runs, in either sitting, and
at least ``NOISE_FLOOR``. A report, never a failing test: the machines that
run it are shared.

Imports the standard library only: it runs in every engine's venv.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: no row's noise is taken to be less than this share of its median
NOISE_FLOOR = 0.05
#: where make bench-engines writes the figures (committed with the docs)
FIGURES = Path("docs/engines.json")


class Figures:
    """One engine benchmark's rows, run by run."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.rows: dict[str, list[float]] = {}

    def add(self, row: str, kvtier_seconds: list[float], ceiling_seconds: list[float]) -> float:
        """The row's per-run ratios (the ceiling's seconds over kvtier's, run
        by run); returns their median."""
        ratios = [c / k for k, c in zip(kvtier_seconds, ceiling_seconds, strict=True)]
        self.rows[row] = ratios
        return statistics.median(ratios)

    def write(self, path: Path) -> None:
        """Merge this engine's rows into the figures at ``path``."""
        data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
        data[self.engine] = {
            "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "rows": {
                row: {"median": round(statistics.median(r), 4), "runs": [round(x, 4) for x in r]}
                for row, r in self.rows.items()
            },
        }
        ordered = {engine: data[engine] for engine in sorted(data)}  # rows in measured order
        path.write_text(json.dumps(ordered, indent=1) + "\n")


def noise(row: dict[str, Any]) -> float:
    """Half the spread of a row's runs, as a share of its median."""
    runs, median = row["runs"], row["median"]
    return (max(runs) - min(runs)) / 2 / median if median else 0.0


def compare(current: dict[str, Any], committed: dict[str, Any]) -> list[str]:
    """The report's lines: each row's change, and which fell by more than the noise."""
    lines: list[str] = []
    fell = 0
    for engine in sorted(current):
        rows = current[engine]["rows"]
        before = committed.get(engine, {}).get("rows", {})
        for name in rows:
            now = rows[name]
            then = before.get(name)
            if then is None:
                lines.append(f"  {engine:8s} {name:40s} {now['median']:.2f}x   (new row)")
                continue
            margin = max(noise(now), noise(then), NOISE_FLOOR)
            change = now["median"] / then["median"] if then["median"] else float("inf")
            flag = ""
            if change < 1 - margin:
                flag = f"  FELL by more than the noise (±{margin:.0%})"
                fell += 1
            lines.append(
                f"  {engine:8s} {name:40s} {then['median']:.2f}x -> {now['median']:.2f}x"
                f"  ({change:.2f}){flag}"
            )
    verdict = f"{fell} row(s) fell by more than the noise" if fell else "no row fell"
    return [*lines, verdict]


def markdown(current: dict[str, Any]) -> str:
    """docs/bench-engines.md: every row's median, engine by engine."""
    lines = [
        "## What an engine's loads and stores cost",
        "",
        "Measured with `make bench-engines`: each engine's own classes moving blocks",
        "through kvtier (vLLM's tier jobs, LMCache's storage plugin, SGLang's HiCache",
        "storage), 64 MiB a run, as a ratio to the ceiling timed in the same run",
        "(memcpy of the same bytes, or vLLM reading the same bytes from files in the",
        "page cache); medians of 5 runs. The runs are in [engines.json](engines.json).",
        "",
        "| engine | row | kvtier / ceiling | measured |",
        "|---|---|---:|---|",
    ]
    for engine in sorted(current):
        when = current[engine]["measured"][:10]
        for name, row in current[engine]["rows"].items():
            lines.append(f"| {engine} | {name} | {row['median']:.2f}x | {when} |")
    return "\n".join(lines) + "\n"


def committed_figures(path: Path) -> dict[str, Any] | None:
    """The figures at ``path`` as committed at HEAD; None where none are."""
    try:
        text = subprocess.run(
            ["git", "show", f"HEAD:{path}"], capture_output=True, check=True, text=True
        ).stdout
    except (subprocess.CalledProcessError, FileNotFoundError):
        return None
    data: dict[str, Any] = json.loads(text)
    return data


def warm(sock: Path, size: int) -> None:
    """Fill the daemon's RAM with blocks of ``size`` of its own, so the
    figures are its steady state (every arena page touched by the daemon's
    own copies, as the tier's stores make them, and blocks of the same size
    evicted to make room), not the first touch of fresh memory. (Written in
    place, the blocks would leave the pages unmapped in the daemon: its
    first copy into each then maps it, docs/shared-memory.md.)"""
    from kvtier import BlockingClient

    block = bytes(size)
    count = 640 * 2**20 // size  # 640 MiB through a 512 MiB RAM tier
    with BlockingClient(sock, write_in_place=False) as c:
        for lo in range(0, count, 32):
            c.put_many([b"warm-%d" % i for i in range(lo, lo + 32)], [block] * 32)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engines")
    parser.add_argument("command", choices=["compare"])
    parser.add_argument("--figures", type=Path, default=FIGURES)
    parser.add_argument("--markdown", type=Path, help="write the rows as a section here")
    args = parser.parse_args(argv)
    current = json.loads(args.figures.read_text())
    if args.markdown is not None:
        args.markdown.write_text(markdown(current))
    committed = committed_figures(args.figures)
    if committed is None:
        print(f"no committed {args.figures} to compare with: these figures are the first")
        return 0
    print(f"engine rows, kvtier / ceiling, committed -> this run ({args.figures}):")
    for line in compare(current, committed):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

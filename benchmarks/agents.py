"""Agent sessions through the eviction policies: prefix hit ratio by RAM
capacity, with and without the retention an engine would send, against
LRU as a chain-blind cache orders blocks and Belady's optimum.

Capacities are stated in the busy sessions' average prompts
(kvtier/agentic.py, ``busy_prompt``), so they mean the same on any trace.
Every row is one replay through the RAM tier's own classes (kvtier
replay), in the same run; the conversation trace (Mooncake's, in
traces/) runs without hints, at shares of its unique blocks as in
docs/eviction.md. Writes a JSON report to benchmarks/results/.

    .venv/bin/python -m benchmarks.agents [--sessions PATH] [--capacities 1,2,3,6]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from kvtier import agentic
from kvtier import replay as rp

ROOT = Path(__file__).resolve().parent.parent
SESSIONS = ROOT.parent / "shared" / "traces" / "agentic" / "kv-cache-tester-dev.tar.gz"
CONVERSATION = ROOT / "traces" / "mooncake_synthetic.jsonl.gz"
#: the rows, in the table's order
ROWS = ("plain-lru", "lru", "harc", "harc+hints", "belady")


def _run(args: tuple[str, str, float, int, float, int]) -> dict[str, Any]:
    path, row, prompts, blocks, concurrency, seed = args
    started = time.perf_counter()
    if path.endswith(".jsonl.gz"):
        chains = rp.load_trace(Path(path))
        hints = times = None
    else:
        turns = agentic.load(Path(path), concurrency, seed)
        chains = [t.chain for t in turns]
        hints = agentic.retention_hints(turns)
        times = [t.at for t in turns]
    capacity = (f"{prompts:g}", blocks)
    if row == "plain-lru":
        result = rp.plain_lru(chains, capacity)
    elif row == "belady":
        result = rp.belady(chains, capacity)
    elif row.endswith("+hints"):
        result = rp.replay(
            chains, row.removesuffix("+hints"), capacity, retentions=hints, times=times
        )
    else:
        result = rp.replay(chains, row, capacity)
    out = result.as_dict()
    out.update(row=row, prompts=prompts, seconds=round(time.perf_counter() - started, 1))
    return out


def sweep(
    path: Path, capacities: list[tuple[float, int]], rows: tuple[str, ...], c: float, seed: int
) -> list[dict[str, Any]]:
    jobs = [(str(path), row, p, b, c, seed) for p, b in capacities for row in rows]
    with ProcessPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
        return list(pool.map(_run, jobs))


def table(results: list[dict[str, Any]], rows: tuple[str, ...], unit: str) -> str:
    caps = list(dict.fromkeys(r["prompts"] for r in results))
    by = {(r["row"], r["prompts"]): r["prefix_hit_ratio"] for r in results}
    head = "| policy | " + " | ".join(f"{c:g} {unit}" for c in caps) + " |"
    lines = [head, "|---|" + "---:|" * len(caps)]
    for row in rows:
        cells = " | ".join(f"{by[(row, c)]:.3f}" for c in caps if (row, c) in by)
        lines.append(f"| `{row}` | {cells} |")
    if "plain-lru" in rows:
        for row in rows:
            if row in ("plain-lru", "belady"):
                continue
            vs = " | ".join(
                f"{by[(row, c)] / by[('plain-lru', c)]:.2f}x" for c in caps if (row, c) in by
            )
            lines.append(f"| `{row}` / `plain-lru` | {vs} |")
        if "belady" in rows:
            for row in rows:
                if row in ("plain-lru", "belady"):
                    continue
                gaps = []
                for c in caps:
                    lru, opt, got = by[("plain-lru", c)], by[("belady", c)], by[(row, c)]
                    gaps.append(f"{(got - lru) / (opt - lru):.0%}" if opt > lru else "-")
                lines.append(f"| `{row}`: gap to optimum closed | " + " | ".join(gaps) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=Path, default=SESSIONS)
    parser.add_argument("--capacities", default="1,2,3,4,6", help="busy prompts")
    parser.add_argument("--concurrency", type=float, default=16.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--conversation", type=Path, default=CONVERSATION)
    parser.add_argument("--shares", default="1,2,5,10,20,40,60", help="percent of unique blocks")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    report: dict[str, Any] = {"date": dt.date.today().isoformat()}
    if args.sessions.exists():
        turns = agentic.load(args.sessions, args.concurrency, args.seed)
        prompt = agentic.busy_prompt(turns)
        caps = [(float(p), round(float(p) * prompt)) for p in args.capacities.split(",")]
        print(
            f"{args.sessions.name}: {len(turns)} requests, busy prompt {prompt:.0f} blocks, "
            f"concurrency {args.concurrency:g}, seed {args.seed}",
            flush=True,
        )
        del turns
        results = sweep(args.sessions, caps, ROWS, args.concurrency, args.seed)
        print(table(results, ROWS, "prompts"), flush=True)
        report["sessions"] = {
            "trace": str(args.sessions),
            "busy_prompt_blocks": round(prompt),
            "concurrency": args.concurrency,
            "seed": args.seed,
            "results": results,
        }
    else:
        print(f"{args.sessions}: not found; the agent sessions are skipped", file=sys.stderr)
    chains = rp.load_trace(args.conversation)
    unique = rp.unique_blocks(chains)
    caps = [(float(s), round(unique * float(s) / 100)) for s in args.shares.split(",")]
    rows = ("plain-lru", "lru", "harc", "belady")
    results = sweep(args.conversation, caps, rows, args.concurrency, args.seed)
    print(f"\n{args.conversation.name}: {len(chains)} requests, {unique} unique blocks")
    print(table(results, rows, "%"))
    report["conversation"] = {"trace": str(args.conversation), "results": results}
    out = args.json or ROOT / "benchmarks" / "results" / f"{report['date']}-agents.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwritten to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

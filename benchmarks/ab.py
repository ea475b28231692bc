"""A same-run A/B of two kvtier daemons: this checkout's and another's.

    python -m benchmarks.ab --baseline /path/to/other/checkout [--rounds 5]

Both daemons serve from RAM only, started as ``make bench`` starts its own
(``benchmarks.suite.kvtier_command``: the lookup process on, as by default);
the other checkout's runs from its own source tree. One client library, this
checkout's, measures the rows of ``make bench`` a change may move: LOOKUP of
1,000 and 10,000 keys, a prefix LOOKUP of a 512-block chain, and 1 MiB PUT
and GET from one client. Rounds alternate between the daemons, so that the
machine's drift falls on both; the report gives each row's median per
daemon and the ratio of this checkout's to the baseline's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.suite import kvtier_command, wait_for_line, wait_until_prepared
from kvtier import Client, loops
from kvtier.bench import Figure, KvtierStore, MiB, lookup_batch, prefix_lookup, put_get

ROOT = Path(__file__).resolve().parent.parent


def start(source: Path, sock: Path) -> subprocess.Popen[bytes]:
    """``kvtier serve`` from ``source``'s tree on ``sock``."""
    env = {**os.environ, "PYTHONPATH": str(source)}
    cmd = kvtier_command(str(sock), "4GiB")
    cmd[cmd.index("warning")] = "info"
    proc = subprocess.Popen(cmd, cwd=source, env=env, stderr=subprocess.PIPE)
    wait_for_line(proc, "kvtier ready")
    wait_until_prepared(str(sock))  # (a tree without the stat does not wait)
    return proc


async def one_round(sock: Path, quick: bool) -> list[Figure]:
    async with await Client.connect(sock) as c:
        figures = [
            await lookup_batch(c, 1000, 1.0, quick=quick, runs=1),
            await lookup_batch(c, 10000, 0.5, quick=quick, runs=1),
            await prefix_lookup(c, quick=quick, runs=1),
            *await put_get(KvtierStore([c]), MiB, 1, quick=quick, runs=1),
        ]
    return figures


async def ab(baseline: Path, rounds: int, quick: bool) -> dict[str, dict[str, list[float]]]:
    """Per workload, per daemon ("new", "old"): one rate per round."""
    rates: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="kvtab-", dir="/tmp") as tmp:
        socks = {"new": Path(tmp) / "new.sock", "old": Path(tmp) / "old.sock"}
        procs = [start(ROOT, socks["new"]), start(baseline, socks["old"])]
        try:
            for r in range(rounds):
                order = ["new", "old"] if r % 2 == 0 else ["old", "new"]
                for which in order:
                    print(f"  round {r + 1}/{rounds}: {which}", file=sys.stderr)
                    for f in await one_round(socks[which], quick):
                        rates.setdefault(f"{f.workload} ({f.unit})", {}).setdefault(
                            which, []
                        ).append(f.rate)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(30)
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--baseline", required=True, type=Path, help="the other checkout")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rates = loops.run(ab(args.baseline.resolve(), args.rounds, args.quick))
    print(f"| workload | baseline | this checkout | ratio (medians of {args.rounds}) |")
    print("|---|---:|---:|---:|")
    for workload, by in rates.items():
        old, new = statistics.median(by["old"]), statistics.median(by["new"])
        print(f"| {workload} | {old:,.2f} | {new:,.2f} | {new / old:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

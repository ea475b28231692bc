"""Eviction policy cost at scale: ns per operation and bytes per resident key.

For each policy, 1M keys are made resident in a Budget (the RAM tier's own
bookkeeping), then a steady mix runs: half touches of resident keys, half
admissions of new keys that each evict one. Memory is the policy's own
structures (tracemalloc), per resident key. Ratios are against LRU in the
same run.

    .venv/bin/python -m benchmarks.policies [--keys N] [--ops N]
"""

from __future__ import annotations

import argparse
import gc
import random
import time
import tracemalloc

from kvtier.tiers.budget import Budget
from kvtier.tiers.policy import POLICIES, make_policy


def key(i: int) -> bytes:
    return i.to_bytes(8, "little")


def measure(name: str, keys: int, ops: int) -> dict[str, float]:
    gc.collect()
    tracemalloc.start()
    policy = make_policy(name)
    for i in range(keys):
        policy.admit(key(i))
    memory = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del policy
    gc.collect()

    budget = Budget(keys, make_policy(name))
    started = time.perf_counter()
    for i in range(keys):
        budget.admit(key(i), 1)
    admit_ns = (time.perf_counter() - started) / keys * 1e9
    rng = random.Random(1)
    touches = [key(rng.randrange(keys)) for _ in range(ops // 2)]
    fresh = keys
    started = time.perf_counter()
    for k in touches:
        if k in budget:
            budget.touch(k)
        budget.evict_for(1)
        budget.admit(key(fresh), 1)
        fresh += 1
    mixed_ns = (time.perf_counter() - started) / ops * 1e9
    return {"admit_ns": admit_ns, "mixed_ns": mixed_ns, "bytes_per_key": memory / keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--ops", type=int, default=400_000)
    args = parser.parse_args()
    rows = {name: measure(name, args.keys, args.ops) for name in POLICIES}
    base = rows["lru"]
    print(f"eviction policies at {args.keys:,} resident keys (ratios: / lru, same run)")
    header = ("policy", "admit ns", "mixed ns/op", "x lru", "B/key", "x lru")
    print("{:8} {:>9} {:>12} {:>6} {:>7} {:>6}".format(*header))
    for name, r in rows.items():
        print(
            f"{name:8} {r['admit_ns']:9.0f} {r['mixed_ns']:12.0f} "
            f"{r['mixed_ns'] / base['mixed_ns']:6.2f} {r['bytes_per_key']:7.0f} "
            f"{r['bytes_per_key'] / base['bytes_per_key']:6.2f}"
        )


if __name__ == "__main__":
    main()

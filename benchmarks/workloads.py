"""Synthetic multi-turn chat traces, to check an eviction policy beyond one trace.

Sessions pick a system prompt by a Zipf law (the shared chain heads), then
take turns: each turn's chain is the previous one plus new blocks, after an
exponential think time. Knobs change what a policy must cope with: short or
long gaps between turns, popularity that shifts, flat popularity, one-turn
traffic, long shared prompts. Each workload is replayed through the RAM
tier's real policies (kvtier.replay) at 5% and 10% of its unique blocks.

    .venv/bin/python -m benchmarks.workloads
"""

from __future__ import annotations

import heapq
import random

from kvtier import replay as rp
from kvtier.tiers.policy import POLICIES

WORKLOADS: dict[str, dict[str, object]] = {
    "short-gaps": {"gap": 5.0},
    "long-gaps": {"gap": 500.0},
    "shifting": {"gap": 50.0, "shift_every": 500},
    "flat-popularity": {"gap": 50.0, "zipf": 0.3},
    "single-turn": {"turns": (1, 1)},
    "long-prompts": {"prompt_blocks": (20, 60), "turn_blocks": (1, 4)},
}


def generate(
    seed: int,
    *,
    requests: int = 4000,
    prompts: int = 200,
    zipf: float = 1.1,
    turns: tuple[int, int] = (1, 8),
    gap: float = 50.0,
    shift_every: int = 0,
    prompt_blocks: tuple[int, int] = (2, 20),
    turn_blocks: tuple[int, int] = (1, 10),
) -> list[rp.Chain]:
    rng = random.Random(seed)
    ids = iter(range(1, 1 << 62))
    heads = [[next(ids) for _ in range(rng.randint(*prompt_blocks))] for _ in range(prompts)]
    weights = [1 / (i + 1) ** zipf for i in range(prompts)]
    waiting: list[tuple[float, int, list[int], int]] = []
    out: list[rp.Chain] = []
    now, session = 0.0, 0
    while len(out) < requests:
        now += rng.expovariate(1.0)
        if shift_every and out and len(out) % shift_every == 0:
            rng.shuffle(heads)
        head = heads[rng.choices(range(prompts), weights)[0]]
        chain = head + [next(ids) for _ in range(rng.randint(*turn_blocks))]
        heapq.heappush(waiting, (now, session, chain, rng.randint(*turns)))
        session += 1
        while waiting and waiting[0][0] <= now:
            at, s, chain, left = heapq.heappop(waiting)
            out.append(chain)
            if left > 1:
                longer = chain + [next(ids) for _ in range(rng.randint(*turn_blocks))]
                heapq.heappush(waiting, (at + rng.expovariate(1 / gap), s, longer, left - 1))
    return out[:requests]


def main() -> None:
    print(f"{'workload':16} {'cap':>4} " + " ".join(f"{p:>7}" for p in POLICIES))
    for name, knobs in WORKLOADS.items():
        chains = generate(7, **knobs)  # type: ignore[arg-type]
        unique = rp.unique_blocks(chains)
        for capacity in rp.parse_capacities("5%,10%", unique):
            ratios = [rp.replay(chains, p, capacity).ratio for p in POLICIES]
            print(f"{name:16} {capacity[0]:>4} " + " ".join(f"{r:7.3f}" for r in ratios))


if __name__ == "__main__":
    main()

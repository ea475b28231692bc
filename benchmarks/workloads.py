"""Synthetic multi-turn chat traces, to check an eviction policy beyond one trace.

Sessions arrive as a Poisson process (one per unit of time). Each picks a
system prompt by a Zipf law over ``prompts`` prompts (the shared chain
heads; ``prompt_blocks`` long, uniform), then takes ``turns`` turns
(uniform): each turn's chain is the previous one plus ``turn_blocks`` new
blocks (uniform), after an exponential think time of mean ``gap``. A
``one_shot`` share of sessions instead asks once, with a prompt of its own
that nobody asks again. Knobs change what a policy must cope with: short or
long gaps between turns, popularity that shifts (the prompts are reshuffled
every ``shift_every`` requests), flat popularity, one-turn traffic, long
shared prompts, mostly one-shot traffic, agents (a few very long shared
system prompts, many quick steps that each add a short tool result). Each
workload is replayed through the RAM tier's real policies (kvtier.replay)
at 1% to 60% of its unique blocks; the capacities of 20% and more are the
large-cache regime.

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
    # Multi-turn chat with long gaps, 70% of sessions one-shot: most blocks
    # are never requested again.
    "one-shots": {"gap": 500.0, "one_shot": 0.7},
    # Agents: 20 system prompts of 40-100 blocks, sessions of 5-20 steps
    # that follow each other quickly, each step adding 1-2 blocks.
    "agents": {
        "prompts": 20,
        "prompt_blocks": (40, 100),
        "turns": (5, 20),
        "turn_blocks": (1, 2),
        "gap": 2.0,
    },
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
    one_shot: float = 0.0,
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
        if one_shot and rng.random() < one_shot:
            head = [next(ids) for _ in range(rng.randint(*prompt_blocks))]
            chain = head + [next(ids) for _ in range(rng.randint(*turn_blocks))]
            left = 1
        else:
            head = heads[rng.choices(range(prompts), weights)[0]]
            chain = head + [next(ids) for _ in range(rng.randint(*turn_blocks))]
            left = rng.randint(*turns)
        heapq.heappush(waiting, (now, session, chain, left))
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
        for capacity in rp.parse_capacities("1%,2%,5%,10%,20%,40%,60%", unique):
            ratios = [rp.replay(chains, p, capacity).ratio for p in POLICIES]
            print(f"{name:16} {capacity[0]:>4} " + " ".join(f"{r:7.3f}" for r in ratios))


if __name__ == "__main__":
    main()

"""The default policy is never worse than LRU: every bundled workload and the
bundled trace, replayed through the RAM tier at 1% to 60% of its unique
blocks, reads a prefix hit ratio at least LRU's less 0.002. (Four sizes
here; ``make bench`` prints every policy at seven, ``benchmarks.workloads``.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.workloads import WORKLOADS, generate
from kvtier import replay as rp

TRACE = Path(__file__).resolve().parent.parent / "traces" / "mooncake_synthetic.jsonl.gz"
CAPACITIES = "1%,5%,20%,60%"
#: how far below LRU the default may read at any one point (replay noise)
TOLERANCE = 0.002


def chains_of(name: str) -> list[rp.Chain]:
    if name == "mooncake-trace":
        return rp.load_trace(TRACE)
    return generate(7, **WORKLOADS[name])  # type: ignore[arg-type]


@pytest.mark.parametrize("name", [*WORKLOADS, "mooncake-trace"])
def test_the_default_policy_is_never_below_lru(name: str) -> None:
    chains = chains_of(name)
    below: list[str] = []
    for capacity in rp.parse_capacities(CAPACITIES, rp.unique_blocks(chains)):
        lru = rp.replay(chains, "lru", capacity).ratio
        harc = rp.replay(chains, "harc", capacity).ratio
        if harc < lru - TOLERANCE:
            below.append(f"{capacity[0]}: harc {harc:.4f} < lru {lru:.4f}")
    assert not below, below

"""Hedged reads' rules alone: the budget, the latency window, the delay."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.tiers.hedging import MIN_SAMPLES, HedgeBudget, LatencyWindow, hedge_delay


@given(st.floats(0, 1), st.lists(st.integers(1, 20), max_size=200))
def test_hedges_stay_within_their_share_of_reads_plus_the_burst(
    ratio: float, reads: list[int]
) -> None:
    budget = HedgeBudget(ratio, burst=10.0)
    hedged = 0
    for n in reads:
        budget.earn(n)
        while budget.spend():  # as many hedges as it allows
            hedged += 1
        assert 0 <= budget.tokens <= budget.burst
    assert hedged <= ratio * sum(reads) + 1.0


def test_a_budget_without_tokens_refuses_and_a_bad_ratio_is_refused() -> None:
    budget = HedgeBudget(0.05)
    assert budget.spend()  # one token to start with
    assert not budget.spend()
    budget.earn(19)
    assert not budget.spend()  # 0.95 of a token
    budget.earn(1)
    assert budget.spend()
    assert not HedgeBudget(0.0).spend()
    with pytest.raises(ValueError, match="between 0 and 1"):
        HedgeBudget(1.5)


def test_a_window_gives_the_p95_of_its_recent_loads_once_it_has_enough() -> None:
    window = LatencyWindow(size=100)
    for i in range(MIN_SAMPLES - 1):
        window.observe(0.001 * i)
    assert window.p95() is None
    for i in range(200):  # only the last 100 stay: 0.100 .. 0.199
        window.observe(0.001 * i)
    assert window.p95() == pytest.approx(0.195)
    window.observe(-1.0)  # (a clock going back is not a time)
    assert window.p95() == pytest.approx(0.195)


@pytest.mark.parametrize(
    ("configured", "p95", "delay"),
    [
        (0.05, 0.5, 0.05),  # hedge_after set: it, whatever the p95
        (None, 0.02, 0.02),  # else the peer's p95
        (None, 0.0, 0.001),  # never under the floor
        (None, None, 3.0),  # no p95 yet: the request's own timeout (no hedge)
    ],
)
def test_the_delay_before_a_hedge(
    configured: float | None, p95: float | None, delay: float
) -> None:
    assert hedge_delay(configured, p95, floor=0.001, ceiling=3.0) == delay

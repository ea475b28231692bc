"""Hedged reads alone: the rules (budget, latency window, delay) and the
race between a read and its hedge, with reads gated by events."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.errors import TierError
from kvtier.tiers.hedger import Hedger
from kvtier.tiers.hedging import MIN_SAMPLES, HedgeBudget, LatencyWindow, hedge_delay
from tests.helpers import wait_until


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
        (None, None, None),  # no p95 yet: no hedge
    ],
)
def test_the_delay_before_a_hedge(
    configured: float | None, p95: float | None, delay: float | None
) -> None:
    assert hedge_delay(configured, p95, floor=0.001) == delay


class Read:
    """A read gated by an event: it answers ``answer`` (or raises it) once let go."""

    def __init__(self, answer: object) -> None:
        self.answer = answer
        self.gate = asyncio.Event()
        self.calls = 0
        self.cancelled = False
        self.answered = False

    async def __call__(self) -> object:
        self.calls += 1
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        self.answered = True
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


def delivered(answer: object) -> bool:
    return answer is not None


async def race(
    hedger: Hedger, first: Read, second: Read | None, delay: float | None = 0.0
) -> asyncio.Task[tuple[object, bool]]:
    """The race as a task, run until it waits on its reads."""
    task = asyncio.create_task(hedger.race(first(), second, delay, delivered))
    await wait_until(lambda: first.calls == 1)
    return task


async def test_a_read_answered_in_time_is_not_hedged() -> None:
    hedger, first, second = Hedger(None, 1.0), Read(b"v"), Read(b"w")
    first.gate.set()
    assert await hedger.race(first(), second, 60.0, delivered) == (b"v", False)
    assert second.calls == 0
    assert hedger.outcomes() == {"won": 0, "lost": 0, "skipped": 0}


async def test_a_hung_read_loses_to_its_hedge_and_is_cancelled() -> None:
    hedger, first, second = Hedger(None, 1.0), Read(b"v"), Read(b"w")
    task = await race(hedger, first, second)
    await wait_until(lambda: second.calls == 1)
    second.gate.set()
    assert await task == (b"w", True)
    assert first.cancelled
    assert hedger.outcomes() == {"won": 1, "lost": 0, "skipped": 0}


async def test_a_read_that_delivers_first_cancels_its_hedge() -> None:
    hedger, first, second = Hedger(None, 1.0), Read(b"v"), Read(b"w")
    task = await race(hedger, first, second)
    await wait_until(lambda: second.calls == 1)
    first.gate.set()
    assert await task == (b"v", False)
    assert second.cancelled
    assert hedger.outcomes() == {"won": 0, "lost": 1, "skipped": 0}


@pytest.mark.parametrize("miss", [None, TierError("the hedge failed")])
async def test_a_hedge_that_does_not_deliver_never_wins(miss: object) -> None:
    """A miss or an error from the hedge leaves the first read to deliver."""
    hedger, first, second = Hedger(None, 1.0), Read(b"v"), Read(miss)
    task = await race(hedger, first, second)
    await wait_until(lambda: second.calls == 1)
    second.gate.set()  # (answered before the first read)
    await wait_until(lambda: second.answered)
    for _ in range(3):  # the race takes the hedge's answer alone
        await asyncio.sleep(0)  # allow-sleep: loop turns, no wait
    assert not task.done()
    first.gate.set()
    assert await task == (b"v", False)
    assert hedger.outcomes() == {"won": 0, "lost": 1, "skipped": 0}


async def test_when_neither_delivers_the_first_reads_error_is_raised() -> None:
    hedger, first, second = Hedger(None, 1.0), Read(TierError("first failed")), Read(None)
    task = await race(hedger, first, second)
    await wait_until(lambda: second.calls == 1)
    second.gate.set()
    first.gate.set()
    with pytest.raises(TierError, match="first failed"):
        await task
    assert hedger.outcomes() == {"won": 0, "lost": 1, "skipped": 0}


async def test_without_a_token_the_hedge_is_skipped_and_the_first_read_awaited() -> None:
    hedger, first, second = Hedger(None, 0.0), Read(b"v"), Read(b"w")
    task = await race(hedger, first, second)
    await wait_until(lambda: hedger.counts.total() == 1)
    first.gate.set()
    assert await task == (b"v", False)
    assert second.calls == 0
    assert hedger.outcomes() == {"won": 0, "lost": 0, "skipped": 1}


async def test_without_another_holder_nothing_is_hedged_or_counted() -> None:
    hedger, first = Hedger(None, 1.0), Read(b"v")
    task = await race(hedger, first, None)
    first.gate.set()
    assert await task == (b"v", False)
    assert hedger.outcomes() == {"won": 0, "lost": 0, "skipped": 0}
    assert hedger.budget.tokens == 1.0


async def test_a_cancelled_race_cancels_both_reads() -> None:
    hedger, first, second = Hedger(None, 1.0), Read(b"v"), Read(b"w")
    task = await race(hedger, first, second)
    await wait_until(lambda: second.calls == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert first.cancelled and second.cancelled


async def test_the_delay_is_the_sources_p95_once_it_has_one() -> None:
    hedger = Hedger(None, 1.0)
    assert hedger.delay("peer-a") is None  # unknown: no hedge
    for _ in range(MIN_SAMPLES):
        first = Read(b"v")
        first.gate.set()
        await hedger.timed("peer-a", first())
    delay = hedger.delay("peer-a")
    assert delay is not None and delay < 1.0
    assert hedger.delay("peer-b") is None  # each source its own
    assert Hedger(0.25, 1.0).delay("peer-a") == 0.25


async def test_a_read_with_no_delay_known_is_not_hedged() -> None:
    hedger, first, second = Hedger(None, 1.0), Read(b"v"), Read(b"w")
    task = asyncio.create_task(hedger.race(first(), second, None, delivered))
    await wait_until(lambda: first.calls == 1)
    first.gate.set()
    assert await task == (b"v", False)
    assert second.calls == 0 and hedger.counts.total() == 0

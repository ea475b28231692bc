"""The lookup core's pure parts, tested without a daemon."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from kvtier.core.deferral import DeferralTracker, blocking_pending
from kvtier.core.probes import ProbeMap, Verdict
from kvtier.core.timers import COMPACT_MIN, Scheduler, TimerHeap
from kvtier.model import HIT, MISS, PENDING, RETRY

# ------------------------------------------------------------------ timers


def test_timer_heap_fires_in_order_and_skips_cancelled() -> None:
    heap = TimerHeap()
    fired: list[str] = []
    heap.push(3.0, lambda: fired.append("c"))
    b = heap.push(2.0, lambda: fired.append("b"))
    heap.push(1.0, lambda: fired.append("a"))
    heap.cancel(b)
    assert len(heap) == 2
    assert heap.next_deadline() == 1.0
    for t in heap.pop_due(2.5):
        t.callback()
    assert fired == ["a"]
    assert heap.next_deadline() == 3.0
    heap.cancel(b)  # cancelling twice changes nothing
    assert len(heap) == 1
    assert [t.deadline for t in heap.pop_due(10.0)] == [3.0]
    assert len(heap) == 0 and heap.next_deadline() is None


def test_cancelled_timers_are_reclaimed() -> None:
    heap = TimerHeap()
    keep = heap.push(1e9, lambda: None)
    held = []
    for i in range(100_000):  # RESERVE + ABORT in a loop, with a long deadline
        t = heap.push(1e6 + i, lambda: None)
        heap.cancel(t)
        held.append(heap.held)
    assert len(heap) == 1
    assert max(held) <= COMPACT_MIN + 2  # never more dead entries than the bound
    assert heap.next_deadline() == 1e9
    heap.cancel(keep)
    assert heap.next_deadline() is None and heap.held == 0


# ------------------------------------------------------------------ probe map


def probe_map(**kw: float) -> ProbeMap:
    opts: dict[str, float] = {"verdict_ttl": 5.0, "error_ttl": 0.5, "max_verdicts": 3, **kw}
    return ProbeMap(
        "t",
        verdict_ttl=opts["verdict_ttl"],
        error_ttl=opts["error_ttl"],
        max_verdicts=int(opts["max_verdicts"]),
    )


async def test_probe_map_caches_verdicts_for_their_ttl() -> None:
    loop = asyncio.get_running_loop()
    pm = probe_map()
    probe = pm.begin(b"k", loop)
    assert pm.inflight(b"k") is probe and pm.verdict(b"k", 0.0) is None
    assert pm.complete(probe, Verdict.PRESENT, now=10.0)
    assert probe.future.result() is Verdict.PRESENT
    assert pm.inflight_count == 0
    assert pm.verdict(b"k", 14.9) is Verdict.PRESENT
    assert pm.verdict(b"k", 15.0) is None  # expired and dropped
    assert pm.verdict_count == 0


async def test_errors_are_kept_shorter_than_verdicts() -> None:
    loop = asyncio.get_running_loop()
    pm = probe_map()
    pm.complete(pm.begin(b"e", loop), Verdict.ERROR, now=0.0)
    pm.complete(pm.begin(b"a", loop), Verdict.ABSENT, now=0.0)
    assert pm.verdict(b"e", 0.4) is Verdict.ERROR
    assert pm.verdict(b"e", 0.6) is None
    assert pm.verdict(b"a", 0.6) is Verdict.ABSENT


async def test_superseded_probe_resolves_but_writes_nothing() -> None:
    loop = asyncio.get_running_loop()
    pm = probe_map()
    old = pm.begin(b"k", loop)
    pm.invalidate(b"k")
    new = pm.begin(b"k", loop)
    assert pm.complete(new, Verdict.ABSENT, now=0.0)
    assert not pm.complete(old, Verdict.PRESENT, now=1.0)  # arrives last: dropped
    assert old.future.result() is Verdict.PRESENT  # its own waiters still wake
    assert pm.verdict(b"k", 1.0) is Verdict.ABSENT


async def test_force_supersedes_and_sets_the_verdict() -> None:
    loop = asyncio.get_running_loop()
    pm = probe_map()
    probe = pm.begin(b"k", loop)
    pm.force(b"k", Verdict.ABSENT, now=0.0)
    assert pm.inflight(b"k") is None
    assert not pm.complete(probe, Verdict.PRESENT, now=0.1)
    assert pm.verdict(b"k", 0.1) is Verdict.ABSENT


async def test_verdicts_are_bounded_in_count_and_expire() -> None:
    loop = asyncio.get_running_loop()
    pm = probe_map(max_verdicts=3)
    for i in range(5):
        pm.complete(pm.begin(bytes([i]), loop), Verdict.ABSENT, now=float(i))
    assert pm.verdict_count == 3
    assert pm.verdict(bytes([0]), 4.0) is None
    assert pm.expire(now=100.0) == 3
    assert repr(pm) == "<ProbeMap t inflight=0 verdicts=0>"


# ------------------------------------------------------------------ reader-side bound

KEYS = [b"a", b"b", b"c"]


def test_blocking_pending_is_the_first_pending_before_a_miss() -> None:
    assert blocking_pending([HIT, PENDING, PENDING]) == 1
    assert blocking_pending([HIT, RETRY, PENDING]) == 2
    assert blocking_pending([HIT, MISS, PENDING]) is None
    assert blocking_pending([HIT, RETRY]) is None


def test_same_key_accrues_until_the_bound() -> None:
    tr = DeferralTracker(idle_ttl=60, max_tags=10)
    r = tr.observe(b"req", KEYS, [HIT, PENDING, HIT], bound=1.0, now=0.0)
    assert r.expired_index is None and r.expires_at == 1.0
    r = tr.observe(b"req", KEYS, [HIT, PENDING, HIT], bound=1.0, now=0.6)
    assert r.expired_index is None and r.expires_at == 1.0  # accrued, not restarted
    r = tr.observe(b"req", KEYS, [HIT, PENDING, HIT], bound=1.0, now=1.0)
    assert (r.expired_index, r.newly_expired) == (1, True)
    r = tr.observe(b"req", KEYS, [HIT, PENDING, HIT], bound=1.0, now=1.5)
    assert (r.expired_index, r.newly_expired) == (1, False)  # counted once


def test_a_different_blocking_key_re_arms() -> None:
    tr = DeferralTracker(idle_ttl=60, max_tags=10)
    tr.observe(b"req", KEYS, [HIT, PENDING, HIT], bound=1.0, now=0.0)
    r = tr.observe(b"req", KEYS, [HIT, HIT, PENDING], bound=1.0, now=0.9)
    assert r.expired_index is None and r.expires_at == pytest.approx(1.9)
    assert r.ends_deferral == pytest.approx(0.9)


def test_nothing_pending_disarms() -> None:
    tr = DeferralTracker(idle_ttl=60, max_tags=10)
    tr.observe(b"req", KEYS, [HIT, PENDING, HIT], bound=1.0, now=0.0)
    r = tr.observe(b"req", KEYS, [HIT, HIT, HIT], bound=1.0, now=0.9)
    assert r.expires_at is None and r.ends_deferral == pytest.approx(0.9)
    r = tr.observe(b"req", KEYS, [HIT, PENDING, HIT], bound=1.0, now=1.2)
    assert r.expired_index is None and r.expires_at == pytest.approx(2.2)  # fresh timer


def test_retry_never_expires() -> None:
    tr = DeferralTracker(idle_ttl=60, max_tags=10)
    for now in (0.0, 5.0, 50.0):
        r = tr.observe(b"req", KEYS, [HIT, RETRY, HIT], bound=1.0, now=now)
        assert r.expired_index is None and r.expires_at is None


def test_a_lookup_reported_after_its_tags_release_leaves_no_state() -> None:
    tr = DeferralTracker(idle_ttl=10, max_tags=2)
    tr.observe(b"req", KEYS, [HIT, PENDING, HIT], bound=1.0, now=0.0)
    assert tr.release(b"req", now=0.5) == pytest.approx(0.5)
    # Answered by the lookup process before the release, heard of after it.
    r = tr.observe(b"req", KEYS, [HIT, PENDING, HIT], bound=1.0, now=0.6, reported=True)
    assert r.expires_at is None and len(tr) == 0
    assert repr(tr) == "<DeferralTracker tags=0 released=1>"
    # A tag never released is kept, reported or not.
    tr.observe(b"other", KEYS, [PENDING], bound=1.0, now=0.7, reported=True)
    assert len(tr) == 1
    # A lookup the daemon answers itself: the tag is in use again.
    r = tr.observe(b"req", KEYS, [HIT, PENDING, HIT], bound=1.0, now=0.8)
    assert r.expires_at == pytest.approx(1.8) and len(tr) == 2
    assert "released=0" in repr(tr)
    # Tombstones are bounded in count and dropped once idle.
    for i in range(3):
        tr.release(b"t%d" % i, now=1.0 + i)
    assert "released=2" in repr(tr)
    tr.expire(now=12.5)  # t1 idle for 10.5 s, t2 for 9.5
    assert "released=1" in repr(tr)


def test_idle_tags_are_dropped_and_bounded() -> None:
    tr = DeferralTracker(idle_ttl=10, max_tags=2)
    tr.observe(b"one", KEYS, [PENDING], bound=1.0, now=0.0)
    tr.observe(b"two", KEYS, [PENDING], bound=1.0, now=5.0)
    tr.observe(b"three", KEYS, [PENDING], bound=1.0, now=6.0)
    assert len(tr) == 2 and tr.get(b"one") is None  # bounded: oldest went
    assert tr.expire(now=15.5) == 1  # "two" idle for 10.5 s
    assert tr.get(b"three") is not None
    assert tr.release(b"three", now=16.0) == pytest.approx(10.0)
    assert len(tr) == 0


# ------------------------------------------------------------------ scheduler


def test_scheduler_batches_probes_per_tick_and_splits_at_max() -> None:
    clock = [100.0]
    batches: list[list[bytes]] = []
    sched = Scheduler(batch_window=0.01, max_batch=3, clock=lambda: clock[0])
    sched.add_prober("t", batches.append)
    for key in (b"a", b"b"):
        sched.enqueue_probe("t", key)
    assert batches == []  # waiting for the tick
    sched.run_due(100.005)
    assert batches == []
    sched.run_due(100.01)
    assert batches == [[b"a", b"b"]]
    for key in (b"c", b"d", b"e", b"f"):
        sched.enqueue_probe("t", key)
    assert batches[-1] == [b"c", b"d", b"e"]  # a full batch leaves at once
    sched.run_due(100.02)
    assert batches[-1] == [b"f"]
    assert sched.timer_count == 0


async def test_scheduler_loop_fires_timers_and_stops() -> None:
    sched = Scheduler(batch_window=0.0, max_batch=10)
    fired = asyncio.Event()
    task = asyncio.create_task(sched.run())
    sched.call_at(sched.now() + 0.01, fired.set)
    await fired.wait()
    sched.stop()
    await task
    assert sched.timer_count == 0


async def test_abandon_all_resolves_every_probe() -> None:
    loop = asyncio.get_running_loop()
    pm = probe_map()
    probes = [pm.begin(bytes([i]), loop) for i in range(3)]
    assert pm.abandon_all() == 3
    assert [p.future.result() for p in probes] == [Verdict.ERROR] * 3
    assert pm.inflight_count == 0


# ------------------------------------------------------------------ circuit breaker


def test_breaker_opens_after_consecutive_failures_and_probes_back() -> None:
    from kvtier.tiers.breaker import BreakerState, CircuitBreaker

    b = CircuitBreaker(failures=3, reset_after=5.0)
    for t in (0.0, 1.0):
        assert b.allow(t)
        b.failure(t)
    b.success()  # a success in between resets the count
    for t in (2.0, 2.1, 2.2):
        assert b.allow(t)
        b.failure(t)
    assert b.state is BreakerState.OPEN
    assert not b.allow(7.1)  # still cooling down
    assert b.allow(7.3)  # half-open: one trial
    assert b.state is BreakerState.HALF_OPEN
    assert not b.allow(7.3)  # only one
    b.failure(7.4)
    assert b.state is BreakerState.OPEN and not b.allow(12.3)
    assert b.allow(12.5)
    b.success()
    assert b.state is BreakerState.CLOSED and b.allow(12.6) and b.allow(12.6)


# ------------------------------------------------------------------ bench harness


async def test_measure_counts_every_operation_of_every_run() -> None:
    from kvtier.bench import measure, percentile

    calls: list[tuple[int, int]] = []

    async def op(i: int, worker: int) -> None:
        calls.append((i, worker))
        await asyncio.sleep(0)  # allow-sleep: a real operation yields; workers interleave

    fig = await measure(
        "noop", "test", op, ops=40, concurrency=4, work_per_op=2, unit="keys/s", runs=3
    )
    assert len(calls) == 40 * 4  # a warm-up and three timed runs
    assert {w for _, w in calls} == {0, 1, 2, 3}
    assert len(fig.runs) == 3 and fig.rate > 0
    assert percentile([1.0, 2.0, 3.0], 0.5) == 2.0 and percentile([], 0.99) == 0.0


async def test_measure_side_by_side_takes_the_systems_runs_in_turn() -> None:
    from kvtier.bench import measure_side_by_side

    calls: list[str] = []

    def op(name: str) -> Callable[[int, int], Awaitable[None]]:
        async def run(i: int, worker: int) -> None:
            calls.append(name)
            await asyncio.sleep(0)  # allow-sleep: a real operation yields; workers interleave

        return run

    figs = await measure_side_by_side(
        "noop",
        [("a", op("a")), ("b", op("b"))],
        ops=10,
        concurrency=2,
        work_per_op=1,
        unit="ops/s",
        runs=3,
    )
    assert [f.system for f in figs] == ["a", "b"]
    assert all(len(f.runs) == 3 and f.rate > 0 for f in figs)  # the warm-up left out
    # a run of a, then one of b, four times (the warm-up round included)
    assert calls == (["a"] * 10 + ["b"] * 10) * 4

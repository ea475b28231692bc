"""Pending writes in motion (kvtier.core.writing): deadlines, one a key or one a batch."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvtier.client.aio import Client
from kvtier.core.counts import CoreCounters
from kvtier.core.timers import Scheduler
from kvtier.core.writes import End
from kvtier.core.writing import Deadline, PendingWrites
from kvtier.model import ConnId, LookupMode, ReserveStatus, State
from kvtier.tiers.ram import RamTier
from tests.helpers import running_daemon

OWNER = ConnId(7)


def pending() -> tuple[PendingWrites, Scheduler, CoreCounters]:
    sched = Scheduler(batch_window=0.0, max_batch=8, clock=lambda: 0.0)
    counters = CoreCounters()
    return PendingWrites(RamTier(1 << 20), sched, counters), sched, counters


async def test_a_batch_pays_one_timer_cancelled_when_its_last_reservation_ends() -> None:
    writes, sched, _ = pending()
    batch = Deadline()
    held = [writes.reserve(bytes([i]), OWNER, 30.0, 0, 100.0, batch) for i in range(16)]
    assert sched.deadline_count == 1  # not 16
    for res in held[:-1]:
        assert writes.end(res, End.COMPLETED)
        assert sched.deadline_count == 1  # the rest still have their deadline
    assert repr(batch) == "<Deadline 1/16 pending>"
    assert writes.end(held[-1], End.COMPLETED)
    assert sched.deadline_count == 0 and len(writes.table) == 0
    assert not writes.end(held[0], End.ABORTED)  # (ended once)
    late = writes.reserve(b"late", OWNER, 30.0, 0, 100.0, batch)  # after the batch's last ended
    assert sched.deadline_count == 1  # armed again
    assert sched.run_due(130.0) == 1 and late.done.result() is End.EXPIRED
    alone = writes.reserve(b"alone", OWNER, 30.0, 0, 100.0)  # without a batch: its own
    assert sched.deadline_count == 1
    writes.end(alone, End.ABORTED)
    assert sched.deadline_count == 0


async def test_at_a_batchs_deadline_each_reservation_still_pending_expires_and_wakes() -> None:
    writes, sched, counters = pending()
    batch = Deadline()
    held = [writes.reserve(bytes([i]), OWNER, 30.0, 0, 100.0, batch) for i in range(6)]
    waiting = [res.done for res in held]  # waiters' futures, made as they ask
    for res in held[:2]:
        writes.end(res, End.COMPLETED)
    assert sched.run_due(129.9) == 0
    assert sched.run_due(130.0) == 1  # the batch's one timer
    assert [f.result() for f in waiting] == [End.COMPLETED] * 2 + [End.EXPIRED] * 4
    assert counters.pending_deadline_expired.value == 4
    assert len(writes.table) == 0 and sched.deadline_count == 0
    assert sched.run_due(1e9) == 0  # nothing left armed


@pytest.mark.parametrize("seed", range(5))
async def test_every_reservation_ends_once_and_leaves_no_timer_whatever_the_order(
    seed: int,
) -> None:
    """Random batches and single reservations, ended in a random order, some
    by their deadlines: each waiter wakes once, and nothing stays armed."""
    rng = random.Random(seed)
    writes, sched, _ = pending()
    now, live = 0.0, []
    for n in range(40):
        batch = Deadline() if rng.random() < 0.7 else None
        for i in range(rng.randrange(1, 6)):
            live.append(
                writes.reserve(f"{n}-{i}".encode(), OWNER, rng.choice([1.0, 5.0]), 0, now, batch)
            )
        now += rng.random()
        for res in rng.sample(live, k=len(live) // 3):
            writes.end(res, rng.choice([End.COMPLETED, End.ABORTED]))
        sched.run_due(now)
        assert sched.deadline_count <= len(writes.table)
    sched.run_due(now + 10.0)
    assert len(writes.table) == 0 and sched.deadline_count == 0
    assert all(res.done.done() for res in live)


async def test_a_reserves_keys_share_one_deadline_and_expire_at_it_on_the_defaults(
    sock_dir: Path,
) -> None:
    """A daemon on its defaults: a RESERVE's keys read PENDING under one
    timer; a reader waiting on them is answered when their deadline passes,
    each counted expired, and nothing stays armed."""
    async with (
        running_daemon(sock_dir) as d,
        await Client.connect(d.socket_path) as writer,
        await Client.connect(d.socket_path) as reader,
    ):
        before = d.scheduler.deadline_count
        keys = [b"a", b"b", b"c"]
        assert await writer.reserve(keys, deadline=0.3) == [ReserveStatus.GRANTED] * 3
        assert d.scheduler.deadline_count == before + 1  # one for the three
        assert (await reader.lookup(keys)).states == [State.PENDING] * 3
        reply = await reader.lookup(keys, mode=LookupMode.PREFIX, wait=30.0)  # until they end
        assert (reply.states, reply.prefix_hits) == ([State.MISS] * 3, 0)
        sample = d.metrics.registry.get_sample_value
        assert sample("kvtier_pending_deadline_expired_total") == 3
        assert d.scheduler.deadline_count == before

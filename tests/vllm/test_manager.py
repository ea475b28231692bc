"""Scenario 1: the kvtier tier under vLLM's real TieringOffloadingManager, with a
CPUPrimaryTierOffloadingManager over a real shared region, on CPU.

Store into the primary, cascade to kvtier, evict from the primary, look the
block up again (answered by kvtier, promoted as HIT_PENDING, then HIT) and
find it byte-identical in the primary region.
"""

from __future__ import annotations

import mmap
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)

from kvtier import BlockingClient
from tests.vllm.conftest import Daemon

CHUNKS = 4
BLOCK = 4 * mmap.PAGESIZE
STEP = ScheduleEndContext((), ())


def engine(daemon: Daemon, **settings: object) -> tuple[TieringOffloadingManager, np.ndarray]:
    """One vLLM engine's offloading stack: a CPU primary over a shared region,
    and the kvtier tier as its secondary."""
    region = SharedOffloadRegion(f"kvtier-test-{uuid.uuid4().hex}", CHUNKS, None, BLOCK, BLOCK)
    primary = CPUPrimaryTierOffloadingManager(CHUNKS, region)
    tier = SecondaryTierFactory.create_secondary_tier(
        {
            "type": "KvtierTier",
            "module_path": "kvtier.integrations.vllm",
            "socket_path": str(daemon.socket_path),
            **settings,
        },
        primary_kv_view=primary.get_kv_memoryview(),
        offloading_spec=None,
    )
    manager = TieringOffloadingManager(primary, [tier], tier_poll_interval_s=0)
    return manager, np.asarray(primary.get_kv_memoryview())


@pytest.fixture
def stack(daemon: Daemon) -> Iterator[tuple[TieringOffloadingManager, np.ndarray]]:
    manager, rows = engine(daemon)
    try:
        yield manager, rows
    finally:
        manager.shutdown()


def settle(manager: TieringOffloadingManager) -> None:
    """End a scheduler step and (tests only) wait for the tier's I/O to finish."""
    manager.on_schedule_end(STEP)
    for tier in manager.secondary_tiers:
        tier.drain_jobs()


def store(
    manager: TieringOffloadingManager, rows: np.ndarray, req: ReqContext, key: bytes, fill: int
) -> None:
    out = manager.prepare_store([key], req)
    assert out is not None and out.keys_to_store == [key]
    (chunk,) = out.store_spec.block_ids  # type: ignore[attr-defined]
    rows[chunk] = fill  # what the GPU -> CPU copy would write
    manager.complete_store([key], req)
    settle(manager)


def load(
    manager: TieringOffloadingManager, rows: np.ndarray, req: ReqContext, key: bytes, fill: int
) -> None:
    """Load ``key`` (its lookup answered HIT) and check its row holds ``fill``."""
    (chunk,) = manager.prepare_load([key], req).block_ids  # type: ignore[attr-defined]
    assert (rows[chunk] == fill).all()
    manager.complete_load([key], req)


def load_until_hit(
    manager: TieringOffloadingManager, req: ReqContext, key: bytes
) -> list[LookupResult]:
    seen = []
    for _ in range(8):
        answer = manager.lookup(key, req)
        seen.append(answer)
        if answer is LookupResult.HIT:
            break
        settle(manager)
    return seen


def test_evicted_block_comes_back_from_kvtier_byte_identical(
    stack: tuple[TieringOffloadingManager, np.ndarray],
) -> None:
    manager, rows = stack
    writer = ReqContext("writer")
    manager.on_new_request(writer)
    first = make_offload_key(b"first" * 4, 0)
    store(manager, rows, writer, first, 7)
    for i in range(CHUNKS):  # fill the primary so the first block is evicted
        store(manager, rows, writer, make_offload_key(b"other%d" % i * 3, 0), 100 + i)
    settle(manager)
    manager.on_request_finished(writer)

    reader = ReqContext("reader")
    manager.on_new_request(reader)
    seen = load_until_hit(manager, reader, first)
    # Not in the primary any more: asked of kvtier (RETRY while it answers),
    # promoted (HIT_PENDING), then readable from the primary (HIT).
    assert seen[0] is LookupResult.RETRY
    assert LookupResult.HIT_PENDING in seen and seen[-1] is LookupResult.HIT, seen
    load(manager, rows, reader, first, 7)  # byte-identical after the round trip
    manager.on_request_finished(reader)
    settle(manager)


def test_two_engines_share_blocks_through_one_daemon(daemon: Daemon) -> None:
    """Scenario 2: what one engine stored, another loads; a block another
    writer is still storing reads RETRY until it lands."""
    from kvtier import BlockingClient

    (a, a_rows), (b, b_rows) = engine(daemon), engine(daemon)
    try:
        writer = ReqContext("a-writer")
        a.on_new_request(writer)
        shared = make_offload_key(b"shared" * 3, 0)
        store(a, a_rows, writer, shared, 42)
        a.on_request_finished(writer)

        reader = ReqContext("b-reader")
        b.on_new_request(reader)
        assert load_until_hit(b, reader, shared)[-1] is LookupResult.HIT
        load(b, b_rows, reader, shared, 42)

        # A third engine is in the middle of storing a block: B waits for it.
        soon = make_offload_key(b"soon" * 4, 0)
        with BlockingClient(daemon.socket_path) as third:
            third.reserve([bytes(soon)], [BLOCK])
            assert b.lookup(soon, reader) is LookupResult.RETRY
            settle(b)
            assert b.lookup(soon, reader) is LookupResult.RETRY  # PENDING: not a MISS
            third.put(bytes(soon), bytes([9]) * BLOCK)
        seen = load_until_hit(b, reader, soon)
        assert seen[-1] is LookupResult.HIT and LookupResult.MISS not in seen
        load(b, b_rows, reader, soon, 9)
        b.on_request_finished(reader)
        settle(b)
    finally:
        a.shutdown()
        b.shutdown()


def test_a_block_whose_writer_never_finishes_reads_miss_after_the_readers_bound(
    daemon: Daemon,
) -> None:
    """The wait vLLM lacks upstream: past max_pending_wait the block is MISS
    for this request (recompute it), not RETRY forever."""
    import time

    from kvtier import BlockingClient

    manager, _ = engine(daemon, max_pending_wait=0.2)
    try:
        reader = ReqContext("patient")
        manager.on_new_request(reader)
        stuck = make_offload_key(b"stuck" * 4, 0)
        with BlockingClient(daemon.socket_path) as writer:
            writer.reserve([bytes(stuck)], [BLOCK], deadline=600.0)  # and never PUTs
            seen = []
            for _ in range(100):
                answer = manager.lookup(stuck, reader)
                seen.append(answer)
                if answer is not LookupResult.RETRY:
                    break
                settle(manager)
                time.sleep(0.01)  # allow-sleep: the reader's max_pending_wait has to pass
            assert seen[0] is LookupResult.RETRY and seen[-1] is LookupResult.MISS, seen
        manager.on_request_finished(reader)
        settle(manager)
    finally:
        manager.shutdown()


def test_stores_and_the_daemons_removals_come_out_as_kv_events(daemon: Daemon) -> None:
    manager, rows = engine(daemon, enable_kv_events=True, locality="LOCAL")
    try:
        (tier,) = manager.secondary_tiers
        watch = tier.removal_watch  # type: ignore[attr-defined]
        assert watch is not None and watch.subscribed.wait(10)
        writer = ReqContext("writer")
        manager.on_new_request(writer)
        key = make_offload_key(b"evented" * 3, 0)
        store(manager, rows, writer, key, 5)
        settle(manager)
        (stored,) = [e for e in manager.take_events() if e.medium is Medium.STORAGE]
        assert stored.keys == [key] and not stored.removed
        assert stored.removal_expected and stored.locality is Locality.LOCAL
        assert stored.ownership == tier.tier_type
        # The daemon lets the block go (here: deleted): the tier says so.
        with BlockingClient(daemon.socket_path) as c:
            assert c.delete(bytes(key))
        assert watch.arrived.wait(10)
        (removed,) = [e for e in manager.take_events() if e.medium is Medium.STORAGE]
        assert removed.keys == [key] and removed.removed
        assert list(manager.take_events()) == []  # each said once
        manager.on_request_finished(writer)
    finally:
        manager.shutdown()


def test_without_kv_events_the_tier_emits_none(
    stack: tuple[TieringOffloadingManager, np.ndarray],
) -> None:
    manager, rows = stack
    writer = ReqContext("writer")
    manager.on_new_request(writer)
    store(manager, rows, writer, make_offload_key(b"quiet" * 4, 0), 1)
    assert [e for e in manager.take_events() if e.medium is Medium.STORAGE] == []
    manager.on_request_finished(writer)


@pytest.mark.parametrize("regions", [True, False])
def test_stores_are_read_by_the_daemon_from_vllms_shared_region(
    daemon: Daemon, regions: bool
) -> None:
    """vLLM's CPU tier lives in a shared file (/dev/shm): the daemon reads a
    store's rows from it itself (a region), one copy, none in vLLM's
    process; ``"regions": false`` sends them over the socket instead."""
    manager, rows = engine(daemon, regions=regions)
    try:
        writer = ReqContext("writer")
        manager.on_new_request(writer)
        key = make_offload_key(b"region" * 4, 0)
        store(manager, rows, writer, key, 42)
        for i in range(CHUNKS):  # evict it from the primary
            store(manager, rows, writer, make_offload_key(b"push%d" % i * 4, 0), i)
        settle(manager)
        manager.on_request_finished(writer)
        copied = daemon.total("kvtier_shared_region_bytes_total", direction="in")
        assert copied == ((CHUNKS + 1) * BLOCK if regions else 0)
        assert daemon.stats()["shared"]["regions"] == (1 if regions else 0)
        reader = ReqContext("reader")
        manager.on_new_request(reader)
        assert load_until_hit(manager, reader, key)[-1] is LookupResult.HIT
        load(manager, rows, reader, key, 42)
        manager.on_request_finished(reader)
        settle(manager)
    finally:
        manager.shutdown()


@pytest.mark.parametrize(
    ("rate", "expected"),
    [(0.0, {LookupResult.HIT, LookupResult.HIT_PENDING}), (1e12, {LookupResult.MISS})],
)
def test_a_prefill_rate_sends_budgets_and_a_block_slower_to_load_reads_miss(
    daemon: Daemon, rate: float, expected: set[LookupResult]
) -> None:
    """``recompute_tokens_per_second``: each lookup carries the seconds its
    blocks would take to recompute; at a (fictitious) trillion tokens a
    second even RAM is slower, and vLLM recomputes."""
    manager, _ = engine(daemon, recompute_tokens_per_second=rate)
    try:
        key = make_offload_key(b"budgeted" * 3, 0)
        with BlockingClient(daemon.socket_path) as c:
            c.put(bytes(key), b"k" * BLOCK)
        reader = ReqContext("reader")
        manager.on_new_request(reader)
        answer = LookupResult.RETRY
        for _ in range(10):  # the first ask answers RETRY; each settle brings the answer
            answer = manager.lookup(key, reader)
            if answer is not LookupResult.RETRY:
                break
            settle(manager)
        assert answer in expected
        manager.on_request_finished(reader)
        settle(manager)
    finally:
        manager.shutdown()

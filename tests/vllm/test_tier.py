"""The kvtier tier inside vLLM's own tiering machinery (vLLM 0.33.0, CPU).

The tier is built by vLLM's SecondaryTierFactory from an out-of-tree config
and driven through vLLM's job and lookup types against a real daemon.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from vllm.v1.kv_offload.base import (
    LookupResult,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from tests.vllm.conftest import Daemon

BLOCK = 64 * 1024
CHUNKS = 16
STEP = ScheduleEndContext((), ())


@pytest.fixture
def region() -> np.ndarray:
    return np.zeros((CHUNKS, BLOCK), dtype=np.uint8)  # the primary tier's rows


@pytest.fixture
def tier(daemon: Daemon, region: np.ndarray) -> Iterator[object]:
    t = SecondaryTierFactory.create_secondary_tier(
        {
            "type": "KvtierTier",
            "module_path": "kvtier.integrations.vllm",
            "socket_path": str(daemon.socket_path),
            "namespace": "tiny-llama/abc123/",
        },
        primary_kv_view=memoryview(region),  # type: ignore[arg-type]
        offloading_spec=None,
    )
    yield t
    t.shutdown()


def job(
    job_id: int, keys: list[bytes], chunks: list[int], *, load: bool, req: str = "r"
) -> TransferJob:
    return TransferJob(job_id, keys, np.array(chunks), load, ReqContext(req))


def step(tier: object, req: ReqContext, keys: list[bytes]) -> list[LookupResult]:
    answers = [tier.lookup(k, req) for k in keys]  # type: ignore[attr-defined]
    tier.on_schedule_end(STEP)  # type: ignore[attr-defined]
    tier.drain_jobs()  # type: ignore[attr-defined]  # tests only: wait for the answers
    return answers


def test_store_lookup_load_round_trip_through_vllm_types(tier: object, region: np.ndarray) -> None:
    keys = [make_offload_key(bytes([i]) * 16, 0) for i in range(4)]
    for i in range(4):
        region[i] = i + 1
    expected = region[:4].copy()
    tier.submit_store(job(1, keys, [0, 1, 2, 3], load=False))  # type: ignore[attr-defined]
    tier.drain_jobs()  # type: ignore[attr-defined]
    (stored,) = tier.get_finished_jobs()  # type: ignore[attr-defined]
    assert stored.success and stored.transfer_bytes == 4 * BLOCK

    req = ReqContext("r2")
    tier.on_new_request(req)  # type: ignore[attr-defined]
    assert step(tier, req, keys) == [LookupResult.RETRY] * 4  # never waits
    assert step(tier, req, keys) == [LookupResult.HIT] * 4

    tier.submit_load(job(2, keys, [8, 9, 10, 11], load=True, req="r2"))  # type: ignore[attr-defined]
    tier.drain_jobs()  # type: ignore[attr-defined]
    (loaded,) = tier.get_finished_jobs()  # type: ignore[attr-defined]
    assert loaded.success and loaded.successful_keys is None
    assert np.array_equal(region[8:12], expected)  # byte-identical in the primary rows
    tier.on_request_finished(req)  # type: ignore[attr-defined]


def test_a_failed_load_reports_its_keys_and_answers_miss(tier: object, region: np.ndarray) -> None:
    here, gone = make_offload_key(b"h" * 16, 0), make_offload_key(b"g" * 16, 0)
    tier.submit_store(job(1, [here], [0], load=False))  # type: ignore[attr-defined]
    tier.drain_jobs()  # type: ignore[attr-defined]
    tier.get_finished_jobs()  # type: ignore[attr-defined]
    tier.submit_load(job(2, [here, gone], [4, 5], load=True))  # type: ignore[attr-defined]
    tier.drain_jobs()  # type: ignore[attr-defined]
    (result,) = tier.get_finished_jobs()  # type: ignore[attr-defined]
    assert not result.success and list(result.successful_keys) == [here]
    # The promotion cannot be delivered: from now on the tier says MISS, so
    # vLLM does not come back to it in a loop.
    assert tier.lookup(gone, ReqContext("r3")) is LookupResult.MISS  # type: ignore[attr-defined]


def test_64_lookups_of_one_key_across_requests_make_one_probe(tier: object, daemon: Daemon) -> None:
    key = make_offload_key(b"cold" * 4, 0)
    reqs = [ReqContext(f"req-{i}") for i in range(64)]
    for req in reqs:
        assert tier.lookup(key, req) is LookupResult.RETRY  # type: ignore[attr-defined]
    for _ in range(200):  # RETRY while the remote tier's probe is in flight (a real daemon's)
        tier.on_schedule_end(STEP)  # type: ignore[attr-defined]
        tier.drain_jobs()  # type: ignore[attr-defined]
        answers = {tier.lookup(key, r) for r in reqs}  # type: ignore[attr-defined]
        if LookupResult.RETRY not in answers:
            break
    assert answers == {LookupResult.MISS}
    assert daemon.metric("kvtier_probes_total", 'outcome="started",tier="mem"') == 1
    for req in reqs:
        tier.on_request_finished(req)  # type: ignore[attr-defined]
    tier.drain_jobs()  # type: ignore[attr-defined]
    assert daemon.metric("kvtier_request_states") == 0
    assert daemon.metric("kvtier_pending_writes") == 0


def test_unknown_settings_are_refused(region: np.ndarray) -> None:
    with pytest.raises(ValueError, match="unknown kvtier tier setting"):
        SecondaryTierFactory.create_secondary_tier(
            {"type": "KvtierTier", "module_path": "kvtier.integrations.vllm", "sokcet": "x"},
            primary_kv_view=memoryview(region),  # type: ignore[arg-type]
            offloading_spec=None,
        )


def test_counts_reach_vllm_through_its_metric_hooks(tier: object, region: np.ndarray) -> None:
    definitions = type(tier).build_metric_definitions({})  # type: ignore[attr-defined]
    keys = [make_offload_key(b"m" * 16, 0)]
    tier.submit_store(job(1, keys, [0], load=False))  # type: ignore[attr-defined]
    tier.drain_jobs()  # type: ignore[attr-defined]
    tier.get_finished_jobs()  # type: ignore[attr-defined]
    req = ReqContext("metrics")
    step(tier, req, [*keys, make_offload_key(b"n" * 16, 0)])
    step(tier, req, [*keys, make_offload_key(b"n" * 16, 0)])
    tier.submit_load(job(2, keys, [1], load=True))  # type: ignore[attr-defined]
    tier.drain_jobs()  # type: ignore[attr-defined]
    tier.get_finished_jobs()  # type: ignore[attr-defined]
    stats = tier.get_stats()  # type: ignore[attr-defined]
    _, values = stats.metric_sections()
    assert set(values) <= set(definitions)
    lookups = values["vllm:kv_offload_kvtier_lookups"]
    # The stored key: RETRY then HIT; the cold one: RETRY twice (the daemon's
    # remote tier is probing it).
    assert lookups == {("retry",): 3, ("hit",): 1}
    assert values["vllm:kv_offload_kvtier_store_bytes"] == {(): BLOCK}
    assert values["vllm:kv_offload_kvtier_load_bytes"] == {(): BLOCK}
    assert tier.get_stats() is None  # type: ignore[attr-defined]  # deltas: reported once


def test_a_requests_kv_hints_lease_its_blocks_and_its_lookups_renew_them(
    tier: object, daemon: Daemon, region: np.ndarray
) -> None:
    """vLLM's own KvHintsEnvelope on the request: its store job's blocks are
    leased to the session, and the same session's next lookups count a
    return within the lease (docs/retention.md)."""
    from vllm.v1.kv_hints.protocol import KvHintAction, KvHintsEnvelope

    from kvtier.client import BlockingClient

    hints = KvHintsEnvelope(
        protocol_version="0.1",
        message_id="turn-1",
        actions=[
            KvHintAction(
                action_id="keep",
                action_type="kv.retain",
                action_version="1.0",
                payload={"session_id": "agent-7", "ttl_seconds": 300, "priority": 80},
            )
        ],
    )
    keys = [make_offload_key(bytes([i + 40]) * 16, 0) for i in range(3)]
    turn = ReqContext("turn-1", kv_hints=hints)
    tier.submit_store(TransferJob(7, keys, np.array([0, 1, 2]), False, turn))  # type: ignore[attr-defined]
    tier.drain_jobs()  # type: ignore[attr-defined]
    (stored,) = tier.get_finished_jobs()  # type: ignore[attr-defined]
    assert stored.success
    again = ReqContext(
        "turn-2",
        kv_transfer_params={
            "kv_hint": {
                "protocol_version": "0.1",
                "message_id": "turn-2",
                "actions": [
                    {
                        "action_id": "keep",
                        "action_type": "kv.retain",
                        "action_version": "1.0",
                        "payload": {"session_id": "agent-7", "ttl_seconds": 300},
                    }
                ],
            }
        },
    )  # (as Dynamo's bridge passes the same envelope)
    step(tier, again, keys)
    assert step(tier, again, keys) == [LookupResult.HIT] * 3
    with BlockingClient.connect(daemon.socket_path, namespace="tiny-llama/abc123/") as c:
        r = c.stats()["retention"]
    assert r["leased_blocks"] == 3 and r["sessions"] == 1
    # the session's latest word (no priority: the default) stands
    assert r["leased_bytes_by_priority"] == {"tiny-llama/abc123/": {"50": 3 * BLOCK}}
    assert r["returns_asked"] >= 3 and r["returns_held"] >= 3

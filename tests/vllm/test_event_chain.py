"""vLLM's own event chain with the kvtier tier in it: the real
TieringOffloadingManager's ``take_events`` (which asks the kvtier tier's),
vLLM's real OffloadingEventsTracker (self-describing events), vLLM's real
ZmqEventPublisher, and a ZMQ reader decoding with vLLM's msgspec classes: what
an llm-d indexer or a Dynamo router subscribed to this engine would read."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from vllm.distributed.kv_events import (
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventGroupSpec,
    OffloadingEventsTracker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import GroupOffloadConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_offload.base import OffloadingKVEventsConfig, ReqContext, make_offload_key
from vllm.v1.request import Request

from kvtier import BlockingClient
from tests.enginedaemon import EngineDaemon, start
from tests.vllm.test_manager import BLOCK, engine, settle, store
from tests.zmqevents import EventReader

TOKENS = 16
TOPIC = "kv@pod-a@tiny-llama"
GROUP = GroupOffloadConfig(
    group_idx=0,
    tokens_per_block=TOKENS,
    tokens_per_chunk=TOKENS,
    hashes_per_chunk=1,
    kv_event_group_spec=OffloadingEventGroupSpec("full_attention", None),
    sliding_window_size_in_chunks=None,
    kv_cache_spec=FullAttentionSpec(
        block_size=TOKENS, num_kv_heads=1, head_size=8, dtype=torch.float32
    ),
    manager_cls=FullAttentionManager,
)


@pytest.fixture
def small(workdir: Path) -> Iterator[tuple[EngineDaemon, Path]]:
    """A daemon whose RAM holds 64 of the engine's blocks, and no disk."""
    d = start(workdir, "--no-disk", "--ram-capacity", f"{64 * BLOCK}")
    try:
        yield d, workdir
    finally:
        d.stop()


def test_a_block_stored_then_evicted_reaches_routers_self_described(
    small: tuple[EngineDaemon, Path],
) -> None:
    d, tmp = small
    init_none_hash(sha256)
    manager, rows = engine(d, enable_kv_events=True, locality="LOCAL")
    tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(True, True), {0: GROUP[4]})
    replay = f"ipc://{tmp}/vllm-replay"
    publisher = ZmqEventPublisher(
        0, endpoint=f"ipc://{tmp}/vllm-events", replay_endpoint=replay, topic=TOPIC
    )
    reader = EventReader(f"ipc://{tmp}/vllm-events", replay, TOPIC, KVEventBatch)
    (tier,) = manager.secondary_tiers
    watch = tier.removal_watch  # type: ignore[attr-defined]

    def step() -> None:
        """What vLLM's scheduler does with the manager's events each step."""
        events = list(tracker.take_events(manager.take_events()))
        if events:
            publisher.publish(KVEventBatch(ts=time.time(), events=events))

    try:
        assert watch is not None and watch.subscribed.wait(10)
        request = Request(
            "r1",
            list(range(100, 100 + TOKENS)),
            SamplingParams(max_tokens=1),
            None,
            block_hasher=get_request_block_hasher(TOKENS, sha256),
        )
        (block_hash,) = request.block_hashes
        key = make_offload_key(block_hash, 0)
        writer = ReqContext("r1")
        manager.on_new_request(writer)
        tracker.record_store(request, GROUP, 0, key)
        store(manager, rows, writer, key, 3)
        settle(manager)
        step()

        # The daemon fills up with other blocks and evicts this one.
        with BlockingClient(d.socket_path) as other:
            for i in range(200):
                other.put(b"filler-%d" % i, bytes(BLOCK))
        assert watch.arrived.wait(10)
        step()

        events = [
            e for e in reader.events(2, start=0) if getattr(e, "medium", None) == MEDIUM_STORAGE
        ]
        stored, removed = events
        assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
        hashed = maybe_convert_block_hash(block_hash)
        assert stored.block_hashes == [hashed] and removed.block_hashes == [hashed]
        # Self-describing: a router that never saw this engine's GPU events
        # can place the block from this event alone.
        assert stored.token_ids == list(range(100, 100 + TOKENS))
        assert stored.block_size == TOKENS and stored.parent_block_hash is None
        assert stored.locality == "LOCAL" and stored.ownership == tier.tier_type
        assert removed.locality == "LOCAL" and removed.group_idx == 0
        manager.on_request_finished(writer)
    finally:
        manager.shutdown()
        publisher.shutdown()
        reader.close()

"""The daemon's KV events, decoded with vLLM's own classes: what llm-d and
Dynamo, which read vLLM's stream, will read from kvtier."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.kv_offload.base import ReqContext, make_offload_key

from kvtier import BlockingClient
from tests.enginedaemon import EngineDaemon, start
from tests.vllm.test_manager import engine, settle, store
from tests.zmqevents import EventReader


@pytest.fixture
def publishing(workdir: Path) -> Iterator[tuple[EngineDaemon, Path]]:
    tmp = workdir
    config = tmp / "kvtier.toml"
    config.write_text(
        "[events]\n"
        f'endpoint = "ipc://{tmp}/events"\n'
        f'replay_endpoint = "ipc://{tmp}/replay"\n'
        'node = "n1"\nmedium = "CPU_TIER2"\n'
    )
    d = start(tmp, "--config", str(config), "--no-disk", "--ram-capacity", "64MiB")
    try:
        yield d, tmp
    finally:
        d.stop()


def test_blocks_the_vllm_tier_stores_reach_routers_in_vllms_own_format(
    publishing: tuple[EngineDaemon, Path],
) -> None:
    d, tmp = publishing
    reader = EventReader(
        f"ipc://{tmp}/events", f"ipc://{tmp}/replay", "kv@n1@default", KVEventBatch
    )
    manager, rows = engine(d)
    try:
        writer = ReqContext("writer")
        manager.on_new_request(writer)
        block_hash = bytes(range(32))
        key = make_offload_key(block_hash, 0)
        store(manager, rows, writer, key, 9)
        settle(manager)
        with BlockingClient(d.socket_path) as c:
            assert c.delete(bytes(key))
        events = reader.events(3)
        assert isinstance(events[0], AllBlocksCleared)
        stored, removed = events[1], events[2]
        assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
        assert stored.block_hashes == [maybe_convert_block_hash(block_hash)]
        assert stored.medium == "CPU_TIER2" and stored.group_idx == 0
        assert removed.block_hashes == stored.block_hashes and removed.medium == "CPU_TIER2"
        manager.on_request_finished(writer)
    finally:
        manager.shutdown()
        reader.close()

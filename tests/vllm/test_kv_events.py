"""The daemon's KV events, decoded with vLLM's own classes: what llm-d and
Dynamo, which read vLLM's stream, will read from kvtier."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
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


@pytest.fixture
def publishing() -> Iterator[tuple[EngineDaemon, Path]]:
    tmp = Path(tempfile.mkdtemp(prefix="kvt-vllm-ev-", dir="/tmp"))
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
        shutil.rmtree(tmp, ignore_errors=True)


def batches(tmp: Path, ctx: zmq.Context[zmq.Socket[bytes]]) -> list[tuple[int, KVEventBatch]]:
    """Every buffered batch, from the replay socket, decoded as vLLM decodes them."""
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    req.setsockopt(zmq.RCVTIMEO, 10_000)
    req.connect(f"ipc://{tmp}/replay")
    try:
        req.send_multipart((b"", (1).to_bytes(8, "big")))
        out: list[tuple[int, KVEventBatch]] = []
        while True:
            _, topic, seq, payload = req.recv_multipart()
            n = int.from_bytes(seq, "big", signed=True)
            if n == -1:
                return out
            assert topic == b"kv@n1@kvtier"
            out.append((n, decoder.decode(payload)))
    finally:
        req.close()


def until(
    tmp: Path, ctx: zmq.Context[zmq.Socket[bytes]], sub: zmq.Socket[bytes], n: int
) -> list[object]:
    """The first ``n`` events, waiting on the live stream between looks."""
    for _ in range(50):
        seen = batches(tmp, ctx)
        assert [s for s, _ in seen] == list(range(1, len(seen) + 1))
        events = [e for _, b in seen for e in b.events]
        if len(events) >= n:
            return events
        if sub.poll(200):  # bounded: the next batch, or look again
            sub.recv_multipart()
    raise AssertionError(f"fewer than {n} events published")


def test_blocks_the_vllm_tier_stores_reach_routers_in_vllms_own_format(
    publishing: tuple[EngineDaemon, Path],
) -> None:
    d, tmp = publishing
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"ipc://{tmp}/events")
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
        events = until(tmp, ctx, sub, 3)
        assert isinstance(events[0], AllBlocksCleared)
        stored, removed = events[1], events[2]
        assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
        assert stored.block_hashes == [maybe_convert_block_hash(block_hash)]
        assert stored.medium == "CPU_TIER2" and stored.group_idx == 0
        assert removed.block_hashes == stored.block_hashes and removed.medium == "CPU_TIER2"
        manager.on_request_finished(writer)
    finally:
        manager.shutdown()
        sub.close()
        ctx.term()

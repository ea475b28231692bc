"""KV events for routers: the daemon's publisher in vLLM's format, with a real ZMQ subscriber."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvtier.client.aio import Client
from kvtier.daemon import Daemon
from kvtier.model import LookupMode
from kvtier.tiers.memory import MemoryRemoteTier
from tests.helpers import running_daemon

RAM_ONLY = {"enabled": False}


def vllm_key(block_hash: bytes, group: int = 0, namespace: bytes = b"m/") -> bytes:
    """A vLLM tier's key: namespace, the engine's block hash, a 4-byte group index."""
    return namespace + block_hash + group.to_bytes(4, "big")


def as_int(block_hash: bytes) -> int:
    """The hash as vLLM converts it (its last 8 bytes, big-endian)."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


def events_config(sock_dir: Path) -> dict[str, Any]:
    return {
        "endpoint": f"ipc://{sock_dir}/kv-events",
        "replay_endpoint": f"ipc://{sock_dir}/kv-replay",
        "node": "node-a",
        "medium": "CPU_TIER2",
    }


async def replay(ctx: zmq.asyncio.Context, sock_dir: Path, start: int) -> list[tuple[int, Any]]:
    """Every buffered batch from ``start`` on, as (sequence number, decoded batch)."""
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(f"ipc://{sock_dir}/kv-replay")
    try:
        await req.send_multipart((b"", start.to_bytes(8, "big")))
        out: list[tuple[int, Any]] = []
        async with asyncio.timeout(10):
            while True:
                _, topic, seq, payload = await req.recv_multipart()
                n = int.from_bytes(seq, "big", signed=True)
                if n == -1:
                    return out
                assert topic == b"kv@node-a@kvtier"
                out.append((n, msgspec.msgpack.decode(payload)))
    finally:
        req.close()


async def published(d: Daemon, ctx: zmq.asyncio.Context, sock_dir: Path, wanted: int) -> list[Any]:
    """The first ``wanted`` events published, once they are (asked of the replay socket)."""
    assert d.publisher is not None
    async with asyncio.timeout(10):
        while True:
            batches = await replay(ctx, sock_dir, 1)
            assert [n for n, _ in batches] == list(range(1, len(batches) + 1))  # no holes
            events = [e for _, (_ts, evs, *_) in batches for e in evs]
            if len(events) >= wanted:
                return events
            await d.publisher.wait_published(len(batches) + 1)


async def test_blocks_stored_and_removed_go_out_in_vllms_format(sock_dir: Path) -> None:
    ctx = zmq.asyncio.Context()
    h1, h2 = bytes(range(32)), bytes(range(1, 33))
    try:
        async with (
            running_daemon(sock_dir, events=events_config(sock_dir)) as d,
            await Client.connect(d.socket_path, shared=False) as c,
        ):
            (cleared,) = await published(d, ctx, sock_dir, 1)
            assert cleared == {"type": "AllBlocksCleared"}  # the start: nothing held
            await c.put_many([vllm_key(h1), vllm_key(h2, group=1)], [b"a" * 5000, b"b" * 5000])
            await d.settle()  # written through to the disk too: announced once
            await c.delete(vllm_key(h1))
            events = await published(d, ctx, sock_dir, 4)  # cleared, 2 stored, 1 removed
            stored = [e for e in events if e["type"] == "BlockStored"]
            assert [(e["block_hashes"], e.get("group_idx")) for e in stored] == [
                ([as_int(h1)], 0),
                ([as_int(h2)], 1),
            ]
            first = stored[0]
            assert first["medium"] == "CPU_TIER2" and first["token_ids"] == []
            assert first["parent_block_hash"] is None and first["block_size"] == 16
            removed = [e for e in events if e["type"] == "BlockRemoved"]
            assert removed == [
                {
                    "type": "BlockRemoved",
                    "block_hashes": [as_int(h1)],
                    "medium": "CPU_TIER2",
                    "group_idx": 0,
                }
            ]
            # A subscriber that joins late sees a later sequence number first and
            # fills the hole from the replay socket. (A subscription takes effect
            # a moment after connecting: blocks are stored until one arrives.)
            late = ctx.socket(zmq.SUB)
            late.setsockopt(zmq.LINGER, 0)
            late.setsockopt(zmq.SUBSCRIBE, b"kv@node-a@")
            late.connect(f"ipc://{sock_dir}/kv-events")
            seq = None
            for i in range(100):
                await c.put(vllm_key(bytes([i]) * 32), b"c")
                if await late.poll(100):  # bounded wait for the next batch
                    _topic, raw, _payload = await late.recv_multipart()
                    seq = int.from_bytes(raw, "big")
                    break
            assert seq is not None and seq > 1
            missed = await replay(ctx, sock_dir, 1)
            assert [n for n, _ in missed][:seq] == list(range(1, seq + 1))
            late.close()
            assert d.publisher is not None and d.publisher.stats.replays >= 1
            sample = d.metrics.registry.get_sample_value
            assert sample("kvtier_kv_events_blocks_total", {"event": "stored"}) == 2 + i + 1
            assert sample("kvtier_kv_events_blocks_total", {"event": "removed"}) == 1
    finally:
        ctx.destroy(linger=0)


async def test_a_block_promoted_from_a_remote_tier_is_published(sock_dir: Path) -> None:
    ctx = zmq.asyncio.Context()
    h = bytes(range(3, 35))
    tier = MemoryRemoteTier("mem")
    tier.blocks[vllm_key(h)] = b"from elsewhere"
    try:
        async with (
            running_daemon(
                sock_dir, remote_tiers=[tier], disk=RAM_ONLY, events=events_config(sock_dir)
            ) as d,
            await Client.connect(d.socket_path, shared=False) as c,
        ):
            await published(d, ctx, sock_dir, 1)
            reply = await c.lookup([vllm_key(h)], mode=LookupMode.PREFIX, wait=5.0)
            assert reply.prefix_hits == 1
            events = await published(d, ctx, sock_dir, 2)
            assert events[-1]["type"] == "BlockStored" and events[-1]["block_hashes"] == [as_int(h)]
    finally:
        ctx.destroy(linger=0)


async def test_on_start_every_block_held_is_announced(sock_dir: Path) -> None:
    ctx = zmq.asyncio.Context()
    h = bytes(range(4, 36))
    try:
        async with running_daemon(sock_dir) as d, await Client.connect(d.socket_path) as c:
            await c.put(vllm_key(h), b"kept")
            await d.settle()  # on disk
        async with running_daemon(sock_dir, events=events_config(sock_dir)) as d:
            events = await published(d, ctx, sock_dir, 2)
            assert events[0] == {"type": "AllBlocksCleared"}
            assert [e["block_hashes"] for e in events[1:]] == [[as_int(h)]]
    finally:
        ctx.destroy(linger=0)

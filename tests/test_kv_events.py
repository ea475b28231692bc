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
from kvtier.tiers.rendezvous import owner
from tests.helpers import running_daemon, wait_on_timers
from tests.ports import free_port
from tests.s3server import ProxiedS3

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
                assert topic == b"kv@node-a@default"
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


async def test_a_block_promoted_from_s3_is_published(s3: ProxiedS3, sock_dir: Path) -> None:
    ctx = zmq.asyncio.Context()
    h = bytes(range(3, 35))
    tier = s3.tier_config(s3.new_bucket())
    stored = s3.proxy.when_completed("PUT", f"/{tier['bucket']}/fleet-a/{vllm_key(h).hex()}")
    try:
        async with (
            running_daemon(sock_dir, remote_tier_configs=[tier], disk=RAM_ONLY) as d,
            await Client.connect(d.socket_path, shared=False) as c,
        ):
            await c.put(vllm_key(h), b"from elsewhere")  # written through to S3
            assert await asyncio.to_thread(stored.wait, 30)
        async with (
            running_daemon(
                sock_dir, remote_tier_configs=[tier], disk=RAM_ONLY, events=events_config(sock_dir)
            ) as d,
            await Client.connect(d.socket_path, shared=False) as c,
        ):
            assert await published(d, ctx, sock_dir, 1) == [{"type": "AllBlocksCleared"}]
            reply = await c.lookup([vllm_key(h)], mode=LookupMode.PREFIX, wait=30.0)
            assert reply.prefix_hits == 1  # probed in S3, promoted into RAM
            events = await published(d, ctx, sock_dir, 2)
            assert events[-1]["type"] == "BlockStored" and events[-1]["block_hashes"] == [as_int(h)]
    finally:
        ctx.destroy(linger=0)


async def test_a_block_a_peer_pushes_here_is_published(sock_dir: Path) -> None:
    ctx = zmq.asyncio.Context()
    a_dir, b_dir = sock_dir / "a", sock_dir / "b"
    a_dir.mkdir()
    b_dir.mkdir()
    here, there = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    members = [here, there]
    # A key whose owner is B: stored on A, pushed to B.
    key = next(
        k
        for k in (vllm_key(bytes([i]) * 32) for i in range(256))
        if owner(k, [m.encode() for m in members]) == there.encode()
    )
    try:
        async with (
            running_daemon(
                b_dir,
                disk=RAM_ONLY,
                peer={"listen": there, "members": members, "token": "t"},
                events=events_config(sock_dir),
            ) as b,
            running_daemon(
                a_dir, disk=RAM_ONLY, peer={"listen": here, "members": members, "token": "t"}
            ) as a,
            await Client.connect(a.socket_path, shared=False) as c,
        ):
            await published(b, ctx, sock_dir, 1)
            await c.put(key, b"pushed to its owner")
            events = await published(b, ctx, sock_dir, 2)
            assert events[-1]["type"] == "BlockStored"
            assert events[-1]["block_hashes"] == [as_int(key[2:34])]
    finally:
        ctx.destroy(linger=0)


async def test_a_slow_subscriber_misses_batches_and_fills_them_from_replay(
    sock_dir: Path,
) -> None:
    """The PUB socket drops batches past its high-water mark for a subscriber
    that does not keep up; the subscriber sees the hole in the sequence
    numbers and asks the replay socket for what it missed."""
    ctx = zmq.asyncio.Context()
    config = {**events_config(sock_dir), "hwm": 1}
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, 1)
    sub.setsockopt(zmq.RCVBUF, 4096)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    batches, per_batch = 400, 256
    try:
        async with (
            running_daemon(sock_dir, disk=RAM_ONLY, events=config) as d,
            await Client.connect(d.socket_path, shared=False) as c,
        ):
            assert d.publisher is not None
            sub.connect(f"ipc://{sock_dir}/kv-events")
            # The subscription is live once a batch arrives on it.
            for i in range(100):
                await c.put(vllm_key(bytes([0xFF, i]) * 16), b"w")
                if await sub.poll(100):  # bounded wait for the next batch
                    break
            else:
                raise AssertionError("the subscription never took effect")
            keys = [vllm_key(i.to_bytes(32, "big")) for i in range(batches * per_batch)]
            for lo in range(0, len(keys), per_batch):
                await c.put_many(keys[lo : lo + per_batch], [b"v"] * per_batch)
            stats = d.publisher.stats
            await wait_on_timers(lambda: stats.stored >= len(keys))
            last = d.publisher.stats.batches
            # Only now does the subscriber read: what the pipes kept.
            seen: dict[int, list[Any]] = {}
            while await sub.poll(500):  # bounded: what is left in the pipes
                _topic, raw, payload = await sub.recv_multipart()
                seen[int.from_bytes(raw, "big")] = msgspec.msgpack.decode(payload)[1]
            first = min(seen)
            missed = [n for n in range(first, last + 1) if n not in seen]
            assert missed, "the high-water mark dropped nothing"
            filled = dict(await replay(ctx, sock_dir, missed[0]))
            assert set(missed) <= set(filled)
            for n in missed:
                seen[n] = filled[n][1]
            announced = {
                h
                for n in range(first, last + 1)
                for e in seen[n]
                if e["type"] == "BlockStored"
                for h in e["block_hashes"]
            }
            assert {as_int(k[2:34]) for k in keys} <= announced
    finally:
        sub.close()
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


async def test_each_namespace_goes_out_under_its_own_topic(sock_dir: Path) -> None:
    ctx = zmq.asyncio.Context()
    ha, hb = bytes(range(5, 37)), bytes(range(6, 38))
    try:
        async with (
            running_daemon(sock_dir, disk=RAM_ONLY, events=events_config(sock_dir)) as d,
            await Client.connect(d.socket_path, namespace="llama@1a2b") as a,
            await Client.connect(d.socket_path, namespace="mistral@3c4d") as b,
        ):
            await published(d, ctx, sock_dir, 1)
            await a.put(vllm_key(ha), b"a")
            await b.put(vllm_key(hb), b"b")
            await a.delete(vllm_key(ha))
            assert d.publisher is not None
            await d.publisher.wait_published(4)
            req = ctx.socket(zmq.DEALER)
            req.setsockopt(zmq.LINGER, 0)
            req.connect(f"ipc://{sock_dir}/kv-replay")
            await req.send_multipart((b"", (1).to_bytes(8, "big")))
            seen: list[tuple[int, bytes, list[Any]]] = []
            async with asyncio.timeout(10):
                while True:
                    _, topic, seq, payload = await req.recv_multipart()
                    n = int.from_bytes(seq, "big", signed=True)
                    if n == -1:
                        break
                    seen.append((n, topic, msgspec.msgpack.decode(payload)[1]))
            req.close()
            assert [n for n, _, _ in seen] == [1, 2, 3, 4]  # one run for every topic
            assert [(t, [e["type"] for e in evs]) for _, t, evs in seen] == [
                (b"kv@node-a@default", ["AllBlocksCleared"]),
                (b"kv@node-a@llama@1a2b", ["BlockStored"]),
                (b"kv@node-a@mistral@3c4d", ["BlockStored"]),
                (b"kv@node-a@llama@1a2b", ["BlockRemoved"]),
            ]
            assert seen[1][2][0]["block_hashes"] == [as_int(ha)]  # hashes as without
    finally:
        ctx.destroy(linger=0)

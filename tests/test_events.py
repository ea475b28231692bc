"""Block events: the event log alone, and SUBSCRIBE end to end."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from pathlib import Path

from kvtier.client.aio import Client
from kvtier.core.events import EventLog
from kvtier.model import BlockEvent, EventKind, EventTier, LookupMode
from kvtier.tiers.memory import MemoryRemoteTier
from tests.helpers import running_daemon

BLOCK = 200_000  # five fit in the 1 MiB of RAM below
RAM_ONLY = {"enabled": False}


def test_sequence_numbers_have_no_holes_and_an_overflow_is_a_gap() -> None:
    log = EventLog()
    sub = log.subscribe(limit=3)
    for i in range(3):
        log.emit(EventKind.STORED, bytes([i]), EventTier.RAM)
    assert [e.seq for e in sub.take(10)] == [1, 2, 3]
    assert not sub.ready.is_set()
    for i in range(5):  # the fourth overflows: all queued are dropped, then a gap
        log.emit(EventKind.STORED, bytes([i]), EventTier.RAM)
    (gap,) = sub.take(10)
    assert gap.kind is EventKind.GAP and gap.seq == 4  # the first event it lost
    assert log.gaps == 1 and "gaps=1" in repr(sub)
    log.emit(EventKind.DELETED, b"k")
    assert sub.take(10) == [BlockEvent(9, EventKind.DELETED, b"k")]
    log.unsubscribe(sub)
    log.emit(EventKind.DELETED, b"k")
    assert len(sub) == 0 and log.seq == 10


async def next_events(events: AsyncGenerator[list[BlockEvent], None], n: int) -> list[BlockEvent]:
    """The next ``n`` events of a subscription (bounded: a missing one fails)."""
    out: list[BlockEvent] = []
    async with asyncio.timeout(10):
        while len(out) < n:
            out += await anext(events)
    assert len(out) == n, out
    return out


def block(i: int) -> bytes:
    return bytes([i]) * BLOCK


def test_many_events_at_once_number_and_overflow_as_one_by_one() -> None:
    log = EventLog()
    sub = log.subscribe(limit=5)
    log.emit(EventKind.STORED, b"a", EventTier.RAM)
    log.emit_many(EventKind.EVICTED, [b"b", b"c", b"d"])
    log.emit_many(EventKind.EVICTED, [])  # nothing: no sequence number
    assert [(e.seq, e.kind, e.key) for e in sub.take(10)] == [
        (1, EventKind.STORED, b"a"),
        (2, EventKind.EVICTED, b"b"),
        (3, EventKind.EVICTED, b"c"),
        (4, EventKind.EVICTED, b"d"),
    ]
    log.emit_many(EventKind.STORED, [b"e", b"f", b"g", b"h"])
    log.emit_many(EventKind.STORED, [b"i", b"j"])  # 6 queued > 5: a gap from seq 5
    (gap,) = sub.take(10)
    assert gap.kind is EventKind.GAP and gap.seq == 5 and log.gaps == 1
    log.emit_many(EventKind.DELETED, [b"k"])
    assert [(e.seq, e.key) for e in sub.take(10)] == [(11, b"k")]
    assert log.stats().published == {"stored": 7, "evicted": 3, "deleted": 1}


async def test_stores_evictions_and_deletes_stream_in_order(sock_dir: Path) -> None:
    async with (
        running_daemon(sock_dir, ram={"capacity": "1MiB", "policy": "lru"}, disk=RAM_ONLY) as d,
        await Client.connect(d.socket_path) as watcher,
        await Client.connect(d.socket_path, shared=False) as c,
    ):
        events = watcher.subscribe()
        first = asyncio.ensure_future(anext(events))
        await watcher.ping()  # SUBSCRIBE was sent before this: it is registered
        await c.put_many([b"a", b"b"], [block(1), block(2)])
        got = await first
        got += await next_events(events, 2 - len(got))
        assert [(e.kind, e.key, e.tier) for e in got] == [
            (EventKind.STORED, b"a", EventTier.RAM),
            (EventKind.STORED, b"b", EventTier.RAM),
        ]
        assert await c.delete(b"a")
        await c.put_many([f"x{i}".encode() for i in range(5)], [block(i) for i in range(5)])
        rest = await next_events(events, 1 + 5 + 1)  # one deleted, five stored, b evicted
        assert rest[0] == BlockEvent(got[-1].seq + 1, EventKind.DELETED, b"a")
        assert (EventKind.EVICTED, b"b") in [(e.kind, e.key) for e in rest]
        seqs = [e.seq for e in got + rest]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no holes
        await events.aclose()


async def test_a_block_on_disk_is_still_held_after_ram_lets_it_go(sock_dir: Path) -> None:
    async with (
        running_daemon(sock_dir, ram={"capacity": "1MiB", "policy": "lru"}) as d,
        await Client.connect(d.socket_path) as watcher,
        await Client.connect(d.socket_path, shared=False) as c,
    ):
        events = watcher.subscribe()
        first = asyncio.ensure_future(anext(events))
        await watcher.ping()
        await c.put(b"k", block(1))
        await d.settle()  # the write-through to disk has landed
        got = await first
        got += await next_events(events, 2 - len(got))
        assert [(e.kind, e.tier) for e in got] == [
            (EventKind.STORED, EventTier.RAM),
            (EventKind.STORED, EventTier.DISK),
        ]
        await c.put_many([f"x{i}".encode() for i in range(5)], [block(i) for i in range(5)])
        await d.settle()
        later = await next_events(events, 10)  # five stored in RAM, five on disk
        assert (EventKind.EVICTED, b"k") not in [(e.kind, e.key) for e in later]
        assert d.disk is not None and d.disk.contains(b"k")


async def test_a_snapshot_then_live_events_and_a_slow_subscriber_resyncs(sock_dir: Path) -> None:
    async with (
        running_daemon(sock_dir, disk=RAM_ONLY) as d,
        await Client.connect(d.socket_path) as watcher,
        await Client.connect(d.socket_path, shared=False) as c,
    ):
        await c.put_many([b"a", b"b"], [b"1", b"2"])
        events = watcher.subscribe(snapshot=True, limit=4)
        held = await next_events(events, 3)
        assert {(e.kind, e.key) for e in held[:2]} == {
            (EventKind.SNAPSHOT, b"a"),
            (EventKind.SNAPSHOT, b"b"),
        }
        assert held[2].kind is EventKind.SNAPSHOT_END
        # Ten events while the subscriber reads nothing: its queue of 4 overflows.
        await c.put_many([f"k{i}".encode() for i in range(10)], [b"v"] * 10)
        (gap,) = await next_events(events, 1)
        assert gap.kind is EventKind.GAP and gap.seq == held[2].seq + 1
        await events.aclose()
        again = watcher.subscribe(snapshot=True)
        resync = await next_events(events=again, n=13)
        assert {e.key for e in resync if e.kind is EventKind.SNAPSHOT} == {
            b"a",
            b"b",
            *(f"k{i}".encode() for i in range(10)),
        }
        gaps = d.metrics.registry.get_sample_value("kvtier_event_gaps_total")
        assert gaps == 1
        await again.aclose()


async def test_a_block_promoted_from_a_remote_tier_is_announced(sock_dir: Path) -> None:
    tier = MemoryRemoteTier("mem")
    tier.blocks[b"far"] = b"from elsewhere"
    async with (
        running_daemon(sock_dir, remote_tiers=[tier], disk=RAM_ONLY) as d,
        await Client.connect(d.socket_path) as watcher,
        await Client.connect(d.socket_path, shared=False) as c,
    ):
        events = watcher.subscribe()
        first = asyncio.ensure_future(anext(events))
        await watcher.ping()
        reply = await c.lookup([b"far"], mode=LookupMode.PREFIX, wait=5.0)
        assert reply.prefix_hits == 1
        (stored,) = await first
        assert (stored.kind, stored.key, stored.tier) == (EventKind.STORED, b"far", EventTier.RAM)
        published = d.metrics.registry.get_sample_value(
            "kvtier_events_published_total", {"kind": "stored"}
        )
        assert published == 1
        assert d.metrics.registry.get_sample_value("kvtier_event_subscribers") == 1
        await events.aclose()


async def test_shutdown_ends_the_stream(sock_dir: Path) -> None:
    async with running_daemon(sock_dir, disk=RAM_ONLY) as d:
        watcher = await Client.connect(d.socket_path)
        events = watcher.subscribe()
        pending = asyncio.ensure_future(anext(events))
        await watcher.ping()
        d.service.begin_shutdown()
        async with asyncio.timeout(10):  # a stream that does not end fails here
            with contextlib.suppress(StopAsyncIteration):
                await pending  # the last batch, or the end
            async for batch in events:
                assert batch == [], batch  # nothing after the last
        await watcher.close()

"""The lookup process: its replica alone, its streams, and a real one beside a daemon."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import mmap
import os
import random
import signal
import socket
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from kvtier.client.aio import Client
from kvtier.client.options import ClientOptions
from kvtier.config import Config, load_config
from kvtier.core.events import EventLog
from kvtier.core.holdings import Holdings
from kvtier.core.writes import ReservationTable
from kvtier.daemon import Daemon
from kvtier.errors import ForbiddenError, UnknownOpcodeError
from kvtier.model import (
    DEFAULT_NAMESPACE,
    HIT,
    MISS,
    PENDING,
    EventKind,
    EventTier,
    FeedOp,
    Lookup,
    LookupMode,
    ReportKind,
    namespace_id,
    namespace_prefix,
)
from kvtier.replica.feed import FeedBounds, FeedWriter
from kvtier.replica.listener import LookupListener
from kvtier.replica.replica import Replica
from kvtier.replica.settings import Settings
from kvtier.server.ops import NamespaceAccess
from kvtier.server.sockets import Peer, PeerPolicy
from kvtier.supervisors.lookup_process import Timing
from kvtier.tiers.base import Tier
from kvtier.tiers.budget import Gone
from kvtier.tiers.memory import MemoryRemoteTier
from kvtier.tiers.ram import RamTier
from kvtier.wire import DEFAULT_SCOPE, CodecError, encode_lookup
from kvtier.wire.framing import Op
from kvtier.wire.replica import RING_HEADER, FeedRing, Report, decode_reports, encode_report
from tests.helpers import running_daemon, wait_on_timers

RAM_ONLY = {"enabled": False}
ON = {"lookup_process": True}
#: a lookup process that went is started again after 10 ms
SOON = Timing(restart_first=0.01)
#: a client that gives the lookup process 50 ms, and may dial it again at each lookup
QUICK = ClientOptions(lookups_timeout=0.05, lookups_redial=0.0)


def replica_of(held: list[bytes], pending: list[bytes] = (), **kw: bool) -> Replica:  # type: ignore[assignment]
    replica = Replica(remotes=kw.get("remotes", False))
    replica.apply([(FeedOp.HELD, k) for k in held] + [(FeedOp.PENDING, k) for k in pending])
    if kw.get("scanning"):
        replica.apply([(FeedOp.SCANNING, b"")])
    return replica


# -- the replica alone


def test_the_replica_answers_held_pending_and_missing_keys_as_the_daemon_orders_them() -> None:
    replica = replica_of([b"a", b"b", b"d", b"p"], [b"c", b"p"])
    reply = replica.answer(Lookup([b"a", b"b", b"c", b"d", b"e"], LookupMode.PREFIX))
    assert reply is not None
    assert list(reply.raw_states) == [HIT, HIT, PENDING, HIT, MISS]
    assert (reply.prefix_hits, reply.defer) == (2, True)  # c may lengthen it
    # Held wins over pending (a block being written again reads HIT).
    reply = replica.answer(Lookup([b"p", b"e"], LookupMode.KEYS))
    assert reply is not None and list(reply.raw_states) == [HIT, MISS]
    assert (reply.prefix_hits, reply.defer) == (1, False)
    window = replica.answer(Lookup([b"e", b"a", b"b"], LookupMode.SLIDING_WINDOW, window=2))
    assert window is not None and window.prefix_hits == 3
    replica.apply([(FeedOp.GONE, b"a"), (FeedOp.SETTLED, b"c")])
    reply = replica.answer(Lookup([b"a", b"c"], LookupMode.PREFIX))
    assert reply is not None and list(reply.raw_states) == [MISS, MISS]
    assert "held=3 pending=1" in repr(replica)
    replica.apply([(FeedOp.RESET, b""), (FeedOp.HELD, b"z")])
    assert (len(replica.held), len(replica.pending)) == (1, 0)


def test_a_lookup_of_held_keys_only_is_all_hit_in_every_mode() -> None:
    """Every key held (the answer asked most, taken in one pass): the same
    states, prefix and deferral the per-key answer gives."""
    keys = [b"k%d" % i for i in range(40)]
    replica = replica_of(keys, [keys[3]])  # held wins over pending
    for mode, window in (
        (LookupMode.PREFIX, 0),
        (LookupMode.KEYS, 0),
        (LookupMode.SLIDING_WINDOW, 8),
    ):
        reply = replica.answer(Lookup(keys, mode, window=window))
        assert reply is not None
        assert (reply.raw_states, reply.prefix_hits, reply.defer) == (bytes([HIT]) * 40, 40, False)
    empty = replica.answer(Lookup([], LookupMode.PREFIX))
    assert empty is not None and (empty.raw_states, empty.prefix_hits, empty.defer) == (
        b"",
        0,
        False,
    )
    one_short = replica.answer(Lookup([*keys, b"gone"], LookupMode.PREFIX))
    assert one_short is not None and list(one_short.raw_states) == [HIT] * 40 + [MISS]
    assert (one_short.prefix_hits, one_short.defer) == (40, False)


def test_the_replica_refers_what_only_the_daemon_can_answer() -> None:
    keys = [b"a", b"x"]
    # A key nothing holds here may be on a remote tier, or on a disk not indexed yet.
    assert replica_of([b"a"], remotes=True).answer(Lookup(keys, LookupMode.PREFIX)) is None
    assert replica_of([b"a"], scanning=True).answer(Lookup(keys, LookupMode.PREFIX)) is None
    held = replica_of([b"a", b"x"], remotes=True, scanning=True).answer(Lookup(keys))
    assert held is not None and held.prefix_hits == 2  # every key held: no doubt
    # A wait on a PENDING key, and the reader's bound on one, are the daemon's.
    pending = replica_of([b"a"], [b"x"])
    assert pending.answer(Lookup(keys, LookupMode.PREFIX, wait=1.0)) is None
    bounded = Lookup(keys, LookupMode.PREFIX, max_pending_wait=1.0, request_tag=b"r")
    assert pending.answer(bounded) is None
    nothing_pending = replica_of([b"a"])
    assert nothing_pending.answer(Lookup(keys, LookupMode.PREFIX, wait=1.0)) is not None
    scanned = replica_of([b"a"], scanning=True)
    scanned.apply([(FeedOp.SCANNED, b"")])
    assert scanned.answer(Lookup(keys, LookupMode.PREFIX)) is not None


def test_holdings_feed_every_change_of_the_local_tiers_indexes_in_its_step() -> None:
    """Whatever changes a tier's index (a store, an eviction, a delete, a
    loss) reaches the feed through the tier's budget: HELD when the first
    local tier takes a key, GONE when the last lets it go."""
    ram, disk = RamTier(100), RamTier(1000)
    events, table = EventLog(), ReservationTable()
    invalidated: list[bytes] = []
    holdings = Holdings(
        [(EventTier.RAM, ram), (EventTier.DISK, disk)], table, events, invalidated.extend
    )
    ram.put(b"a", b"x" * 10)
    written: list[tuple[FeedOp, bytes]] = []
    holdings.feed(written.extend, None)
    assert written == [(FeedOp.RESET, b""), (FeedOp.HELD, b"a")]
    sub = events.subscribe(100)
    written.clear()
    disk.put(b"a", b"x" * 10)  # held already: the feed says nothing more
    disk.put(b"b", b"y" * 10)
    _, evicted = ram.put(b"c", b"z" * 95)
    assert [k for k, _ in evicted] == [b"a"]  # the disk still holds it: no GONE
    assert written == [(FeedOp.HELD, b"b"), (FeedOp.HELD, b"c")]
    disk.budget.remove(b"b", Gone.LOST)  # found corrupt
    disk.remove(b"a")
    assert written[2:] == [(FeedOp.GONE, b"b"), (FeedOp.GONE, b"a")]
    kinds = [(e.kind, e.key, e.tier) for e in sub.take(100)]
    assert kinds == [
        (EventKind.STORED, b"a", EventTier.DISK),
        (EventKind.STORED, b"b", EventTier.DISK),
        (EventKind.STORED, b"c", EventTier.RAM),
        (EventKind.EVICTED, b"b", EventTier.NONE),
        (EventKind.DELETED, b"a", EventTier.NONE),
    ]
    assert invalidated.count(b"a") == 4 and invalidated.count(b"b") == 2
    holdings.stop_feed()
    ram.put(b"d", b"w")
    assert written[-1] == (FeedOp.GONE, b"a")


@pytest.mark.parametrize("disk", [True, False], ids=["defaults", "ram-only"])
@pytest.mark.parametrize("n", [1, 8])
async def test_a_reserved_batch_is_never_missing_at_any_point_of_the_feed(
    tmp_path: Path, n: int, disk: bool
) -> None:
    """Keys reserved, then stored (one PUT, or a batch of eight): replayed
    record by record, the feed shows each key PENDING, then HIT, and never
    MISS in between, whatever point of it the lookup process has read. On
    the defaults (a disk written through) and on RAM alone."""
    async with running_daemon(tmp_path, disk={"enabled": disk}) as daemon:
        written: list[tuple[FeedOp, bytes]] = []
        daemon.service.holdings.feed(written.extend, None)
        keys = [b"batch-%d" % i for i in range(n)]
        async with await Client.connect(daemon.socket_path) as c:
            await c.reserve(keys, [4096] * n, deadline=30.0)
            await c.put_many(keys, [bytes(4096)] * n)
        daemon.service.holdings.stop_feed()
    replica, seen = Replica(remotes=False), {k: [MISS] for k in keys}
    for record in written:
        replica.apply([record])
        reply = replica.answer(Lookup(keys))
        assert reply is not None
        for key, state in zip(keys, reply.raw_states, strict=True):
            if state != seen[key][-1]:
                seen[key].append(state)
    assert all(states == [MISS, PENDING, HIT] for states in seen.values()), seen


def test_the_feed_ring_hands_over_every_record_in_order_and_refuses_to_overtake() -> None:
    mem = memoryview(mmap.mmap(-1, RING_HEADER + 256))
    writer, reader = FeedRing(mem), FeedRing(mem)
    # Start near the counters' wrap, so that it is crossed too.
    struct.pack_into("=I4xI", mem, 0, 2**32 - 100, 2**32 - 100)
    rng = random.Random(3)
    sent: list[tuple[FeedOp, bytes]] = []
    got: list[tuple[FeedOp, bytes]] = []
    refused = 0
    for _ in range(5000):
        records = [
            (rng.choice(list(FeedOp)), os.urandom(rng.randrange(0, 60)))
            for _ in range(rng.randrange(1, 4 if rng.random() < 0.5 else 9))
        ]  # (one to eight records: a write wraps the ring between two of them)
        if writer.write(records):
            sent += records
        else:
            refused += 1  # all or nothing: the reader is a ring behind
        if rng.random() < 0.4:
            got += reader.read()
    got += reader.read()
    assert got == sent and refused > 0
    assert "written=" in repr(writer)
    with pytest.raises(ValueError, match="larger than the ring"):
        writer.write([(FeedOp.HELD, b"k" * 300)])
    with pytest.raises(ValueError, match="power of two"):
        FeedRing(memoryview(bytearray(RING_HEADER + 100)))


def test_the_ring_counts_the_readers_reads_even_of_nothing() -> None:
    mem = memoryview(mmap.mmap(-1, RING_HEADER + 256))
    writer, reader = FeedRing(mem), FeedRing(mem)
    struct.pack_into("=I", mem, 24, 2**32 - 2)  # (the count wraps, as the others do)
    assert writer.reads() == 2**32 - 2
    assert reader.read() == [] and reader.read() == []
    assert writer.reads() == 0
    writer.write([(FeedOp.HELD, b"k")])
    assert reader.read() == [(FeedOp.HELD, b"k")]
    assert writer.reads() == 1 and "reads=1" in repr(writer)


def test_the_report_stream_decodes_whole_reports_only() -> None:
    req = Lookup([b"a", b"b"], LookupMode.PREFIX, request_tag=b"t")
    meta = encode_lookup(req)
    stream = encode_report(ReportKind.READY) + encode_report(ReportKind.ANSWERED, meta, b"\x01\x00")
    buf = bytearray(stream[:-1])
    assert decode_reports(buf) == [Report(ReportKind.READY)]
    buf += stream[-1:]
    assert decode_reports(buf) == [Report(ReportKind.ANSWERED, req, b"\x01\x00", 1)]
    again = encode_report(ReportKind.ANSWERED, meta, b"\x01\x00", 5)
    assert decode_reports(bytearray(again))[0].times == 5
    with pytest.raises(CodecError, match="2 keys with 1 states"):
        decode_reports(bytearray(encode_report(ReportKind.ANSWERED, meta, b"\x01")))
    with pytest.raises(CodecError, match="unknown report kind"):
        decode_reports(bytearray(b"\x01\x00\x00\x00\x63"))
    # A named namespace's lookup: its keys decoded in its scope, as asked.
    prefix = namespace_prefix(namespace_id("tenant"))
    named = encode_lookup(req, prefix)
    (report,) = decode_reports(
        bytearray(encode_report(ReportKind.ANSWERED, named, b"\x01\x00", 1, prefix))
    )
    assert report.lookup is not None and report.lookup.keys == [prefix + b"a", prefix + b"b"]
    assert report.prefix == prefix  # (the daemon keeps the namespace's request tags apart)
    # The default namespace's key that starts with the namespace mark is escaped.
    marked = encode_lookup(Lookup([prefix + b"a"]))
    (report,) = decode_reports(bytearray(encode_report(ReportKind.ANSWERED, marked, b"\x01")))
    assert report.lookup is not None and report.lookup.keys != [prefix + b"a"]
    with pytest.raises(ForbiddenError):  # a report that names another scope than its keys'
        decode_reports(bytearray(encode_report(ReportKind.ANSWERED, meta, b"\x01\x00", 1, prefix)))


# -- a real lookup process beside a daemon


@asynccontextmanager
async def with_lookup_process(
    sock_dir: Path, remote_tiers: list[Tier] | None = None, **sections: Any
) -> AsyncIterator[Daemon]:
    server = {**ON, **sections.pop("server", {})}
    async with running_daemon(sock_dir, remote_tiers, server=server, **sections) as d:
        assert d.lookups is not None and d.lookups.feed is not None
        async with asyncio.timeout(60):
            await d.lookups.feed.listening.wait()
        yield d
    assert d.lookup_process is not None and d.lookup_process.returncode is not None
    assert not Path(f"{d.socket_path}.lookups").exists()  # it cleaned up as it stopped


def feed_of(d: Daemon) -> FeedWriter:
    assert d.lookups is not None and d.lookups.feed is not None
    return d.lookups.feed


async def answered(d: Daemon, n: int, referred: int = 0) -> None:
    """Until the daemon has heard of ``n`` lookups answered at the process
    (and ``referred`` referred): it reports within a few milliseconds."""
    feed = feed_of(d)
    await wait_on_timers(lambda: (feed.answered, feed.referred) >= (n, referred))


async def restarted(d: Daemon, first: FeedWriter) -> FeedWriter:
    """Until a lookup process started after ``first``'s listens; its feed."""
    await wait_on_timers(lambda: feed_of(d) is not first and feed_of(d).listening.is_set())
    return feed_of(d)


def default_users(d: Daemon, uids: list[int]) -> Config:
    """``d``'s configuration with only ``uids`` allowed the default namespace."""
    return with_namespaces(d, {"default": {"uids": uids}})


def with_namespaces(d: Daemon, namespaces: dict[str, Any]) -> Config:
    """``d``'s configuration with these ``[namespaces]``."""
    base: dict[str, Any] = d.config.model_dump(mode="json")
    sections = {k: v for k, v in base.items() if isinstance(v, dict)}
    return load_config(None, {**sections, "namespaces": namespaces})


async def test_the_process_answers_as_the_daemon_would_right_after_each_change(
    sock_dir: Path,
) -> None:
    rng = random.Random(7)
    keys = [f"k{i:03d}".encode() for i in range(40)]
    async with (
        with_lookup_process(sock_dir, ram={"capacity": "1MiB"}, disk=RAM_ONLY) as d,
        await Client.connect(d.socket_path) as c,
        await Client.connect(d.socket_path, lookup_process=False) as direct,
    ):
        assert c.lookups_process and not direct.lookups_process
        # Its answers come from memory: waiting for one keeps the CPU.
        assert " lookups <IdlePoll window=200us idle keeps-cpu polls=" in repr(c)
        assert " lookups" not in repr(direct)
        asked = 0
        for step in range(120):
            pick = rng.sample(keys, rng.randint(1, 6))
            action = rng.random()
            if action < 0.45:  # small blocks over the socket, large ones in place
                size = rng.choice([4096, 100_000])
                await c.put_many(pick, [os.urandom(size)] * len(pick))
            elif action < 0.6:
                await c.delete_many(pick)
            elif action < 0.75:
                await c.reserve(pick, [4096] * len(pick))  # PENDING until put or aborted
            elif action < 0.85:
                await c.abort(pick)
            probe = rng.sample(keys, 12)
            for mode in (LookupMode.PREFIX, LookupMode.KEYS):
                # At once, after the acknowledgement: each of the process's
                # answers must be the daemon's (peeks leave the order alone).
                there = await c.lookup(probe, mode=mode, peek=True)
                here = await direct.lookup(probe, mode=mode, peek=True)
                assert there == here, f"step {step}: {there} != {here}"
                asked += 1
        await answered(d, asked)  # (the process reports within a few ms)
        stats = (await c.stats())["server"]["lookup_process"]
        assert stats["state"] == "listening"
        assert (stats["answered"], stats["referred"]) == (asked, 0)  # RAM only: all answered
        assert d.service.counters.lookup_peeks.value == 2 * asked  # both sides counted


async def test_lookups_answered_at_the_process_keep_blocks_warm(sock_dir: Path) -> None:
    block = 200_000  # five fit in 1 MiB
    async with (
        with_lookup_process(
            sock_dir, ram={"capacity": "1MiB", "policy": "lru"}, disk=RAM_ONLY
        ) as d,
        await Client.connect(d.socket_path, shared=False) as c,
    ):
        first = [b"a", b"b", b"c", b"d", b"e"]
        await c.put_many(first, [os.urandom(block)] * 5)
        reply = await c.lookup([b"a"], mode=LookupMode.PREFIX)  # at the process
        assert reply.prefix_hits == 1
        await answered(d, 1)  # its touch reached the daemon's eviction order
        await c.put_many([b"f", b"g"], [os.urandom(block)] * 2)
        states = await c.lookup(first, mode=LookupMode.KEYS, peek=True)
        assert list(states.raw_states) == [HIT, MISS, MISS, HIT, HIT]
        await answered(d, 2)
        value = d.metrics.registry.get_sample_value
        assert value("kvtier_lookup_process_lookups_total", {"outcome": "answered"}) == 2
        assert value("kvtier_lookup_keys_total", {"state": "hit"}) == 1 + 3
        assert value("kvtier_lookup_keys_total", {"state": "miss"}) == 2


async def test_a_lookup_the_process_cannot_answer_is_answered_by_the_daemon(
    sock_dir: Path,
) -> None:
    tier = MemoryRemoteTier("mem")
    tier.blocks[b"far"] = b"from elsewhere"
    async with (
        with_lookup_process(sock_dir, remote_tiers=[tier], disk=RAM_ONLY) as d,
        await Client.connect(d.socket_path, shared=False) as c,
    ):
        await c.put(b"near", b"here")
        held = await c.lookup([b"near"], mode=LookupMode.PREFIX)
        assert held.prefix_hits == 1  # every key held: the process answers
        reply = await c.lookup([b"near", b"far"], mode=LookupMode.PREFIX, wait=5.0)
        assert reply.prefix_hits == 2  # the daemon probed the remote tier
        await answered(d, 1, referred=1)
        assert feed_of(d).stats()["referred"] == 1
        assert d.server.counters.lookup_process.total() == 2


async def test_a_process_that_stops_reading_its_feed_is_killed_and_started_again(
    sock_dir: Path,
) -> None:
    # (a stall period of 1 s: on a loaded machine an idle process can wait
    # a few hundred ms for a CPU, and a shorter one would kill it here)
    timing = dataclasses.replace(SOON, feed=FeedBounds(stall=1.0))
    async with (
        with_lookup_process(sock_dir, lookup_timing=timing, disk=RAM_ONLY) as d,
        await Client.connect(d.socket_path, QUICK, shared=False, timeout=60) as c,
    ):
        first, proc = feed_of(d), d.lookup_process
        assert proc is not None
        # Idle, it reads every FEED_POLL: more than a stall period passes,
        # and it stays.
        reads = first.reads
        await wait_on_timers(lambda: first.reads >= reads + 30)
        assert not first.ended and d.server.counters.lookup_restarts.value == 0
        await c.put(b"k", b"v")
        proc.send_signal(signal.SIGSTOP)  # alive, and reading nothing
        try:
            again = await restarted(d, first)
        finally:
            with contextlib.suppress(ProcessLookupError):  # (killed: gone)
                proc.send_signal(signal.SIGCONT)
        assert first.stalled and first.stats()["state"] == "stalled"
        assert await proc.wait() == -signal.SIGKILL
        assert d.lookup_process is not None and d.lookup_process.pid != proc.pid
        assert d.server.counters.lookup_restarts.value == 1
        # Its connection to the old one gone, the client asks the daemon,
        # then dials the new one.
        assert (await c.lookup([b"k"])).prefix_hits == 1
        assert (await c.lookup([b"k"])).prefix_hits == 1
        assert c.lookups_process
        await answered(d, 1)
        assert again.answered == 1


async def test_when_the_process_dies_the_daemon_answers_and_starts_it_again(sock_dir: Path) -> None:
    async with (
        with_lookup_process(sock_dir, lookup_timing=SOON, disk=RAM_ONLY) as d,
        await Client.connect(d.socket_path, shared=False, lookups_redial=0.0) as c,
    ):
        await c.put(b"k", b"v")
        assert (await c.lookup([b"k"])).prefix_hits == 1
        first, proc = feed_of(d), d.lookup_process
        assert proc is not None
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        await wait_on_timers(lambda: first.ended)  # its end closed
        assert (await c.lookup([b"k"])).prefix_hits == 1  # asked the daemon
        await c.put(b"j", b"w")  # while none runs: in the next one's snapshot
        again = await restarted(d, first)
        assert d.lookup_process is not None and d.lookup_process.pid != proc.pid
        stats = (await c.stats())["server"]["lookup_process"]
        assert (stats["state"], stats["restarts"]) == ("listening", 1)
        # The client that lost it dials it again, and it answers from the
        # snapshot it started with.
        assert (await c.lookup([b"j", b"k"], mode=LookupMode.PREFIX)).prefix_hits == 2
        assert c.lookups_process
        await answered(d, 1)
        assert (again.answered, again.referred) == (1, 0)
        async with await Client.connect(d.socket_path, shared=False) as later:
            assert later.lookups_process
    assert d.server.counters.lookup_restarts.value == 1


async def test_a_process_that_keeps_going_is_started_again_ever_later(
    sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    deep = _unbindable(sock_dir)  # each one exits at once: it cannot listen
    quick = Timing(restart_first=0.01, restart_most=0.04)
    with caplog.at_level(logging.WARNING, logger="kvtier.daemon"):
        async with running_daemon(
            deep, server={"lookup_process": True}, lookup_timing=quick, disk=RAM_ONLY
        ) as d:
            await wait_on_timers(lambda: d.server.counters.lookup_restarts.value >= 4)
            async with await Client.connect(d.socket_path) as c:
                await c.put(b"k", b"v")
                assert (await c.lookup([b"k"])).prefix_hits == 1  # the daemon answers
    said = [r.getMessage() for r in caplog.records if "lookup process went" in r.getMessage()]
    delays = [float(m.rpartition(" in ")[2].rstrip("s")) for m in said]
    assert delays[:4] == [0.01, 0.02, 0.04, 0.04]  # doubling, up to the most


async def test_a_reload_that_changes_who_may_use_a_namespace_restarts_it_at_once(
    sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sources: list[Config] = []
    me = os.getuid()
    async with with_lookup_process(
        sock_dir,
        disk=RAM_ONLY,
        reread=lambda: sources[-1],
        namespaces={"default": {"uids": [me, me + 1]}},
    ) as d:
        first = feed_of(d)
        sources.append(default_users(d, [me]))
        with caplog.at_level(logging.WARNING, logger="kvtier.daemon"):
            d.reload()
            await restarted(d, first)
        assert not any("lookup process went" in r.getMessage() for r in caplog.records)
        assert d.server.counters.lookup_restarts.value == 1
        assert d.lookup_process is not None  # it was told the new users
        argv = Path(f"/proc/{d.lookup_process.pid}/cmdline").read_bytes().split(b"\0")
        assert Settings.from_json(argv[-2].decode()).access["uids"] == {"": [me]}
        async with await Client.connect(d.socket_path) as c:
            assert c.lookups_process
            await c.put(b"k", b"v")
            assert (await c.lookup([b"k"])).prefix_hits == 1
        # The same users again: it stays.
        sources.append(default_users(d, [me]))
        d.reload()
        assert feed_of(d) is not first and not feed_of(d).ended
        # A named namespace's users: started again, told them.
        second = feed_of(d)
        sources.append(with_namespaces(d, {"default": {"uids": [me]}, "tenant": {"uids": [me]}}))
        d.reload()
        await restarted(d, second)
        assert d.server.counters.lookup_restarts.value == 2
        assert d.lookup_process is not None
        argv = Path(f"/proc/{d.lookup_process.pid}/cmdline").read_bytes().split(b"\0")
        told = Settings.from_json(argv[-2].decode()).access
        assert told["uids"] == {"": [me], namespace_id("tenant").hex(): [me]}
        async with await Client.connect(d.socket_path, namespace="tenant") as t:
            assert t.lookups_process


async def test_a_named_namespace_looks_up_at_the_process_within_its_own_keys(
    sock_dir: Path,
) -> None:
    me = os.getuid()
    async with (
        with_lookup_process(
            sock_dir, disk=RAM_ONLY, namespaces={"tenant": {}, "closed": {"uids": [me + 1]}}
        ) as d,
        await Client.connect(d.socket_path, namespace="tenant", shared=False) as tenant,
        await Client.connect(d.socket_path, shared=False) as default,
    ):
        assert tenant.lookups_process and default.lookups_process
        await tenant.put(b"k", b"v")
        await default.put(b"d", b"v")
        assert (await tenant.lookup([b"k", b"d"])).raw_states == bytes([HIT, MISS])
        assert (await default.lookup([b"k", b"d"])).raw_states == bytes([MISS, HIT])
        await answered(d, 2)  # both at the process
        # Its reports count in the right namespace, as the daemon's own lookups do.
        for ns in (namespace_id("tenant"), DEFAULT_NAMESPACE):
            counts = d.service.answers.namespace_counts[ns]
            assert (counts.hits, counts.misses) == (1, 1)
        path = Path(f"{d.socket_path}.lookups")
        async with await Client.connect(
            path, namespace="tenant", shared=False, lookup_process=False
        ) as raw:
            with pytest.raises(ForbiddenError, match="outside this connection's namespace"):
                await raw.request(Op.LOOKUP, encode_lookup(Lookup([b"k"])))
            assert (await raw.lookup([b"k"])).prefix_hits == 1  # (with its prefix)
        with pytest.raises(ForbiddenError, match="may not use namespace 'closed'"):
            await Client.connect(path, namespace="closed", lookup_process=False)


async def test_the_lookup_socket_answers_lookups_only(sock_dir: Path) -> None:
    async with (
        with_lookup_process(sock_dir, disk=RAM_ONLY) as d,
        await Client.connect(d.socket_path, namespace="tenant", shared=False) as tenant,
    ):
        path = Path(f"{d.socket_path}.lookups")
        await tenant.put(b"k", b"v")
        assert (await tenant.lookup([b"k"])).prefix_hits == 1
        raw = await Client.connect(path, shared=False, lookup_process=False)
        with pytest.raises(UnknownOpcodeError, match=r"this socket answers HELLO, PING, LOOKUP$"):
            await raw.get(b"k")
        assert (await raw.lookup([b"k"])).prefix_hits == 0  # the default namespace's k
        # A broken frame closes its own connection, and no other.
        reader, writer = await asyncio.open_unix_connection(str(path))
        writer.write(b"\x00" * 64)
        await writer.drain()
        assert await reader.read() != b""  # an error frame, then EOF
        writer.close()
        assert (await raw.request(Op.PING, b"x")).meta == b"x"
        await raw.close()


async def test_a_full_ring_keeps_the_rest_and_the_process_refers_until_it_is_in() -> None:
    """Both ends in one loop, over a ring of 256 bytes: what does not fit
    waits in the daemon, and meanwhile no answer can miss it."""
    mem = memoryview(mmap.mmap(-1, RING_HEADER + 256))
    ours, theirs = socket.socketpair()
    replica = Replica(remotes=False)
    reports: list[Report] = []
    writer = FeedWriter(ours, FeedRing(mem), lambda _k: True, reports.append)
    listener = LookupListener(
        theirs,
        FeedRing(mem),
        apply=replica.apply,
        answer=replica.answer,
        hello=lambda _h: pytest.fail("no HELLO here"),
        peers=PeerPolicy(None),
        access=NamespaceAccess(),
        max_frame=1 << 20,
        max_batch=1024,
    )
    keys = [f"key-{i:03d}".encode() for i in range(40)]  # 40 x 10 bytes: more than a ring
    writer.write([(FeedOp.HELD, k) for k in keys])
    assert writer.backlogged > 0 and "behind" in repr(FeedRing(mem))
    meta = encode_lookup(Lookup(keys, LookupMode.PREFIX))
    assert listener.lookup(meta) is None  # referred: the ring lacks some changes
    assert listener.behind and len(replica.held) < len(keys)

    # The daemon writes the rest as the process reads (every lookup, every poll).
    def caught_up() -> bool:
        listener.catch_up()
        return not listener.behind

    await wait_on_timers(caught_up)
    assert writer.backlogged == 0 and writer.written == len(keys)
    reply = listener.lookup(meta)
    assert reply is not None and reply.prefix_hits == len(keys)
    writer.end()
    theirs.close()


def _unbindable(sock_dir: Path) -> Path:
    """A directory for a daemon's socket of 100 bytes: the daemon binds it
    and its ".shm" twin, but its ".lookups" twin is past the 107 bytes a Unix
    socket's path may have: the lookup process fails to bind, and says so by
    going."""
    room = 100 - len(str(sock_dir)) - len("/d.sock") - 1
    deep = sock_dir / ("d" * room)
    deep.mkdir(mode=0o700)
    return deep


async def test_a_lookup_process_that_cannot_listen_leaves_the_daemon_answering(
    sock_dir: Path,
) -> None:
    deep = _unbindable(sock_dir)
    never = Timing(restart_first=3600.0, restart_most=3600.0)  # (not in this test)
    async with running_daemon(
        deep, server={"lookup_process": True}, lookup_timing=never, disk=RAM_ONLY
    ) as d:
        feed = feed_of(d)
        async with asyncio.timeout(60):
            await feed.decided.wait()  # (the daemon waited for it before serving)
        assert feed.ended and not feed.listening.is_set()
        async with await Client.connect(d.socket_path) as c:
            assert not c.lookups_process
            await c.put(b"k", b"v")
            assert (await c.lookup([b"k"])).prefix_hits == 1
            assert (await c.stats())["server"]["lookup_process"]["state"] == "ended"
    assert d.lookup_process is not None
    async with asyncio.timeout(30):
        assert await d.lookup_process.wait() == 1


async def test_a_store_answered_before_it_is_filed_is_in_the_feed_before_its_answer(
    sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An in-place store is answered first and filed right after: the
    lookup process hears of it before the answer goes, not after."""
    async with with_lookup_process(sock_dir, disk=RAM_ONLY) as d:
        feed = feed_of(d)
        seen: list[object] = []
        write, put = feed.write, d.service.stores.put

        def logged_write(records: list[tuple[FeedOp, bytes]]) -> None:
            seen.extend(records)
            write(records)

        def logged_put(*args: Any, **kw: Any) -> Any:
            seen.append("filed")
            return put(*args, **kw)

        monkeypatch.setattr(feed, "write", logged_write)
        monkeypatch.setattr(d.service.stores, "put", logged_put)
        async with await Client.connect(d.socket_path) as c:
            assert c.shared
            await c.put(b"big", os.urandom(1 << 20))  # written in place, then COMMIT
        assert seen.index((FeedOp.HELD, b"big")) < seen.index("filed")


async def test_a_lookup_socket_that_does_not_answer_holds_no_lookup_up(sock_dir: Path) -> None:
    accepted: list[socket.socket] = []
    async with running_daemon(sock_dir, server={"lookup_process": False}, disk=RAM_ONLY) as d:
        # Something listens where the lookup process would, and never answers.
        mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        mute.bind(f"{d.socket_path}.lookups")
        mute.listen()
        mute.setblocking(False)
        loop = asyncio.get_running_loop()
        loop.add_reader(mute.fileno(), lambda: accepted.append(mute.accept()[0]))
        try:
            # (Each dial would wait for the client's own timeout without its own.)
            async with (
                asyncio.timeout(30),
                await Client.connect(d.socket_path, QUICK, timeout=60) as c,
            ):
                assert not c.lookups_process  # its HELLO went unanswered
                await c.put(b"k", b"v")
                for _ in range(3):  # each may dial again, and gives up in time
                    assert (await c.lookup([b"k"])).prefix_hits == 1
                assert not c.lookups_process
        finally:
            loop.remove_reader(mute.fileno())
            mute.close()
            for conn in accepted:
                conn.close()
    assert len(accepted) >= 1


async def test_a_new_process_takes_a_snapshot_far_larger_than_its_ring(sock_dir: Path) -> None:
    me = os.getuid()
    sources: list[Config] = []
    keys = [b"k%05d" % i for i in range(3000)]
    async with (
        with_lookup_process(
            sock_dir,
            disk=RAM_ONLY,
            reread=lambda: sources[-1],
            namespaces={"default": {"uids": [me, me + 1]}},
        ) as d,
        await Client.connect(d.socket_path, shared=False) as c,
    ):
        for lo in range(0, len(keys), 500):  # (the first ring, of 4 MiB, takes them as they come)
            await c.put_many(keys[lo : lo + 500], [b"v"] * 500)
        first = feed_of(d)
        assert not first.ended
        # The next one's ring holds about 100 changes: its snapshot of 3000
        # keys waits for room, past the backlog's bound for later changes.
        assert d.lookups is not None
        small = FeedBounds(ring_bytes=4096, backlog=100)
        d.lookups.timing = dataclasses.replace(d.lookups.timing, feed=small)
        sources.append(default_users(d, [me]))
        d.reload()
        again = await restarted(d, first)
        await wait_on_timers(lambda: again.backlogged == 0 or again.ended)
        assert not again.ended and again.written >= len(keys)
        async with await Client.connect(d.socket_path, shared=False) as later:
            assert later.lookups_process
            assert (await later.lookup(keys, mode=LookupMode.PREFIX)).prefix_hits == len(keys)
        await answered(d, 1)  # at the process, from its snapshot
        assert again.referred == 0


async def test_a_stuck_process_holds_no_lookup_up(sock_dir: Path) -> None:
    async with (
        with_lookup_process(sock_dir, disk=RAM_ONLY) as d,
        await Client.connect(d.socket_path, QUICK, shared=False, timeout=60) as c,
    ):
        await c.put(b"k", b"v")
        assert (await c.lookup([b"k"])).prefix_hits == 1
        await answered(d, 1)
        proc = d.lookup_process
        assert proc is not None
        proc.send_signal(signal.SIGSTOP)
        try:
            # Stuck, not gone: the daemon does not start another. Each lookup
            # gives it lookups_timeout (then a dial does) and asks the daemon.
            async with asyncio.timeout(30):
                for _ in range(3):
                    assert (await c.lookup([b"k"])).prefix_hits == 1
                    assert not c.lookups_process
        finally:
            proc.send_signal(signal.SIGCONT)
        assert (await c.lookup([b"k"])).prefix_hits == 1  # dialled again: it answers
        assert c.lookups_process
        await answered(d, 2)
        assert d.server.counters.lookup_restarts.value == 0


def test_the_process_is_told_who_may_use_which_namespace_as_the_daemon_checks_it() -> None:
    me = os.getuid()
    tenant = namespace_id("tenant")
    access = NamespaceAccess(
        uids={DEFAULT_NAMESPACE: frozenset({me}), tenant: frozenset({me + 1})},
        configured=frozenset({tenant}),
        strict=True,
    )
    told = NamespaceAccess.from_json(json.loads(json.dumps(access.to_json())))
    assert told == access  # (a reload that changes any of it starts a new process)
    assert told != NamespaceAccess(uids=access.uids, configured=access.configured)
    mine, theirs = Peer(1, me, 0), Peer(1, me + 1, 0)
    assert told.scope_for("", mine) == (DEFAULT_NAMESPACE, DEFAULT_SCOPE)
    ns, scope = told.scope_for("tenant", theirs)
    assert ns == tenant and scope.prefix == namespace_prefix(tenant)
    with pytest.raises(ForbiddenError, match="may not use namespace 'tenant'"):
        told.scope_for("tenant", mine)
    with pytest.raises(ForbiddenError, match="not configured here"):
        told.scope_for("elsewhere", mine)


async def test_release_answers_whether_the_tag_had_state_whoever_answered_its_lookups(
    sock_dir: Path,
) -> None:
    """RELEASE answers 1 for a tag whose lookup the lookup process answered
    just before (its report reached the daemon before that answer), 0 for
    a tag never seen; either way the tag leaves no state behind."""
    keys = [b"held-%d" % i for i in range(4)]
    async with (
        with_lookup_process(sock_dir, disk=RAM_ONLY) as d,
        await Client.connect(d.socket_path) as c,
    ):
        await c.put_many(keys, [b"v"] * 4)
        released = []
        for i in range(40):
            tag = b"request-%d" % i
            reply = await c.lookup(
                keys, mode=LookupMode.PREFIX, max_pending_wait=5.0, request_tag=tag
            )
            assert reply.prefix_hits == 4
            released.append(await c.release(tag))
        assert released == [True] * 40
        assert await c.release(b"never-seen") is False
        await answered(d, 40)
        assert feed_of(d).referred == 0  # all 40 at the process
        assert d.service.map_sizes().request_states == 0

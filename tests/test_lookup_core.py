"""The two invariants over the socket, against a gated in-memory remote tier.

Every concurrency step is driven by events on the fake tier and by the
daemon's own state; nothing waits by sleeping.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvtier import Client, LookupMode, PutStatus, ReserveStatus, State
from kvtier.daemon import Daemon
from kvtier.errors import BadArgumentError, ConnectionClosedError
from kvtier.tiers.memory import MemoryRemoteTier
from tests.helpers import running_daemon, wait_until

K = b"k" * 32
OTHER = b"o" * 32
VALUE = b"v" * 4096
H, M, P, R = State.HIT, State.MISS, State.PENDING, State.RETRY


@dataclass
class Core:
    daemon: Daemon
    tier: MemoryRemoteTier

    @property
    def path(self) -> Path:
        return self.daemon.socket_path

    def counter(self, name: str, **labels: str) -> float:
        value = self.daemon.metrics.registry.get_sample_value(name, labels or None)
        return value or 0.0

    async def client(self) -> Client:
        return await Client.connect(self.path)

    async def assert_idle(self, client: Client) -> None:
        maps = (await client.stats())["maps"]
        assert maps["probes_inflight"] == 0
        assert maps["reservations"] == 0
        assert maps["request_states"] == 0


@pytest.fixture
async def core(sock_dir: Path, request: pytest.FixtureRequest) -> AsyncIterator[Core]:
    marker = request.node.get_closest_marker("lookup")
    lookup: dict[str, Any] = dict(marker.kwargs) if marker else {}
    tier = MemoryRemoteTier("mem")
    async with running_daemon(sock_dir, remote_tiers=[tier], lookup=lookup) as daemon:
        yield Core(daemon, tier)


async def until_waiting(core: Core, n: int) -> None:
    """Until ``n`` requests are waiting in the daemon (each STATS is one round trip)."""
    async with await core.client() as probe:
        for _ in range(1000):
            if (await probe.stats())["server"]["requests_waiting"] == n:
                return
    raise AssertionError(f"never saw {n} waiting request(s)")


# ---------------------------------------------------------------- shared probes


async def test_64_concurrent_lookups_make_one_backend_call(core: Core) -> None:
    core.tier.blocks[K] = VALUE
    gate = core.tier.lookup_gate = asyncio.Event()
    clients = [await core.client() for _ in range(8)]
    lookups = [asyncio.create_task(c.lookup([K], wait=30.0)) for c in clients for _ in range(8)]
    await core.tier.lookup_started.wait()
    await wait_until(
        lambda: core.counter("kvtier_probes_total", tier="mem", outcome="joined") == 63
    )
    gate.set()
    replies = await asyncio.gather(*lookups)
    assert len(core.tier.lookup_calls) == 1
    assert len(core.tier.load_calls) == 1  # one promotion for 64 readers
    assert {tuple(r.states) for r in replies} == {(H,)}
    assert core.counter("kvtier_probes_total", tier="mem", outcome="started") == 1
    await core.assert_idle(clients[0])
    for c in clients:
        await c.close()


async def test_non_blocking_lookups_answer_retry_while_probing(core: Core) -> None:
    core.tier.blocks[K] = VALUE
    gate = core.tier.lookup_gate = asyncio.Event()
    async with await core.client() as c:
        replies = await asyncio.gather(*(c.lookup([K]) for _ in range(64)))
        assert {tuple(r.states) for r in replies} == {(R,)}
        assert all(r.defer for r in replies)
        gate.set()
        final = await c.lookup([K], wait=30.0)
        assert final.states == [H]
        assert len(core.tier.lookup_calls) == 1


async def test_a_departed_caller_never_cancels_the_probe(core: Core) -> None:
    gate = core.tier.lookup_gate = asyncio.Event()
    a = await core.client()
    a_lookup = asyncio.create_task(a.lookup([K], wait=30.0))
    await core.tier.lookup_started.wait()
    a_lookup.cancel()  # A's call is cancelled ...
    with pytest.raises(asyncio.CancelledError):
        await a_lookup
    await a.close()  # ... and A disconnects
    async with await core.client() as b:
        b_lookup = asyncio.create_task(b.lookup([K], wait=30.0))
        await wait_until(
            lambda: core.counter("kvtier_probes_total", tier="mem", outcome="joined") >= 1
        )
        gate.set()
        assert (await b_lookup).states == [M]
        assert len(core.tier.lookup_calls) == 1
        await core.assert_idle(b)


@pytest.mark.lookup(probe_batch_window=3600.0, probe_max_batch=2)
async def test_a_probe_superseded_before_its_batch_left_still_ends_its_waiters(
    core: Core,
) -> None:
    """A probe queued for the next batch whose key is stored here meanwhile
    (which supersedes the probe) still goes out with its batch: a lookup
    waiting on it answers when it ends, not when its wait passes."""
    async with await core.client() as c, await core.client() as w:
        assert (await c.lookup([K])).states == [R]  # K's probe, queued
        waiting = asyncio.create_task(w.lookup([K], wait=3600.0))
        await until_waiting(core, 1)  # (joined K's probe)
        assert await c.put(K, VALUE) == PutStatus.STORED  # K changed here
        assert (await c.lookup([OTHER])).states == [R]  # the batch is full: it leaves
        async with asyncio.timeout(60):  # (a guard: it ends in milliseconds)
            assert (await waiting).states == [H]
        assert core.tier.lookup_calls == [[K, OTHER]]
        assert core.counter("kvtier_probe_superseded_total", tier="mem") == 1
        await core.assert_idle(c)


async def test_verdict_outlives_its_callers_until_the_truth_changes(core: Core) -> None:
    gate = core.tier.lookup_gate = asyncio.Event()
    async with await core.client() as c:
        assert (await c.lookup([K])).states == [R]  # nobody waits on this probe
        await core.tier.lookup_started.wait()
        gate.set()
        await core.daemon.settle()  # the probe's task ends by itself
        assert (await c.stats())["maps"]["probes_inflight"] == 0
        assert (await c.lookup([K])).states == [M]  # from the kept verdict
        assert len(core.tier.lookup_calls) == 1
        assert core.counter("kvtier_probes_total", tier="mem", outcome="cached") == 1

        assert await c.put(K, VALUE) == PutStatus.STORED  # a store changes the truth
        assert (await c.lookup([K])).states == [H]
        assert await c.delete(K)  # and so does a delete
        assert (await c.lookup([K], wait=30.0)).states == [M]
        assert len(core.tier.lookup_calls) == 2  # re-probed, not a stale verdict


async def test_delete_drops_a_present_verdict(core: Core) -> None:
    core.tier.blocks[K] = VALUE
    async with await core.client() as c:
        assert (await c.lookup([K], wait=30.0)).states == [H]  # probed, promoted
        assert await c.delete(K)  # gone from RAM and from the remote tier
        assert (await c.lookup([K], wait=30.0)).states == [M]
        assert await c.get(K) is None
        assert len(core.tier.load_calls) == 1  # no promotion from a stale verdict


@pytest.mark.lookup(probe_timeout=0.2, error_ttl=0.0)
@pytest.mark.parametrize("fault", ["raise", "hang", "short", "raise_midway"])
async def test_every_key_of_a_failed_probe_resolves(core: Core, fault: Any) -> None:
    core.tier.lookup_fault = fault
    keys = [bytes([i]) * 8 for i in range(3)]
    async with await core.client() as c:
        reply = await c.lookup(keys, wait=30.0)
        assert reply.states == [M, M, M]
        kind = {"hang": "timeout", "short": "bad_result"}.get(fault, "error")
        assert core.counter("kvtier_probe_failures_total", tier="mem", kind=kind) == 3
        assert core.counter("kvtier_probe_verdicts_total", tier="mem", verdict="error") == 3
        await core.assert_idle(c)
        # Errors are not kept like verdicts: once the backend heals, it is asked again.
        core.tier.lookup_fault = None
        core.tier.blocks[keys[0]] = VALUE
        assert (await c.lookup(keys, wait=30.0)).states == [H, M, M]
        assert len(core.tier.lookup_calls) == 2


async def test_stale_probe_result_arriving_last_is_ignored(core: Core) -> None:
    core.tier.blocks[K] = VALUE
    first_gate = core.tier.lookup_gate = asyncio.Event()
    async with await core.client() as c:
        assert (await c.lookup([K])).states == [R]  # probe 1 sees K present ...
        await core.tier.lookup_started.wait()
        assert await c.delete(K)  # ... K is deleted: probe 1 is superseded
        second_gate = core.tier.lookup_gate = asyncio.Event()
        core.tier.lookup_started.clear()
        assert (await c.lookup([K])).states == [R]  # probe 2 sees K absent
        await core.tier.lookup_started.wait()
        second_gate.set()
        await wait_until(
            lambda: core.counter("kvtier_probe_verdicts_total", tier="mem", verdict="absent") == 1
        )
        first_gate.set()  # the stale "present" arrives last
        await wait_until(lambda: core.counter("kvtier_probe_superseded_total", tier="mem") == 1)
        assert (await c.lookup([K])).states == [M]
        assert core.tier.load_calls == []  # no promotion from the stale answer
        assert len(core.tier.lookup_calls) == 2


@pytest.mark.lookup(probe_timeout=0.2, error_ttl=0.0)
async def test_a_backend_that_ignores_cancellation_still_times_out(core: Core) -> None:
    core.tier.blocks[K] = VALUE
    core.tier.lookup_fault = "ignore_cancel"
    gate = core.tier.lookup_gate = asyncio.Event()
    async with await core.client() as c:
        # Answered MISS at probe_timeout, not RETRY at the end of the caller's wait.
        assert (await c.lookup([K], wait=30.0)).states == [M]
        assert core.counter("kvtier_probe_failures_total", tier="mem", kind="timeout") == 1
        assert core.tier.cancels_ignored >= 1
        assert (await c.stats())["maps"]["probes_inflight"] == 0
        gate.set()  # the backend answers at last: "present", too late
        await core.daemon.settle()
        assert core.counter("kvtier_probe_late_total", tier="mem") == 1
        assert core.counter("kvtier_probe_verdicts_total", tier="mem", verdict="present") == 0
        assert core.tier.load_calls == []  # the late answer started nothing


@pytest.mark.parametrize("fault", ["endless", "junk"])
async def test_answers_are_read_bounded_and_must_be_booleans(core: Core, fault: Any) -> None:
    core.tier.blocks[K] = VALUE  # "junk" answers "no" (truthy) for it
    core.tier.lookup_fault = fault
    async with await core.client() as c:
        assert (await c.lookup([K, b"absent"], wait=30.0)).states == [M, M]
    assert core.counter("kvtier_probe_failures_total", tier="mem", kind="bad_result") == 2
    assert core.tier.load_calls == []  # truthy junk is not a hit


async def test_keys_of_one_tick_share_one_batch(core: Core) -> None:
    keys = [bytes([i]) * 8 for i in range(100)]
    async with await core.client() as c:
        replies = await asyncio.gather(c.lookup(keys[:50]), c.lookup(keys[50:]))
        assert all(set(r.states) == {R} for r in replies)
        await c.lookup(keys, wait=30.0)
    assert [len(call) for call in core.tier.lookup_calls] == [100]


@pytest.mark.lookup(probe_max_batch=10)
async def test_batches_split_at_the_maximum(core: Core) -> None:
    keys = [bytes([i]) * 8 for i in range(25)]
    async with await core.client() as c:
        assert set((await c.lookup(keys, wait=30.0)).states) == {M}
    assert sorted(len(call) for call in core.tier.lookup_calls) == [5, 10, 10]


async def test_failed_load_forces_miss_without_a_new_probe(core: Core) -> None:
    core.tier.blocks[K] = VALUE
    core.tier.load_fault = True
    async with await core.client() as c:
        assert (await c.lookup([K], wait=30.0)).states == [M]  # probe said yes, load failed
        assert (await c.lookup([K])).states == [M]
        assert await c.get(K) is None
        assert len(core.tier.lookup_calls) == 1
        assert len(core.tier.load_calls) == 1
        assert core.counter("kvtier_promotions_total", tier="mem", outcome="failed") == 1
        await core.assert_idle(c)


async def test_concurrent_gets_share_one_load(core: Core) -> None:
    core.tier.blocks[K] = VALUE
    gate = core.tier.load_gate = asyncio.Event()
    async with await core.client() as c:
        gets = [asyncio.create_task(c.get(K)) for _ in range(32)]
        await core.tier.load_started.wait()
        assert (await c.lookup([K])).states == [P]  # the promotion reads PENDING
        gate.set()
        values = await asyncio.gather(*gets)
        assert all(v == VALUE for v in values)
        assert len(core.tier.load_calls) == 1
        await core.assert_idle(c)


# ---------------------------------------------------------------- reservations


@pytest.mark.lookup(pending_deadline=0.2)
async def test_silent_writer_is_expired_at_its_deadline(core: Core) -> None:
    async with await core.client() as writer, await core.client() as reader:
        statuses = await writer.reserve([K], [1 << 20])
        assert statuses == [ReserveStatus.GRANTED]
        assert (await reader.stats())["tiers"]["ram"]["reserved_bytes"] == 1 << 20
        assert (await reader.lookup([K])).states == [P]
        reply = await reader.lookup([K], mode=LookupMode.PREFIX, wait=30.0)
        assert (reply.states, reply.prefix_hits, reply.defer) == ([M], 0, False)
        assert core.counter("kvtier_pending_deadline_expired_total") == 1
        assert core.counter("kvtier_reservations_total", event="expired") == 1
        assert (await reader.stats())["tiers"]["ram"]["reserved_bytes"] == 0
        await core.assert_idle(reader)


async def test_writer_disconnect_releases_its_reservations(core: Core) -> None:
    writer = await core.client()
    async with await core.client() as reader:
        assert await writer.reserve([K, b"k2"]) == [ReserveStatus.GRANTED] * 2
        waiting = asyncio.create_task(reader.lookup([K, b"k2"], wait=30.0))
        await until_waiting(core, 1)
        await writer.close()
        assert (await waiting).states == [M, M]
        assert core.counter("kvtier_reservations_total", event="released") == 2
        await core.assert_idle(reader)


async def test_reservation_is_completed_by_put_and_never_stolen(core: Core) -> None:
    async with await core.client() as writer, await core.client() as other:
        await other.put(b"present", VALUE)
        statuses = await writer.reserve([K, b"present"])
        assert statuses == [ReserveStatus.GRANTED, ReserveStatus.PRESENT]
        assert await other.reserve([K]) == [ReserveStatus.PENDING]  # not stolen
        assert await other.abort([K]) == [False]  # nor aborted by someone else
        waiting = asyncio.create_task(other.lookup([K], wait=30.0))
        await until_waiting(core, 1)
        await writer.put(K, VALUE)
        assert (await waiting).states == [H]
        assert core.counter("kvtier_reservations_total", event="completed") == 1
        assert await writer.reserve([b"k3"]) == [ReserveStatus.GRANTED]
        assert await writer.abort([b"k3"]) == [True]
        assert (await other.lookup([b"k3"], wait=30.0)).states == [M]
        await core.assert_idle(other)


# ---------------------------------------------------------------- reader-side bound


async def test_expired_pending_key_truncates_the_prefix(core: Core) -> None:
    async with await core.client() as writer, await core.client() as reader:
        await writer.put(b"a", VALUE)
        await writer.put(b"c", VALUE)
        await writer.reserve([b"b"])
        chain = [b"a", b"b", b"c"]
        first = await reader.lookup(
            chain, mode=LookupMode.PREFIX, request_tag=b"req-1", max_pending_wait=0.1
        )
        assert (first.states, first.prefix_hits, first.defer) == ([H, P, H], 1, True)
        # Held by the server until the reader's bound passes, then MISS for this request.
        later = await reader.lookup(
            chain, mode=LookupMode.PREFIX, request_tag=b"req-1", max_pending_wait=0.1, wait=30.0
        )
        assert (later.states, later.prefix_hits, later.defer) == ([H, M, H], 1, False)
        assert core.counter("kvtier_lookup_pending_expired_total") == 1
        # Another request is not affected, and the key is still pending at the source.
        other = await reader.lookup(chain, request_tag=b"req-2", max_pending_wait=5.0)
        assert other.states == [H, P, H]
        assert await reader.release(b"req-1") and await reader.release(b"req-2")
        assert not await reader.release(b"req-1")
        await writer.abort([b"b"])
        await core.assert_idle(reader)


async def test_zero_disables_the_bound_and_retry_never_expires(core: Core) -> None:
    gate = core.tier.lookup_gate = asyncio.Event()
    async with await core.client() as writer, await core.client() as reader:
        await writer.reserve([b"p"])
        reply = await reader.lookup([b"p"], request_tag=b"r", max_pending_wait=0.0, wait=0.2)
        assert reply.states == [P]  # no bound: still pending after the wait
        reply = await reader.lookup([b"u"], request_tag=b"r", max_pending_wait=0.05, wait=0.2)
        assert reply.states == [R]  # a probe in flight is not expired by the bound
        assert core.counter("kvtier_lookup_pending_expired_total") == 0
        gate.set()
        await writer.abort([b"p"])
        await reader.release(b"r")


@pytest.mark.parametrize("bad", [math.nan, -1.0, math.inf])
async def test_bad_bounds_are_rejected(core: Core, bad: float) -> None:
    async with await core.client() as c:
        with pytest.raises(BadArgumentError, match="max_pending_wait"):
            await c.lookup([K], request_tag=b"r", max_pending_wait=bad)
        with pytest.raises(BadArgumentError, match="wait"):
            await c.lookup([K], wait=bad)
        with pytest.raises(BadArgumentError, match="request tag"):
            await c.lookup([K], max_pending_wait=1.0)
        assert await c.ping(b"ok") == b"ok"


async def test_sliding_window_mode(core: Core) -> None:
    async with await core.client() as c:
        for key in (b"b", b"c", b"e", b"f", b"g"):
            await c.put(key, VALUE)
        chain = [b"a", b"b", b"c", b"d", b"e", b"f", b"g", b"h"]
        reply = await c.lookup(chain, mode=LookupMode.SLIDING_WINDOW, window=2)
        # a, d and h are probed (the answer cannot wait): the window of f, g holds
        assert reply.states == [R, H, H, R, H, H, H, R]
        assert reply.prefix_hits == 7 and reply.defer
        reply = await c.lookup(chain, mode=LookupMode.SLIDING_WINDOW, window=2, wait=30.0)
        assert reply.prefix_hits == 7 and not reply.defer
        with pytest.raises(BadArgumentError, match="window"):
            await c.lookup(chain, mode=LookupMode.SLIDING_WINDOW, window=0)


async def test_shutdown_answers_waiting_lookups_at_once(sock_dir: Path) -> None:
    tier = MemoryRemoteTier("mem")
    tier.lookup_gate = asyncio.Event()  # never opened: the probe hangs
    async with running_daemon(
        sock_dir, remote_tiers=[tier], server={"shutdown_grace": 30.0}
    ) as daemon:
        writer = await Client.connect(daemon.socket_path)
        reader = await Client.connect(daemon.socket_path)
        await writer.reserve([b"p"])
        waiting = asyncio.create_task(reader.lookup([b"p", b"u"], wait=60.0))
        await tier.lookup_started.wait()
        daemon.stop()
        reply = await asyncio.wait_for(waiting, timeout=10.0)
        # Answered with what was known, not after 60 s. Closing the idle writer
        # during shutdown may have released "p" already (no new probe starts then).
        assert reply.states[0] in (P, M) and reply.states[1] == R
        await writer.close()
        await reader.close()
    # The hung probe was cut short at shutdown and resolved, not left in flight.
    assert daemon.service.map_sizes().probes_inflight["mem"] == 0
    assert daemon.service.map_sizes().pending_writes == 0


async def test_half_closed_client_gets_its_reply_at_once_then_eof(core: Core) -> None:
    from kvtier import wire
    from kvtier.model import Lookup
    from tests.helpers import RawConnection

    gate = core.tier.lookup_gate = asyncio.Event()
    raw = RawConnection(core.path)
    raw.send_frame(wire.Op.LOOKUP, 5, wire.encode_lookup(Lookup([K], wait=600.0)))
    await core.tier.lookup_started.wait()
    raw.sock.shutdown(1)  # SHUT_WR: the client will not ask again ...
    frame = await asyncio.to_thread(raw.recv_frame)
    # ... so the waiting lookup answers now, with what is known (the probe is gated).
    assert wire.decode_lookup_reply(frame.meta).states == [R]
    assert await asyncio.to_thread(raw.at_eof)
    raw.close()
    gate.set()
    await core.daemon.settle()
    assert core.daemon.service.map_sizes().probes_inflight["mem"] == 0


async def test_a_waiting_lookup_ends_with_its_connection(core: Core) -> None:
    gate = core.tier.lookup_gate = asyncio.Event()
    c = await core.client()
    waiting = asyncio.create_task(c.lookup([K], wait=600.0))
    await core.tier.lookup_started.wait()

    assert core.daemon.server is not None
    (conn,) = core.daemon.server.connections
    assert conn.inflight == 1  # the waiting lookup
    await c.close()
    with pytest.raises(ConnectionClosedError):
        await waiting
    await conn.done.wait()
    assert conn.inflight == 0  # the server stopped waiting at once ...
    assert core.daemon.service.map_sizes().probes_inflight["mem"] == 1  # ... the probe did not
    gate.set()
    await core.daemon.settle()
    assert core.daemon.service.map_sizes().probes_inflight["mem"] == 0
    assert len(core.tier.lookup_calls) == 1


@pytest.mark.lookup(remote_hit="hit")
async def test_remote_hit_mode_answers_hit_and_loads_on_get(core: Core) -> None:
    core.tier.blocks[K] = VALUE
    async with await core.client() as c:
        assert (await c.lookup([K], wait=30.0)).states == [H]  # present remotely: HIT
        assert core.tier.load_calls == []  # no promotion started by the lookup
        assert await c.get(K) == VALUE  # the GET loads it
        assert len(core.tier.load_calls) == 1
        assert (await c.lookup([K])).states == [H]  # now resident in RAM
        await core.assert_idle(c)

"""Regions: the daemon copies blocks itself to and from a client's memory file."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import itertools
import os
import secrets
import struct
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio.lowlevel
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvtier import wire
from kvtier.client.aio import Client
from kvtier.client.shared import hand_region
from kvtier.core.shared.copier import Copier, Steps
from kvtier.core.shared.regions import MAX_REGIONS, _steps, may_map
from kvtier.daemon import Daemon
from kvtier.errors import (
    BadArgumentError,
    ForbiddenError,
    KvtierError,
    NoCapacityError,
    ProtocolError,
)
from kvtier.model import LOOP_STEP, PutStatus, State
from tests.helpers import received_bytes, running_daemon, shared_stats, watching_stores

MiB = 1024 * 1024

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="Linux only")


@pytest.fixture(params=[0, 2], ids=["copies-on-loop", "copy-threads"])
async def daemon(request: pytest.FixtureRequest, sock_dir: Path) -> AsyncIterator[Daemon]:
    """Each test twice: the daemon copies regions on its loop, and in 2 threads."""
    async with running_daemon(sock_dir, shared={"copy_threads": request.param}) as d:
        assert d.shared is not None and d.shared.regions.copier.threads == request.param
        yield d


def pattern(seed: int, size: int) -> bytes:
    return (bytes([seed % 251, (seed * 7) % 253]) * (size // 2 + 1))[:size]


@pytest.fixture(params=["mapped", "read"])
def memfd(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[int]:
    """An engine's host pool: 4 MiB in a memory file, three blocks written in
    it. ``mapped``: a memfd of this user, which the daemon maps and copies
    with memcpy; ``read``: a file others may write (the daemon does not map
    it: a shrink under a copy would fault it), read and written with
    pread/pwrite."""
    if request.param == "mapped":
        fd = os.memfd_create("pool")
    else:
        path = tmp_path / "pool"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.fchmod(fd, 0o666)
    os.ftruncate(fd, 4 * MiB)
    os.pwrite(fd, pattern(1, MiB), 0)
    os.pwrite(fd, pattern(2, 256 * 1024), MiB)
    os.pwrite(fd, pattern(3, 4096), 2 * MiB)
    yield fd
    os.close(fd)


SPANS = [(0, MiB), (MiB, 256 * 1024), (2 * MiB, 4096)]
KEYS = [b"big", b"mid", b"small"]


@given(st.lists(st.integers(1, 3 * LOOP_STEP), max_size=12))
def test_a_copys_steps_hold_every_byte_once_in_order_and_at_most_a_loop_step(
    sizes: list[int],
) -> None:
    views = [memoryview(bytearray(n)) for n in sizes]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    steps = list(_steps(views, offsets, [True] * len(views)))
    assert all(0 < sum(len(p) for p, _, _ in step) <= LOOP_STEP for step in steps)
    pieces = [(len(p), o) for step in steps for p, o, _ in step]
    covered = 0
    for n, o in pieces:  # the region's bytes, in order, each once
        assert o == covered
        covered += n
    assert covered == sum(sizes)
    # a step is only cut where the next piece would not fit
    for a, b in itertools.pairwise(steps):
        assert sum(len(p) for p, _, _ in a) + len(b[0][0]) > LOOP_STEP


async def test_blocks_move_between_a_region_and_ram_without_the_socket(
    daemon: Daemon, memfd: int
) -> None:
    async with await Client.connect(daemon.socket_path) as c:
        region = await c.attach_region(memfd)
        assert shared_stats(daemon)["regions"] == 1
        mapped = os.fstat(memfd).st_nlink == 0  # the memfd; the open file is not
        assert shared_stats(daemon)["regions_mapped"] == int(mapped)
        before = received_bytes(daemon)
        on_loop = shared_stats(daemon)["copy_threads"] == 0
        assert await c.put_region(region, KEYS, SPANS) == [PutStatus.STORED] * 3
        assert await c.put_region(region, KEYS[:1], SPANS[:1]) == [PutStatus.EXISTS]
        assert received_bytes(daemon) - before < 4096  # keys and spans, not 1.3 MiB
        # On the loop, LOOP_STEP (1 MiB) a step at most: the big block, then
        # the other two together.
        assert MiB == LOOP_STEP
        steps = 2
        assert shared_stats(daemon)["copy_steps"] == (steps if on_loop else 0)
        for key, (off, n) in zip(KEYS, SPANS, strict=True):
            got = await c.get(key)
            assert got is not None and bytes(got) == os.pread(memfd, n, off)
        # Back out into other places of the region; a missing block's room is untouched.
        rooms = [(3 * MiB, MiB), (3 * MiB + MiB - 4096, 4096)]
        os.pwrite(memfd, b"\xee" * 4096, rooms[1][0])
        assert await c.get_region(region, [b"big", b"nope"], rooms) == [MiB, None]
        steps += 1  # the big one, back out
        assert shared_stats(daemon)["copy_steps"] == (steps if on_loop else 0)
        assert os.pread(memfd, MiB, 3 * MiB)[: MiB - 4096] == pattern(1, MiB)[: MiB - 4096]
        st = shared_stats(daemon)
        assert st["region_bytes_in"] == MiB + 256 * 1024 + 4096
        assert st["region_bytes_out"] == MiB
        sample = daemon.metrics.registry.get_sample_value
        assert sample("kvtier_shared_region_bytes_total", {"direction": "in"}) == (
            MiB + 256 * 1024 + 4096
        )
        assert sample("kvtier_shared_regions") == 1
        assert daemon.server is not None
        (conn,) = daemon.server.connections
    await conn.done.wait()
    assert shared_stats(daemon)["regions"] == 0  # closed with its connection
    assert shared_stats(daemon)["regions_mapped"] == 0  # and unmapped


async def test_bad_region_requests_are_refused_and_others_carry_on(
    daemon: Daemon, memfd: int
) -> None:
    async with (
        await Client.connect(daemon.socket_path) as c,
        await Client.connect(daemon.socket_path) as other,
    ):
        region = await c.attach_region(memfd)
        with pytest.raises(BadArgumentError, match="outside region"):
            await c.put_region(region, [b"k"], [(4 * MiB - 10, 11)])
        with pytest.raises(BadArgumentError, match="no region"):
            await c.put_region(region + 100, [b"k"], [(0, 10)])
        with pytest.raises(BadArgumentError, match="no region"):
            await other.get_region(region, [b"k"], [(0, 10)])  # not its region
        await c.put_region(region, KEYS[:1], SPANS[:1])
        with pytest.raises(BadArgumentError, match="room holds"):
            await c.get_region(region, [b"big"], [(0, 100)])
        assert daemon.service.ram.budget.pinned_count == 0  # the refused GET let go
        malformed = struct.pack("<IB", region, 0) + wire.encode_keys([b"k"]) + b"\x00" * 4
        with pytest.raises(ProtocolError, match=r"one \(offset, length\) per key"):
            await c.request(wire.Op.PUT_REGION, malformed)
        # A REGION naming memory of the client's own (as cross-memory attach
        # once did) is refused: regions are memory files, handed over
        with pytest.raises(BadArgumentError, match="carries nothing"):
            await c.request(wire.Op.REGION, b"\x01" + bytes(24))
        assert await c.ping(b"y") == b"y"
        assert await other.ping(b"x") == b"x"
        got = await other.get(b"big")
        assert got is not None and bytes(got) == pattern(1, MiB)


async def test_a_region_store_with_checksums_stores_what_matches_and_nothing_of_a_lie(
    daemon: Daemon, memfd: int
) -> None:
    """PUT_REGION with each block's XXH3-64 (as a writer that cannot be
    trusted not to change its memory sends it): the daemon checks the bytes
    it copied; one block that does not match stores none of the request."""
    async with await Client.connect(daemon.socket_path) as c:
        region = await c.attach_region(memfd)
        sums = [xxhash.xxh3_64_intdigest(os.pread(memfd, n, off)) for off, n in SPANS]
        lie = wire.RegionIO(region, [b"l-" + k for k in KEYS], SPANS, [*sums[:2], sums[2] ^ 1])
        with pytest.raises(BadArgumentError, match="does not match its checksum"):
            await c.request(wire.Op.PUT_REGION, wire.encode_region_io(lie))
        assert [await c.get(k) for k in lie.keys] == [None, None, None]
        honest = wire.RegionIO(region, KEYS, SPANS, sums)
        frame = await c.request(wire.Op.PUT_REGION, wire.encode_region_io(honest))
        assert wire.decode_put_reply(frame.meta) == [PutStatus.STORED] * 3
        for key, (off, n) in zip(KEYS, SPANS, strict=True):
            got = await c.get(key)
            assert got is not None and bytes(got) == os.pread(memfd, n, off)


async def test_a_region_is_a_regular_file_used_with_the_clients_own_access(
    daemon: Daemon, memfd: int, tmp_path: Any
) -> None:
    async with await Client.connect(daemon.socket_path) as c:
        r, w = os.pipe()
        try:
            with pytest.raises(BadArgumentError, match="regular file"):
                await c.attach_region(r)
        finally:
            os.close(r)
            os.close(w)
        readonly = os.open(f"/proc/self/fd/{memfd}", os.O_RDONLY)
        try:
            region = await c.attach_region(readonly)
        finally:
            os.close(readonly)  # the daemon holds its own
        assert await c.put_region(region, [b"ro"], SPANS[:1]) == [PutStatus.STORED]
        with pytest.raises(KvtierError, match="Bad file descriptor"):
            await c.get_region(region, [b"ro"], [(0, MiB)])  # it may not write there
        assert await c.ping() == b""


async def test_a_region_shrunk_under_the_daemon_reads_as_an_error(
    daemon: Daemon, memfd: int
) -> None:
    async with await Client.connect(daemon.socket_path) as c:
        region = await c.attach_region(memfd)
        os.ftruncate(memfd, MiB // 2)
        with pytest.raises(KvtierError, match="shrunk"):
            await c.put_region(region, [b"gone"], SPANS[:1])
        assert await c.get(b"gone") is None  # nothing half-stored
        assert daemon.shared is not None and daemon.shared.stats().regions == 1


async def test_regions_need_shared_memory_a_token_and_a_bound(daemon: Daemon, memfd: int) -> None:
    async with await Client.connect(daemon.socket_path, shared=False) as plain:
        with pytest.raises(ForbiddenError, match="shared memory"):
            await plain.attach_region(memfd)
    async with await Client.connect(daemon.socket_path) as c:
        assert c.server is not None and c.server.shared is not None
        with pytest.raises(ForbiddenError, match="token"):
            await asyncio.to_thread(
                hand_region, c.server.shared.path, secrets.token_bytes(16), memfd, 5.0
            )
        assert daemon.handoff is not None and daemon.handoff.regions_refused == 1
        for _ in range(MAX_REGIONS):
            await c.attach_region(memfd)
        with pytest.raises(NoCapacityError, match="at most"):
            await c.attach_region(memfd)


async def test_a_cancelled_copy_keeps_its_memory_until_the_thread_ends() -> None:
    go, copying = threading.Event(), threading.Event()
    released = asyncio.get_running_loop().create_future()
    copier = Copier(1)

    def copy() -> Steps[None]:
        copying.set()
        go.wait(10)
        yield

    task = asyncio.ensure_future(copier.run(copy(), lambda: released.set_result(True)))
    await asyncio.to_thread(copying.wait, 10)
    assert (copier.threads, copier.running, copier.steps) == (1, 1, 0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not released.done()  # the thread still writes into it
    go.set()
    assert await released
    copier.close()


@pytest.mark.parametrize("threads", [0, 1])
async def test_a_failed_copy_releases_at_once(threads: int) -> None:
    released: list[bool] = []
    copier = Copier(threads)

    def copy() -> Steps[None]:
        yield
        raise OSError("bad descriptor")

    with pytest.raises(OSError):
        await copier.run(copy(), lambda: released.append(True))
    assert released == [True]
    assert copier.running == 0
    copier.close()


async def test_a_copy_on_the_loop_lets_other_work_run_between_its_steps() -> None:
    copier = Copier(0, turn=0.0)  # a step a turn
    seen: list[str] = []

    def copy() -> Steps[int]:
        for i in range(3):
            seen.append(f"step {i}")
            yield
        return 42

    async def other() -> None:
        for _ in range(3):
            seen.append("other")
            await anyio.lowlevel.checkpoint()

    result, _ = await asyncio.gather(copier.run(copy(), lambda: None), other())
    assert result == 42
    assert seen == ["step 0", "other", "step 1", "other", "step 2", "other"]
    assert (copier.threads, copier.running, copier.steps, copier.turns) == (0, 0, 3, 3)


async def test_a_turn_on_the_loop_takes_the_steps_that_fit_in_it() -> None:
    """Steps of 20 us in turns of 50 us: three a turn (the third ends past
    the turn), then the others' work; the last turn ends with the copy."""
    now = [0.0]

    def clock() -> float:
        return now[0]

    copier = Copier(0, turn=50e-6, clock=clock)
    seen: list[str] = []

    def copy() -> Steps[int]:
        for i in range(5):
            now[0] += 20e-6
            seen.append(f"step {i}")
            yield
        return 7

    async def other() -> None:
        for _ in range(2):
            seen.append("other")
            await anyio.lowlevel.checkpoint()

    result, _ = await asyncio.gather(copier.run(copy(), lambda: None), other())
    assert result == 7
    assert seen == ["step 0", "step 1", "step 2", "other", "step 3", "step 4", "other"]
    assert (copier.steps, copier.turns) == (5, 1)


async def test_a_cancelled_copy_on_the_loop_takes_no_further_step() -> None:
    copier = Copier(0, turn=0.0)
    stepped = asyncio.Event()
    taken: list[int] = []
    ended: list[str] = []

    def copy() -> Steps[None]:
        try:
            for i in range(4):
                taken.append(i)
                stepped.set()
                yield
        finally:
            ended.append("closed")

    task = asyncio.ensure_future(copier.run(copy(), lambda: ended.append("abandoned")))
    await stepped.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert taken == [0]
    assert ended == ["closed", "abandoned"]  # its memory is let go after its last step
    assert (copier.threads, copier.running, copier.steps) == (0, 0, 1)


def test_the_daemon_maps_only_files_no_one_it_does_not_trust_can_shrink(tmp_path: Path) -> None:
    """A mapped file shrunk under a copy would fault the daemon: it maps a
    memfd sealed against shrinking for anyone, and otherwise only a file of
    its own user, from a client of its own user, that no other user can
    open; everything else is read with pread, where a shrink is an error."""
    me, other = os.geteuid(), os.geteuid() + 4242

    def verdict(fd: int, uid: int) -> bool:
        return may_map(fd, os.fstat(fd), uid)

    sealed = os.memfd_create("sealed", os.MFD_ALLOW_SEALING)
    plain = os.memfd_create("plain")
    private = os.open(tmp_path / "private", os.O_RDWR | os.O_CREAT, 0o600)
    shared = os.open(tmp_path / "shared", os.O_RDWR | os.O_CREAT, 0o600)
    os.fchmod(shared, 0o664)  # its group may write (and so shrink) it
    try:
        for fd in (sealed, plain, private, shared):
            os.ftruncate(fd, 4096)
        assert not verdict(sealed, other)
        fcntl.fcntl(sealed, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        assert verdict(sealed, other) and verdict(sealed, me)
        assert verdict(plain, me) and not verdict(plain, other)
        assert verdict(private, me) and not verdict(private, other)
        assert not verdict(shared, me)
        if me == 0:  # a file of another user, from a client of the daemon's user
            os.fchown(private, 4242, -1)
            assert not verdict(private, me)
    finally:
        for fd in (sealed, plain, private, shared):
            os.close(fd)


class GatedCopier(Copier):
    """The daemon's copier, each copy held at ``gate`` until the test opens it."""

    def __init__(self, threads: int) -> None:
        super().__init__(threads)
        self.gate, self.started = asyncio.Event(), asyncio.Event()

    async def run(self, steps: Steps[Any], abandoned: Callable[[], None]) -> Any:
        self.started.set()
        try:
            await self.gate.wait()
        except BaseException:
            steps.close()
            abandoned()
            raise
        return await super().run(steps, abandoned)


@contextlib.contextmanager
def gated_copies(daemon: Daemon) -> Iterator[GatedCopier]:
    """The daemon's copies held at a gate (:class:`GatedCopier`), where they
    run otherwise (on its loop, or in threads)."""
    assert daemon.shared is not None
    kept = daemon.shared.regions.copier
    gated = daemon.shared.regions.copier = GatedCopier(kept.threads)
    try:
        yield gated
    finally:
        gated.gate.set()
        daemon.shared.regions.copier = kept
        gated.close()


async def test_a_region_store_is_answered_once_copied_and_stored_in_that_step(
    daemon: Daemon, memfd: int
) -> None:
    """The answer leaves as soon as the daemon is done reading the writer's
    memory; the blocks are stored right after, in the same step (no request
    in between), even when the writer hung up during the copy."""
    sent = daemon.server.counters.sent_bytes
    with watching_stores(daemon) as seen:
        async with (
            await Client.connect(daemon.socket_path) as c,
            await Client.connect(daemon.socket_path) as reader,
        ):
            region = await c.attach_region(memfd)
            with gated_copies(daemon) as gated:
                # (blocks of a slot each: a block under shared.min_block has none,
                # makes its room as it is stored, and is stored before the answer)
                answered = asyncio.ensure_future(c.put_region(region, KEYS[:2], SPANS[:2]))
                await asyncio.wait_for(gated.started.wait(), 10)
                before = sent.value
                gated.gate.set()
                assert await answered == [PutStatus.STORED] * 2
                # the reply was handed to the transport before the store ran
                assert seen.sent == [before + wire.framing.HEADER_SIZE + 4 + 2]
                assert (await reader.lookup(KEYS[:2])).states == [State.HIT] * 2

                # A writer gone during its copy: its blocks are stored all the same.
                gated.gate.clear()
                gated.started.clear()
                seen.stored.clear()
                hung_up = asyncio.ensure_future(c.put_region(region, [b"late"], SPANS[:1]))
                await asyncio.wait_for(gated.started.wait(), 10)
                await c.close()
                with pytest.raises(KvtierError):
                    await hung_up
                gated.gate.set()
                await seen.stored.wait()
                assert (await reader.lookup([b"late"])).states == [State.HIT]
    assert len(seen.sent) == 2
    st = shared_stats(daemon)
    assert st["regions"] == 0
    # no rooms were made for the next store of a writer that is gone
    assert st["region_rooms"] == 0 and daemon.ram.reserved_bytes == 0


async def test_blocks_read_pending_while_the_daemon_copies_them_in(
    daemon: Daemon, memfd: int
) -> None:
    """PUT_REGION reserves its keys itself: a reader finds them PENDING (not
    MISS) while the copy runs, HIT once stored; a copy that fails ends them."""
    sample = daemon.metrics.registry.get_sample_value
    async with (
        await Client.connect(daemon.socket_path) as c,
        await Client.connect(daemon.socket_path) as reader,
    ):
        region = await c.attach_region(memfd)
        with gated_copies(daemon) as gated:
            put = asyncio.ensure_future(c.put_region(region, KEYS, SPANS))
            await asyncio.wait_for(gated.started.wait(), 10)
            assert (await reader.lookup(KEYS)).states == [State.PENDING] * 3
            assert not put.done()
            gated.gate.set()
            assert await put == [PutStatus.STORED] * 3
        assert (await reader.lookup(KEYS)).states == [State.HIT] * 3
        assert sample("kvtier_reservations_total", {"event": "completed"}) == 3
        os.ftruncate(memfd, MiB // 2)
        with pytest.raises(KvtierError, match="shrunk"):
            await c.put_region(region, [b"gone"], SPANS[:1])
        assert (await reader.lookup([b"gone"])).states == [State.MISS]
        assert sample("kvtier_reservations_total", {"event": "aborted"}) == 1


QUARTER = 256 * 1024


async def test_a_region_store_like_the_last_lands_in_rooms_made_after_it(
    daemon: Daemon, memfd: int
) -> None:
    """Once a PUT_REGION is answered and stored, the daemon makes rooms for
    the connection's next one like it (as many blocks, of their length), so
    that one waits for no eviction; its blocks are stored as they were
    written. Rooms a store cannot use are freed, and so are those of a
    connection that goes."""
    spans = [(3 * MiB + i * QUARTER, QUARTER) for i in range(4)]
    for i, (offset, n) in enumerate(spans):
        os.pwrite(memfd, pattern(10 + i, n), offset)
    slots = daemon.ram.slots
    assert slots is not None
    room = slots.block_size(QUARTER)
    async with await Client.connect(daemon.socket_path) as c:
        region = await c.attach_region(memfd)
        first = [b"first-%d" % i for i in range(4)]
        assert await c.put_region(region, first, spans) == [PutStatus.STORED] * 4
        st = shared_stats(daemon)
        assert (st["region_rooms"], st["region_rooms_used"]) == (4, 0)
        assert daemon.ram.reserved_bytes == 4 * room  # held for the next store
        assert daemon.metrics.registry.get_sample_value("kvtier_shared_region_rooms") == 4

        second = [b"second-%d" % i for i in range(4)]
        assert await c.put_region(region, second, spans) == [PutStatus.STORED] * 4
        st = shared_stats(daemon)
        assert (st["region_rooms"], st["region_rooms_used"]) == (4, 4)
        for i, key in enumerate(first + second):
            got = await c.get(key)
            assert got is not None and bytes(got) == pattern(10 + i % 4, QUARTER)

        # Blocks of another length: the rooms go, and rooms of that length come.
        assert await c.put_region(region, [b"whole"], SPANS[:1]) == [PutStatus.STORED]
        st = shared_stats(daemon)
        assert (st["region_rooms"], st["region_rooms_used"]) == (1, 4)
        assert daemon.ram.reserved_bytes == slots.block_size(MiB)
        got = await c.get(b"whole")
        assert got is not None and bytes(got) == pattern(1, MiB)
        assert daemon.server is not None
        (conn,) = daemon.server.connections
    await conn.done.wait()
    assert shared_stats(daemon)["region_rooms"] == 0
    assert daemon.ram.reserved_bytes == 0


async def test_no_rooms_are_made_for_a_connection_lost_during_its_store(
    daemon: Daemon, memfd: int
) -> None:
    """A connection lost while the daemon copies into the rooms made for it:
    its blocks are stored all the same, and no rooms are made for a next
    store that cannot come: no RAM stays held for it."""
    assert daemon.server is not None
    spans = [(3 * MiB + i * QUARTER, QUARTER) for i in range(4)]
    with watching_stores(daemon) as seen, gated_copies(daemon) as gated:
        gated.gate.set()
        c = await Client.connect(daemon.socket_path)
        region = await c.attach_region(memfd)
        await c.put_region(region, [b"first-%d" % i for i in range(4)], spans)
        assert shared_stats(daemon)["region_rooms"] == 4
        gated.gate.clear()
        gated.started.clear()
        seen.stored.clear()
        second = [b"second-%d" % i for i in range(4)]
        put = asyncio.ensure_future(c.put_region(region, second, spans))
        await asyncio.wait_for(gated.started.wait(), 10)
        st = shared_stats(daemon)
        assert (st["region_rooms"], st["region_rooms_used"]) == (0, 4)  # copied into now
        (conn,) = daemon.server.connections
        assert conn.transport is not None
        conn.transport.abort()
        await conn.done.wait()
        gated.gate.set()
        await seen.stored.wait()  # (and what follows the store in its step has run)
        with pytest.raises(KvtierError):
            await put
        await c.close()
    assert all(daemon.ram.contains(key) for key in second)
    assert shared_stats(daemon)["region_rooms"] == 0
    assert daemon.ram.reserved_bytes == 0


async def test_no_rooms_ahead_past_an_eighth_of_ram_or_where_namespaces_have_shares(
    sock_dir: Path, memfd: int
) -> None:
    """Rooms made ahead hold RAM no block is in: at most an eighth of it for
    every connection together, and none where a namespace's share counts its
    blocks (docs/tenancy.md)."""
    spans = [(i * MiB, MiB) for i in range(3)]
    async with (
        running_daemon(sock_dir, ram={"capacity": "16MiB"}) as d,
        await Client.connect(d.socket_path) as c,
        await Client.connect(d.socket_path) as other,
    ):
        region = await c.attach_region(memfd)
        # 3 MiB of blocks: more than 2 MiB, an eighth of 16
        keys = [b"three-%d" % i for i in range(3)]
        assert await c.put_region(region, keys, spans) == [PutStatus.STORED] * 3
        assert shared_stats(d)["region_rooms"] == 0
        # 2 MiB: rooms for the next
        two = [b"two-0", b"two-1"]
        assert await c.put_region(region, two, spans[:2]) == [PutStatus.STORED] * 2
        assert shared_stats(d)["region_rooms"] == 2
        # another connection's 1 MiB would take them past 2 MiB together
        theirs = await other.attach_region(memfd)
        assert await other.put_region(theirs, [b"one-0"], spans[:1]) == [PutStatus.STORED]
        assert shared_stats(d)["region_rooms"] == 2
        # once the first connection's rooms are taken, the second gets its own
        assert await c.put_region(region, [b"one-1"], spans[:1]) == [PutStatus.STORED]
        assert await other.put_region(theirs, [b"one-2"], spans[:1]) == [PutStatus.STORED]
        assert shared_stats(d)["region_rooms"] == 2  # a room each
    async with (
        running_daemon(sock_dir, namespaces={"a": {}}) as d,
        await Client.connect(d.socket_path, namespace="a") as c,
    ):
        region = await c.attach_region(memfd)
        assert await c.put_region(region, [b"k"], spans[:1]) == [PutStatus.STORED]
        assert shared_stats(d)["region_rooms"] == 0
        assert d.ram.reserved_bytes == 0

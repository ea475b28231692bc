"""Shared memory end to end: leases, staging, the handoff, and clients that do not opt in."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import subprocess
import sys
import textwrap
import types
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import xxhash

from kvtier import BlockingClient, wire
from kvtier.client.aio import Client
from kvtier.client.shared import COMMITS_A_REQUEST, InPlaceCommits, attach
from kvtier.core.shared.inplace import QUARANTINE_SECONDS, may_write_in_place
from kvtier.daemon import Daemon
from kvtier.errors import (
    BadArgumentError,
    DaemonUnavailableError,
    ErrorCode,
    ForbiddenError,
    NoCapacityError,
    RequestTimeoutError,
    ValueTooLargeError,
)
from kvtier.model import MAX_IN_PLACE_ROOMS, Leased, PutStatus, State
from kvtier.server.handoff import Handoff
from kvtier.server.sockets import PeerPolicy
from kvtier.tiers.ram import Arena
from kvtier.wire import Op
from tests.helpers import (
    ROOT,
    DaemonProcess,
    memory_of,
    received_bytes,
    running_daemon,
    shared_stats,
    wait_on_timers,
    watching_stores,
)

MiB = 1024 * 1024

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="Linux only")


def block(seed: int, size: int = MiB) -> bytes:
    return bytes([seed % 251]) * (size - 1) + bytes([seed % 7])


@pytest.fixture
async def staging_daemon(sock_dir: Path) -> AsyncIterator[Daemon]:
    """A daemon whose clients write through staging (no one writes in place)."""
    async with running_daemon(sock_dir, shared={"write_in_place": False}) as d:
        yield d


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "staged"])
async def test_blocks_go_through_shared_memory_not_the_socket(
    sock_dir: Path, in_place: bool
) -> None:
    async with (
        running_daemon(sock_dir, shared={"write_in_place": in_place}) as daemon,
        await Client.connect(daemon.socket_path, stage_writes=True) as c,
    ):
        assert c.shared
        before = received_bytes(daemon)
        assert await c.put(b"k", block(1)) == PutStatus.STORED
        assert await c.put(b"k", block(1)) == PutStatus.EXISTS
        assert received_bytes(daemon) - before < 4096  # two COMMITs, not 2 MiB
        got = await c.get(b"k")
        assert got is not None and bytes(got) == block(1)
        dest = bytearray(MiB + 10)
        assert await c.get_into(b"k", dest) == MiB
        assert dest[:MiB] == block(1)
        assert await c.get_many_into([b"k", b"nope"], [bytearray(MiB), bytearray(1)]) == [MiB, None]
        async with c.lease(b"k") as view:
            assert view is not None and view.readonly and view == block(1)
            assert shared_stats(daemon)["leases"] == 1
        assert await c.get(b"nope") is None
        small = await c.put(b"small", b"s" * 100)  # small blocks take the socket
        assert small == PutStatus.STORED and bytes(await c.get(b"small") or b"") == b"s" * 100
        await c.ping()  # the releases queued above have been sent by now
        st = shared_stats(daemon)
        assert st["leases"] == 0 and st["leases_ended"]["released"] == 4
        # a room kept for the next block of this size: a RAM slot, or staging
        assert (st["in_place_rooms"], st["staging_rooms"]) == ((1, 0) if in_place else (0, 1))
        assert st["in_place_commits"] == int(in_place)
        sample = daemon.metrics.registry.get_sample_value
        assert sample("kvtier_shared_in_place_commits_total") == int(in_place)
        assert sample("kvtier_shared_in_place_rooms") == int(in_place)
        assert daemon.server is not None
        (conn,) = daemon.server.connections
        await c.close()
        await conn.done.wait()  # the client closed: its room is given back
        st = shared_stats(daemon)
        assert st["staging_rooms"] == 0 and st["staging_allocated_bytes"] == 0
        assert st["in_place_rooms"] == 0 and st["in_place_quarantined"] == 0
        assert daemon.ram.reserved_bytes == 0  # no RAM held for a room either


async def test_by_default_a_lone_large_block_is_written_in_place_and_a_small_one_is_sent(
    daemon: Daemon,
) -> None:
    async with await Client.connect(daemon.socket_path) as c:
        before = received_bytes(daemon)
        assert await c.put(b"big", block(5)) is PutStatus.STORED  # 1 MiB: in place
        assert received_bytes(daemon) - before < 4096  # STAGE and a COMMIT
        assert shared_stats(daemon)["in_place_rooms"] == 1  # kept for the next
        before = received_bytes(daemon)
        assert await c.put(b"mid", block(6)[: 256 * 1024]) is PutStatus.STORED
        assert received_bytes(daemon) - before > 256 * 1024  # under 512 KiB: the socket
        assert bytes(await c.get(b"big") or b"") == block(5)
        assert bytes(await c.get(b"mid") or b"") == block(6)[: 256 * 1024]


async def test_without_staging_reads_use_shared_memory_and_writes_the_socket(
    daemon: Daemon,
) -> None:
    async with await Client.connect(daemon.socket_path, stage_writes=False) as c:
        assert c.shared
        before = received_bytes(daemon)
        await c.put(b"k", block(7))  # over the socket, into its arena slot
        assert received_bytes(daemon) - before > MiB
        assert shared_stats(daemon)["staging_rooms"] == 0
        assert (daemon.ram.stats().arena_allocated_bytes or 0) >= MiB
        assert await c.get_many_into([b"k"], [bytearray(MiB)]) == [MiB]
        assert shared_stats(daemon)["leased_bytes"] == MiB
        await c.ping()
        assert shared_stats(daemon)["leases_ended"]["released"] == 1


async def test_a_client_that_does_not_opt_in_works_unchanged(daemon: Daemon) -> None:
    async with await Client.connect(daemon.socket_path, shared=False) as c:
        assert not c.shared
        before = received_bytes(daemon)
        await c.put(b"k", block(2))
        assert received_bytes(daemon) - before > MiB  # the block crossed the socket
        assert bytes(await c.get(b"k") or b"") == block(2)
        # ...and landed straight in the arena (received into its slot)
        assert (daemon.ram.stats().arena_allocated_bytes or 0) >= MiB
        with pytest.raises(ForbiddenError, match="not agreed at HELLO"):
            await c.request(Op.GET_SHARED, wire.encode_get_shared([], [b"k"]))


async def test_a_lease_pins_its_block_and_its_bytes(sock_dir: Path) -> None:
    async with (
        running_daemon(sock_dir, ram={"capacity": "4MiB"}, disk={"enabled": False}) as d,
        await Client.connect(d.socket_path) as reader,
        await Client.connect(d.socket_path, shared=False) as writer,
    ):
        await writer.put(b"held", block(3))
        async with reader.lease(b"held") as view:
            assert view is not None
            for i in range(8):  # 8 MiB through 4 MiB of RAM
                await writer.put(b"other%d" % i, block(10 + i))
            assert (await writer.lookup([b"held"])).states == [State.HIT]  # never evicted
            await writer.delete(b"held")
            await writer.put(b"held", block(4))  # a writer gets a new allocation
            assert bytes(await writer.get(b"held") or b"") == block(4)
            assert view == block(3)  # the reader's bytes did not change
            allocated = d.ram.stats().arena_allocated_bytes
        await reader.ping()
        # the old block's slot was freed when the lease ended
        assert allocated is not None
        assert (d.ram.stats().arena_allocated_bytes or 0) < allocated


async def test_a_lease_held_past_its_deadline_is_revoked_and_counted(daemon: Daemon) -> None:
    assert daemon.shared is not None
    async with await Client.connect(daemon.socket_path) as c:
        await c.put(b"k", block(5))
        async with c.lease(b"k") as view:
            assert view is not None
            assert daemon.ram.budget.pinned_count == 1
            daemon.shared.expire(daemon.scheduler.now() + daemon.shared.lease_timeout + 1)
            st = shared_stats(daemon)
            assert st["leases"] == 0 and st["leases_ended"]["revoked"] == 1
            assert daemon.ram.budget.pinned_count == 0  # the block may go now
            assert daemon.ram.remove(b"k")
        await c.ping()  # releasing a revoked lease is harmless
    sample = daemon.metrics.registry.get_sample_value(
        "kvtier_shared_leases_ended_total", {"end": "revoked"}
    )
    assert sample == 1


async def test_commits_are_checked_and_rooms_are_the_clients_own(staging_daemon: Daemon) -> None:
    daemon = staging_daemon
    assert daemon.shared is not None
    async with (
        await Client.connect(daemon.socket_path) as a,
        await Client.connect(daemon.socket_path) as b,
    ):
        frame = await a.request(Op.STAGE, wire.encode_u64(MiB))
        offset = wire.decode_u64(frame.meta, "STAGE")
        mapped = await asyncio.to_thread(attach, f"{daemon.socket_path}.shm", 1.0)
        assert not mapped.writable  # write_in_place is off: the arena is read-only
        mapped.staging[offset : offset + MiB] = block(6)
        good = xxhash.xxh3_64_intdigest(block(6))
        allocated = daemon.ram.stats().arena_allocated_bytes
        bad = wire.Commit(b"k", offset, MiB, good ^ 1, keep_room=True)
        with pytest.raises(BadArgumentError, match="checksum mismatch"):
            await a.request(Op.COMMIT, wire.encode_commit(bad))
        # the copy checked (in the block's own arena slot) is given back
        assert daemon.ram.stats().arena_allocated_bytes == allocated
        theirs = wire.Commit(b"k", offset, MiB, good, keep_room=True)
        with pytest.raises(BadArgumentError, match="belongs to this connection"):
            await b.request(Op.COMMIT, wire.encode_commit(theirs))
        too_long = wire.Commit(b"k", offset, MiB + 1, good, keep_room=True)
        with pytest.raises(BadArgumentError, match="does not fit"):
            await a.request(Op.COMMIT, wire.encode_commit(too_long))
        assert await b.get(b"k") is None  # nothing was stored
        ok = wire.Commit(b"k", offset, MiB, good, keep_room=False)
        await a.request(Op.COMMIT, wire.encode_commit(ok))
        assert bytes(await b.get(b"k") or b"") == block(6)
        assert shared_stats(daemon)["commits_refused"] == 3
        assert shared_stats(daemon)["staging_rooms"] == 0  # given back by the commit
        mapped.release()
        # an abandoned room is reclaimed at its deadline
        await a.request(Op.STAGE, wire.encode_u64(4096))
        assert shared_stats(daemon)["staging_rooms"] == 1
        daemon.shared.expire(daemon.scheduler.now() + daemon.shared.staging_timeout + 1)
        st = shared_stats(daemon)
        assert st["staging_rooms"] == 0 and st["staging_expired"] == 1


_HOLDER = """
import asyncio, sys
from kvtier.client.aio import Client

async def main():
    c = await Client.connect(sys.argv[1], stage_writes=True)
    assert c.shared
    await c.put(b"mine", bytes(1 << 20))  # keeps a room (a RAM slot) for the next
    async with c.lease(b"mine") as view:
        async with c.lease(b"mine") as again:
            print("holding", flush=True)
            await asyncio.Event().wait()

asyncio.run(main())
"""


async def killed_client(
    daemon: Daemon,
    script: str,
    ready: bytes,
    while_alive: Callable[[], None],
    reaped_first: bool = False,
) -> None:
    """Run ``script`` as a client process of ``daemon``; once it prints
    ``ready``, check ``while_alive()``, kill it (SIGKILL) and wait until the
    daemon has closed its connection (``reaped_first``: the process reaped
    before the daemon, on this loop, hears of the close)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), str(daemon.socket_path)],
        stdout=subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        assert await asyncio.to_thread(proc.stdout.readline) == ready
        while_alive()
        assert daemon.server is not None
        (conn,) = daemon.server.connections
        proc.send_signal(signal.SIGKILL)
        if reaped_first:
            proc.wait()  # (blocking: the daemon's loop runs only after)
        await conn.done.wait()
    finally:
        proc.kill()
        proc.wait()


async def test_a_client_killed_while_holding_leases_leaves_nothing_pinned(daemon: Daemon) -> None:
    def holding() -> None:
        st = shared_stats(daemon)
        assert st["leases"] == 2 and st["in_place_rooms"] == 1
        assert daemon.ram.budget.pinned_count == 1

    await killed_client(daemon, _HOLDER, b"holding\n", holding)
    st = shared_stats(daemon)
    assert st["leases"] == 0 and st["leases_ended"]["closed"] == 2
    assert daemon.ram.budget.pinned_count == 0
    # Its room is freed at once when the daemon sees the process gone as the
    # connection closes, else after the quarantine (the kernel closes a
    # killed process's sockets a moment before it reads as exited): only
    # the stored block stays.
    assert st["in_place_rooms"] == 0 and st["in_place_quarantined"] in (0, 1)
    assert daemon.shared is not None
    daemon.shared.expire(daemon.scheduler.now() + QUARANTINE_SECONDS + 1)
    st = shared_stats(daemon)
    assert st["in_place_quarantined"] == 0 and daemon.ram.reserved_bytes == 0
    assert st["arena_allocated_bytes"] == MiB


async def test_a_refused_handoff_leaves_the_client_on_the_socket(sock_dir: Path) -> None:
    arena, staging = Arena(1 << 20), Arena(1 << 20)
    handoff = Handoff(
        sock_dir / "h.shm",
        arena_fd=arena.readonly_fd(),
        arena_bytes=arena.size,
        staging_fd=os.dup(staging.fd),
        staging_bytes=staging.size,
        peers=PeerPolicy(frozenset({os.getuid() + 4242})),
        mode=0o600,
    )
    handoff.bind()
    task = asyncio.create_task(handoff.serve())
    try:
        with pytest.raises(OSError, match="refused to share memory"):
            await asyncio.to_thread(attach, str(handoff.path), 1.0)
        assert handoff.refused == 1 and handoff.handed == 0
    finally:
        task.cancel()
        handoff.close()
        arena.close()
        staging.close()


_OTHER_UID = """
import os, socket, sys
os.setgid(65534)
os.setuid(65534)
for what, path in (("handoff", sys.argv[1]), ("descriptor", sys.argv[2])):
    try:
        if what == "handoff":
            socket.socket(socket.AF_UNIX).connect(path)
        else:
            os.open(path, os.O_RDONLY)
        print(what, "open")
    except PermissionError:
        print(what, "refused")
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")
async def test_a_client_of_another_uid_cannot_map_the_arena(daemon: Daemon) -> None:
    assert daemon.arena is not None
    fd_path = f"/proc/{os.getpid()}/fd/{daemon.arena.fd}"
    out = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", _OTHER_UID, str(daemon.socket_path) + ".shm", fd_path],
        capture_output=True,
        check=True,
    )
    assert out.stdout.decode().split("\n")[:2] == ["handoff refused", "descriptor refused"]


async def test_a_client_falls_back_when_the_daemon_refuses_the_shared_flag(
    sock_dir: Path,
) -> None:
    """A daemon older than shared memory rejects the HELLO flag as malformed:
    the client says HELLO again without it and uses the socket."""
    hellos: list[wire.Hello] = []

    async def old_daemon(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while head := await reader.readexactly(wire.HEADER_SIZE):
            h = wire.unpack_header(head)
            meta = await reader.readexactly(h.meta_len)
            hello = wire.decode_hello(meta)
            hellos.append(hello)
            if hello.shared:
                body = wire.encode_error("1 unexpected trailing bytes in message")
                status = int(ErrorCode.MALFORMED)
            else:
                body, status = (
                    wire.encode_hello_reply(wire.HelloReply(1, 256, 100, 1 << 20, 1 << 16, "old")),
                    0,
                )
            parts = wire.frame_parts(
                h.opcode, h.request_id, body, flags=wire.FLAG_REPLY, status=status
            )
            writer.writelines(parts)

    server = await asyncio.start_unix_server(old_daemon, path=str(sock_dir / "old.sock"))
    async with server:
        c = await Client.connect(sock_dir / "old.sock")
        try:
            assert not c.shared and c.server is not None and c.server.server_name == "old"
            assert [h.shared for h in hellos] == [True, False]
        finally:
            await c.close()


async def _stage_in_place(c: Client, length: int = MiB) -> int:
    frame = await c.request(Op.STAGE, wire.encode_stage(length, in_place=True))
    return wire.decode_u64(frame.meta, "STAGE")


async def test_in_place_commits_are_checked_and_rooms_are_the_clients_own(daemon: Daemon) -> None:
    """A room in place is a RAM slot: the writer's bytes are the block, and
    only bytes that match their checksum, committed by the room's own
    connection at the room's length, are ever stored."""
    async with (
        await Client.connect(daemon.socket_path) as a,
        await Client.connect(daemon.socket_path) as b,
    ):
        before = daemon.ram.stats().arena_allocated_bytes or 0
        offset = await _stage_in_place(a)
        assert shared_stats(daemon)["in_place_rooms"] == 1
        assert daemon.ram.reserved_bytes == MiB  # the room counts against RAM
        mapped = await asyncio.to_thread(attach, f"{daemon.socket_path}.shm", 1.0)
        arena = mapped.arena
        try:
            assert mapped.writable  # a client of the daemon's own user
            arena[offset : offset + MiB] = block(8)
            good = xxhash.xxh3_64_intdigest(block(8))

            def commit(key: bytes, length: int, checksum: int, renew: bool = True) -> bytes:
                return wire.encode_commit(wire.Commit(key, offset, length, checksum, renew, True))

            with pytest.raises(BadArgumentError, match="belongs to this connection"):
                await b.request(Op.COMMIT, commit(b"k", MiB, good))
            with pytest.raises(BadArgumentError, match="one block of the length"):
                await a.request(Op.COMMIT, commit(b"k", MiB - 1, good))
            assert shared_stats(daemon)["in_place_rooms"] == 1  # both left it a's
            frame = await a.request(Op.COMMIT, commit(b"k", MiB, good))
            status, room = wire.decode_commit_reply(frame.meta)
            assert status is PutStatus.STORED and room is not None and room != offset
            assert bytes(await b.get(b"k") or b"") == block(8)
            # The key held now: EXISTS, and the new room stays a's (it is the next).
            offset = room
            frame = await a.request(Op.COMMIT, commit(b"k", MiB, 0))
            assert wire.decode_commit_reply(frame.meta) == (PutStatus.EXISTS, offset)
            # A lying checksum (or bytes torn by another writer) stores nothing,
            # and the slot goes back.
            arena[offset : offset + MiB] = block(9)
            with pytest.raises(BadArgumentError, match="checksum mismatch"):
                await a.request(Op.COMMIT, commit(b"k2", MiB, good))
            assert await b.get(b"k2") is None
            st = shared_stats(daemon)
            assert st["in_place_rooms"] == 0 and st["commits_refused"] == 3
            assert st["in_place_commits"] == 1
            # k, and the room made for a's next COMMIT after the answer to its last
            assert st["in_place_prepared"] == 1
            assert daemon.ram.stats().arena_allocated_bytes == before + 2 * MiB
            assert daemon.ram.reserved_bytes == MiB
            # Without a checksum the slot is stored as written (a socket PUT's trust).
            offset = await _stage_in_place(a)
            arena[offset : offset + MiB] = block(10)
            unchecked = wire.Commit(b"k3", offset, MiB, 0, False, True, unchecked=True)
            frame = await a.request(Op.COMMIT, wire.encode_commit(unchecked))
            assert wire.decode_commit_reply(frame.meta) == (PutStatus.STORED, None)
            assert bytes(await b.get(b"k3") or b"") == block(10)
            assert shared_stats(daemon)["in_place_commits"] == 2
            # A connection holds a bounded number of rooms; UNSTAGE gives one back.
            with pytest.raises(NoCapacityError, match=r"under shared\.min_block"):
                await _stage_in_place(a, 4096)
            rooms = [await _stage_in_place(a, 64 * 1024) for _ in range(8)]
            with pytest.raises(NoCapacityError, match="at most 8"):
                await _stage_in_place(a, 64 * 1024)
            gone = await a.request(Op.UNSTAGE, wire.encode_stage(rooms[0], in_place=True))
            assert gone.meta == b"\x01"
            again = await b.request(Op.UNSTAGE, wire.encode_stage(rooms[1], in_place=True))
            assert again.meta == b"\x00"  # not b's to give back
            assert shared_stats(daemon)["in_place_rooms"] == 7
        finally:
            mapped.release()


async def test_an_in_place_commit_is_answered_before_its_block_is_filed(daemon: Daemon) -> None:
    """The COMMIT's reply (with the next room, made first) is handed to the
    transport before the block is stored, in the same step: the writer
    fills its next room while the daemon files the last block away; a
    durable COMMIT is stored first (its disk write is of what RAM holds)."""
    sent = daemon.server.counters.sent_bytes
    with watching_stores(daemon) as seen:
        async with (
            await Client.connect(daemon.socket_path) as a,
            await Client.connect(daemon.socket_path) as b,
        ):
            offset = await _stage_in_place(a)
            mapped = await asyncio.to_thread(attach, f"{daemon.socket_path}.shm", 1.0)
            arena = mapped.arena
            try:
                arena[offset : offset + MiB] = block(11)
                commit = wire.Commit(b"k", offset, MiB, 0, True, True, unchecked=True)
                before = sent.value
                frame = await a.request(Op.COMMIT, wire.encode_commit(commit))
                status, room = wire.decode_commit_reply(frame.meta)
                assert status is PutStatus.STORED and room is not None
                assert seen.sent == [before + wire.framing.HEADER_SIZE + 9]
                assert bytes(await b.get(b"k") or b"") == block(11)

                arena[room : room + MiB] = block(12)
                durable = wire.Commit(b"d", room, MiB, 0, False, True, unchecked=True)
                before = sent.value
                frame = await a.request(
                    Op.COMMIT, wire.encode_commit(durable), flags=wire.FLAG_DURABLE
                )
                assert wire.decode_commit_reply(frame.meta) == (PutStatus.STORED, None)
                assert seen.sent[1] == before  # stored, then answered
                assert bytes(await b.get(b"d") or b"") == block(12)
                assert shared_stats(daemon)["in_place_commits"] == 2
            finally:
                mapped.release()


@contextlib.contextmanager
def rooms_made(daemon: Daemon) -> Iterator[list[float]]:
    """While within: the daemon's bytes sent so far each time it made a room
    (an eviction, then a slot): which answers had left before it."""
    sent = daemon.server.counters.sent_bytes
    made: list[float] = []
    stores = daemon.service.stores
    stage_room = stores.stage_room

    def recording(length: int, namespace: bytes) -> memoryview | None:
        made.append(sent.value)
        return stage_room(length, namespace)

    stores.stage_room = recording  # type: ignore[method-assign]
    try:
        yield made
    finally:
        stores.stage_room = stage_room  # type: ignore[method-assign]


async def test_the_room_an_in_place_commit_hands_out_was_made_after_the_last_answer(
    daemon: Daemon,
) -> None:
    """A writer commits blocks of one length one after the other: the room
    the next COMMIT hands out is made once the answer to this one has left
    (after its block is stored), so no answer but the first waits for the
    eviction that makes a room. A room prepared for a length the writer
    stops using is freed; one prepared for a connection that goes is freed
    at once (no writer ever had it)."""
    shared = daemon.shared
    assert shared is not None
    sent = daemon.server.counters.sent_bytes
    reply = wire.framing.HEADER_SIZE + 9  # a COMMIT's answer with a room
    with rooms_made(daemon) as made:
        async with await Client.connect(daemon.socket_path) as a:
            offset = await _stage_in_place(a)
            mapped = await asyncio.to_thread(attach, f"{daemon.socket_path}.shm", 1.0)
            arena = mapped.arena
            try:
                rooms = [offset]
                for i in range(3):
                    arena[rooms[-1] : rooms[-1] + MiB] = block(20 + i)
                    commit = wire.Commit(b"r%d" % i, rooms[-1], MiB, 0, True, True, unchecked=True)
                    made.clear()
                    before = sent.value
                    frame = await a.request(Op.COMMIT, wire.encode_commit(commit))
                    status, room = wire.decode_commit_reply(frame.meta)
                    assert status is PutStatus.STORED and room is not None
                    if i == 0:  # none prepared yet: made before the answer, then one after
                        assert made == [before, before + reply]
                    else:  # the prepared one handed out; the next made after the answer
                        assert made == [before + reply]
                    assert shared.stats().in_place_prepared == 1
                    rooms.append(room)
                assert len(set(rooms)) == 4
                for i in range(3):
                    assert bytes(await a.get(b"r%d" % i) or b"") == block(20 + i)

                # Another length: the prepared room of 1 MiB goes back.
                half = await _stage_in_place(a, MiB // 2)
                arena[half : half + MiB // 2] = block(30, MiB // 2)
                commit = wire.Commit(b"h", half, MiB // 2, 0, True, True, unchecked=True)
                await a.request(Op.COMMIT, wire.encode_commit(commit))
                assert shared.stats().in_place_prepared == 1
                ((ready,),) = shared.in_place._prepared.values()
                assert len(ready) == MiB // 2
                assert bytes(await a.get(b"h") or b"") == block(30, MiB // 2)
            finally:
                mapped.release()
    for conn in list(daemon.server.connections):
        await conn.done.wait()  # the daemon has seen the writer go
    assert shared.stats().in_place_prepared == 0
    # Held now: only the rooms the writer had (quarantined until their deadline).
    quarantined = sum(len(room.view or b"") for room in shared.in_place._quarantine)
    assert daemon.ram.budget.held == quarantined


async def test_writing_in_place_is_refused_where_it_is_off(staging_daemon: Daemon) -> None:
    async with await Client.connect(staging_daemon.socket_path) as c:
        with pytest.raises(ForbiddenError, match="write_in_place"):
            await _stage_in_place(c)
        assert await c.put(b"k", block(3)) is PutStatus.STORED  # staged instead
        assert shared_stats(staging_daemon)["staging_rooms"] == 1
        assert bytes(await c.get(b"k") or b"") == block(3)


def test_only_the_daemons_own_user_writes_in_place() -> None:
    me = os.geteuid()
    assert may_write_in_place(me)
    assert not may_write_in_place(me + 4242)
    assert not may_write_in_place(None)  # credentials unknown
    assert not may_write_in_place(me, enabled=False)


@pytest.mark.parametrize("writable", [True, False])
async def test_the_handoff_gives_the_arena_writable_only_to_whom_it_may(
    sock_dir: Path, writable: bool
) -> None:
    arena, staging = Arena(1 << 20), Arena(1 << 20)
    asked: list[int | None] = []

    def may(uid: int | None) -> bool:
        asked.append(uid)
        return writable

    handoff = Handoff(
        sock_dir / "h.shm",
        arena_fd=arena.readonly_fd(),
        arena_bytes=arena.size,
        arena_rw_fd=os.dup(arena.fd),
        writable=may,
        staging_fd=os.dup(staging.fd),
        staging_bytes=staging.size,
        peers=PeerPolicy.for_socket(0o600, None, None),
        mode=0o600,
    )
    handoff.bind()
    task = asyncio.create_task(handoff.serve())
    try:
        mapped = await asyncio.to_thread(attach, str(handoff.path), 1.0)
        assert mapped.writable is writable and asked == [os.getuid()]
        if writable:
            mapped.arena[:4] = b"abcd"
            assert arena.mapping[:4] == b"abcd"  # the daemon's own memory
        else:
            with pytest.raises(TypeError):
                mapped.arena[:4] = b"abcd"
        mapped.release()
        assert handoff.handed == 1 and handoff.handed_writable == int(writable)
    finally:
        task.cancel()
        handoff.close()
        arena.close()
        staging.close()


async def test_put_many_writes_each_large_block_in_place(daemon: Daemon) -> None:
    sizes = [MiB, 300_000, 100, MiB, 2 * MiB, 70_000]
    keys = [b"m%d" % i for i in range(len(sizes))]
    values = [block(i, n) for i, n in enumerate(sizes)]
    async with await Client.connect(daemon.socket_path) as c:
        before = received_bytes(daemon)
        assert await c.put_many(keys, values) == [PutStatus.STORED] * len(keys)
        assert received_bytes(daemon) - before < 64 * 1024  # only the 100 bytes crossed
        assert shared_stats(daemon)["in_place_commits"] == 5
        for key, value in zip(keys, values, strict=True):
            assert bytes(await c.get(key) or b"") == value
        again = await c.put_many(keys, values)
        assert again == [PutStatus.EXISTS] * len(keys)


_HALF_WRITER = """
import asyncio, sys
from kvtier import wire
from kvtier.client.aio import Client
from kvtier.client.shared import COMMITS_A_REQUEST, InPlaceCommits, attach
from kvtier.wire import Op

async def main():
    c = await Client.connect(sys.argv[1])
    frame = await c.request(Op.STAGE, wire.encode_stage(1 << 20, in_place=True))
    offset = wire.decode_u64(frame.meta, "STAGE")
    mapped = attach(sys.argv[1] + ".shm", 1.0)
    assert mapped.writable
    mapped.arena[offset : offset + (1 << 19)] = b"x" * (1 << 19)  # half the block
    print("writing", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_a_batch_of_commits_hands_out_rooms_all_made_after_the_last_answer(
    daemon: Daemon,
) -> None:
    """A COMMIT_MANY renews each of its rooms: the rooms it hands out were
    made after the answer to the connection's last batch (one for each block
    that batch stored), so only the first batch's answer waits for the
    evictions that make rooms; they stay within a connection's count."""
    shared = daemon.shared
    assert shared is not None
    sent = daemon.server.counters.sent_bytes
    n = COMMITS_A_REQUEST
    reply = wire.framing.HEADER_SIZE + n * wire.COMMIT_REPLY_SIZE
    with rooms_made(daemon) as made:
        async with await Client.connect(daemon.socket_path) as a:
            rooms = [await _stage_in_place(a) for _ in range(n)]
            mapped = await asyncio.to_thread(attach, f"{daemon.socket_path}.shm", 1.0)
            try:
                for batch in range(3):
                    keys = [b"m%d-%d" % (batch, i) for i in range(n)]
                    for i, room in enumerate(rooms):
                        mapped.arena[room : room + MiB] = block(40 + batch * n + i)
                    commits = [
                        wire.Commit(k, r, MiB, 0, True, True, unchecked=True)
                        for k, r in zip(keys, rooms, strict=True)
                    ]
                    made.clear()
                    before = sent.value
                    frame = await a.request(Op.COMMIT_MANY, wire.encode_commit_many(commits))
                    answers = wire.decode_commit_many_reply(frame.meta, n)
                    assert [status for status, _ in answers] == [PutStatus.STORED] * n
                    after = [before + reply] * n  # one made for each block, after the answer
                    assert made == ([before] * n if batch == 0 else []) + after
                    assert shared.stats().in_place_prepared == n
                    rooms = [room for _, room in answers if room is not None]
                    assert len(rooms) == n
                    for i, key in enumerate(keys):
                        assert bytes(await a.get(key) or b"") == block(40 + batch * n + i)
                assert shared.stats().in_place_rooms <= MAX_IN_PLACE_ROOMS
            finally:
                mapped.release()
    for conn in list(daemon.server.connections):
        await conn.done.wait()
    assert shared.stats().in_place_prepared == 0  # freed with the connection


async def test_a_writer_killed_mid_store_leaves_no_slot_behind(daemon: Daemon) -> None:
    assert daemon.shared is not None
    before = daemon.ram.stats().arena_allocated_bytes

    def writing() -> None:
        assert shared_stats(daemon)["in_place_rooms"] == 1

    await killed_client(daemon, _HALF_WRITER, b"writing\n", writing, reaped_first=True)
    # The writer's process is gone as its connection closes: nothing can
    # write the room any more, so it is freed at once, not quarantined.
    st = shared_stats(daemon)
    assert st["in_place_quarantined"] == 0 and st["in_place_commits"] == 0
    assert daemon.ram.stats().arena_allocated_bytes == before
    assert daemon.ram.reserved_bytes == 0 and len(daemon.ram) == 0


async def test_many_writes_in_place_share_the_connections_rooms(daemon: Daemon) -> None:
    """More large blocks than a connection may hold rooms for wait for one
    (none falls back to staging), and a block of a new length gives the
    spare rooms of the other length back (they would hold RAM idle)."""
    async with await Client.connect(daemon.socket_path) as c:
        keys = [b"b%d" % i for i in range(3 * MAX_IN_PLACE_ROOMS)]
        values = [block(i) for i in range(len(keys))]
        assert await c.put_many(keys, values) == [PutStatus.STORED] * len(keys)
        st = shared_stats(daemon)
        assert st["in_place_commits"] == len(keys) and st["staging_rooms"] == 0
        assert st["in_place_rooms"] == MAX_IN_PLACE_ROOMS  # each renewed, kept as spares
        odd = block(99, 600_000)
        assert await c.put(b"odd", odd) is PutStatus.STORED
        st = shared_stats(daemon)
        assert st["in_place_commits"] == len(keys) + 1 and st["staging_rooms"] == 0
        assert st["in_place_rooms"] == 1  # the spares of the other length went back
        for key, value in [*zip(keys, values, strict=True), (b"odd", odd)]:
            assert bytes(await c.get(key) or b"") == value


async def test_concurrent_writers_in_place_never_wait_for_each_others_rooms(
    daemon: Daemon,
) -> None:
    """Writers of one connection each copy their blocks a group at a time,
    and none waits for a room while holding rooms it has not written: as
    many writers as the connection has rooms, each with more blocks than a
    group, all finish, every block in place and intact."""
    writers = MAX_IN_PLACE_ROOMS  # each could hold a room and wait for more
    each = 2 * COMMITS_A_REQUEST + 1
    async with await Client.connect(daemon.socket_path) as c:
        values = {
            b"w%d-%d" % (w, i): block(w * 100 + i, 300_000)
            for w in range(writers)
            for i in range(each)
        }
        keys = list(values)
        results = await asyncio.wait_for(
            asyncio.gather(
                *(
                    c.put_many(
                        keys[w * each : (w + 1) * each],
                        [values[k] for k in keys[w * each : (w + 1) * each]],
                    )
                    for w in range(writers)
                )
            ),
            30,
        )
        assert results == [[PutStatus.STORED] * each] * writers
        st = shared_stats(daemon)
        assert st["in_place_commits"] == writers * each and st["staging_rooms"] == 0
        for key, value in values.items():
            assert bytes(await c.get(key) or b"") == value


def arena_mappings() -> int:
    """Mappings of a daemon's arena in this process (each in-process daemon
    maps its own once)."""
    return sum("memfd:kvtier-ram " in line for line in Path("/proc/self/maps").open())


async def test_a_process_maps_a_daemons_memory_once_however_many_clients(sock_dir: Path) -> None:
    other = sock_dir / "other"
    other.mkdir()
    async with running_daemon(sock_dir) as first, running_daemon(other) as second:
        gc.collect()  # (mappings earlier tests left to the collector go first)
        daemons_own = arena_mappings()
        a = await Client.connect(first.socket_path)
        b = await Client.connect(first.socket_path)
        assert a.shared and b.shared
        assert arena_mappings() == daemons_own + 1  # one for both clients
        assert "MappedMemory arena=" in repr(a) and "rw users=2 " in repr(a)
        assert await a.put(b"from-a", block(1)) is PutStatus.STORED
        assert await b.put(b"from-b", block(2)) is PutStatus.STORED
        assert shared_stats(first)["in_place_commits"] == 2
        assert bytes(await b.get(b"from-a") or b"") == block(1)
        assert bytes(await a.get(b"from-b") or b"") == block(2)

        c = await Client.connect(second.socket_path)  # another daemon: its own
        assert arena_mappings() == daemons_own + 2
        assert "rw users=1 " in repr(c)

        await a.close()
        await a.close()  # (once is all it lets go of)
        assert arena_mappings() == daemons_own + 2
        assert "rw users=1 " in repr(b)
        assert await b.put(b"after-a", block(3)) is PutStatus.STORED
        assert bytes(await b.get(b"after-a") or b"") == block(3)
        assert bytes(await b.get(b"from-a") or b"") == block(1)

        await b.close()
        assert arena_mappings() == daemons_own + 1  # only the other daemon's client's
        again = await Client.connect(first.socket_path)  # maps it anew
        assert arena_mappings() == daemons_own + 2 and "rw users=1 " in repr(again)
        assert bytes(await again.get(b"after-a") or b"") == block(3)
        await again.close()
        await c.close()
        assert arena_mappings() == daemons_own


async def test_the_blocks_of_one_read_share_one_lease(daemon: Daemon) -> None:
    """A read, asked for in one request, costs the daemon one lease,
    granted and given back whole."""
    n = 64
    keys = [b"batch-%d" % i for i in range(n)]
    blocks = [block(i, 256 * 1024) for i in range(n)]
    async with await Client.connect(daemon.socket_path) as c:
        assert c.shared
        await c.put_many(keys, blocks)
        before = shared_stats(daemon)["leases_ended"]["released"]
        dests = [bytearray(256 * 1024) for _ in keys]
        assert await c.get_many_into(keys, dests) == [256 * 1024] * n
        assert dests == blocks
        await c.ping()  # the release queued after the copies has been sent
        st = shared_stats(daemon)
        assert st["leases"] == 0 and st["leases_ended"]["released"] == before + 1
        assert st["leased_bytes"] >= n * 256 * 1024
        assert daemon.ram.budget.pinned_count == 0


async def test_leases_given_back_with_a_read_end_once_it_is_answered(daemon: Daemon) -> None:
    """The leases a GET_SHARED gives back (ended after its answer is
    written) have ended by the time its reply is read; a key asked again
    keeps its block pinned by the new lease alone."""
    async with await Client.connect(daemon.socket_path) as c:
        await c.put_many([b"a", b"b"], [block(1), block(2)])
        frame = await c.request(Op.GET_SHARED, wire.encode_get_shared([], [b"a", b"b"]))
        (first, _) = wire.decode_get_shared_reply(frame.meta, frame.data)
        assert isinstance(first, Leased)
        assert daemon.ram.budget.pinned_count == 2
        frame = await c.request(Op.GET_SHARED, wire.encode_get_shared([first.lease_id], [b"b"]))
        (again,) = wire.decode_get_shared_reply(frame.meta, frame.data)
        assert isinstance(again, Leased) and again.lease_id != first.lease_id
        st = shared_stats(daemon)
        assert st["leases"] == 1 and st["leases_ended"]["released"] == 1
        assert daemon.ram.budget.pinned_count == 1
        await c.request(Op.UNLEASE, wire.encode_unlease([again.lease_id]))
        assert daemon.ram.budget.pinned_count == 0


async def test_a_read_with_a_block_too_long_for_its_buffer_copies_nothing(
    daemon: Daemon,
) -> None:
    """Every block of a read is checked against its destination before any
    is copied: one that does not fit ends the read, nothing lands, and the
    read's lease goes back."""
    keys = [b"fit-%d" % i for i in range(12)]
    async with await Client.connect(daemon.socket_path) as c:
        await c.put_many(keys, [block(i) for i in range(12)])
        dests = [bytearray(MiB) for _ in keys]
        dests[5] = bytearray(10)
        with pytest.raises(ValueTooLargeError, match="destination holds 10"):
            await c.get_many_into(keys, dests)
        assert dests[0] == dests[4] == dests[6] == dests[11] == bytes(MiB)
        await c.ping()  # the release queued has been sent
        st = shared_stats(daemon)
        assert st["leases"] == 0 and st["leases_ended"]["released"] == 1
        assert daemon.ram.budget.pinned_count == 0


@pytest.mark.parametrize("read", ["get_many_into", "get_many"])
async def test_a_read_cancelled_while_its_answer_comes_gives_its_lease_back(
    daemon: Daemon, read: str
) -> None:
    """A caller cancelled after its read was asked for: the answer still
    comes, and its lease goes back once it does (nothing stays pinned until
    the lease deadline)."""
    keys = [b"cancelled-%d" % i for i in range(4)]
    async with await Client.connect(daemon.socket_path) as c:
        await c.put_many(keys, [block(i) for i in range(4)])
        dests = [bytearray(MiB) for _ in keys]
        asking = c.get_many_into(keys, dests) if read == "get_many_into" else c.get_many(keys)
        reading = asyncio.create_task(asking)
        asyncio.get_running_loop().call_soon(reading.cancel)  # once the request is written
        with pytest.raises(asyncio.CancelledError):
            await reading
        await c.ping()  # the answer has come by now, its lease queued to go back
        await c.ping()  # and given back
        st = shared_stats(daemon)
        assert st["leases"] == 0 and st["leases_ended"]["released"] == 1
        assert daemon.ram.budget.pinned_count == 0


async def test_a_batch_of_small_blocks_is_written_in_place(daemon: Daemon) -> None:
    """A put_many of 256 KiB blocks goes in place (their copies pipeline),
    not over the socket."""
    keys = [b"small-%d" % i for i in range(8)]
    values = [block(i, 256 * 1024) for i in range(8)]
    async with await Client.connect(daemon.socket_path) as c:
        before = received_bytes(daemon)
        assert await c.put_many(keys, values) == [PutStatus.STORED] * 8
        await c.ping()
        assert received_bytes(daemon) - before < 8 * 4096  # COMMITs, not 2 MiB of bodies
        st = shared_stats(daemon)
        assert st["in_place_commits"] == 8 and st["staging_rooms"] == 0
        for key, value in zip(keys, values, strict=True):
            assert bytes(await c.get(key) or b"") == value


async def test_a_commit_of_many_stores_each_block_or_none_of_them(daemon: Daemon) -> None:
    """COMMIT_MANY: each block in its room is stored and each room renewed,
    with one reply; a batch naming a room that is not the connection's, a
    room twice or a key twice is refused whole, and leaves every room the
    writer's."""
    async with (
        await Client.connect(daemon.socket_path) as a,
        await Client.connect(daemon.socket_path) as b,
    ):
        rooms = [await _stage_in_place(a) for _ in range(3)]
        theirs = await _stage_in_place(b)
        mapped = await asyncio.to_thread(attach, f"{daemon.socket_path}.shm", 1.0)
        try:
            for i, offset in enumerate(rooms):
                mapped.arena[offset : offset + MiB] = block(20 + i)

            def many(keys: list[bytes], offsets: list[int]) -> bytes:
                return wire.encode_commit_many(
                    [
                        wire.Commit(k, o, MiB, 0, True, True, True)
                        for k, o in zip(keys, offsets, strict=True)
                    ]
                )

            keys = [b"many-%d" % i for i in range(3)]
            for bad, why in (
                (many(keys, [rooms[0], rooms[1], theirs]), "belongs to this connection"),
                (many(keys, [rooms[0], rooms[1], rooms[1]]), "each room, and each key, once"),
                (many([keys[0], keys[0], keys[1]], rooms), "each room, and each key, once"),
            ):
                with pytest.raises(BadArgumentError, match=why):
                    await a.request(Op.COMMIT_MANY, bad)
            st = shared_stats(daemon)
            assert st["in_place_rooms"] == 4 and st["in_place_commits"] == 0
            frame = await a.request(Op.COMMIT_MANY, many(keys, rooms))
            answers = wire.decode_commit_many_reply(frame.meta, 3)
            assert [status for status, _ in answers] == [PutStatus.STORED] * 3
            renewed = [room for _, room in answers]
            assert None not in renewed and not set(renewed) & set(rooms)
            for i, key in enumerate(keys):
                assert bytes(await b.get(key) or b"") == block(20 + i)
            st = shared_stats(daemon)
            assert st["in_place_commits"] == 3 and st["in_place_rooms"] == 4  # 3 renewed, b's
        finally:
            mapped.release()


async def test_put_many_in_place_sends_its_commits_together(daemon: Daemon) -> None:
    sample = daemon.metrics.registry.get_sample_value
    keys = [b"together-%d" % i for i in range(16)]
    values = [block(i, 256 * 1024) for i in range(16)]
    async with await Client.connect(daemon.socket_path) as c:
        assert await c.put_many(keys, values) == [PutStatus.STORED] * 16
        for key, value in zip(keys, values, strict=True):
            assert bytes(await c.get(key) or b"") == value
    many = sample("kvtier_requests_total", {"op": "commit_many", "outcome": "ok"}) or 0
    one = sample("kvtier_requests_total", {"op": "commit", "outcome": "ok"}) or 0
    assert shared_stats(daemon)["in_place_commits"] == 16
    assert many >= 16 // COMMITS_A_REQUEST and many + one < 16


class _Calls:
    """A connection's requests, recorded and answered at once (each COMMIT
    of many: every block stored, next room 7), or failed with ``fail``, or
    never answered (``hang``)."""

    def __init__(self, fail: Exception | None = None, hang: bool = False) -> None:
        self.sent: list[tuple[int, int, int]] = []  # (op, commits, flags)
        self.fail = fail
        self.hang = hang

    def send(self, op: int, meta: bytes, *, flags: int = 0) -> asyncio.Future[object]:
        reply: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        n = 1 if op == Op.COMMIT else len(wire.decode_commit_many(meta, 64))
        self.sent.append((op, n, flags))
        if self.hang:
            return reply
        if self.fail is not None:
            reply.set_exception(self.fail)
        elif op == Op.COMMIT:
            meta = wire.encode_commit_reply(PutStatus.STORED, 7)
            reply.set_result(
                types.SimpleNamespace(meta=meta, header=types.SimpleNamespace(status=0))
            )
        else:
            meta = wire.encode_commit_many_reply([(PutStatus.STORED, 7)] * n)
            reply.set_result(
                types.SimpleNamespace(meta=meta, header=types.SimpleNamespace(status=0))
            )
        return reply


def _commit(i: int) -> wire.Commit:
    return wire.Commit(b"c%d" % i, i * MiB, MiB, 0, True, True, True)


async def test_commits_of_one_step_leave_together_and_a_full_request_at_once() -> None:
    calls = _Calls()
    commits = InPlaceCommits(calls, b"")  # type: ignore[arg-type]
    answers = [commits.commit(_commit(i), False, None) for i in range(COMMITS_A_REQUEST + 2)]
    durable = commits.commit(_commit(99), True, None)
    gone = answers.pop()
    gone.cancel()  # its writer gave up before the request left: not sent
    assert await asyncio.gather(*answers, durable) == [(PutStatus.STORED, 7)] * (
        COMMITS_A_REQUEST + 2
    )
    assert calls.sent == [
        (Op.COMMIT_MANY, COMMITS_A_REQUEST, 0),  # full: left at once
        (Op.COMMIT, 1, 0),  # the rest of the step
        (Op.COMMIT, 1, wire.FLAG_DURABLE),  # durable ones apart
    ]
    assert (commits.requests, commits.commits) == (3, COMMITS_A_REQUEST + 2)


async def test_a_failed_request_fails_each_of_its_writers() -> None:
    commits = InPlaceCommits(_Calls(fail=DaemonUnavailableError("gone")), b"")  # type: ignore[arg-type]
    answers = [commits.commit(_commit(i), False, None) for i in range(3)]
    for answer in answers:
        with pytest.raises(DaemonUnavailableError, match="gone"):
            await answer


async def test_a_request_sent_leaves_at_once_and_one_unanswered_times_out() -> None:
    calls = _Calls(hang=True)
    commits = InPlaceCommits(calls, b"")  # type: ignore[arg-type]
    answers = [commits.commit(_commit(i), False, 0.01) for i in range(2)]
    commits.send()
    assert calls.sent == [(Op.COMMIT_MANY, 2, 0)]  # written before this coroutine yields
    for answer in answers:
        with pytest.raises(RequestTimeoutError):
            await answer


def _allocated(fd: int) -> int:
    """Bytes of memory a memory file holds."""
    return os.fstat(fd).st_blocks * 512


async def test_a_daemon_allocates_and_maps_its_shared_memory_once_it_serves(
    sock_dir: Path,
) -> None:
    shared = {"preallocate": True, "staging_bytes": "8MiB"}
    async with running_daemon(sock_dir, shared=shared) as daemon:
        await daemon.settle()  # (the preparation is the daemon's background work)
        st = shared_stats(daemon)
        assert daemon.arena is not None and daemon.staging is not None
        assert st["arena_prepared_bytes"] == daemon.ram.capacity == 64 * MiB
        assert st["staging_prepared_bytes"] == daemon.staging.size == 8 * MiB
        assert st["preparing"] is False  # done
        # the arena's first ram.capacity bytes hold memory; the quarter above does not
        assert _allocated(daemon.arena.fd) == 64 * MiB < daemon.arena.size
        assert "prepared=67108864" in repr(daemon.arena)
        # a client maps the daemon's allocated pages in ahead of use
        async with await Client.connect(daemon.socket_path) as c:
            assert c.server is not None and c.server.shared is not None
            mapped = await asyncio.to_thread(attach, c.server.shared.path, 5.0)
            try:
                assert await asyncio.to_thread(mapped.mapped_in_done.wait, 10)
                assert mapped.mapped_in == 64 * MiB
            finally:
                mapped.release()


async def test_without_preallocation_memory_grows_with_the_blocks_stored(sock_dir: Path) -> None:
    async with running_daemon(sock_dir, shared={"preallocate": False}) as daemon:
        await daemon.settle()
        assert daemon.arena is not None
        assert shared_stats(daemon)["arena_prepared_bytes"] == 0
        assert shared_stats(daemon)["preparing"] is False  # (never started)
        assert _allocated(daemon.arena.fd) == 0
        async with await Client.connect(daemon.socket_path, shared=False) as plain:
            assert await plain.put(b"one", block(1)) is PutStatus.STORED  # the daemon copies it
        assert _allocated(daemon.arena.fd) == MiB
        async with await Client.connect(daemon.socket_path) as c:  # maps the arena
            assert c.server is not None and c.server.shared is not None
            mapped = await asyncio.to_thread(attach, c.server.shared.path, 5.0)
            try:
                assert await asyncio.to_thread(mapped.mapped_in_done.wait, 10)
                # only the pages the block holds: mapping in allocates none
                assert mapped.mapped_in == MiB
            finally:
                mapped.release()
        assert _allocated(daemon.arena.fd) == MiB


async def test_a_daemon_stopped_while_it_prepares_its_memory_stops(sock_dir: Path) -> None:
    async with running_daemon(
        sock_dir, ram={"capacity": "512MiB"}, shared={"preallocate": True}
    ) as daemon:
        assert daemon.arena is not None
        arena = daemon.arena
    # stopped at once: the step in flight ended before the arena closed
    assert 0 <= arena.prepared <= 512 * MiB
    assert not arena.preparing


async def test_a_daemon_process_holds_its_shared_memory_once_it_has_prepared_it(
    sock_dir: Path,
) -> None:
    proc = DaemonProcess(
        sock_dir, "--ram-capacity", "64MiB", env={"KVTIER_SHARED__PREALLOCATE": "true"}
    ).start()
    try:
        with BlockingClient(proc.socket_path) as c:

            def prepared() -> bool:
                st = c.stats()["shared"]
                return not st["preparing"] and (
                    st["arena_prepared_bytes"],
                    st["staging_prepared_bytes"],
                ) == (64 * MiB, st["staging_bytes"])

            await wait_on_timers(prepared)  # (the daemon's worker thread)
            staging = c.stats()["shared"]["staging_bytes"]
        # allocated and mapped in the daemon
        assert memory_of(proc.pid)["RssShmem"] >= 64 * MiB + staging
    finally:
        assert proc.stop() == 0

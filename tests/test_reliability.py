"""Whatever a client or a backend does, every probe, reservation and connection
ends on time. One deterministic test per failure found from outside."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from kvtier import BlockingClient, Client, PutStatus, ReserveStatus, State, wire
from kvtier.config import load_config
from kvtier.daemon import Daemon
from kvtier.errors import ErrorCode
from kvtier.model import Lookup, Reserve
from kvtier.tiers.memory import MemoryRemoteTier
from kvtier.wire import Op
from tests.helpers import DaemonProcess, metric_value, rss_bytes, running_daemon, wait_until

K = b"k" * 32
OTHER = b"o" * 32
M, P = State.MISS, State.PENDING


@pytest.fixture
async def daemon(sock_dir: Path) -> AsyncIterator[Daemon]:
    async with running_daemon(sock_dir, disk={"enabled": False}) as d:
        yield d


class Raw:
    """An asyncio connection that speaks frames by hand."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, path: Path) -> Raw:
        return cls(*await asyncio.open_unix_connection(str(path)))

    def send(self, op: int, rid: int, meta: bytes = b"", data: bytes = b"") -> None:
        self.writer.write(wire.pack_header(op, rid, len(meta), len(data)) + meta + data)

    async def recv(self) -> wire.Frame:
        header = wire.unpack_header(await self.reader.readexactly(wire.HEADER_SIZE))
        meta = await self.reader.readexactly(header.meta_len)
        data = await self.reader.readexactly(header.data_len)
        return wire.Frame(header, meta, data)

    async def send_ping(self) -> None:
        """A PING, answered: the daemon has taken the connection."""
        self.send(Op.PING, 999, b"p")
        assert (await self.recv()).header.request_id == 999

    def half_close(self) -> None:
        sock = self.writer.get_extra_info("socket")
        sock.shutdown(socket.SHUT_WR)

    async def at_eof(self) -> bool:
        return await self.reader.read(1) == b""

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


def protocol_errors(d: Daemon, code: str) -> float:
    return d.metrics.registry.get_sample_value("kvtier_protocol_errors_total", {"code": code}) or 0


# ---------------------------------------------------------------- 1, 2: connections


async def test_half_close_mid_frame_with_a_request_in_flight_frees_everything(
    daemon: Daemon,
) -> None:
    async with await Client.connect(daemon.socket_path) as other:
        assert await other.reserve([OTHER], deadline=600.0)  # keeps the lookup below waiting
        raw = await Raw.open(daemon.socket_path)
        raw.send(Op.RESERVE, 1, wire.encode_reserve(Reserve([K], [0], 600.0)))
        assert (await raw.recv()).header.status == 0
        raw.send(Op.LOOKUP, 2, wire.encode_lookup(Lookup([OTHER], wait=600.0)))
        meta, data = wire.encode_put([K], [b"v" * 1_000_000])
        frame = wire.pack_header(Op.PUT, 3, len(meta), 1_000_000) + meta + bytes(data[0])
        raw.writer.write(frame[: len(frame) // 2])  # a big frame, cut in the middle
        await raw.writer.drain()
        assert (await other.stats())["server"]["requests_waiting"] == 1
        raw.half_close()
        # The waiting lookup answers at once with what is known, then the daemon closes.
        reply = await raw.recv()
        assert wire.decode_lookup_reply(reply.meta).states == [P]
        assert await raw.at_eof()
        await raw.close()
        # Its reservation ended with its EOF (it can never send the PUT now) ...
        assert (await other.lookup([K])).states == [M]
        stats = await other.stats()
        assert stats["maps"]["reservations"] == 1  # only the other writer's
        assert stats["server"]["connections"] == 1
        # ... and the half frame was discarded and counted.
        assert protocol_errors(daemon, "truncated_frame") == 1


async def test_eof_ends_reservations_while_a_get_of_its_own_is_in_flight(
    daemon: Daemon,
) -> None:
    async with await Client.connect(daemon.socket_path) as other:
        assert await other.reserve([OTHER], deadline=600.0)
        raw = await Raw.open(daemon.socket_path)
        raw.send(Op.RESERVE, 1, wire.encode_reserve(Reserve([K], [0], 600.0)))
        assert (await raw.recv()).header.status == 0
        raw.send(Op.GET, 2, wire.encode_keys([OTHER]))  # waits on the other writer
        await raw.writer.drain()
        assert (await other.stats())["server"]["requests_waiting"] == 1
        await raw.close()  # fully closed while its GET is in flight
        # Its reservation ends at once, not when the GET finishes.
        waited = await other.lookup([K], wait=30.0)
        assert waited.states == [M]
        assert (await other.stats())["maps"]["reservations"] == 1
        await other.put(OTHER, b"x")  # the GET can finish now; its reply has nowhere to go
        await daemon.settle()
        stats = await other.stats()
        assert stats["server"]["connections"] == 1
        assert stats["server"]["requests_waiting"] == 0


# ---------------------------------------------------------------- who may connect


async def test_a_user_not_allowed_is_refused_counted_and_others_served(sock_dir: Path) -> None:
    import os
    import stat

    from kvtier.errors import ForbiddenError

    async with running_daemon(
        sock_dir,
        disk={"enabled": False},
        server={"socket_mode": "0660", "allowed_uids": [os.getuid() + 1]},
    ) as d:
        assert stat.S_IMODE(os.stat(d.socket_path).st_mode) == 0o660
        with pytest.raises(ForbiddenError, match=f"uid {os.getuid()}"):
            await Client.connect(d.socket_path)
        refused = d.metrics.registry.get_sample_value(
            "kvtier_connections_refused_total", {"reason": "not_allowed"}
        )
        assert refused == 1
        assert d.server is not None and not d.server.connections
    async with (
        running_daemon(
            sock_dir,
            disk={"enabled": False},
            server={"socket_mode": 0o660, "allowed_gids": [os.getgid()]},
        ) as d,
        await Client.connect(d.socket_path) as c,
    ):
        assert await c.ping(b"in") == b"in"  # admitted by its group


def test_socket_mode_must_not_open_the_socket_to_others() -> None:
    from kvtier.config import load_config
    from kvtier.errors import ConfigError

    for bad in ("0666", "0644", "0400", 0o700):
        with pytest.raises(ConfigError, match="socket_mode"):
            load_config(None, {"server": {"socket_mode": bad}})
    assert load_config(None, {"server": {"socket_mode": "0660"}}).server.socket_mode == 0o660


def test_peer_policy_defaults() -> None:
    import os

    from kvtier.server.sockets import Peer, PeerPolicy

    me, other = Peer(1, os.getuid(), 0), Peer(2, os.getuid() + 1, 4242)
    private = PeerPolicy.for_socket(0o600, None, None)
    assert private.allows(other) and private.allows(None)  # the file mode decides
    shared = PeerPolicy.for_socket(0o660, None, None)
    assert shared.allows(me) and not shared.allows(other) and not shared.allows(None)
    listed = PeerPolicy.for_socket(0o660, None, [4242])
    assert listed.allows(other) and not listed.allows(me)


# ---------------------------------------------------------------- shutdown


class StubbornTier(MemoryRemoteTier):
    """A backend whose lookup ignores cancellation until released."""

    def __init__(self) -> None:
        super().__init__("stubborn")
        self.release = asyncio.Event()

    async def batch_lookup(self, keys: Sequence[bytes]) -> list[bool]:
        self.lookup_started.set()
        while True:
            try:
                await self.release.wait()
                return [False] * len(keys)
            except asyncio.CancelledError:
                continue  # the misbehaviour under test


async def test_shutdown_abandons_a_task_that_ignores_cancellation(
    sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier = StubbornTier()
    config = load_config(
        None,
        {
            "server": {"socket_path": sock_dir / "d.sock", "shutdown_task_timeout": 0.2},
            "metrics": {"enabled": False},
            "disk": {"enabled": False},
            "lookup": {"probe_timeout": 60.0},
        },
    )
    daemon = Daemon(config, remote_tiers=[tier])
    run = asyncio.create_task(daemon.run())
    await daemon.ready.wait()
    try:
        async with await Client.connect(daemon.socket_path) as c:
            assert (await c.lookup([K])).states == [State.RETRY]
        await tier.lookup_started.wait()
        daemon.stop()
        await asyncio.wait_for(run, 30)  # returns although the probe never ends
        assert daemon.background.abandoned == 1
        assert "abandoned background task" in caplog.text
        assert not daemon.socket_path.exists()
    finally:
        tier.release.set()  # let the abandoned task end before the test's loop closes
        await asyncio.sleep(0)  # allow-sleep: one loop turn for the released task


def test_the_process_exits_although_a_task_ignores_cancellation() -> None:
    code = (
        "import asyncio\n"
        "from kvtier import loops\n"
        "async def stubborn():\n"
        "    while True:\n"
        "        try:\n"
        "            await asyncio.Event().wait()\n"
        "        except asyncio.CancelledError:\n"
        "            pass\n"
        "async def main():\n"
        "    asyncio.get_running_loop().create_task(stubborn())\n"
        "    await asyncio.sleep(0)\n"
        "    return 'done'\n"
        "print(loops.run(main()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "done"


# ---------------------------------------------------------------- accounting

MIB = 1 << 20


def ram_bytes(d: Daemon) -> tuple[int, int]:
    """(reserved_bytes, used_bytes) of the RAM tier."""
    st = d.ram.stats()
    return st.reserved_bytes, st.used_bytes


async def _stall_mid_body(d: Daemon, key: bytes) -> tuple[Raw, bytes]:
    """RESERVE ``key`` (1 MiB) and start its PUT on a raw connection, stopping
    halfway through the body; returns the connection and the rest of the frame."""
    raw = await Raw.open(d.socket_path)
    raw.send(Op.RESERVE, 1, wire.encode_reserve(Reserve([key], [MIB], 0.0)))
    assert wire.decode_status_bytes((await raw.recv()).meta) == [ReserveStatus.GRANTED]
    assert ram_bytes(d)[0] == MIB
    meta, data = wire.encode_put([key], [bytes([7]) * MIB])
    frame = wire.pack_header(Op.PUT, 2, len(meta), MIB) + meta + b"".join(bytes(p) for p in data)
    half = len(frame) - MIB // 2
    before = d.server.counters.received_bytes.value
    raw.writer.write(frame[:half])
    await raw.writer.drain()
    await wait_until(lambda: d.server.counters.received_bytes.value - before >= half)
    return raw, frame[half:]


async def test_a_reserved_put_received_in_place_is_counted_once(daemon: Daemon) -> None:
    assert daemon.arena is not None  # the body lands straight in its arena slot
    # stalled mid-body: the reservation's room became the slot, not a second one
    raw, rest = await _stall_mid_body(daemon, K)
    assert ram_bytes(daemon) == (MIB, 0)
    # completed: the block is used, nothing reserved
    raw.writer.write(rest)
    reply = await raw.recv()
    assert reply.header.status == 0
    assert wire.decode_put_reply(reply.meta) == [PutStatus.STORED]
    assert ram_bytes(daemon) == (0, MIB)
    await raw.close()
    # aborted: the writer goes away mid-body; its reservation and slot are freed
    raw, _ = await _stall_mid_body(daemon, OTHER)
    assert ram_bytes(daemon) == (MIB, MIB)
    await raw.close()
    await wait_until(lambda: daemon.service.map_sizes().pending_writes == 0)
    await wait_until(lambda: ram_bytes(daemon) == (0, MIB))


async def test_a_reserved_put_through_staging_is_counted_once(sock_dir: Path) -> None:
    async with (
        running_daemon(sock_dir, shared={"write_in_place": False}) as daemon,
        await Client.connect(daemon.socket_path, stage_writes=True) as c,
    ):
        assert c.shared
        await c.reserve([K], [MIB])
        assert ram_bytes(daemon) == (MIB, 0)
        # staged, not committed: the staging region is not RAM's budget
        frame = await c.request(Op.STAGE, wire.encode_u64(MIB))
        offset = wire.decode_u64(frame.meta, "STAGE")
        assert ram_bytes(daemon) == (MIB, 0)
        # completed
        assert await c.put(K, bytes([3]) * MIB) == PutStatus.STORED
        assert ram_bytes(daemon) == (0, MIB)
        # aborted before its commit
        await c.reserve([OTHER], [MIB])
        assert ram_bytes(daemon) == (MIB, MIB)
        assert await c.abort([OTHER]) == [True]
        assert ram_bytes(daemon) == (0, MIB)
        await c.request(Op.UNSTAGE, wire.encode_u64(offset))


async def test_a_reserved_put_written_in_place_is_counted_once_committed(daemon: Daemon) -> None:
    """An in-place room is RAM (its slot becomes the block): while the block
    is written it counts beside the reservation; once committed, once."""
    async with await Client.connect(daemon.socket_path) as c:
        assert c.shared
        await c.reserve([K], [MIB])
        assert ram_bytes(daemon) == (MIB, 0)
        frame = await c.request(Op.STAGE, wire.encode_stage(MIB, in_place=True))
        offset = wire.decode_u64(frame.meta, "STAGE")
        assert ram_bytes(daemon) == (2 * MIB, 0)  # the reservation, and the room
        await c.request(Op.UNSTAGE, wire.encode_stage(offset, in_place=True))
        assert await c.put(K, bytes([3]) * MIB) == PutStatus.STORED
        # the block, once; held too: the room the client keeps for its next
        # block, and the one the daemon made for the COMMIT after that
        assert ram_bytes(daemon) == (2 * MIB, MIB)
        assert daemon.shared is not None
        assert daemon.shared.stats().in_place_rooms == 1
        assert daemon.shared.stats().in_place_prepared == 1
        await c.reserve([OTHER], [MIB])
        assert await c.abort([OTHER]) == [True]
        assert ram_bytes(daemon) == (2 * MIB, MIB)
        assert daemon.server is not None
        (conn,) = daemon.server.connections
    await conn.done.wait()
    assert ram_bytes(daemon) == (0, MIB)  # the spare room given back, the prepared one freed


# ---------------------------------------------------------------- memory

#: what the daemon may hold beyond RAM's capacity and the write backlog while
#: small blocks stream in: the RAM tier's bookkeeping per block and allocator
#: slack, plus the disk tier's index (its key, size and eviction order) per
#: block on disk
RSS_SLACK = 32 * MIB
DISK_INDEX_PER_BLOCK = 512


def test_small_blocks_stream_through_in_bounded_memory(sock_dir: Path) -> None:
    # 20 MiB in 5,000 blocks of 4 KiB: more than twice RAM and backlog together
    ram, backlog, n, size = 4 * MIB, 4 * MIB, 5_000, 4096
    proc = DaemonProcess(
        sock_dir,
        "--ram-capacity",
        str(ram),
        "--disk-capacity",
        "4GiB",
        env={"KVTIER_DISK__MAX_PENDING_WRITE_BYTES": str(backlog)},
    ).start()
    try:
        base = peak = rss_bytes(proc.pid)
        with BlockingClient(proc.socket_path, shared=False) as c:
            for start in range(0, n, 500):
                keys = [i.to_bytes(32, "big") for i in range(start, start + 500)]
                c.put_many(keys, [bytes([i % 251]) * size for i in range(500)])
                peak = max(peak, rss_bytes(proc.pid))
            tiers = c.stats()["tiers"]
            assert tiers["ram"]["used_bytes"] <= ram
        bound = ram + backlog + RSS_SLACK + DISK_INDEX_PER_BLOCK * tiers["disk"]["blocks"]
        assert peak - base <= bound, (
            f"RSS grew by {(peak - base) / MIB:.0f} MiB, more than {bound / MIB:.0f} MiB "
            f"({tiers['disk']['blocks']} blocks on disk)"
        )
        dropped = metric_value(
            proc.scrape(), "kvtier_tier_writes_dropped_total", 'cause="backlog",tier="disk"'
        )
        assert dropped == 0  # past the backlog the writer is slowed: nothing is dropped
        assert tiers["disk"]["blocks"] == n  # (a write in flight is indexed)
    finally:
        assert proc.stop() == 0


# ---------------------------------------------------------------- what RAM has promised


async def _half_put(path: Path, key: bytes, size: int, deadline: float = 1.0) -> Raw:
    """A raw connection that RESERVEs ``key`` (``size`` bytes, for
    ``deadline`` seconds) and sends half of its PUT frame."""
    raw = await Raw.open(path)
    raw.send(Op.RESERVE, 1, wire.encode_reserve(Reserve([key], [size], deadline)))
    assert wire.decode_status_bytes((await raw.recv()).meta) == [ReserveStatus.GRANTED]
    meta, data = wire.encode_put([key], [bytes([7]) * size])
    frame = wire.pack_header(Op.PUT, 2, len(meta), size) + meta + b"".join(map(bytes, data))
    raw.writer.write(frame[: len(frame) - size // 2])
    await raw.writer.drain()
    return raw


async def test_every_body_being_received_is_counted(daemon: Daemon) -> None:
    """A 4 KiB and a 1 MiB reserved PUT, each half received: STATS counts
    the room of both (the small body's reservation keeps its room until
    the block is stored; the large one's became its arena slot)."""
    assert daemon.server is not None
    small = await _half_put(daemon.socket_path, K, 4096)
    large = await _half_put(daemon.socket_path, OTHER, MIB)
    await wait_until(lambda: not any(c.reader.idle for c in daemon.server.connections))
    async with await Client.connect(daemon.socket_path) as c:
        stats = await c.stats()
    assert stats["tiers"]["ram"]["reserved_bytes"] == 4096 + MIB
    assert stats["tiers"]["ram"]["used_bytes"] == 0
    assert stats["server"]["receiving_bytes"] == 0  # both land in RAM's own room
    for raw in (small, large):
        await raw.close()
    await wait_until(lambda: daemon.service.map_sizes().pending_writes == 0)
    assert ram_bytes(daemon) == (0, 0)


async def test_a_writer_stalled_inside_a_put_body_is_closed_and_its_room_freed(
    sock_dir: Path,
) -> None:
    """RESERVE with a short deadline, half a 1 MiB PUT, then silence with the
    connection open: readers read MISS at the deadline, and at
    ``server.body_timeout`` the daemon says why, closes the connection and
    gives back the room; a bystander is served throughout."""
    async with (
        running_daemon(sock_dir, disk={"enabled": False}, server={"body_timeout": 0.6}) as d,
        await Client.connect(d.socket_path, lookup_process=False) as c,
    ):
        raw = await _half_put(d.socket_path, K, MIB, deadline=0.3)
        assert ram_bytes(d) == (MIB, 0)
        assert (await c.lookup([K], wait=30.0)).states == [M]  # the write deadline
        async with asyncio.timeout(30):
            reply = await raw.recv()  # the daemon's word, then its EOF
            assert reply.header.status == ErrorCode.TIMEOUT
            assert reply.header.request_id == 2
            assert "body_timeout" in wire.decode_error(reply.meta)
            assert await raw.at_eof()
        await raw.close()
        await wait_until(lambda: d.server is not None and len(d.server.connections) == 1)
        assert ram_bytes(d) == (0, 0)
        assert protocol_errors(d, "body_timeout") == 1
        assert await c.ping(b"still") == b"still"
        await c.put(K, b"v")
        assert await c.get(K) == b"v"


# ---------------------------------------------------------------- writes kept, not dropped


async def test_a_burst_of_puts_is_slowed_to_the_disk_not_dropped(sock_dir: Path) -> None:
    """3,000 PUTs of 1 KiB through a 256 KiB RAM tier with write-through to
    a disk whose writes in flight are bounded at 64 KiB: the writer is
    slowed while the bound is reached instead of its blocks being dropped,
    so the disk ends with every block (RAM evicted most meanwhile)."""
    n, value = 1500, b"v" * 1024
    keys = [b"burst-%05d" % i for i in range(n)]
    async with (
        running_daemon(
            sock_dir,
            ram={"capacity": "256KiB"},
            disk={
                "path": sock_dir / "data",
                "capacity": "64MiB",
                "max_pending_write_bytes": "64KiB",
            },
        ) as d,
        await Client.connect(d.socket_path, lookup_process=False) as c,
    ):
        for lo in range(0, n, 100):  # 100 single-key PUTs in flight at a time
            statuses = await asyncio.gather(*(c.put(k, value) for k in keys[lo : lo + 100]))
            assert set(statuses) == {PutStatus.STORED}
        await d.settle()
        stats = await c.stats()
        assert stats["writes"]["disk"]["dropped_backlog"] == 0
        assert stats["writes"]["disk"]["in_flight_bytes"] == 0
        assert stats["tiers"]["disk"]["blocks"] == n
        assert stats["tiers"]["ram"]["evictions"] > n // 3
        assert (await c.lookup(keys)).states == [State.HIT] * n
        assert d.service.write_room() is None


# ---------------------------------------------------------------- EOF closes


async def test_a_half_closed_connection_closes_once_its_replies_are_out(sock_dir: Path) -> None:
    """The histories the protocol fuzzer left open after a half-close: every
    request is answered, then the daemon closes at once, and the
    connection's reservation ends with it."""
    async with (
        running_daemon(
            sock_dir,
            disk={"enabled": False},
            server={"max_frame_bytes": "4MiB", "max_block_bytes": "1MiB"},
        ) as d,
        await Client.connect(d.socket_path, lookup_process=False) as other,
    ):
        keys = [b"a", b"b"]
        lookup = wire.encode_lookup(Lookup(keys, wait=5.0, request_tag=b"t"))
        first = Raw(*await asyncio.open_unix_connection(str(d.socket_path)))
        first.send(Op.PING, 1, b"ping")
        first.send(Op.RESERVE, 2, wire.encode_reserve(Reserve(keys, [4096, 0], 60.0)))
        first.send(Op.LOOKUP, 3, lookup)  # waits on its own reservations
        first.send(Op.LOOKUP, 4, wire.encode_lookup(Lookup(keys)))
        values = [bytes([i]) * (1 << 20) for i in range(3)]
        meta, parts = wire.encode_put([b"x", b"y", b"z"], values)
        data = b"".join(bytes(p) for p in parts)
        second = Raw(*await asyncio.open_unix_connection(str(d.socket_path)))
        second.send(Op.PUT, 1, meta, data)  # near the maximum frame size
        second.send(Op.PUT, 2, *wire.encode_put([b"w"], [b"v"])[:1], b"v")
        for raw, rids in ((first, {1, 2, 3, 4}), (second, {1, 2})):
            await raw.writer.drain()
            raw.half_close()
            async with asyncio.timeout(10):
                answered = {(await raw.recv()).header.request_id for _ in rids}
                assert answered == rids
                assert await raw.at_eof()  # closed, not left open
            await raw.close()
        await wait_until(lambda: d.server is not None and len(d.server.connections) == 1)
        assert (await other.stats())["maps"]["reservations"] == 0
        assert (await other.lookup([b"x", b"y", b"z", b"w"])).states == [State.HIT] * 4


async def test_a_half_closed_subscriber_is_closed(sock_dir: Path) -> None:
    """A SUBSCRIBE stream lasts as long as its connection: once the client
    half-closes (it can ask for nothing more), the stream ends and the
    daemon closes the connection instead of keeping it open for ever."""
    async with running_daemon(sock_dir, disk={"enabled": False}) as d:
        raw = await Raw.open(d.socket_path)
        raw.send(Op.PING, 1, b"ping")
        raw.send(Op.SUBSCRIBE, 2, wire.encode_subscribe(True, 0))
        assert (await raw.recv()).header.request_id == 1
        first = await raw.recv()  # the snapshot
        assert first.header.request_id == 2 and first.header.flags & wire.FLAG_MORE
        raw.half_close()
        async with asyncio.timeout(10):
            while not await raw.at_eof():
                pass  # (any events still on the way)
        await raw.close()
        await wait_until(lambda: d.server is not None and not d.server.connections)


async def test_a_writer_the_daemon_stopped_reading_is_not_timed_out(sock_dir: Path) -> None:
    """``body_timeout`` is for clients that stall, not for the daemon's own
    flow control: a client whose replies back up is not read from, so its
    half-sent PUT receives nothing for a while; it is not closed for that,
    and its PUT lands once it reads its replies."""
    async with (
        running_daemon(sock_dir, disk={"enabled": False}, server={"body_timeout": 0.2}) as d,
        await Client.connect(d.socket_path, lookup_process=False) as c,
    ):
        assert d.server is not None
        await c.put(OTHER, bytes(MIB))
        raw = await Raw.open(d.socket_path)
        await raw.send_ping()
        conn = max(d.server.connections, key=lambda x: x.conn_id.value)  # raw's, the newest
        assert conn.flow is not None
        # A GET whose 1 MiB reply backs up, and in the same write the first
        # half of a PUT: the daemon stops reading inside the PUT's frame.
        meta, data = wire.encode_put([K], [b"p" * MIB])
        frame = wire.pack_header(Op.PUT, 1, len(meta), MIB) + meta + b"".join(map(bytes, data))
        get = wire.encode_keys([OTHER])
        raw.writer.write(
            wire.pack_header(Op.GET, 100, len(get), 0) + get + frame[: len(frame) // 2]
        )
        await wait_until(lambda: conn.flow is not None and conn.flow.read_paused)
        assert not conn.reader.idle
        await asyncio.sleep(1.0)  # allow-sleep: five body timeouts pass with reading paused
        assert protocol_errors(d, "body_timeout") == 0
        raw.writer.write(frame[len(frame) // 2 :])
        answered = set()
        async with asyncio.timeout(30):
            while 1 not in answered:
                answered.add((await raw.recv()).header.request_id)
        assert answered == {100, 1}
        assert await c.get(K) == b"p" * MIB
        await raw.close()

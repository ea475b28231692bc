"""The client against an in-process daemon, and against a scripted fake server."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier import BlockingClient, Client, LookupMode, LookupReply, PutStatus, State, wire
from kvtier.backoff import Backoff
from kvtier.client.batching import SOCKET_ONLY, SOLO_VALUE_BYTES, WritePath
from kvtier.client.options import ClientOptions, OptionChanges
from kvtier.client.protocol import checked
from kvtier.client.redial import Redial
from kvtier.daemon import Daemon
from kvtier.errors import (
    BadArgumentError,
    BadKeyError,
    ConnectionClosedError,
    DaemonUnavailableError,
    KvtierError,
    RequestTimeoutError,
    ValueTooLargeError,
)
from kvtier.wire import Op
from tests.helpers import DaemonProcess, wait_until

MiB = 1 << 20


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


async def test_put_get_lookup_delete(daemon: Daemon) -> None:
    async with await Client.connect(daemon.socket_path) as client:
        assert client.server is not None and client.server.version == 1
        assert await client.put(key(1), b"one") == PutStatus.STORED
        assert await client.put(key(1), b"one") == PutStatus.EXISTS
        assert await client.get(key(1)) == b"one"
        assert await client.get(key(2)) is None
        reply = await client.lookup([key(1), key(2)])
        assert reply.states == [State.HIT, State.MISS]
        assert await client.delete(key(1)) is True
        assert await client.delete(key(1)) is False
        assert await client.get(key(1)) is None


async def test_many_concurrent_calls_on_one_connection(daemon: Daemon) -> None:
    async with await Client.connect(daemon.socket_path) as client:
        values = {key(i): bytes([i % 251]) * (1 + i * 97 % 5000) for i in range(300)}
        statuses = await asyncio.gather(*(client.put(k, v) for k, v in values.items()))
        assert set(statuses) == {PutStatus.STORED}
        got = await asyncio.gather(*(client.get(k) for k in values))
        assert [bytes(g or b"") for g in got] == list(values.values())


async def test_put_many_splits_and_keeps_order(daemon: Daemon) -> None:
    async with await Client.connect(daemon.socket_path) as client:
        keys = [key(i) for i in range(50)]
        values = [bytes([i]) * (200_000 if i % 10 == 0 else 100) for i in range(50)]
        assert await client.put_many(keys, values) == [PutStatus.STORED] * 50
        assert [bytes(v or b"") for v in await client.get_many(keys)] == values
        reply = await client.lookup([*keys, key(999)], mode=LookupMode.PREFIX)
        assert (reply.prefix_hits, reply.defer) == (50, False)


async def test_errors_are_typed_and_leave_the_connection_usable(daemon: Daemon) -> None:
    async with await Client.connect(daemon.socket_path) as client:
        with pytest.raises(BadKeyError, match=r"1\.\.256"):
            await client.get(b"")
        with pytest.raises(BadKeyError):
            await client.put(b"k" * 257, b"v")
        with pytest.raises(ValueTooLargeError, match="maximum block size"):
            await client.put(b"k", bytes(16 * 1024 * 1024 + 1))
        assert await client.ping(b"still here") == b"still here"


async def test_connect_to_nothing_is_a_clear_error(sock_dir: Path) -> None:
    with pytest.raises(DaemonUnavailableError, match="no kvtier daemon"):
        await Client.connect(sock_dir / "absent.sock")


def test_blocking_client(daemon_thread: Path) -> None:
    with BlockingClient(daemon_thread) as client:
        assert client.put(b"key", b"value") == PutStatus.STORED
        assert client.get(b"key") == b"value"
        assert client.get(b"nope") is None
        assert client.lookup_prefix([b"key", b"nope"]).prefix_hits == 1
        assert client.stats()["tiers"]["ram"]["blocks"] == 1
        with pytest.raises(BadKeyError):
            client.get(b"")


@pytest.fixture
def daemon_thread(sock_dir: Path) -> Iterator[Path]:
    """A daemon on its own loop in a thread, for the blocking client."""
    import threading

    from tests.helpers import running_daemon

    started = threading.Event()
    loop = asyncio.new_event_loop()
    stop: asyncio.Event | None = None

    async def main() -> None:
        nonlocal stop
        stop = asyncio.Event()
        async with running_daemon(sock_dir):
            started.set()
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),))
    thread.start()
    assert started.wait(30)
    yield sock_dir / "d.sock"
    assert stop is not None
    loop.call_soon_threadsafe(stop.set)
    thread.join(30)
    loop.close()


# ------------------------------------------------------------ scripted server


FrameHandler = Callable[[list[wire.Frame], asyncio.StreamWriter], None]


async def scripted_server(
    path: Path, on_frames: Callable[[wire.Frame, asyncio.StreamWriter], None]
) -> asyncio.AbstractServer:
    """A server answering HELLO properly and routing other frames to ``on_frames``."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                header = wire.unpack_header(await reader.readexactly(wire.HEADER_SIZE))
                meta = await reader.readexactly(header.meta_len)
                data = await reader.readexactly(header.data_len)
                frame = wire.Frame(header, meta, data)
                if header.opcode == wire.Op.HELLO:
                    reply = wire.encode_hello_reply(
                        wire.HelloReply(1, 256, 1000, 1 << 26, 1 << 24, "scripted")
                    )
                    writer.writelines(
                        wire.frame_parts(wire.Op.HELLO, header.request_id, reply, flags=1)
                    )
                else:
                    on_frames(frame, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    return await asyncio.start_unix_server(handle, str(path))


async def test_replies_out_of_order_reach_their_callers(sock_dir: Path) -> None:
    held: list[wire.Frame] = []
    writers: list[asyncio.StreamWriter] = []

    def on_frame(frame: wire.Frame, writer: asyncio.StreamWriter) -> None:
        held.append(frame)
        writers.append(writer)
        if len(held) == 3:  # answer in reverse order
            for f in reversed(held):
                writer.writelines(
                    wire.frame_parts(f.header.opcode, f.header.request_id, f.meta, flags=1)
                )

    server = await scripted_server(sock_dir / "s.sock", on_frame)
    async with server, await Client.connect(sock_dir / "s.sock") as client:
        results = await asyncio.gather(client.ping(b"a"), client.ping(b"b"), client.ping(b"c"))
    assert list(results) == [b"a", b"b", b"c"]


async def test_timeout_drops_the_late_reply(sock_dir: Path) -> None:
    held: list[tuple[wire.Frame, asyncio.StreamWriter]] = []
    arrived = asyncio.Event()

    def on_frame(frame: wire.Frame, writer: asyncio.StreamWriter) -> None:
        if frame.meta == b"slow":
            held.append((frame, writer))
            arrived.set()
            return
        writer.writelines(
            wire.frame_parts(frame.header.opcode, frame.header.request_id, frame.meta, flags=1)
        )

    server = await scripted_server(sock_dir / "s.sock", on_frame)
    async with server, await Client.connect(sock_dir / "s.sock") as client:
        with pytest.raises(RequestTimeoutError):
            await client.ping(b"slow", timeout=0.05)
        assert arrived.is_set()
        frame, writer = held[0]
        writer.writelines(
            wire.frame_parts(frame.header.opcode, frame.header.request_id, b"late", flags=1)
        )
        assert await client.ping(b"fast") == b"fast"  # the late reply went nowhere
        assert " in_flight=0 " in repr(client)


async def test_server_closing_fails_pending_calls(sock_dir: Path) -> None:
    def on_frame(frame: wire.Frame, writer: asyncio.StreamWriter) -> None:
        writer.close()

    server = await scripted_server(sock_dir / "s.sock", on_frame)
    async with server:
        client = await Client.connect(sock_dir / "s.sock")
        with pytest.raises(ConnectionClosedError):
            await client.ping()
        with pytest.raises(ConnectionClosedError):
            await client.ping()
        await client.close()


async def test_get_into_receives_blocks_straight_into_the_callers_buffer(daemon: Daemon) -> None:
    from kvtier.errors import ValueTooLargeError

    big, small = bytes(range(256)) * 4096, b"tiny block"  # 1 MiB (direct), 10 B (ring)
    async with await Client.connect(daemon.socket_path) as c:
        await c.put_many([b"big", b"small"], [big, small])
        region = bytearray(b"\xee" * (3 * len(big)))  # three rows, like a KV region
        rows = [memoryview(region)[i * len(big) : (i + 1) * len(big)] for i in range(3)]
        got = await c.get_many_into([b"big", b"small", b"absent"], rows)
        assert got == [len(big), len(small), None]
        assert rows[0] == big
        assert rows[1][: len(small)] == small and rows[1][len(small) :] == b"\xee" * (
            len(big) - len(small)
        )
        assert rows[2] == b"\xee" * len(big)  # a miss writes nothing
        with pytest.raises(ValueTooLargeError, match="destination holds 100"):
            await c.get_into(b"big", bytearray(100))
        assert await c.get_into(b"small", bytearray(64)) == len(small)  # still usable
        with pytest.raises(ValueError, match="read-only"):
            await c.get_into(b"small", b"read-only bytes")


async def test_an_engine_tier_never_strands_a_key_on_a_short_answer(sock_dir: Path) -> None:
    """A server that answers one state fewer than the keys asked: every key
    still gets an answer (MISS), none is left waiting."""
    from kvtier.integrations.engine import Answer, EngineTier

    def on_frame(frame: wire.Frame, writer: asyncio.StreamWriter) -> None:
        req = wire.decode_lookup(frame.meta)
        states = bytes([1] * (len(req.keys) - 1))  # HIT for all but the last: one short
        reply = wire.encode_lookup_reply(LookupReply(states, len(states), False))
        writer.writelines(wire.frame_parts(wire.Op.LOOKUP, frame.header.request_id, reply, flags=1))

    server = await scripted_server(sock_dir / "s.sock", on_frame)
    async with server:
        tier = EngineTier(sock_dir / "s.sock")
        try:
            keys = [b"a", b"b", b"c"]
            assert [tier.lookup("r", k) for k in keys] == [Answer.RETRY] * 3
            tier.flush()
            await asyncio.to_thread(tier.drain)
            assert [tier.lookup("r", k) for k in keys] == [Answer.MISS] * 3
        finally:
            await asyncio.to_thread(tier.close)


# ---------------------------------------------------------------- one client, two faces


def _public(cls: type) -> dict[str, object]:
    return {
        name: inspect.getattr_static(cls, name) for name in dir(cls) if not name.startswith("_")
    }


def _parameters(fn: object) -> list[tuple[str, object, object]]:
    params = list(inspect.signature(fn).parameters.values())  # type: ignore[arg-type]
    return [(p.name, p.kind, p.default) for p in params if p.name not in ("self", "cls")]


def _unnamed(params: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Parameters with the default client name left out (of a ``name``
    parameter, or of the default options)."""
    out = []
    for p in params:
        if p[0] == "name":
            p = (*p[:2], None)
        elif isinstance(p[2], ClientOptions):
            p = (*p[:2], dataclasses.replace(p[2], name=""))
        out.append(p)
    return out


def test_every_public_method_of_the_client_has_a_blocking_twin() -> None:
    aio, blocking = _public(Client), _public(BlockingClient)
    instance_attrs = {"path", "timeout", "name", "server"}  # set by the async client's __init__
    missing = sorted(set(aio) - set(blocking) - instance_attrs)
    assert not missing, f"BlockingClient lacks {missing}"
    assert instance_attrs <= set(blocking)
    for name, attr in aio.items():
        twin = blocking.get(name)
        if name == "connect":  # the constructor connects too, with the same options
            ours = _parameters(BlockingClient.__init__)
            assert [p[:2] for p in ours] == [p[:2] for p in _parameters(Client.connect)]
        if isinstance(attr, property):
            assert isinstance(twin, property), name
            continue
        fn = attr.__func__ if isinstance(attr, classmethod | staticmethod) else attr
        if not callable(fn):
            continue
        twin_fn = twin.__func__ if isinstance(twin, classmethod | staticmethod) else twin
        ours, theirs = _parameters(twin_fn), _parameters(fn)
        if name in ("connect", "connect_tcp"):  # only the default client name differs
            ours, theirs = _unnamed(ours), _unnamed(theirs)
        assert ours == theirs, f"{name}: blocking {ours} != async {theirs}"


def test_the_blocking_client_offers_leases_and_shared_memory(sock_dir: Path) -> None:
    proc = DaemonProcess(sock_dir, "--ram-capacity", "64MiB").start()
    try:
        block = bytes(range(256)) * 1024
        with BlockingClient(proc.socket_path) as c:
            assert c.shared  # the daemon offers shared memory on this host
            c.put(b"k", block)
            with c.lease(b"k") as view:
                assert view is not None and bytes(view) == block
            assert c.stats()["shared"]["leases"] == 0  # given back on leaving the block
            with c.lease(b"absent") as view:
                assert view is None
        with BlockingClient(proc.socket_path, shared=False) as c:
            assert not c.shared
            assert c.get(b"k") == block
            frame = c.request(Op.PING, b"raw")
            assert bytes(frame.meta) == b"raw"
    finally:
        assert proc.stop() == 0


# ---------------------------------------------------------------- redial


def test_backoff_doubles_to_its_cap_and_resets_on_success() -> None:
    b = Backoff(0.05, 0.3)
    assert [b.failed(10.0) for _ in range(4)] == [0.05, 0.1, 0.2, 0.3]
    assert b.not_before == 10.3
    b.succeeded()
    assert (b.not_before, b.failed(0.0)) == (0.0, 0.05)
    with pytest.raises(ValueError, match="first <= most"):
        Backoff(1.0, 0.5)


async def test_redial_shares_one_attempt_and_waits_out_its_backoff_on_its_clock(
    daemon: Daemon,
) -> None:
    now = [100.0]
    gate = asyncio.Event()
    attempts: list[str] = []
    fail = [True]

    async def dial() -> Client:
        attempts.append("dial")
        await gate.wait()
        if fail[0]:
            raise DaemonUnavailableError("down")
        return await Client.connect(daemon.socket_path)

    redial = Redial(dial, what="test daemon", backoff=Backoff(1.0, 4.0), clock=lambda: now[0])
    callers = [asyncio.create_task(redial.client()) for _ in range(5)]
    await wait_until(lambda: len(attempts) == 1)
    gate.set()
    results = await asyncio.gather(*callers, return_exceptions=True)
    # The first caller's attempt failed; the others then met its backoff.
    assert attempts == ["dial"]
    assert all(isinstance(r, DaemonUnavailableError) for r in results)
    assert "next attempt in 1.00s" in str(results[-1])
    now[0] += 0.5
    with pytest.raises(DaemonUnavailableError, match=r"next attempt in 0\.50s"):
        await redial.client()
    fail[0] = False
    now[0] += 0.5  # the backoff has passed on the injected clock
    client = await redial.client()
    assert attempts == ["dial", "dial"] and redial.connected
    assert await redial.client() is client  # kept, not dialled again
    assert "connected" in repr(redial)
    redial.drop()
    assert not redial.connected
    await redial.close()


def test_the_options_keywords_are_the_options_record_s_fields() -> None:
    """``Client.connect(path, namespace=...)`` and the record say the same:
    the keyword arguments' names and types are the record's fields'."""
    assert [f.name for f in dataclasses.fields(ClientOptions)] == list(
        OptionChanges.__annotations__
    )
    assert typing.get_type_hints(OptionChanges) == typing.get_type_hints(ClientOptions)


def test_bad_options_are_refused_before_connecting(tmp_path: Path) -> None:
    with pytest.raises(BadArgumentError, match="idle_poll"):
        ClientOptions(idle_poll=-1)
    with pytest.raises(TypeError, match="nmespace"):
        asyncio.run(Client.connect(tmp_path / "none.sock", nmespace="x"))  # type: ignore[call-arg]
    # no daemon listens there: the name is refused first
    with pytest.raises(BadArgumentError, match="letters, digits"):
        asyncio.run(Client.connect(tmp_path / "none.sock", namespace="no spaces"))


def test_the_write_path_is_chosen_once_from_the_options_and_what_the_daemon_offers() -> None:
    small, mid, large = bytes(SOLO_VALUE_BYTES - 1), bytes(SOLO_VALUE_BYTES), bytes(MiB)
    # No shared memory, or stage_writes=False: everything over the socket.
    for path in (WritePath.choose(None, False, True), WritePath.choose(False, True, True)):
        assert path == SOCKET_ONLY
        assert not path.one(large) and not path.many([large, large])
    # The default, written in place: a lone block of 512 KiB or more, and
    # every batch with a block of 64 KiB or more.
    in_place = WritePath.choose(None, True, True)
    assert in_place.one(large) and not in_place.one(mid)
    assert in_place.many([large, large, small]) and in_place.many([mid, mid])
    assert not in_place.many([small, small])
    # The default, staged: a batch only where its one large block is alone.
    staged = WritePath.choose(None, True, False)
    assert staged.many([large, small]) and not staged.many([large, large])
    # stage_writes=True: every block of 64 KiB or more.
    every = WritePath.choose(True, True, False)
    assert every.one(mid) and not every.one(small)
    assert every.many([mid, mid]) and not every.many([small, small])


def test_client_options_refuse_bad_lookup_process_seconds() -> None:
    with pytest.raises(BadArgumentError, match="lookups_timeout"):
        ClientOptions(lookups_timeout=0)
    with pytest.raises(BadArgumentError, match="lookups_redial"):
        ClientOptions(lookups_redial=-1)


def test_a_request_sent_without_waiting_is_answered_through_its_future(sock_dir: Path) -> None:
    proc = DaemonProcess(sock_dir, "--ram-capacity", "64MiB").start()
    try:
        with BlockingClient(proc.socket_path) as c:
            reply = c.send(Op.PING, b"hello").result(10)
            assert bytes(checked(reply).meta) == b"hello"
            bad = c.send(Op.GET, b"\xff").result(10)  # a malformed key list: an error reply
            with pytest.raises(KvtierError):
                checked(bad)
    finally:
        proc.stop()

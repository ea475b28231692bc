"""The direct reader: loads in the caller's thread, through shared memory.

The daemon here runs on the test's event loop, so each blocking call of the
reader runs in a worker thread (``asyncio.to_thread``), as an engine's
thread would call it.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.client.aio import Client
from kvtier.client.direct import DirectReader
from kvtier.daemon import Daemon
from kvtier.errors import (
    BadArgumentError,
    BadKeyError,
    ConnectionClosedError,
    DaemonUnavailableError,
    RequestTimeoutError,
    ValueTooLargeError,
)
from tests.helpers import running_daemon, shared_stats, wait_until

KiB, MiB = 1024, 1024 * 1024

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="Linux only")


def block(seed: int, size: int) -> bytes:
    return bytes([seed % 251]) * (size - 1) + bytes([seed % 7])


async def connect(daemon: Daemon, namespace: str = "", timeout: float = 5.0) -> DirectReader:
    return await asyncio.to_thread(
        DirectReader.connect, daemon.socket_path, namespace=namespace, timeout=timeout
    )


async def read(reader: DirectReader, keys: list[bytes], dests: list[bytearray]) -> list[int | None]:
    return await asyncio.to_thread(reader.get_many_into, keys, [memoryview(d) for d in dests])


async def test_blocks_land_in_the_callers_buffers_and_every_lease_goes_back(
    daemon: Daemon,
) -> None:
    # large blocks leased out of the arena, a small one inside the reply,
    # one absent, one shorter than its buffer
    sizes = {b"big-0": MiB, b"big-1": 256 * KiB, b"small": 4 * KiB, b"short": 100 * KiB}
    async with await Client.connect(daemon.socket_path) as c:
        await c.put_many(list(sizes), [block(i, n) for i, n in enumerate(sizes.values())])
    reader = await connect(daemon)
    try:
        keys = [b"big-0", b"absent", b"big-1", b"small", b"short"]
        dests = [bytearray(MiB) for _ in keys]
        got = await read(reader, keys, dests)
        assert got == [MiB, None, 256 * KiB, 4 * KiB, 100 * KiB]
        assert dests[0] == block(0, MiB)
        assert dests[1] == bytes(MiB)  # untouched
        assert dests[2][: 256 * KiB] == block(1, 256 * KiB)
        assert dests[3][: 4 * KiB] == block(2, 4 * KiB)
        assert dests[4][: 100 * KiB] == block(3, 100 * KiB)
        assert reader.blocks_read == 4 and reader.leases_taken == 1
        await asyncio.to_thread(reader.get_many_into, [], [])  # (a read of nothing)
        # the UNLEASE went out after the copies; a read after it is answered after it
        await read(reader, [b"absent"], [bytearray(1)])
        st = shared_stats(daemon)
        assert st["leases"] == 0 and st["leases_ended"]["released"] == 1
        assert daemon.ram.budget.pinned_count == 0
        assert "open" in repr(reader) and "blocks_read=4" in repr(reader)
    finally:
        reader.close()
    assert reader.closed and "closed" in repr(reader)
    with pytest.raises(ConnectionClosedError):
        await read(reader, [b"big-0"], [bytearray(MiB)])


async def test_a_block_too_long_for_its_buffer_copies_nothing_and_the_reader_goes_on(
    daemon: Daemon,
) -> None:
    keys = [b"fits", b"too-long"]
    async with await Client.connect(daemon.socket_path) as c:
        await c.put_many(keys, [block(1, MiB), block(2, MiB)])
    reader = await connect(daemon)
    try:
        dests = [bytearray(MiB), bytearray(10)]
        with pytest.raises(ValueTooLargeError, match="destination holds 10"):
            await read(reader, keys, dests)
        assert dests == [bytearray(MiB), bytearray(10)]  # checked before any copy
        got = [bytearray(MiB)]
        assert await read(reader, [b"too-long"], got) == [MiB]  # the reader goes on
        assert got[0] == block(2, MiB)
        st = shared_stats(daemon)
        assert st["leases"] == 0 and st["leases_ended"]["released"] == 2
    finally:
        reader.close()


async def test_bad_arguments_are_refused_before_anything_is_sent(daemon: Daemon) -> None:
    reader = await connect(daemon)
    try:
        with pytest.raises(BadArgumentError, match="2 keys for 1 destinations"):
            await read(reader, [b"a", b"b"], [bytearray(1)])
        assert not reader.closed
        # the daemon's error reply: raised, and the connection goes on
        too_long = b"k" * (reader.server.max_key_bytes + 1)
        with pytest.raises(BadKeyError):
            await read(reader, [too_long], [bytearray(1)])
        assert not reader.closed
        assert await read(reader, [b"absent"], [bytearray(1)]) == [None]
    finally:
        reader.close()
    with pytest.raises(BadArgumentError):
        await connect(daemon, namespace="x" * 300)


async def test_a_reader_sees_its_own_namespace_only(daemon: Daemon) -> None:
    async with await Client.connect(daemon.socket_path, namespace="tenant-a") as c:
        await c.put(b"k", block(5, MiB))
    mine, other = await connect(daemon, "tenant-a"), await connect(daemon)
    try:
        assert await read(mine, [b"k"], [bytearray(MiB)]) == [MiB]
        assert await read(other, [b"k"], [bytearray(MiB)]) == [None]
    finally:
        mine.close()
        other.close()


async def test_no_daemon_or_no_shared_memory_is_refused_at_connect(sock_dir: Path) -> None:
    with pytest.raises(DaemonUnavailableError, match="no kvtier daemon is listening"):
        await asyncio.to_thread(DirectReader.connect, sock_dir / "none.sock")
    async with running_daemon(sock_dir, shared={"enabled": False}) as d:
        with pytest.raises(DaemonUnavailableError, match="offers no shared memory"):
            await connect(d)


@pytest.fixture
def silent_server(tmp_path: Path) -> Iterator[Path]:
    """A socket that takes connections and never answers."""
    path = tmp_path / "silent.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen()
    yield path
    server.close()


def test_a_daemon_that_does_not_answer_times_out(silent_server: Path) -> None:
    with pytest.raises(RequestTimeoutError, match=r"no reply within 0\.05s"):
        DirectReader.connect(silent_server, timeout=0.05)


async def test_a_read_past_its_timeout_closes_the_reader_and_its_leases_end(
    daemon: Daemon,
) -> None:
    """The daemon's loop held up while a read waits (the read runs on the
    loop's own thread, so the loop cannot answer): the read times out and
    the reader closes; the daemon then answers the connection it finds
    closed, and ends the lease it granted."""
    async with await Client.connect(daemon.socket_path) as c:
        await c.put(b"k", block(1, MiB))
    reader = await connect(daemon, timeout=0.2)
    with pytest.raises(RequestTimeoutError, match=r"no reply within 0\.2s"):
        reader.get_many_into([b"k"], [memoryview(bytearray(MiB))])  # (blocks the loop)
    assert reader.closed
    await wait_until(lambda: shared_stats(daemon)["leases"] == 0)
    assert daemon.ram.budget.pinned_count == 0
    again = await connect(daemon)
    try:
        assert await read(again, [b"k"], [bytearray(MiB)]) == [MiB]
    finally:
        again.close()


async def test_the_callers_buffers_are_taken_while_the_daemon_answers(daemon: Daemon) -> None:
    """``read_into`` asks first and takes the buffers before the answer
    comes: with the daemon unable to answer (the read runs on its loop's
    thread) the buffers are still taken, and the read then times out."""
    async with await Client.connect(daemon.socket_path) as c:
        await c.put(b"k", block(1, MiB))
    reader = await connect(daemon, timeout=0.2)
    taken: list[bool] = []

    def buffers() -> list[memoryview | None]:
        taken.append(True)
        return [memoryview(bytearray(MiB))]

    with pytest.raises(RequestTimeoutError):
        reader.read_into([b"k"], buffers)  # (blocks the loop)
    assert taken == [True] and reader.closed


async def test_keys_without_a_buffer_are_not_copied_and_bad_buffers_close_the_reader(
    daemon: Daemon,
) -> None:
    keys = [b"a", b"b", b"c"]
    async with await Client.connect(daemon.socket_path) as c:
        await c.put_many(keys, [block(i, MiB) for i in range(3)])
    reader = await connect(daemon)
    dests = [bytearray(MiB), bytearray(MiB)]
    got = await asyncio.to_thread(
        reader.read_into, keys, lambda: [memoryview(dests[0]), None, memoryview(dests[1])]
    )
    assert got == [MiB, None, MiB] and dests == [block(0, MiB), block(2, MiB)]
    assert reader.blocks_read == 2

    def fails() -> list[memoryview | None]:
        raise MemoryError("no buffers")

    with pytest.raises(MemoryError):
        await asyncio.to_thread(reader.read_into, keys, fails)
    assert reader.closed
    reader = await connect(daemon)
    with pytest.raises(BadArgumentError, match="3 keys for 1 destinations"):
        await asyncio.to_thread(reader.read_into, keys, lambda: [None])
    assert reader.closed
    # the answers nobody copied: their leases ended with the connections
    await wait_until(lambda: shared_stats(daemon)["leases"] == 0)
    assert daemon.ram.budget.pinned_count == 0
    st = shared_stats(daemon)
    assert st["leases_ended"]["released"] == 1

"""Stores wait for the end of their loop step: the reads that arrived with
them are answered first, and each connection's requests keep their order.

Against an in-process daemon on the test's loop: two requests written in the
same step reach the daemon in the same step (one poll of both sockets).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from kvtier import Client, PutStatus, State
from kvtier.daemon import Daemon
from kvtier.errors import KvtierError
from kvtier.server.connection import Connection
from tests.helpers import running_daemon

KiB = 1024


async def test_a_lookup_that_arrives_with_a_store_is_answered_first(
    daemon: Daemon, sock_dir: Path
) -> None:
    sock = sock_dir / "d.sock"
    value = os.urandom(4 * KiB)
    async with (
        await Client.connect(sock) as writer,
        await Client.connect(sock, lookup_process=False) as reader,  # the daemon's order
    ):
        # Both sent in this step: the PUT first, on its own connection.
        put = asyncio.ensure_future(writer.put(b"k", value))
        lookup = asyncio.ensure_future(reader.lookup([b"k"]))
        first = await lookup
        assert not put.done()  # its reply leaves a step later
        assert first.states == [State.MISS]  # answered before the store ran
        assert await put == PutStatus.STORED
        assert (await reader.lookup([b"k"])).states == [State.HIT]
        assert await reader.get(b"k") == value


async def test_requests_behind_a_held_store_keep_their_order(
    daemon: Daemon, sock_dir: Path
) -> None:
    async with await Client.connect(sock_dir / "d.sock") as client:
        # One connection, one step: the LOOKUP waits behind the PUT it follows.
        put = asyncio.ensure_future(client.put(b"k", os.urandom(4 * KiB)))
        lookup = asyncio.ensure_future(client.lookup([b"k"]))
        assert (await lookup).states == [State.HIT]
        assert put.done() and put.result() == PutStatus.STORED
    assert repr(daemon.server).startswith("<Server connections=") and "holding=0" in repr(
        daemon.server
    )


async def test_a_store_held_when_its_connection_drops_leaves_no_slot(sock_dir: Path) -> None:
    async with running_daemon(sock_dir) as daemon:
        server = daemon.server
        hold = server.hold
        dropped: list[Connection] = []

        def drop_then_hold(conn: Connection) -> None:
            # The connection is lost ahead of its turn: its PUT body, received
            # into a RAM slot, goes with it, and the held PUT is never run.
            assert conn.transport is not None
            conn.transport.abort()
            dropped.append(conn)
            hold(conn)

        server.hold = drop_then_hold  # type: ignore[method-assign]
        async with await Client.connect(sock_dir / "d.sock", stage_writes=False) as client:
            with pytest.raises((KvtierError, OSError)):
                await client.put(b"big", os.urandom(256 * KiB))
        server.hold = hold  # type: ignore[method-assign]
        (conn,) = dropped
        await conn.done.wait()
        assert conn.closed and "held=0" in repr(conn)
        async with await Client.connect(sock_dir / "d.sock") as other:
            assert (await other.lookup([b"big"])).states == [State.MISS]
        ram = daemon.ram.stats()
        assert (ram.blocks, ram.used_bytes, ram.arena_allocated_bytes or 0) == (0, 0, 0)

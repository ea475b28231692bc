"""Cross-memory attach: the daemon reads a writer's blocks out of its memory."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import xxhash

from kvtier import cma, wire
from kvtier.client.aio import Client
from kvtier.daemon import Daemon
from kvtier.errors import BadArgumentError, ForbiddenError
from kvtier.model import Buffer, PutStatus
from kvtier.wire import Op
from tests.helpers import ROOT, received_bytes, running_daemon, shared_stats

MiB = 1024 * 1024

pytestmark = pytest.mark.skipif(not cma.AVAILABLE, reason="Linux only")


@pytest.fixture(params=[0, 2], ids=["copies-on-loop", "copy-threads"])
async def daemon(request: pytest.FixtureRequest, sock_dir: Path) -> AsyncIterator[Daemon]:
    """A daemon nobody writes in place to: a batch of large blocks is then
    read out of its writer's memory, on its loop or in 2 threads."""
    shared = {"write_in_place": False, "copy_threads": request.param}
    async with running_daemon(sock_dir, shared=shared) as d:
        yield d


def test_address_of_names_the_bytes_of_any_contiguous_buffer() -> None:
    """Writable or read-only, sliced, of any item size or shape: the address
    and length are those of the buffer's own bytes."""
    import ctypes

    whole = bytearray(b"0123456789")
    address, length = cma.address_of(whole)
    assert length == 10 and ctypes.string_at(address, 10) == b"0123456789"
    ctypes.memmove(address + 2, b"ab", 2)  # written through it: the buffer's bytes
    assert whole == bytearray(b"01ab456789")
    assert cma.address_of(memoryview(whole)[3:7]) == (address + 3, 4)
    frozen = bytes(whole)
    at, n = cma.address_of(frozen)
    assert n == 10 and ctypes.string_at(at, n) == frozen
    cells = bytearray(96)
    grid = memoryview(cells).cast("q", (3, 4))  # 8-byte items, two dimensions
    at, n = cma.address_of(grid)
    assert (at, n) == (cma.address_of(cells)[0], 96)
    assert cma.address_of(bytearray())[1] == 0
    with pytest.raises(ValueError, match="contiguous"):
        cma.address_of(memoryview(whole)[::2])


def block(seed: int, size: int = MiB) -> bytes:
    return (bytes([seed % 251, (seed * 3) % 241]) * (size // 2 + 1))[:size]


async def test_large_blocks_are_read_out_of_the_writers_memory(daemon: Daemon) -> None:
    async with await Client.connect(daemon.socket_path) as c:
        assert await c.put(b"one", block(1)) == PutStatus.STORED  # alone: over the socket
        assert c.process_region is None
        before = received_bytes(daemon)
        keys = [b"small", b"one", b"two", b"three"]
        values: list[Buffer] = [
            b"s" * 100,
            block(1),
            bytearray(block(2)),
            memoryview(block(3, 2 * MiB)),
        ]
        statuses = await c.put_many(keys, values)
        assert statuses == [PutStatus.STORED, PutStatus.EXISTS, PutStatus.STORED, PutStatus.STORED]
        # Keys, addresses and checksums crossed the socket (and the small block).
        assert received_bytes(daemon) - before < 8192
        assert c.process_region
        assert shared_stats(daemon)["region_bytes_in"] == MiB + 2 * MiB  # "one" was not read
        for key, value in zip(keys, values, strict=True):
            got = await c.get(key)
            assert got is not None and bytes(got) == bytes(value)
        assert "staged=0" in repr(daemon.ram.slots)


async def test_a_wrong_checksum_stores_nothing(daemon: Daemon) -> None:
    async with await Client.connect(daemon.socket_path) as c:
        await c.put_many([b"w1", b"w2"], [block(8), block(9)])  # attaches the region
        region = c.process_region
        assert region
        value = block(4)
        io = wire.RegionIO(
            region, [b"liar"], [cma.address_of(value)], [xxhash.xxh3_64_intdigest(value) ^ 1]
        )
        refused = shared_stats(daemon)["commits_refused"]
        with pytest.raises(BadArgumentError, match="checksum"):
            await c.request(Op.PUT_REGION, wire.encode_region_io(io))
        assert await c.get(b"liar") is None
        assert shared_stats(daemon)["commits_refused"] == refused + 1
        assert "staged=0" in repr(daemon.ram.slots)


async def test_a_probe_the_daemon_cannot_read_is_refused(daemon: Daemon) -> None:
    async with await Client.connect(daemon.socket_path, cross_memory=False) as c:
        bad = wire.ProcessProbe(0x1000, 64, 0)  # nothing is mapped there
        with pytest.raises(ForbiddenError, match="cross-memory"):
            await c.request(Op.REGION, wire.encode_process_region(bad))
        probe = os.urandom(64)
        address, length = cma.address_of(probe)
        wrong = wire.ProcessProbe(address, length, xxhash.xxh3_64_intdigest(probe) ^ 1)
        with pytest.raises(BadArgumentError, match="probe"):
            await c.request(Op.REGION, wire.encode_process_region(wrong))
        assert shared_stats(daemon)["regions"] == 0


_DYING_WRITER = """
import os, sys
from kvtier import cma, wire
from kvtier.client.blocking import BlockingClient
from kvtier.wire import Op

c = BlockingClient(sys.argv[1])
c.put_many([b"w1", b"w2"], [bytes(1 << 20), bytes(1 << 20)])  # attaches this process's memory
value = bytes([7]) * (1 << 20)
io = wire.RegionIO(
    c.process_region, [b"orphan"], [cma.address_of(value)], None
)
c.post(Op.PUT_REGION, wire.encode_region_io(io))
os._exit(0)  # gone before, during or after the daemon's copy
"""


async def test_a_writer_that_dies_mid_store_leaves_no_slot_behind(daemon: Daemon) -> None:
    proc = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", textwrap.dedent(_DYING_WRITER), str(daemon.socket_path)],
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 0
    assert daemon.server is not None
    for conn in list(daemon.server.connections):
        await conn.done.wait()
    await daemon.settle()
    async with await Client.connect(daemon.socket_path) as c:
        got = await c.get(b"orphan")
        assert got is None or bytes(got) == bytes([7]) * MiB  # whole, or not at all
    assert "staged=0" in repr(daemon.ram.slots)
    assert shared_stats(daemon)["regions"] == 0

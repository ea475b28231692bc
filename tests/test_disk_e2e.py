"""The disk tier across restarts and crashes of a real daemon process."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
from pathlib import Path

import pytest

from kvtier import Client, PutStatus, State
from kvtier.errors import KvtierError
from kvtier.tiers.disk.format import block_path
from tests.helpers import DaemonProcess


def key_of(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "big"), digest_size=32).digest()


def value_of(i: int, size: int = 64 * 1024) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little")).digest() * (size // 64)


def temp_files(root: Path) -> list[str]:
    return [f for _, _, fs in os.walk(root) for f in fs if ".tmp-" in f]


async def test_durable_blocks_survive_a_restart(sock_dir: Path) -> None:
    first = DaemonProcess(sock_dir, "--ram-capacity", "64MiB").start()
    keys = [key_of(i) for i in range(200)]
    async with await Client.connect(first.socket_path) as c:
        statuses = await c.put_many(keys, [value_of(i) for i in range(200)], durable=True)
        assert statuses == [PutStatus.STORED] * 200
    assert first.stop() == 0

    second = DaemonProcess(sock_dir, "--ram-capacity", "64MiB").start()
    async with await Client.connect(second.socket_path) as c:
        reply = await c.lookup(keys, wait=30.0)  # waits out the index rebuild if needed
        assert reply.prefix_hits == 200
        got = await c.get_many(keys)
        assert all(g == value_of(i) for i, g in enumerate(got))
        stats = await c.stats()
    assert stats["tiers"]["ram"]["blocks"] == 200  # promoted from disk on the way
    assert stats["tiers"]["disk"]["blocks"] == 200
    assert second.stop() == 0


async def test_sigkill_mid_burst_loses_nothing_acknowledged(sock_dir: Path) -> None:
    proc = DaemonProcess(sock_dir, "--ram-capacity", "64MiB").start()
    acked: set[int] = set()
    enough = asyncio.Event()

    async def writer(client: Client, start: int) -> None:
        for i in range(start, 100_000, 8):
            try:
                await client.put(key_of(i), value_of(i), durable=True)
            except KvtierError:
                return  # the daemon died under us
            acked.add(i)
            if len(acked) >= 120:
                enough.set()

    clients = [await Client.connect(proc.socket_path) for _ in range(8)]
    writers = [asyncio.create_task(writer(c, n)) for n, c in enumerate(clients)]
    await enough.wait()
    proc.send_signal(signal.SIGKILL)  # while 8 durable writes are in flight
    await asyncio.gather(*writers)
    for c in clients:
        await c.close()
    assert proc.wait() == -signal.SIGKILL
    highest = max(acked)

    restarted = DaemonProcess(sock_dir, "--ram-capacity", "64MiB").start()
    async with await Client.connect(restarted.socket_path) as c:
        await c.lookup([key_of(0)], wait=30.0)  # index rebuilt
        candidates = list(range(highest + 64))
        got = await c.get_many([key_of(i) for i in candidates])
    served = {i for i, g in zip(candidates, got, strict=True) if g is not None}
    wrong = [i for i, g in zip(candidates, got, strict=True) if g is not None and g != value_of(i)]
    assert wrong == []  # checksums: nothing torn is ever served
    assert acked <= served  # every durably acknowledged block is back
    assert temp_files(restarted.data_dir) == []  # leftovers of the crash are gone
    assert restarted.stop() == 0


async def test_corrupted_files_on_disk_read_as_miss(sock_dir: Path) -> None:
    proc = DaemonProcess(sock_dir).start()
    keys = [key_of(i) for i in range(4)]
    async with await Client.connect(proc.socket_path) as c:
        await c.put_many(keys, [value_of(i) for i in range(4)], durable=True)
    assert proc.stop() == 0
    files = sorted(Path(proc.data_dir).glob("*/*.blk"), key=lambda p: p.name)
    assert len(files) == 4
    flipped = bytearray(files[0].read_bytes())
    flipped[len(flipped) // 2] ^= 0x01
    files[0].write_bytes(bytes(flipped))
    files[1].write_bytes(files[1].read_bytes()[:1000])  # truncated

    restarted = DaemonProcess(sock_dir).start()
    async with await Client.connect(restarted.socket_path) as c:
        await c.lookup([keys[0]], wait=30.0)
        got = await c.get_many(keys)
        stats = await c.stats()
    served = [g for g in got if g is not None]
    assert len(served) == 2
    assert all(bytes(g) in {value_of(i) for i in range(4)} for g in served)
    assert stats["tiers"]["disk"]["corrupt_discarded"] == 2
    text = restarted.scrape()
    assert "kvtier_disk_corrupt_blocks_total 2.0" in text
    assert restarted.stop() == 0


async def test_small_disk_stays_within_capacity(sock_dir: Path) -> None:
    capacity = 4 * 1024 * 1024
    proc = DaemonProcess(
        sock_dir, "--ram-capacity", "1MiB", "--disk-capacity", str(capacity)
    ).start()
    async with await Client.connect(proc.socket_path) as c:
        for start in range(0, 300, 50):  # 19 MiB through a 4 MiB disk
            await c.put_many(
                [key_of(i) for i in range(start, start + 50)],
                [value_of(i) for i in range(start, start + 50)],
                durable=True,
            )
            disk = (await c.stats())["tiers"]["disk"]
            assert disk["used_bytes"] <= capacity
            on_disk = sum(
                (Path(d) / f).stat().st_size for d, _, fs in os.walk(proc.data_dir) for f in fs
            )
            assert on_disk <= capacity
        assert disk["evictions"] > 0
        assert await c.get(key_of(0)) is None  # evicted from both tiers
        assert await c.get(key_of(299)) == value_of(299)
    assert proc.stop() == 0


async def test_a_block_whose_disk_read_failed_looks_up_miss_at_both_sockets(
    sock_dir: Path,
) -> None:
    """Three files with a payload byte flipped and two truncated: each GET
    finds nothing, and a LOOKUP right after answers MISS for all five, from
    the lookup process as from the daemon: the daemon's dropping a block
    reaches the lookup process's replica in the same step. The files go."""
    proc = DaemonProcess(sock_dir).start()
    keys = [key_of(i) for i in range(8)]
    async with await Client.connect(proc.socket_path) as c:
        await c.put_many(keys, [value_of(i) for i in range(8)], durable=True)
    assert proc.stop() == 0
    files = [block_path(proc.data_dir, k) for k in keys]
    assert all(f.exists() for f in files)
    for f in files[:3]:
        flipped = bytearray(f.read_bytes())
        flipped[-100] ^= 0x01  # in the payload
        f.write_bytes(bytes(flipped))
    for f in files[3:5]:
        f.write_bytes(f.read_bytes()[:1000])

    restarted = DaemonProcess(sock_dir, "--ram-capacity", "1MiB").start()
    async with (
        await Client.connect(restarted.socket_path) as c,
        await Client.connect(restarted.socket_path, lookup_process=False) as direct,
    ):
        assert c.lookups_process
        await direct.lookup(keys, wait=30.0)  # the index is rebuilt
        for k in keys[:5]:
            assert await c.get(k) is None
        stats = await c.stats()
        at_process = await c.lookup(keys[:5])
        at_daemon = await direct.lookup(keys[:5])
        for _ in range(10_000):  # its report reaches the daemon a few ms later
            answered = (await c.stats())["server"]["lookup_process"]["answered"]
            if answered:
                break
    assert stats["tiers"]["disk"]["corrupt_discarded"] == 5
    assert at_daemon.states == [State.MISS] * 5
    assert at_process.states == [State.MISS] * 5
    assert answered >= 1  # the lookup process answered, not the daemon
    assert not any(f.exists() for f in files[:5])
    assert all(f.exists() for f in files[5:])
    assert restarted.stop() == 0


def test_a_second_daemon_is_refused_the_data_directory_of_a_live_one(sock_dir: Path) -> None:
    """Two daemons in one data directory would evict and index each other's
    blocks: the second is refused at start, naming the first; once the
    first has gone (killed: the kernel lets go of its lock), one starts."""
    first = DaemonProcess(sock_dir, "--ram-capacity", "16MiB").start()
    other = sock_dir / "other"
    other.mkdir()
    second, third = (DaemonProcess(other, "--ram-capacity", "16MiB") for _ in range(2))
    second.data_dir = third.data_dir = first.data_dir
    try:
        with pytest.raises(RuntimeError, match=f"pid {first.pid}.* keeps its blocks in"):
            second.start()
        assert second.wait(30) == 1
        first.stop(signal.SIGKILL)
        third.start()
    finally:
        third.stop()
        first.stop()

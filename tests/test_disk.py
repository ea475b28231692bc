"""The disk tier on its own, and wired into the service."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kvtier import Client, PutStatus, State
from kvtier.config import DiskConfig
from kvtier.core.service import Service
from kvtier.core.timers import Scheduler
from kvtier.daemon import Daemon
from kvtier.errors import TierError
from kvtier.model import Limits, Lookup, LookupReply
from kvtier.tiers.disk import HEADER, DiskTier
from kvtier.tiers.disk import io as disk_io
from kvtier.tiers.disk import tier as disk_tier
from kvtier.tiers.ram import RamTier
from tests.helpers import running_daemon


@pytest.fixture
async def tier(tmp_path: Path) -> AsyncIterator[DiskTier]:
    t = DiskTier(tmp_path / "data", 10 * 1024 * 1024, fsync="batch")
    t.prepare()
    await t.rebuild_index()
    yield t
    await t.close()


def files_under(root: Path) -> list[Path]:
    """The files a disk tier keeps under ``root``, but for its lock."""
    lock = root / disk_io.LOCK_FILE
    return [p for d, _, fs in os.walk(root) for f in fs if (p := Path(d) / f) != lock]


async def test_round_trip_with_hostile_keys(tier: DiskTier, tmp_path: Path) -> None:
    keys = [b"/", b"..", b"../../etc/passwd", b"\x00", b"a/b\x00c", b"\xff" * 256, b"x"]
    for i, key in enumerate(keys):
        await tier.write(key, bytes([i]) * (1000 + i), durable=True)
    for i, key in enumerate(keys):
        value = await tier.read(key)
        assert value is not None and bytes(value) == bytes([i]) * (1000 + i)
    # Every file lies inside the data directory; nothing was created beside it.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]
    paths = files_under(tier.root)
    assert len(paths) == len(keys)
    assert all(p.resolve().is_relative_to(tier.root.resolve()) for p in paths)


async def test_write_is_idempotent_and_remove_works(tier: DiskTier) -> None:
    await tier.write(b"k", b"one")
    await tier.write(b"k", b"two")  # present already: kept as is
    assert bytes(await tier.read(b"k") or b"") == b"one"
    assert await tier.remove(b"k")
    assert not await tier.remove(b"k")
    assert await tier.read(b"k") is None
    assert files_under(tier.root) == []


async def test_flipped_byte_is_discarded_never_served(tier: DiskTier) -> None:
    await tier.write(b"k", b"A" * 5000)
    path = tier.path_of(b"k")
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert await tier.read(b"k") is None
    assert tier.corrupt == 1
    assert not tier.contains(b"k") and not path.exists()


async def test_truncated_and_stray_files_are_cleaned_at_rebuild(tmp_path: Path) -> None:
    root = tmp_path / "data"
    first = DiskTier(root, 10 * 1024 * 1024, fsync="always")
    first.prepare()
    await first.rebuild_index()
    for i in range(20):
        await first.write(bytes([i]) * 8, bytes([i]) * 3000)
    await first.close()
    torn = first.path_of(bytes([3]) * 8)
    torn.write_bytes(torn.read_bytes()[:-100])  # truncated
    garbage = first.path_of(bytes([4]) * 8)
    garbage.write_bytes(b"not a block at all")
    leftover = torn.with_name(torn.name + ".tmp-0123")
    leftover.write_bytes(b"half a write")

    second = DiskTier(root, 10 * 1024 * 1024)
    second.prepare()
    assert second.scanning
    await second.rebuild_index()
    assert not second.scanning
    assert len(second) == 18
    assert second.corrupt == 2 and second.temp_removed == 1
    assert not leftover.exists() and not torn.exists()
    for i in range(20):
        value = await second.read(bytes([i]) * 8)
        assert value is None if i in (3, 4) else bytes(value or b"") == bytes([i]) * 3000
    await second.close()


async def test_capacity_holds_under_a_long_write_stream(tmp_path: Path) -> None:
    capacity = 256 * 1024
    t = DiskTier(tmp_path / "data", capacity, fsync="none")
    t.prepare()
    await t.rebuild_index()
    block = 10_000
    for i in range(200):
        await t.write(i.to_bytes(4, "big"), bytes([i % 256]) * block)
        on_disk = sum(p.stat().st_size for p in files_under(t.root))
        assert t.used_bytes <= capacity
        assert on_disk <= capacity
    per_file = HEADER.size + 4 + block
    assert len(t) == capacity // per_file
    assert t.evictions == 200 - len(t)
    assert await t.read((0).to_bytes(4, "big")) is None  # evicted long ago
    assert await t.read((199).to_bytes(4, "big")) is not None
    await t.close()


async def test_disk_full_is_a_clear_error_and_leaves_no_torn_file(
    tier: DiskTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, buffers: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "writev", full)  # the disk tier writes with os.writev
    with pytest.raises(TierError, match="disk full"):
        await tier.write(b"k", b"x" * 100)
    monkeypatch.undo()
    assert tier.enospc == 1
    assert not tier.contains(b"k")
    assert files_under(tier.root) == []  # the temporary file is gone too
    await tier.write(b"k", b"x" * 100)  # and the tier keeps working
    assert tier.contains(b"k")


@pytest.mark.parametrize("fsync", ["none", "batch", "always"])
async def test_durable_writes_under_each_fsync_policy(tmp_path: Path, fsync: str) -> None:
    t = DiskTier(tmp_path / "data", 1 << 20, fsync=fsync)  # type: ignore[arg-type]
    t.prepare()
    await t.rebuild_index()
    await asyncio.gather(*(t.write(bytes([i]), b"v" * 100, durable=True) for i in range(10)))
    assert len(t) == 10
    if fsync == "batch":
        assert t.unsynced_writes == 0  # every durable write was synced
    await t.close()


# ---------------------------------------------------------------- in the service


async def test_unscanned_keys_read_retry_then_hit(tmp_path: Path) -> None:
    root = tmp_path / "data"
    seed = DiskTier(root, 1 << 20)
    seed.prepare()
    await seed.rebuild_index()
    await seed.write(b"old", b"from before the restart", durable=True)
    await seed.close()

    disk = DiskTier(root, 1 << 20)
    disk.prepare()  # index not rebuilt yet
    service = Service(
        Limits(256, 1000, 1 << 20),
        RamTier(1 << 20),
        disk=disk,
        disk_cfg=DiskConfig(),
        scheduler=Scheduler(batch_window=0.001, max_batch=64),
    )
    async with asyncio.TaskGroup() as tasks:
        service.start(tasks.create_task)
        scheduler = tasks.create_task(service.scheduler.run())
        reply = service.lookup(Lookup([b"old", b"new"]))
        assert isinstance(reply, LookupReply) and reply.states == [State.RETRY, State.RETRY]
        await disk.rebuild_index()
        reply = service.lookup(Lookup([b"old", b"new"]))
        assert isinstance(reply, LookupReply) and reply.states == [State.HIT, State.MISS]
        service.scheduler.stop()
        await scheduler
        service.close()
    await disk.close()


@pytest.fixture
async def daemon_with_disk(sock_dir: Path) -> AsyncIterator[Daemon]:
    async with running_daemon(sock_dir, disk={"fsync": "batch"}) as d:
        yield d


async def test_32_concurrent_gets_of_a_disk_only_block_read_once(
    daemon_with_disk: Daemon,
) -> None:
    d = daemon_with_disk
    assert d.disk is not None
    async with await Client.connect(d.socket_path) as c:
        assert await c.put(b"block", b"B" * 100_000, durable=True) == PutStatus.STORED
        assert d.disk.contains(b"block")
        d.ram.remove(b"block")  # now it lives only on disk
        reads_before = d.disk.reads
        assert (await c.lookup([b"block"])).states == [State.HIT]  # readable now
        values = await asyncio.gather(*(c.get(b"block") for _ in range(32)))
        assert all(v == b"B" * 100_000 for v in values)
        assert d.disk.reads - reads_before == 1
        promoted = d.metrics.registry.get_sample_value(
            "kvtier_promotions_total", {"tier": "disk", "outcome": "completed"}
        )
        assert promoted == 1
        assert d.ram.contains(b"block")


async def test_a_key_listed_twice_is_loaded_once(daemon_with_disk: Daemon) -> None:
    d = daemon_with_disk
    assert d.disk is not None
    async with await Client.connect(d.socket_path) as c:
        await c.put(b"twice", b"T" * 1000, durable=True)
        d.ram.remove(b"twice")
        reply = await c.lookup([b"twice", b"other", b"twice"])  # prefetch starts one load
        assert reply.states == [State.HIT, State.MISS, State.HIT]
        assert await c.get_many([b"twice", b"twice"]) == [b"T" * 1000] * 2
        await d.settle()
        started = d.metrics.registry.get_sample_value(
            "kvtier_promotions_total", {"tier": "disk", "outcome": "started"}
        )
        assert started == 1


async def test_write_back_demotes_on_eviction(sock_dir: Path) -> None:
    async with running_daemon(
        sock_dir, ram={"capacity": "1MiB"}, disk={"write_policy": "write-back"}
    ) as d:
        assert d.disk is not None
        async with await Client.connect(d.socket_path) as c:
            for i in range(8):
                await c.put(bytes([i]) * 4, bytes([i]) * 300_000)
            assert not d.disk.contains(bytes([7]) * 4)  # resident in RAM only
            await d.settle()
            demoted = d.metrics.registry.get_sample_value(
                "kvtier_demotions_total", {"tier": "disk", "outcome": "completed"}
            )
            assert demoted == 5
            for i in range(8):  # everything is still readable, from one tier or the other
                assert await c.get(bytes([i]) * 4) == bytes([i]) * 300_000


async def test_a_block_demoted_while_its_disk_write_lands_is_still_found(
    sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Write-back: a block RAM evicts is on its way to the disk, never in
    neither tier. While its file write is in flight a LOOKUP finds it and a
    GET waits for the write to land, then reads it."""
    started, release = threading.Event(), threading.Event()

    def gated(*args: Any) -> Any:
        started.set()
        release.wait(30)
        return disk_io.write_block(*args)

    monkeypatch.setattr(disk_tier, "write_block", gated)
    async with running_daemon(
        sock_dir, ram={"capacity": "1MiB"}, disk={"write_policy": "write-back"}
    ) as d:
        assert d.disk is not None
        async with await Client.connect(d.socket_path) as c:
            for i in range(4):  # three fit: the fourth evicts the first
                await c.put(bytes([i]) * 4, bytes([i]) * 300_000)
            assert await asyncio.to_thread(started.wait, 30)
            first = bytes([0]) * 4
            assert not d.ram.contains(first) and d.disk.reads == 0
            assert d.disk.contains(first)  # its write in flight
            assert (await c.lookup([first])).states == [State.HIT]
            read = asyncio.ensure_future(c.get(first))
            await asyncio.to_thread(release.set)
            assert await read == bytes([0]) * 300_000
            assert d.disk.reads == 1


async def test_write_policy_none_writes_only_durable_puts(sock_dir: Path) -> None:
    async with running_daemon(sock_dir, disk={"write_policy": "none"}) as d:
        assert d.disk is not None
        async with await Client.connect(d.socket_path) as c:
            await c.put(b"cache-only", b"x" * 1000)
            await c.put(b"durable", b"y" * 1000, durable=True)
            await d.settle()
            assert not d.disk.contains(b"cache-only")
            assert d.disk.contains(b"durable")


async def test_a_durable_put_written_in_place_is_on_disk_when_it_returns(
    daemon_with_disk: Daemon,
) -> None:
    d = daemon_with_disk
    assert d.disk is not None and d.shared is not None
    block = bytes(range(256)) * 4096  # 1 MiB: written in place
    async with await Client.connect(d.socket_path) as c:
        assert await c.put(b"big", block, durable=True) == PutStatus.STORED
        assert d.shared.stats().in_place_commits == 1
        assert d.disk.contains(b"big")
        d.ram.remove(b"big")  # only the disk has it now
        assert bytes(await c.get(b"big") or b"") == block


@pytest.mark.parametrize("fsync", ["batch", "always", "none"])
async def test_a_bucket_is_made_by_its_first_block_and_kept(tmp_path: Path, fsync: Any) -> None:
    """A fresh disk makes no fan-out directory up front; a block's write
    makes its own, and the next start reads the block from it."""
    first = DiskTier(tmp_path / "data", 1 << 20, fsync=fsync)
    first.prepare()
    await first.load_index()
    await first.rebuild_index()
    assert [p.name for p in (tmp_path / "data").iterdir() if len(p.name) == 2] == []
    await first.write(b"k", b"v" * 100, durable=True)
    await first.write(b"k2", b"w" * 100)  # (a second block, the same way)
    assert first.path_of(b"k").is_file()
    await first.close()
    second = DiskTier(tmp_path / "data", 1 << 20, fsync=fsync)
    second.prepare()
    await second.load_index()
    await second.rebuild_index()
    assert bytes(await second.read(b"k") or b"") == b"v" * 100
    await second.close()

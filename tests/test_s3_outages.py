"""Outages of the object store end cleanly, against Ceph's RADOS Gateway
(tests/ceph.py): writes made while it is down are owed and reach it once
it is back, from memory or from the disk across a daemon's crash; the
owed bytes are bounded; a durable PUT without a disk rests on the store
or fails saying why. RGW is killed and started again for an outage; the
proxy in front of it goes away for the shorter ones."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier import Client
from kvtier.daemon import Daemon
from kvtier.errors import BadArgumentError, KvtierError, NotDurableError
from tests.ceph import CephS3
from tests.helpers import DaemonProcess, running_daemon, short_tmpdir, wait_on_timers

VALUE = b"owed-block" * 30_000
#: a breaker that tries the store again after 1 s of its outage (5 s by default)
QUICK: dict[str, Any] = {"breaker_reset": 1.0, "connect_timeout": 0.5, "max_attempts": 1}


@contextlib.asynccontextmanager
async def serving(
    s3: CephS3, bucket: str, *, disk: dict[str, Any] | None = None, **tier: Any
) -> AsyncIterator[tuple[Daemon, Client]]:
    """A daemon whose S3 tier is ``bucket`` (``tier``: settings of its own;
    no disk unless ``disk``), and a client of it."""
    async with (
        running_daemon(
            short_tmpdir(),
            remote_tier_configs=[s3.tier_config(bucket, **tier)],
            disk=disk or {"enabled": False},
        ) as d,
        await Client.connect(d.socket_path) as c,
    ):
        yield d, c


def sample(d: Daemon, name: str, **labels: str) -> float:
    return d.metrics.registry.get_sample_value(name, labels) or 0.0


def objects(s3: CephS3, bucket: str) -> dict[str, bytes]:
    boto = s3.boto()
    listed = boto.list_objects_v2(Bucket=bucket).get("Contents", [])
    return {o["Key"]: boto.get_object(Bucket=bucket, Key=o["Key"])["Body"].read() for o in listed}


def names(keys: list[bytes]) -> set[str]:
    return {f"fleet-a/{k.hex()}" for k in keys}


@pytest.fixture
def rgw_back(s3: CephS3) -> Iterator[None]:
    """RGW runs again after the test, whatever it did to it."""
    yield
    if s3.cluster.procs["rgw"].poll() is not None:
        s3.cluster.start_rgw()


@pytest.mark.parametrize(
    ("disk", "tier"), [(False, {}), (True, QUICK)], ids=["memory-defaults", "disk-quick-breaker"]
)
async def test_writes_made_while_the_store_is_down_reach_it_once_it_returns(
    s3: CephS3, rgw_back: None, disk: bool, tier: dict[str, Any], tmp_path: Path
) -> None:
    """RGW is killed; 16 PUTs are answered STORED and their writes through
    are owed (held in memory, or read back from the disk); RGW starts again
    and every block is in the bucket, byte for byte, nothing dropped. On the
    tier's defaults (breaker_reset 5 s), and with a disk and a quick breaker."""
    bucket = s3.new_bucket()
    keys = [b"outage-%d" % i for i in range(16)]
    values = [bytes([i]) + VALUE for i in range(16)]
    disk_cfg = {"enabled": True, "path": str(tmp_path / "disk")} if disk else None
    async with serving(s3, bucket, disk=disk_cfg, **tier) as (d, c):
        await asyncio.to_thread(s3.cluster.rgw_signal, signal.SIGKILL)
        for key, value in zip(keys, values, strict=True):
            assert await c.put(key, value) is not None  # answered at once
        # Each was sent and failed at least once (and stays owed).
        await wait_on_timers(lambda: sample(d, "kvtier_tier_writes_owed_total", tier="s3") >= 16)
        assert sample(d, "kvtier_tier_owed_blocks", tier="s3") == 16
        assert sample(d, "kvtier_tier_owed_bytes", tier="s3") == sum(map(len, values))
        await asyncio.to_thread(s3.cluster.start_rgw)
        back = time.monotonic()
        await wait_on_timers(lambda: sample(d, "kvtier_tier_owed_blocks", tier="s3") == 0)
        print(f"owed writes sent {time.monotonic() - back:.2f}s after RGW answered")
        stats = (await c.stats())["writes"]["s3"]
        assert stats["owed_sent"] == 16
        assert stats["dropped_backlog"] == stats["dropped_failed"] == stats["dropped_gone"] == 0
    stored = await asyncio.to_thread(objects, s3, bucket)
    assert stored == {f"fleet-a/{k.hex()}": v for k, v in zip(keys, values, strict=True)}


async def test_owed_writes_outlive_a_crash_of_the_daemon(
    s3: CephS3, rgw_back: None, tmp_path: Path
) -> None:
    """With a disk tier the keys owed are kept beside the blocks: a daemon
    killed (SIGKILL) while RGW is down leaves them, and the next start on
    the same data directory sends them once RGW is back."""
    bucket = s3.new_bucket()
    keys = [b"crash-owed-%d" % i for i in range(8)]
    values = [bytes([i]) + VALUE for i in range(8)]
    config = tmp_path / "kvtier.toml"
    tier = s3.tier_config(bucket, **QUICK)
    config.write_text(
        "[[remote_tiers]]\n"
        + "".join(f"{k} = {json.dumps(v)}\n" for k, v in tier.items())
        + "[disk]\nenabled = true\n"
    )
    sock_dir = short_tmpdir()
    await asyncio.to_thread(s3.cluster.rgw_signal, signal.SIGKILL)
    first = DaemonProcess(sock_dir, "--config", str(config)).start()
    try:
        async with await Client.connect(first.socket_path) as c:
            # Durable: on the disk before the answer (a block only in RAM dies
            # with the daemon, owed or not).
            await c.put_many(keys, values, durable=True)

            async def owed() -> int:
                return int((await c.stats())["writes"]["s3"]["owed_blocks"])

            for _ in range(600):
                if await owed() == 8:
                    break
                await asyncio.sleep(0.05)  # allow-sleep: the writes fail on the daemon's timers
            assert await owed() == 8
    finally:
        first.stop(signal.SIGKILL)
    await asyncio.to_thread(s3.cluster.start_rgw)
    second = DaemonProcess(sock_dir, "--config", str(config)).start()
    try:
        async with await Client.connect(second.socket_path) as c:
            for _ in range(600):
                stats = (await c.stats())["writes"]["s3"]
                if stats["owed_blocks"] == 0:
                    break
                await asyncio.sleep(0.05)  # allow-sleep: sent on the daemon's timers
            assert stats["owed_blocks"] == 0 and stats["owed_sent"] == 8, "\n".join(second.lines)
            assert stats["dropped_gone"] == 0
    finally:
        assert second.stop() == 0
    stored = await asyncio.to_thread(objects, s3, bucket)
    assert stored == {f"fleet-a/{k.hex()}": v for k, v in zip(keys, values, strict=True)}


async def test_the_owed_bytes_are_bounded_and_what_they_drop_is_counted(s3: CephS3) -> None:
    """``max_backlog_bytes`` holds three blocks: of five written while the
    store is away, two of the oldest waiting are dropped and counted, and
    three reach the bucket, the newest among them."""
    bucket = s3.new_bucket()
    keys = [b"bound-%d" % i for i in range(5)]
    tier = s3.tier_config(bucket, max_backlog_bytes=3 * len(VALUE), **QUICK)
    async with (
        running_daemon(short_tmpdir(), remote_tier_configs=[tier], disk={"enabled": False}) as d,
        await Client.connect(d.socket_path) as c,
    ):
        s3.proxy.go_away()
        try:
            for key in keys:
                await c.put(key, VALUE)
            await wait_on_timers(
                lambda: (
                    sample(d, "kvtier_tier_writes_dropped_total", tier="s3", cause="backlog") == 2
                    and sample(d, "kvtier_tier_owed_blocks", tier="s3") == 3
                )
            )
        finally:
            s3.proxy.come_back()
        await wait_on_timers(lambda: sample(d, "kvtier_tier_owed_blocks", tier="s3") == 0)
    # Which three depends on which were being sent when the newest came
    # (an entry being sent ends by its send, never by the bound).
    stored = set(await asyncio.to_thread(objects, s3, bucket))
    assert len(stored) == 3 and stored <= names(keys)


async def test_a_block_deleted_while_owed_never_reaches_the_store(s3: CephS3) -> None:
    bucket = s3.new_bucket()
    keep, gone = b"owed-kept", b"owed-deleted"
    async with serving(s3, bucket, **QUICK) as (d, c):
        s3.proxy.go_away()
        try:
            await c.put_many([keep, gone], [VALUE, VALUE])
            await wait_on_timers(lambda: sample(d, "kvtier_tier_owed_blocks", tier="s3") == 2)
            with pytest.raises(KvtierError, match="delete failed"):  # (the store is away)
                await c.delete(gone)
            assert sample(d, "kvtier_tier_owed_blocks", tier="s3") == 1
        finally:
            s3.proxy.come_back()
        await wait_on_timers(lambda: sample(d, "kvtier_tier_owed_blocks", tier="s3") == 0)
    assert set(await asyncio.to_thread(objects, s3, bucket)) == names([keep])


async def test_a_durable_put_without_a_disk_rests_on_the_store(s3: CephS3) -> None:
    """No disk tier: a durable PUT is answered once the store has the block
    (its object is there when the answer comes); with the store away it
    fails saying why, and the block is still written through once the
    store is back."""
    bucket = s3.new_bucket()
    async with serving(s3, bucket, **QUICK) as (d, c):
        await c.put(b"durable-up", VALUE, durable=True)
        boto = s3.boto()
        head = await asyncio.to_thread(
            boto.head_object, Bucket=bucket, Key=f"fleet-a/{b'durable-up'.hex()}"
        )
        assert head["ContentLength"] == len(VALUE)
        s3.proxy.go_away()
        try:
            with pytest.raises(NotDurableError, match="not durable"):
                await c.put(b"durable-down", VALUE, durable=True)
            assert await c.get(b"durable-down") == VALUE  # stored, not durable
        finally:
            s3.proxy.come_back()
        await wait_on_timers(lambda: sample(d, "kvtier_tier_owed_blocks", tier="s3") == 0)
    assert set(await asyncio.to_thread(objects, s3, bucket)) == names(
        [b"durable-up", b"durable-down"]
    )


async def test_a_durable_put_to_a_daemon_with_nothing_that_outlives_it_is_refused() -> None:
    async with (
        running_daemon(short_tmpdir(), disk={"enabled": False}) as d,
        await Client.connect(d.socket_path, shared=False) as c,
    ):
        with pytest.raises(BadArgumentError, match="no disk tier and no object store"):
            await c.put(b"nowhere", VALUE, durable=True)
        assert await c.get(b"nowhere") == VALUE  # stored as by a plain PUT


async def test_without_a_backlog_a_write_the_store_fails_is_dropped_and_counted(
    s3: CephS3,
) -> None:
    """``max_backlog_bytes = 0``: nothing is owed; a write the store fails
    is dropped and counted (``dropped_failed``), as the peers' are."""
    bucket = s3.new_bucket()
    async with serving(s3, bucket, max_backlog_bytes=0, **QUICK) as (d, c):
        s3.proxy.go_away()
        try:
            await c.put(b"unowed", VALUE)
            await d.settle()  # (the write through ended)
        finally:
            s3.proxy.come_back()
        stats = (await c.stats())["writes"]["s3"]
        assert stats["dropped_failed"] == 1 and "owed_blocks" not in stats
        assert sample(d, "kvtier_tier_writes_dropped_total", tier="s3", cause="failed") == 1
    assert await asyncio.to_thread(objects, s3, bucket) == {}

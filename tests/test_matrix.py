"""Every advertised guarantee, on the defaults and on each documented setting
that changes its path.

One daemon per setting (the defaults, with the lookup process as
``kvtier serve`` runs it; ``lookup.remote_hit = "hit"``; writes through
staging instead of in place; blocks written from a client's region; no
disk tier; the namespace's blocks sealed), with an S3 tier on a real
S3-compatible server, runs the same checks:

* a load that fails (an object whose bytes do not match) finds nothing,
  and the key never reads HIT after;
* an object another daemon sealed under a key this one lacks is never
  handed out;
* a budget too small for S3 answers MISS and sends no GET;
* a reservation reads PENDING to other clients until its PUT, and MISS
  once its writer is gone;
* a namespace's blocks are invisible to another namespace;
* a GET the store holds back is hedged, and the block arrives.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvtier import Client, PutStatus, ReserveStatus, State
from kvtier.core.costs import Costs, Estimate
from kvtier.daemon import Daemon
from kvtier.model import LookupMode, namespace_prefix
from kvtier.tiers.s3 import CHECKSUM_META, object_checksum
from kvtier.tiers.sealing import Keyring, Keys, Sealer
from tests.helpers import running_daemon, short_tmpdir
from tests.s3server import ProxiedS3

NS = "tenant-a"
#: a lookup's bound on waiting for its keys to settle (it answers as soon as they do)
SETTLE = 10.0
BLOCK = 256 * 1024


def key_file() -> Path:
    path = short_tmpdir() / "tenant-a.key"
    path.write_bytes(os.urandom(32))
    path.chmod(0o600)
    return path


#: the settings that change a guarantee's path, each as config sections
SETTINGS: dict[str, dict[str, Any]] = {
    "defaults": {"server": {"lookup_process": True}},
    "remote_hit=hit": {"lookup": {"remote_hit": "hit"}},
    "write_in_place=off": {"shared": {"write_in_place": False}},
    "regions": {},  # (a client's way of writing: blocks copied from its region)
    "disk=off": {"disk": {"enabled": False}},
    "sealed": {"namespaces": {NS: {"encryption_key_file": None}}},  # (a key file per run)
}


def sections_for(name: str) -> dict[str, Any]:
    sections = {k: dict(v) for k, v in SETTINGS[name].items()}
    if name == "sealed":
        sections["namespaces"] = {NS: {"encryption_key_file": key_file()}}
    return sections


def object_name(s3: ProxiedS3, key: bytes) -> str:
    return f"fleet-a/{NS}/{key.hex()}"


def as_stored(d: Daemon, key: bytes, value: bytes) -> bytes:
    """``value`` as a daemon with ``d``'s keys writes it to the bucket
    (sealed where the namespace has a key)."""
    return bytes(Sealer(d.parts.keys).seal(namespace_prefix(NS.encode()) + key, value))


def plant(s3: ProxiedS3, bucket: str, key: bytes, body: bytes, checksum_of: bytes) -> None:
    full = namespace_prefix(NS.encode()) + key
    s3.boto().put_object(
        Bucket=bucket,
        Key=object_name(s3, key),
        Body=body,
        Metadata={CHECKSUM_META: object_checksum(full, checksum_of)},
    )


async def put(c: Client, key: bytes, value: bytes, setting: str) -> PutStatus:
    """``value`` stored under ``key``: through a region of the client's
    (``regions``), else as a PUT."""
    if setting != "regions":
        return await c.put(key, value)
    fd = os.memfd_create("pool")
    try:
        os.ftruncate(fd, len(value))
        os.pwrite(fd, value, 0)
        region = await c.attach_region(fd)
        (status,) = await c.put_region(region, [key], [(0, len(value))])
        return status
    finally:
        os.close(fd)


def gets(s3: ProxiedS3, key: bytes) -> int:
    return sum(n for (m, p), n in s3.proxy.counts.items() if m == "GET" and key.hex() in p)


async def failed_load_reads_miss(d: Daemon, s3: ProxiedS3, bucket: str, setting: str) -> None:
    key = b"torn"
    body = os.urandom(BLOCK)
    plant(s3, bucket, key, body, checksum_of=body[::-1])  # bytes that do not match
    async with await Client.connect(d.socket_path, namespace=NS) as c:
        # (with remote_hit = "hit" the first answer may be HIT: the store
        # said it holds the object; its load is what fails)
        await c.lookup([key], mode=LookupMode.PREFIX, wait=SETTLE)
        assert await c.get(key) is None
        for _ in range(3):  # never HIT once its load failed
            reply = await c.lookup([key], mode=LookupMode.PREFIX, wait=SETTLE)
            assert reply.states != [State.HIT]
            assert await c.get(key) is None


async def sealed_elsewhere_is_never_handed_out(
    d: Daemon, s3: ProxiedS3, bucket: str, setting: str
) -> None:
    key = b"sealed-elsewhere"
    value = os.urandom(BLOCK)
    other = Sealer(Keys({NS.encode(): Keyring.of(os.urandom(32))}))
    sealed = bytes(other.seal(namespace_prefix(NS.encode()) + key, value))
    plant(s3, bucket, key, sealed, checksum_of=sealed)
    async with await Client.connect(d.socket_path, namespace=NS) as c:
        await c.lookup([key], wait=SETTLE)
        assert await c.get(key) is None
        assert (await c.lookup([key], wait=SETTLE)).states == [State.MISS]


async def a_small_budget_sends_no_get(d: Daemon, s3: ProxiedS3, bucket: str, setting: str) -> None:
    keys = [b"budget-%d" % i for i in range(4)]
    for key in keys:
        body = as_stored(d, key, os.urandom(BLOCK))
        plant(s3, bucket, key, body, checksum_of=body)
    d.service.answers.c.costs.sources.update(
        Costs({"s3": Estimate(ttfb=20e-3, throughput=100e6)}).sources
    )
    async with await Client.connect(d.socket_path, namespace=NS) as c:
        for _ in range(3):
            reply = await c.lookup(keys, mode=LookupMode.PREFIX, budget=1e-4, wait=1.0)
            assert reply.states == [State.MISS] * 4
    await d.settle()
    assert sum(gets(s3, k) for k in keys) == 0


async def a_reservation_reads_pending_until_its_put(
    d: Daemon, s3: ProxiedS3, bucket: str, setting: str
) -> None:
    value = os.urandom(BLOCK)
    async with (
        await Client.connect(d.socket_path, namespace=NS) as writer,
        await Client.connect(d.socket_path, namespace=NS) as reader,
    ):
        assert await writer.reserve([b"res"], [BLOCK]) == [ReserveStatus.GRANTED]
        assert (await reader.lookup([b"res"])).states == [State.PENDING]
        assert await put(writer, b"res", value, setting) is PutStatus.STORED
        assert (await reader.lookup([b"res"], wait=SETTLE)).states == [State.HIT]
        assert bytes(await reader.get(b"res") or b"") == value
        gone = await Client.connect(d.socket_path, namespace=NS)
        assert await gone.reserve([b"res-gone"], [BLOCK]) == [ReserveStatus.GRANTED]
        assert (await reader.lookup([b"res-gone"])).states == [State.PENDING]
        await gone.close()
        assert (await reader.lookup([b"res-gone"], wait=SETTLE)).states == [State.MISS]


async def namespaces_stay_apart(d: Daemon, s3: ProxiedS3, bucket: str, setting: str) -> None:
    value = os.urandom(BLOCK)
    async with (
        await Client.connect(d.socket_path, namespace=NS) as mine,
        await Client.connect(d.socket_path, namespace="tenant-b") as theirs,
    ):
        assert await put(mine, b"shared-name", value, setting) is PutStatus.STORED
        assert (await theirs.lookup([b"shared-name"], wait=SETTLE)).states == [State.MISS]
        assert await theirs.get(b"shared-name") is None
        assert bytes(await mine.get(b"shared-name") or b"") == value


async def a_held_get_is_hedged(d: Daemon, s3: ProxiedS3, bucket: str, setting: str) -> None:
    key = b"hedged"
    value = os.urandom(BLOCK)
    body = as_stored(d, key, value)
    plant(s3, bucket, key, body, checksum_of=body)
    await d.settle()
    s3.proxy.hold("GET", 1)  # the next GET waits until released
    try:
        async with await Client.connect(d.socket_path, namespace=NS) as c:
            await c.lookup([key], wait=SETTLE)
            assert bytes(await c.get(key) or b"") == value  # the hedge's answer
    finally:
        s3.proxy.release()
    won = d.metrics.registry.get_sample_value(
        "kvtier_hedged_reads_total", {"tier": "s3", "outcome": "won"}
    )
    assert won == 1


CHECKS = [
    failed_load_reads_miss,
    sealed_elsewhere_is_never_handed_out,
    a_small_budget_sends_no_get,
    a_reservation_reads_pending_until_its_put,
    namespaces_stay_apart,
    a_held_get_is_hedged,
]


@pytest.mark.parametrize("setting", list(SETTINGS))
async def test_every_guarantee_holds(s3: ProxiedS3, setting: str) -> None:
    bucket = s3.new_bucket()
    # (a GET not answered after 50 ms is sent again, whatever the budget)
    tier = s3.tier_config(bucket, hedge_after=0.05, hedge_max_ratio=1.0)
    async with running_daemon(
        short_tmpdir(), remote_tier_configs=[tier], **sections_for(setting)
    ) as d:
        for check in CHECKS:
            await check(d, s3, bucket, setting)

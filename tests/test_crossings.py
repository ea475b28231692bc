"""Every tier crossing hands a client exactly the bytes stored under a key,
or nothing (:meth:`kvtier.tiers.sealing.Sealer.admit`, the one rule).

Daemons whose keys and codecs differ share a real S3-compatible bucket,
or are each other's peers on loopback: a block sealed or packed by one is
opened by another that can, and is a counted miss (never bytes) where it
cannot, on the default path and on each setting that changes it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvtier import Client
from kvtier.daemon import Daemon
from kvtier.model import namespace_prefix
from kvtier.tiers.rendezvous import owner
from kvtier.tiers.sealing import HEADER, MAGIC
from tests.helpers import running_daemon, short_tmpdir
from tests.ports import free_port
from tests.s3server import ProxiedS3

NS = "tenant-a"
BLOCK = 256 * 1024
#: a plain block that begins the way a sealed one does
LOOKALIKE = MAGIC + bytes([1, 0, 0]) + bytes(HEADER.size) + os.urandom(BLOCK - HEADER.size - 6)


def key_file(where: Path) -> Path:
    path = where / "tenant-a.key"
    path.write_bytes(os.urandom(32))
    path.chmod(0o600)
    return path


def keyed(path: Path | None) -> dict[str, Any]:
    return {NS: {"encryption_key_file": path}} if path is not None else {}


def seal_failures(d: Daemon, tier: str) -> dict[str, int]:
    for t in [d.ram, d.disk, *(s.tier for s in d.parts.remotes)]:
        if t is not None and t.name == tier:
            stats = t.stats()
            assert stats.seal_failures is not None
            return stats.seal_failures
    raise AssertionError(f"no tier {tier}")


async def fill_bucket(
    s3: ProxiedS3, bucket: str, key: Path | None, codec: str, blocks: dict[bytes, bytes]
) -> None:
    """``blocks`` written through to ``bucket`` by a daemon with ``key`` for
    tenant-a (None: none) and S3 ``codec``."""
    where = short_tmpdir()
    async with running_daemon(
        where,
        remote_tier_configs=[s3.tier_config(bucket, codec=codec)],
        namespaces=keyed(key),
    ) as writer:
        async with await Client.connect(writer.socket_path, namespace=NS) as c:
            await c.put_many(list(blocks), list(blocks.values()))
        await writer.settle()
    assert len(s3.boto().list_objects_v2(Bucket=bucket).get("Contents", [])) == len(blocks)


async def read_back(
    s3: ProxiedS3, bucket: str, key: Path | None, blocks: dict[bytes, bytes], **sections: Any
) -> tuple[list[bytes | None], dict[str, int]]:
    """What a second daemon (key ``key``) hands its client for each block,
    by a lookup that waits for the probes, then GETs; and its S3 tier's
    seal failures."""
    async with running_daemon(
        short_tmpdir(),
        remote_tier_configs=[s3.tier_config(bucket)],
        namespaces=keyed(key),
        **sections,
    ) as reader:
        async with await Client.connect(reader.socket_path, namespace=NS) as c:
            keys = list(blocks)
            await c.lookup(keys, wait=5.0)
            got = [None if v is None else bytes(v) for v in await c.get_many(keys)]
            # asked again: a refused block is never served later either
            await c.lookup(keys, wait=5.0)
            again = [None if v is None else bytes(v) for v in await c.get_many(keys)]
        assert again == got
        return got, seal_failures(reader, "s3")


#: the settings that change a read's path from S3 to the client
PATHS = [
    pytest.param({}, id="defaults"),
    pytest.param({"lookup": {"remote_hit": "hit"}}, id="remote_hit=hit"),
    pytest.param({"disk": {"enabled": False}}, id="no-disk"),
]


@pytest.mark.parametrize("sections", PATHS)
async def test_a_daemon_without_the_key_hands_out_no_block_sealed_in_the_bucket(
    s3: ProxiedS3, sections: dict[str, Any]
) -> None:
    bucket = s3.new_bucket()
    blocks = {b"sealed-%d" % i: os.urandom(BLOCK) for i in range(4)}
    await fill_bucket(s3, bucket, key_file(short_tmpdir()), "none", blocks)
    got, failures = await read_back(s3, bucket, None, blocks, **sections)
    assert got == [None] * len(blocks)
    assert failures["no_key"] >= len(blocks)


async def test_a_daemon_with_the_key_hands_out_no_plain_block_in_its_namespace(
    s3: ProxiedS3,
) -> None:
    bucket = s3.new_bucket()
    blocks = {b"plain-%d" % i: os.urandom(BLOCK) for i in range(3)}
    await fill_bucket(s3, bucket, None, "none", blocks)
    got, failures = await read_back(s3, bucket, key_file(short_tmpdir()), blocks)
    assert got == [None] * len(blocks)
    assert failures["plain"] >= len(blocks)


@pytest.mark.parametrize("sections", PATHS)
async def test_a_block_packed_by_another_daemon_reads_as_it_was_stored(
    s3: ProxiedS3, sections: dict[str, Any]
) -> None:
    bucket = s3.new_bucket()
    blocks = {b"packed-%d" % i: (b"\x00\x3c" * (BLOCK // 2)) for i in range(3)}
    blocks[b"lookalike"] = LOOKALIKE  # stored wrapped: never read as a header
    await fill_bucket(s3, bucket, None, "zstd", blocks)
    got, failures = await read_back(s3, bucket, None, blocks, **sections)
    assert got == list(blocks.values())
    assert sum(failures.values()) == 0


async def test_a_plain_block_that_looks_sealed_crosses_every_tier_as_it_is(
    s3: ProxiedS3,
) -> None:
    """No key, no codec: a block whose first bytes are a header's comes back
    whole from RAM, the disk and S3."""
    bucket = s3.new_bucket()
    blocks = {b"lookalike": LOOKALIKE}
    await fill_bucket(s3, bucket, None, "none", blocks)
    stored = s3.boto().get_object(Bucket=bucket, Key="fleet-a/tenant-a/" + b"lookalike".hex())
    assert stored["Body"].read()[HEADER.size :] == LOOKALIKE  # wrapped in the bucket
    got, _ = await read_back(s3, bucket, None, blocks)
    assert got == [LOOKALIKE]
    where = short_tmpdir()
    async with (
        running_daemon(where, ram={"capacity": "1MiB"}) as d,
        await Client.connect(d.socket_path) as c,
    ):
        await c.put(b"lookalike", LOOKALIKE, durable=True)
        for i in range(8):  # RAM gives it up to the disk
            await c.put(b"filler-%d" % i, os.urandom(BLOCK))
        assert not d.ram.contains(b"lookalike")
        assert bytes(await c.get(b"lookalike") or b"") == LOOKALIKE


# -- peers


def peer_section(me: str, members: list[str]) -> dict[str, Any]:
    return {
        "listen": me,
        "members": members,
        "token": "crossings-token",
        "request_timeout": 3.0,
    }


def owned_by(addresses: list[str], i: int, tag: str) -> bytes:
    names = [a.encode() for a in addresses]
    for n in range(10_000):
        key = f"{tag}-{n}".encode()
        if owner(namespace_prefix(NS.encode()) + key, names) == names[i]:
            return key
    raise AssertionError("no key found")


async def test_a_peer_without_the_key_neither_loads_nor_keeps_a_sealed_block() -> None:
    """P seals tenant-a's blocks, Q has no key: a block Q loads from P, and
    one P pushes to Q (its owner), are misses at Q, counted, never bytes."""
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    keyfile = key_file(short_tmpdir())
    value = os.urandom(BLOCK)
    async with (
        running_daemon(
            short_tmpdir(), peer=peer_section(addresses[0], addresses), namespaces=keyed(keyfile)
        ) as p,
        running_daemon(short_tmpdir(), peer=peer_section(addresses[1], addresses)) as q,
    ):
        kept, pushed = owned_by(addresses, 0, "kept"), owned_by(addresses, 1, "pushed")
        async with await Client.connect(p.socket_path, namespace=NS) as cp:
            await cp.put(kept, value)  # P owns it: it stays at P
            await cp.put(pushed, value)  # Q owns it: pushed to Q, sealed
        await p.settle()
        await q.settle()
        async with await Client.connect(q.socket_path, namespace=NS) as cq:
            await cq.lookup([kept, pushed], wait=5.0)
            assert [await cq.get(kept), await cq.get(pushed)] == [None, None]
        failures = seal_failures(q, "peers")
        assert failures["no_key"] >= 2  # the load, and the push received
        # P itself still serves both
        async with await Client.connect(p.socket_path, namespace=NS) as cp:
            assert bytes(await cp.get(kept) or b"") == value
            assert bytes(await cp.get(pushed) or b"") == value


async def test_a_plain_block_that_looks_sealed_travels_between_peers_as_it_is() -> None:
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    async with (
        running_daemon(short_tmpdir(), peer=peer_section(addresses[0], addresses)) as p,
        running_daemon(short_tmpdir(), peer=peer_section(addresses[1], addresses)) as q,
    ):
        kept, pushed = owned_by(addresses, 0, "kept"), owned_by(addresses, 1, "pushed")
        async with await Client.connect(p.socket_path, namespace=NS) as cp:
            await cp.put(kept, LOOKALIKE)
            await cp.put(pushed, LOOKALIKE)  # to Q, its owner, received in place
        await p.settle()
        async with await Client.connect(q.socket_path, namespace=NS) as cq:
            await cq.lookup([kept], wait=5.0)
            assert bytes(await cq.get(kept) or b"") == LOOKALIKE
            assert q.ram.contains(namespace_prefix(NS.encode()) + pushed)
            assert bytes(await cq.get(pushed) or b"") == LOOKALIKE


def test_a_default_namespace_key_that_begins_with_the_mark_has_the_escaped_object_name(
    s3: ProxiedS3,
) -> None:
    """docs/s3.md: the key as every tier keeps it, escaped (0xff, 0x00, the key)."""
    from kvtier.config import S3TierConfig
    from kvtier.model import NAMESPACE_ESCAPE
    from kvtier.tiers.s3 import S3Tier

    tier = S3Tier(S3TierConfig(**s3.tier_config("kvtier-names")))
    assert tier.object_key(NAMESPACE_ESCAPE + b"\xffab") == "fleet-a/ff00ff6162"
    assert tier.object_key(namespace_prefix(b"t") + b"ab") == "fleet-a/t/6162"

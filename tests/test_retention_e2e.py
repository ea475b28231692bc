"""Retention leases end to end: a session's blocks stay in RAM while other
traffic fills it, go to the disk rather than nowhere when RAM cannot keep
them, end when the session says so, and bad leases are refused without
harm (docs/retention.md)."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest

from kvtier import wire
from kvtier.client.aio import Client
from kvtier.errors import BadArgumentError, ForbiddenError, KvtierError
from kvtier.model import LookupMode, Retention
from kvtier.tiers.rendezvous import owner
from tests.ceph import CephS3
from tests.helpers import running_daemon, wait_until
from tests.ports import free_port

BLOCK = 200_000  # five fit in the 1 MiB of RAM below
RAM = {"capacity": "1MiB"}
RAM_ONLY = {"enabled": False}
#: all of RAM may be leased: leased blocks must then leave it
ALL_LEASED = {**RAM, "retained_share": 1.0}
SESSION = Retention(b"agent-1", ttl=600.0, priority=70)


def blocks(name: str, n: int) -> tuple[list[bytes], list[bytes]]:
    return [f"{name}{i}".encode() for i in range(n)], [bytes([i + 1]) * BLOCK for i in range(n)]


async def retention(c: Client) -> dict[str, Any]:
    stats: dict[str, Any] = (await c.stats())["retention"]
    return stats


SETTINGS = {
    # the defaults: RAM above a disk written through, the lookup process on
    "defaults": dict(server={"lookup_process": True}),
    "ram-only": dict(disk=RAM_ONLY),
    "shared-memory-writes": dict(disk=RAM_ONLY, shared={"preallocate": True}),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
async def test_a_leased_session_keeps_its_blocks_in_ram_under_other_traffic(
    sock_dir: Path, setting: str
) -> None:
    async with (
        running_daemon(sock_dir, ram=RAM, **SETTINGS[setting]) as d,  # type: ignore[arg-type]
        await Client.connect(d.socket_path) as c,
    ):
        mine, values = blocks("agent", 3)
        await c.put_many(mine, values, retention=SESSION)
        other, others = blocks("other", 6)
        for key, value in zip(other, others, strict=True):  # fills RAM twice over
            await c.put(key, value)
        r = await retention(c)
        assert (r["leased_blocks"], r["sessions"], r["evicted_from_ram"]) == (3, 1, 0)
        held = r["leased_bytes"]["default"]  # (as RAM counts them: whole pages in the arena)
        assert 3 * BLOCK <= held < 3 * (BLOCK + 8192)
        assert [await c.get(k) for k in mine] == values
        # the session comes back: its lookup renews the lease and counts a return
        reply = await c.lookup_prefix(mine, retention=SESSION)
        assert reply.prefix_hits == 3
        r = await retention(c)
        assert (r["returns_asked"], r["returns_held"]) == (3, 3)
        leased = d.metrics.registry.get_sample_value(
            "kvtier_retention_leased_bytes", {"namespace": "default", "priority": "70"}
        )
        assert leased == held
        # the session is over: its blocks are ordinary again, and go first
        assert await c.unretain(SESSION.session) == 3
        for key, value in zip(other[:3], others[:3], strict=True):
            await c.delete(key)
            await c.put(key, value)
        r = await retention(c)
        assert (r["leased_blocks"], r["released"], r["broken"]) == (0, 3, 0)
        if setting != "defaults":  # (with a disk below, they are still found there)
            assert [await c.get(k) for k in mine] == [None] * 3


async def test_without_a_lease_the_same_blocks_are_gone(sock_dir: Path) -> None:
    async with (
        running_daemon(sock_dir, ram=RAM, disk=RAM_ONLY) as d,
        await Client.connect(d.socket_path) as c,
    ):
        mine, values = blocks("agent", 3)
        await c.put_many(mine, values)
        other, others = blocks("other", 6)
        for key, value in zip(other, others, strict=True):
            await c.put(key, value)
        assert [await c.get(k) for k in mine] == [None] * 3


async def test_leased_blocks_ram_cannot_keep_go_to_the_disk_rather_than_nowhere(
    sock_dir: Path,
) -> None:
    # a disk that takes no block of its own accord: the lease sends them there
    async with (
        running_daemon(sock_dir, ram=ALL_LEASED, disk={"write_policy": "none"}) as d,
        await Client.connect(d.socket_path) as c,
    ):
        mine, values = blocks("agent", 8)  # more than RAM holds, all leased
        await c.put_many(mine[:4], values[:4], retention=SESSION)
        await c.put_many(mine[4:], values[4:], retention=SESSION)
        await d.settle()
        r = await retention(c)
        assert r["evicted_from_ram"] >= 3 and r["broken"] == 0
        assert [await c.get(k) for k in mine] == values
        assert d.parts.service.disk is not None
        assert all(d.parts.service.disk.contains(k) for k in mine[:3])


async def test_leased_blocks_with_nothing_below_are_counted_broken(sock_dir: Path) -> None:
    async with (
        running_daemon(sock_dir, ram=ALL_LEASED, disk=RAM_ONLY) as d,
        await Client.connect(d.socket_path) as c,
    ):
        mine, values = blocks("agent", 8)
        await c.put_many(mine, values, retention=SESSION)
        r = await retention(c)
        assert r["broken"] == r["evicted_from_ram"] >= 3
        broken = d.metrics.registry.get_sample_value(
            "kvtier_retention_blocks_total", {"event": "broken"}
        )
        assert broken == r["broken"]


async def test_a_namespace_with_no_retained_share_keeps_no_lease(sock_dir: Path) -> None:
    async with (
        running_daemon(sock_dir, ram={**RAM, "retained_share": 0.0}, disk=RAM_ONLY) as d,
        await Client.connect(d.socket_path) as c,
    ):
        mine, values = blocks("agent", 3)
        await c.put_many(mine, values, retention=SESSION)
        r = await retention(c)
        assert (r["leased_blocks"], r["capped"], r["granted"]) == (0, 3, 3)


def _frame_lease(session: bytes, ttl: float, priority: int) -> bytes:
    return bytes([len(session)]) + session + struct.pack("<dB", ttl, priority)


@pytest.mark.parametrize(
    "meta",
    [
        _frame_lease(b"s", 0.0, 50),  # no time to keep
        _frame_lease(b"s", 1.0, 101),  # a priority out of range
        _frame_lease(b"s" * 65, 1.0, 50),  # a session id too long
        _frame_lease(b"s", 1.0, 50)[:-3],  # truncated
        b"",
    ],
)
async def test_a_bad_lease_is_refused_and_the_connection_goes_on(
    sock_dir: Path, meta: bytes
) -> None:
    async with (
        running_daemon(sock_dir, ram=RAM, disk=RAM_ONLY) as d,
        await Client.connect(d.socket_path, shared=False) as c,
        await Client.connect(d.socket_path, shared=False) as other,
    ):
        await c.put(b"k", b"v")
        with pytest.raises(KvtierError, match=r"retention|lease|truncated|session|priority"):
            await c.request(wire.Op.RETAIN, meta + wire.encode_keys([b"k"]), flags=wire.FLAG_RETAIN)
        with pytest.raises(KvtierError):
            await c.request(wire.Op.RETAIN, wire.encode_keys([b"k"]))  # no lease at all
        assert await c.ping(b"still here") == b"still here"
        assert await other.get(b"k") == b"v"
        assert (await retention(c))["leased_blocks"] == 0


async def test_the_peer_port_takes_a_retain_and_no_other_lease(sock_dir: Path) -> None:
    peer = {"listen": "127.0.0.1:0", "members": ["127.0.0.1:9"], "token": "t"}
    async with running_daemon(sock_dir, ram=RAM, disk=RAM_ONLY, peer=peer) as d:
        assert d.peer_port is not None
        async with await Client.connect_tcp("127.0.0.1", d.peer_port, token=b"t") as c:
            await c.put(b"k", b"v")
            await c.retain([b"k"], SESSION)  # a peer's session, on what it pushed
            assert d.service.retainer.stats()["leased_blocks"] == 1
            with pytest.raises(BadArgumentError, match="local clients"):  # (a lease on a PUT)
                await c.put(b"k2", b"v", retention=SESSION)
            with pytest.raises(BadArgumentError, match="local clients"):  # (on a lookup)
                await c.lookup_prefix([b"k"], retention=SESSION)
            with pytest.raises(ForbiddenError, match="UNRETAIN is not allowed on the peer port"):
                await c.unretain(SESSION.session)


@pytest.mark.parametrize("setting", ["defaults", "ram-only"])
async def test_a_sessions_lease_reaches_the_peer_that_owns_its_blocks(
    sock_dir: Path, setting: str
) -> None:
    """Blocks stored on A that B owns are pushed to B; the session's lease
    goes with them, so B keeps them before its unleased blocks, whichever
    of the push and the lease lands first. On the defaults (each daemon's
    disk written through) and on RAM alone."""
    disk = RAM_ONLY if setting == "ram-only" else {"enabled": True}
    a_dir, b_dir = sock_dir / "a", sock_dir / "b"
    a_dir.mkdir()
    b_dir.mkdir()
    here, there = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    members = [m.encode() for m in (here, there)]
    peer = {"members": [here, there], "token": "t"}
    theirs = [k for k in (b"blk-%d" % i for i in range(200)) if owner(k, members) == members[1]]
    mine, values = theirs[:3], [bytes([i + 1]) * BLOCK for i in range(3)]
    async with (
        running_daemon(b_dir, ram=RAM, disk=disk, peer={**peer, "listen": there}) as b,
        running_daemon(a_dir, ram=RAM, disk=disk, peer={**peer, "listen": here}) as a,
        await Client.connect(a.socket_path) as c,
        await Client.connect(b.socket_path) as on_b,
    ):
        await c.put_many(mine, values, retention=SESSION)
        await wait_until(lambda: b.service.retainer.stats()["leased_blocks"] == 3)
        assert b.service.retainer.stats()["sessions"] == 1
        other, others = blocks("other", 6)
        for key, value in zip(other, others, strict=True):  # fills B's RAM twice over
            await on_b.put(key, value)
        assert all(b.service.ram.contains(k) for k in mine)
        assert [await on_b.get(k) for k in mine] == values


async def test_on_the_defaults_a_session_back_from_the_disk_is_leased_in_ram_again(
    sock_dir: Path,
) -> None:
    # the defaults: RAM above a disk written through, the lookup process on.
    # The session is over, other traffic pushes its blocks out of RAM (the
    # disk keeps them); it comes back with its lease: its blocks are read
    # into RAM and leased as they land, and stay under more traffic.
    low = Retention(b"agent-a", ttl=600.0, priority=30)
    async with (
        running_daemon(sock_dir, ram=RAM, **SETTINGS["defaults"]) as d,  # type: ignore[arg-type]
        await Client.connect(d.socket_path) as c,
    ):
        ram = d.parts.service.ram
        mine, values = blocks("agent-a", 3)
        await c.put_many(mine, values, retention=low)
        assert await c.unretain(low.session) == 3
        other, others = blocks("other", 6)
        for key, value in zip(other, others, strict=True):
            await c.put(key, value)
        await d.settle()
        assert not any(ram.contains(k) for k in mine)
        reply = await c.lookup_prefix(mine, retention=low)
        assert reply.prefix_hits == 3
        await d.settle()
        assert all(ram.contains(k) for k in mine)
        r = await retention(c)
        assert (r["leased_blocks"], r["sessions"]) == (3, 1)
        more, mores = blocks("more", 6)
        for key, value in zip(more, mores, strict=True):
            await c.put(key, value)
        assert all(ram.contains(k) for k in mine)


async def test_a_returning_session_gets_its_blocks_back_in_ram_leased(sock_dir: Path) -> None:
    # A keeps 3 blocks at a low priority; B's 4 at a higher one push 2 of
    # A's to the disk (RAM holds 5). B is over; A comes back: its blocks
    # are read back into RAM and leased there again, ahead of other traffic.
    low = Retention(b"agent-a", ttl=600.0, priority=30)
    high = Retention(b"agent-b", ttl=600.0, priority=70)
    async with (
        running_daemon(sock_dir, ram=ALL_LEASED, disk={"write_policy": "none"}) as d,
        await Client.connect(d.socket_path) as c,
    ):
        ram = d.parts.service.ram
        mine, values = blocks("agent-a", 3)
        await c.put_many(mine, values, retention=low)
        theirs, others = blocks("agent-b", 4)
        await c.put_many(theirs, others, retention=high)
        await d.settle()
        assert sum(ram.contains(k) for k in mine) == 1
        assert await c.unretain(high.session) == 4
        reply = await c.lookup_prefix(mine, retention=low)
        assert reply.prefix_hits == 3
        await d.settle()
        assert all(ram.contains(k) for k in mine)
        r = await retention(c)
        assert (r["leased_blocks"], r["sessions"]) == (3, 1)
        other, more = blocks("other", 6)  # fills RAM again
        for key, value in zip(other, more, strict=True):
            await c.put(key, value)
        assert all(ram.contains(k) for k in mine)
        assert [await c.get(k) for k in mine] == values


async def test_a_returning_session_whose_blocks_are_only_in_s3_gets_them_leased_in_ram(
    sock_dir: Path, s3: CephS3
) -> None:
    # another daemon of the fleet stored the session's blocks; this one
    # finds them in the bucket, promotes them and leases them as they land
    tier = [s3.tier_config(s3.new_bucket())]
    mine, values = blocks("agent", 3)
    async with (
        running_daemon(sock_dir, disk=RAM_ONLY, remote_tier_configs=tier) as d,
        await Client.connect(d.socket_path) as c,
    ):
        await c.put_many(mine, values, durable=True)
    async with (
        running_daemon(sock_dir, ram=RAM, disk=RAM_ONLY, remote_tier_configs=tier) as d,
        await Client.connect(d.socket_path) as c,
    ):
        reply = await c.lookup(mine, mode=LookupMode.PREFIX, wait=10.0, retention=SESSION)
        assert reply.prefix_hits == 3
        assert [await c.get(k) for k in mine] == values
        await d.settle()
        r = await retention(c)
        assert (r["leased_blocks"], r["sessions"]) == (3, 1)


#: a disk of about ten blocks below the RAM of five
SMALL_DISK = {"capacity": "2MiB"}


@pytest.mark.parametrize("leased", [True, False], ids=["leased", "not-leased"])
@pytest.mark.parametrize("policy", ["write-through", "write-back"])
async def test_the_disk_keeps_a_leased_session_while_other_traffic_fills_it(
    sock_dir: Path, policy: str, leased: bool
) -> None:
    """The disk orders leases as RAM does: a session's blocks stay on it
    while unleased traffic fills it several times over; without the lease
    they are the first to go. Written through (the default), and written
    back (the session's blocks then reach the disk once RAM lets them go,
    all of RAM being leasable, and are leased there as they land)."""
    ram = RAM if policy == "write-through" else ALL_LEASED
    async with (
        running_daemon(sock_dir, ram=ram, disk={**SMALL_DISK, "write_policy": policy}) as d,
        await Client.connect(d.socket_path) as c,
    ):
        disk = d.parts.service.disk
        assert disk is not None
        mine, values = blocks("agent", 8 if policy == "write-back" else 3)
        await c.put_many(mine, values, retention=SESSION if leased else None)
        await d.settle()
        on_disk = [k for k in mine if disk.contains(k)]
        assert on_disk  # (written through, or sent down by RAM)
        other, others = blocks("other", 30)
        for key, value in zip(other, others, strict=True):  # the disk, three times over
            await c.put(key, value)
            await d.settle()
        r = await retention(c)
        if leased:
            assert all(disk.contains(k) for k in on_disk)
            # (RAM may have sent more of them down meanwhile: leased too)
            assert r["disk"]["leased_blocks"] == sum(disk.contains(k) for k in mine)
            assert r["disk"]["evicted"] == 0
            assert [await c.get(k) for k in on_disk] == [values[mine.index(k)] for k in on_disk]
        else:
            assert not any(disk.contains(k) for k in on_disk)
            assert r["disk"]["leased_blocks"] == 0


@pytest.mark.parametrize("setting", ["defaults", "ram-only"])
async def test_a_lookup_of_the_sessions_whole_prompt_ends_its_leases_on_a_prompt_it_left(
    sock_dir: Path, setting: str
) -> None:
    """On the defaults (a disk written through: it ends the leases there
    too) and on RAM alone (the blocks it left are then gone)."""
    on_disk = setting == "defaults"
    async with (
        running_daemon(sock_dir, ram=RAM, disk={"enabled": on_disk}) as d,
        await Client.connect(d.socket_path) as c,
    ):
        ram = d.parts.service.ram
        old, values = blocks("agent", 3)
        await c.put_many(old, values, retention=SESSION)
        await d.settle()  # (written through, leased on the disk as they land)
        if on_disk:
            assert (await retention(c))["disk"]["leased_blocks"] == 3
        # a lookup of part of a prompt (an engine asking past what it holds) ends nothing
        await c.lookup_prefix(old[1:], retention=SESSION)
        assert (await retention(c))["superseded"] == 0
        new = [old[0], b"agent-compacted"]  # the session compacted its context
        await c.lookup_prefix(new, retention=SESSION, whole=True)
        r = await retention(c)
        assert (r["superseded"], r["leased_blocks"], r["sessions"]) == (2, 1, 1)
        if on_disk:
            assert r["disk"]["leased_blocks"] == 1
        superseded = d.metrics.registry.get_sample_value(
            "kvtier_retention_blocks_total", {"event": "superseded"}
        )
        assert superseded == 2
        other, others = blocks("other", 4)  # RAM holds five: two must go
        for key, value in zip(other, others, strict=True):
            await c.put(key, value)
        assert ram.contains(old[0])  # still the session's
        assert not any(ram.contains(k) for k in old[1:])  # the prompt it left went first
        assert all(ram.contains(k) for k in other)
        # (on RAM alone they are gone; with the disk below, read from there)
        expected = values[1:] if on_disk else [None, None]
        assert [await c.get(k) for k in old[1:]] == expected
        with pytest.raises(ValueError, match="PREFIX mode, with a lease"):
            await c.lookup(new, whole=True)

"""Namespaces: keys scoped in every tier, who may use which, quotas applied
by a real daemon, live changes on SIGHUP."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtier import BlockingClient, wire
from kvtier.client.aio import Client
from kvtier.config import load_config
from kvtier.errors import BadArgumentError, ErrorCode, ForbiddenError
from kvtier.model import EventKind, LookupMode, State, namespace_prefix
from kvtier.tiers.rendezvous import owner
from kvtier.wire import FLAG_REPLY, Op
from tests.helpers import DaemonProcess, RawConnection, running_daemon, wait_until
from tests.ports import free_port
from tests.s3server import ProxiedS3

H, M = State.HIT, State.MISS
RAM_ONLY = {"enabled": False}
K = b"block-0001"


async def test_each_namespace_sees_its_own_blocks_only(sock_dir: Path) -> None:
    async with (
        running_daemon(sock_dir) as d,
        await Client.connect(d.socket_path, namespace="model-a") as a,
        await Client.connect(d.socket_path, namespace="model-b") as b,
        await Client.connect(d.socket_path) as plain,
    ):
        await a.put(K, b"a" * 5000)
        await b.put(K, b"b" * 5000)
        named = sorted(repr(c).split()[2] for c in d.server.connections if c.namespace)
        assert named == ["namespace=model-a", "namespace=model-b"]
        assert await a.get(K) == b"a" * 5000
        assert await b.get(K) == b"b" * 5000
        assert await plain.get(K) is None
        assert (await plain.lookup([K])).states == [M]
        await plain.put(K, b"p")
        assert await b.delete(K)
        assert (await a.lookup([K])).states == [H]  # b's delete was b's only
        assert (await b.lookup([K])).states == [M]
        assert await plain.get(K) == b"p"
        await d.settle()  # on disk too, each under its own name (b's deleted)
        assert d.disk is not None and len(d.disk) == 2


async def test_a_default_client_cannot_name_a_namespaced_key(sock_dir: Path) -> None:
    forged = namespace_prefix(b"model-a") + K
    async with (
        running_daemon(sock_dir) as d,
        await Client.connect(d.socket_path, namespace="model-a") as a,
        await Client.connect(d.socket_path) as plain,
    ):
        await a.put(K, b"secret")
        assert (await plain.lookup([forged])).states == [M]
        assert await plain.get(forged) is None
        assert not await plain.delete(forged)
        await plain.put(forged, b"planted")  # stored under its own (escaped) name
        assert await a.get(K) == b"secret"
        assert await plain.get(forged) == b"planted"
        # A batch of equal-length keys of which one starts with the mark.
        keys = [b"x" * 20, b"\xff" + b"y" * 19]
        await plain.put_many(keys, [b"1", b"2"])
        assert await plain.get_many(keys) == [b"1", b"2"]


def test_a_key_without_the_connections_prefix_is_refused(sock_dir: Path) -> None:
    d = DaemonProcess(sock_dir, "--no-disk").start()
    try:
        with RawConnection(d.socket_path) as raw:
            hello = wire.Hello(1, wire.VERSION, "raw", namespace="model-a")
            raw.send_frame(Op.HELLO, 1, wire.encode_hello(hello))
            assert raw.recv_frame().header.status == ErrorCode.OK
            other = namespace_prefix(b"model-b") + K
            raw.send_frame(Op.GET, 2, wire.encode_keys([other]))
            reply = raw.recv_frame()
            assert reply.header.flags & FLAG_REPLY and reply.header.status == ErrorCode.FORBIDDEN
            assert b"outside this connection's namespace" in reply.meta
            # The connection goes on: its own keys work.
            raw.send_frame(Op.GET, 3, wire.encode_keys([K], namespace_prefix(b"model-a")))
            assert raw.recv_frame().header.status == ErrorCode.OK
    finally:
        assert d.stop() == 0


async def test_who_may_use_a_namespace(sock_dir: Path) -> None:
    me = os.getuid()
    namespaces: dict[str, Any] = {"mine": {"uids": [me]}, "theirs": {"uids": [me + 1]}}
    async with running_daemon(sock_dir, namespaces=namespaces) as d:
        async with await Client.connect(d.socket_path, namespace="mine") as c:
            await c.put(K, b"ok")
        with pytest.raises(ForbiddenError, match="may not use namespace 'theirs'"):
            await Client.connect(d.socket_path, namespace="theirs")
        with pytest.raises(BadArgumentError, match="letters, digits"):
            await Client.connect(d.socket_path, namespace="no spaces")
        async with await Client.connect(d.socket_path, namespace="unlisted") as c:
            await c.put(K, b"open")  # not configured: open, with the default share
    strict = {"configured_namespaces_only": True}
    async with running_daemon(sock_dir, namespaces=namespaces, server=strict) as d:
        with pytest.raises(ForbiddenError, match="not configured"):
            await Client.connect(d.socket_path, namespace="unlisted")


def test_the_default_namespace_can_be_closed_to_a_user(sock_dir: Path) -> None:
    config = sock_dir / "kvtier.toml"
    config.write_text(f"[namespaces.default]\nuids = [{os.getuid() + 1}]\n[namespaces.mine]\n")
    d = DaemonProcess(sock_dir, "--no-disk", "--config", str(config)).start()
    try:
        with pytest.raises(ForbiddenError, match="may not use namespace 'default'"):
            BlockingClient(d.socket_path)  # HELLO names none
        with RawConnection(d.socket_path) as raw:  # no HELLO at all
            raw.send_frame(Op.GET, 1, wire.encode_keys([K]))
            reply = raw.recv_frame()
            assert reply.header.status == ErrorCode.FORBIDDEN
            assert b"name a namespace" in reply.meta
        with BlockingClient(d.socket_path, namespace="mine") as c:
            c.put(K, b"fine")
    finally:
        assert d.stop() == 0


async def test_events_and_stats_show_a_tenant_its_own_namespace(sock_dir: Path) -> None:
    async with (
        running_daemon(sock_dir, disk=RAM_ONLY, namespaces={"a": {}, "b": {}}) as d,
        await Client.connect(d.socket_path, namespace="a") as a,
        await Client.connect(d.socket_path, namespace="b") as b,
        await Client.connect(d.socket_path, namespace="a") as watcher,
    ):
        await b.put(b"b-first", b"1")
        stream = watcher.subscribe(snapshot=True)
        first = await anext(stream)
        # The snapshot: a holds nothing yet; b's block is not shown.
        assert [e.kind for e in first] == [EventKind.SNAPSHOT_END]
        await b.put(b"b-only", b"2")
        await a.put(b"a-only", b"3")
        batch = await anext(stream)
        assert [(e.kind, e.key) for e in batch] == [(EventKind.STORED, b"a-only")]
        await stream.aclose()
        stats = await a.stats()
        assert set(stats["namespaces"]) == {"a"}
        assert stats["namespaces"]["a"]["blocks"] == 1


async def test_namespaces_stay_apart_across_peers(sock_dir: Path) -> None:
    """Over the peer port a block keeps its namespace: a tenant on another
    node reads its own blocks from there, never another tenant's."""
    a_dir, b_dir = sock_dir / "a", sock_dir / "b"
    a_dir.mkdir()
    b_dir.mkdir()
    here, there = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    members = [here, there]
    # A key that, in namespace t1, is owned by B: stored on A, pushed to B.
    prefix = namespace_prefix(b"t1")
    key = next(
        k
        for k in (b"blk-%d" % i for i in range(1000))
        if owner(prefix + k, [m.encode() for m in members]) == there.encode()
    )
    peer = {"members": members, "token": "t"}
    async with (
        running_daemon(b_dir, disk=RAM_ONLY, peer={**peer, "listen": there}) as b,
        running_daemon(a_dir, disk=RAM_ONLY, peer={**peer, "listen": here}) as a,
        await Client.connect(a.socket_path, namespace="t1") as writer,
        await Client.connect(b.socket_path, namespace="t1") as same,
        await Client.connect(b.socket_path, namespace="t2") as other,
        await Client.connect(b.socket_path) as plain,
    ):
        await writer.put(key, b"t1's block")
        assert (await same.lookup([key], wait=5.0)).states == [H]  # the push landed
        assert (await other.lookup([key], wait=5.0)).states == [M]
        assert (await plain.lookup([key], wait=5.0)).states == [M]
        assert await same.get(key) == b"t1's block"


async def test_quotas_change_on_sighup(sock_dir: Path, tmp_path: Path) -> None:
    config = tmp_path / "kvtier.toml"

    def write(ram_max: str) -> None:
        config.write_text(f'[namespaces.noisy]\nram_max = "{ram_max}"\n')

    write("1MiB")

    def reread() -> Any:
        return load_config(config, {"server": {"socket_path": sock_dir / "d.sock"}})

    block = b"x" * (256 * 1024)
    start = {"noisy": {"ram_max": "1MiB"}}
    async with (
        running_daemon(sock_dir, disk=RAM_ONLY, reread=reread, namespaces=start) as d,
        # (over the socket: a writer in place holds a room in its share too)
        await Client.connect(d.socket_path, namespace="noisy", stage_writes=False) as c,
    ):
        keys = [b"n%d" % i for i in range(12)]
        await c.put_many(keys, [block] * 12)
        held = (await c.lookup(keys, mode=LookupMode.KEYS)).states.count(H)
        assert held == 4  # 1 MiB of 256 KiB blocks
        write("2MiB")
        d.reload()
        await c.put_many([b"m%d" % i for i in range(12)], [block] * 12)
        stats = await c.stats()
        assert stats["namespaces"]["noisy"]["bytes"] == 2 * 1024 * 1024


async def test_per_namespace_series_are_capped_and_the_rest_summed(sock_dir: Path) -> None:
    quotas = {"a": {"ram_max": "1MiB", "ram_min": "64KiB"}}
    async with running_daemon(
        sock_dir,
        disk=RAM_ONLY,
        namespaces=quotas,
        metrics={"port": 0, "max_namespaces": 2},
        server={"lookup_process": True},
    ) as d:
        for ns in ("a", "b", "c", "d"):
            async with await Client.connect(d.socket_path, namespace=ns) as c:
                await c.put(b"k", b"v" * 10)
                await c.lookup([b"k", b"gone"])
        sample = d.metrics.registry.get_sample_value
        # The lookup process answered them: the daemon counts its reports.
        assert d.lookups is not None
        feed = d.lookups.feed
        assert feed is not None
        await wait_until(lambda: feed.answered + feed.referred == 4, 10**6)
        seen = {
            s.labels["namespace"]
            for family in d.metrics.registry.collect()
            if family.name == "kvtier_namespace_lookup_keys"
            for s in family.samples
        }
        assert seen == {"a", "b", "other"}  # configured first, then first seen
        assert (
            sample("kvtier_namespace_lookup_keys_total", {"namespace": "other", "state": "hit"})
            == 2
        )
        assert sample("kvtier_namespace_bytes", {"namespace": "other", "tier": "ram"}) == 20
        assert (
            sample("kvtier_namespace_ram_limit_bytes", {"namespace": "a", "limit": "max"})
            == 1 << 20
        )
        assert (
            sample("kvtier_namespace_ram_limit_bytes", {"namespace": "a", "limit": "min"})
            == 1 << 16
        )


def test_stats_per_namespace_from_the_command_line(sock_dir: Path, tmp_path: Path) -> None:
    config = tmp_path / "kvtier.toml"
    config.write_text('[namespaces.llama]\nram_max = "1MiB"\n')
    d = DaemonProcess(sock_dir, "--no-disk", "--config", str(config)).start()
    try:
        with BlockingClient(d.socket_path, namespace="llama") as c:
            c.put(b"k", b"v" * 1000)
            c.lookup([b"k", b"k2", b"k3", b"k4"])

        def kvtier(*args: str) -> str:
            out = subprocess.run(
                [sys.executable, "-m", "kvtier", "stats", "--socket", str(d.socket_path), *args],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert out.returncode == 0, out.stderr
            return out.stdout

        table = kvtier("--namespace").splitlines()
        assert table[0].split() == [
            "namespace", "ram", "blocks", "disk", "ram_min", "ram_max", "hits", "misses", "hit%"
        ]  # fmt: skip
        llama = next(line.split() for line in table if line.startswith("llama"))
        assert llama[1:3] == ["1000B", "1"] and llama[5] == "1.0MiB"
        assert llama[-3:] == ["1", "3", "25.0"]
        one = json.loads(kvtier("--namespace", "llama", "--json"))
        assert one == {
            "llama": {
                "bytes": 1000,
                "blocks": 1,
                "disk_bytes": 0,
                "disk_blocks": 0,
                "evictions": 0,
                "hits": 1,
                "misses": 3,
                "ram_min": 0,
                "ram_max": 1 << 20,
            }
        }
    finally:
        assert d.stop() == 0


async def test_namespaces_stay_apart_in_a_shared_bucket(s3: ProxiedS3, sock_dir: Path) -> None:
    tier = s3.tier_config(s3.new_bucket())
    written = s3.proxy.when_completed("PUT", f"/{tier['bucket']}/fleet-a/t1/{K.hex()}")
    a_dir, b_dir = sock_dir / "a", sock_dir / "b"
    a_dir.mkdir()
    b_dir.mkdir()
    async with (
        running_daemon(a_dir, remote_tier_configs=[tier], disk=RAM_ONLY) as a,
        await Client.connect(a.socket_path, namespace="t1") as writer,
    ):
        await writer.put(K, b"t1's block")  # written through to S3, under t1/
        assert await asyncio.to_thread(written.wait, 30)
    async with (
        running_daemon(b_dir, remote_tier_configs=[tier], disk=RAM_ONLY) as b,
        await Client.connect(b.socket_path, namespace="t1") as same,
        await Client.connect(b.socket_path, namespace="t2") as other,
        await Client.connect(b.socket_path) as plain,
    ):
        assert (await other.lookup([K], wait=10.0)).states == [M]  # probed: not there
        assert (await plain.lookup([K], wait=10.0)).states == [M]
        assert await other.get(K) is None
        assert (await same.lookup([K], wait=10.0)).states == [H]  # promoted from S3
        assert await same.get(K) == b"t1's block"


async def test_a_namespace_over_its_disk_max_gives_up_its_own_files(sock_dir: Path) -> None:
    quotas = {"capped": {"disk_max": "1MiB"}, "free": {}}
    block = b"d" * (256 * 1024)
    async with (
        running_daemon(sock_dir, namespaces=quotas) as d,
        await Client.connect(d.socket_path, namespace="capped") as capped,
        await Client.connect(d.socket_path, namespace="free") as free,
    ):
        await free.put_many([b"f%d" % i for i in range(6)], [block] * 6)
        await capped.put_many([b"c%d" % i for i in range(8)], [block] * 8)
        await d.settle()  # written through to the disk
        assert d.disk is not None and d.disk.budget.shares is not None
        used = d.disk.budget.shares.used
        assert used[b"capped"] <= 1 << 20 < used[b"capped"] + len(block)  # its own oldest went
        assert len(d.disk.budget.shares.policies[b"free"]) == 6  # the other lost nothing
        stats = (await free.stats())["namespaces"]
        assert set(stats) == {"free"} and stats["free"]["disk_blocks"] == 6


def test_bad_namespace_tables_are_clear_errors(tmp_path: Path) -> None:
    from kvtier.build import build
    from kvtier.errors import ConfigError

    def load(text: str) -> Any:
        path = tmp_path / "kvtier.toml"
        path.write_text(text)
        return load_config(path, {"server": {"socket_path": tmp_path / "s"}})

    with pytest.raises(ConfigError, match="letters, digits"):
        load('[namespaces."has space"]\n')
    with pytest.raises(ConfigError, match=r"ram_min .* is above ram_max"):
        load('[namespaces.a]\nram_min = "2GiB"\nram_max = "1GiB"\n')
    with pytest.raises(ConfigError, match="weight"):
        load("[namespaces.a]\nweight = 0\n")
    with pytest.raises(ConfigError, match=r"extra|not permitted|unknown"):
        load("[namespaces.a]\nram_mni = 1\n")
    too_much = load(
        '[ram]\ncapacity = "1GiB"\n[disk]\nenabled = false\n[shared]\nenabled = false\n'
        '[namespaces.a]\nram_min = "600MiB"\n[namespaces.b]\nram_min = "600MiB"\n'
    )
    with pytest.raises(ConfigError, match="ram_min add up to"):
        build(too_much)


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "socket"])
async def test_a_namespace_at_its_max_writing_large_blocks_evicts_only_its_own(
    sock_dir: Path, in_place: bool
) -> None:
    """A block written in place takes its room in its namespace's share, as
    its PUT would: a namespace at its max gives up its own blocks for it,
    never another's (RAM is 64 MiB; 'capped' may hold 4 MiB of it, and
    there is room for that beside the other namespace's blocks)."""
    block = b"c" * (1024 * 1024)
    quotas = {"capped": {"ram_max": "4MiB"}, "other": {}}
    async with (
        running_daemon(sock_dir, disk=RAM_ONLY, namespaces=quotas) as d,
        # (over the socket: no rooms of its own in RAM's share of them)
        await Client.connect(d.socket_path, namespace="other", stage_writes=False) as other,
        await Client.connect(
            d.socket_path, namespace="capped", write_in_place=in_place, stage_writes=in_place
        ) as capped,
    ):
        theirs = [b"o%d" % i for i in range(48)]  # room left for capped's 4 MiB and rooms
        await other.put_many(theirs, [b"o" * (1024 * 1024)] * len(theirs))
        assert (await other.lookup(theirs, mode=LookupMode.KEYS)).states == [H] * len(theirs)
        assert d.shared is not None
        commits = d.shared.stats().in_place_commits
        mine = [b"c%d" % i for i in range(12)]
        for key in mine:
            assert await capped.put(key, block) is not None
        written = d.shared.stats().in_place_commits - commits
        assert written == (len(mine) if in_place else 0)
        # Its newest 4 MiB; in place, the room kept for its next block is
        # RAM of its share too, so one block fewer.
        kept = 3 if in_place else 4
        held = (await capped.lookup(mine, mode=LookupMode.KEYS)).states
        assert held.count(H) == kept and held[-kept:] == [H] * kept
        assert (await other.lookup(theirs, mode=LookupMode.KEYS)).states == [H] * len(theirs)


async def test_a_block_larger_than_its_namespaces_max_is_refused_saying_so(
    sock_dir: Path,
) -> None:
    from kvtier.errors import NoCapacityError

    async with (
        running_daemon(sock_dir, disk=RAM_ONLY, namespaces={"small": {"ram_max": "512KiB"}}) as d,
        await Client.connect(d.socket_path, namespace="small", shared=False) as c,
    ):
        with pytest.raises(NoCapacityError) as refused:
            await c.put(b"big", b"x" * (600 * 1024))
        assert "larger than the ram_max of namespace 'small'" in refused.value.message
        assert "pinned" not in refused.value.message  # nothing is pinned: it is the max
        assert (await c.lookup([b"big"])).states == [State.MISS]

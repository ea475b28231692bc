"""The peer tier against real daemons and real (misbehaving) TCP peers, in process."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvtier import Client, State
from kvtier.daemon import Daemon
from kvtier.tiers.peers import NoPeers, RendezvousPicker
from kvtier.tiers.rendezvous import ranked
from tests.helpers import running_daemon, short_tmpdir

TOKEN = "tier-token"


@dataclass(eq=False)
class FakeNode:
    address: str
    down: bool = False
    closed: list[str] = field(default_factory=list)

    def is_down(self) -> bool:
        return self.down


def test_the_picker_skips_itself_and_down_peers() -> None:
    members = [f"10.0.0.{i}:7070" for i in range(1, 5)]
    picker = RendezvousPicker(FakeNode, members=members, self_address=members[0])
    assert [p.address for p in picker.peers()] == members[1:]
    names = [m.encode() for m in members]
    for n in range(2000):
        key = f"k{n}".encode()
        first = ranked(key, names)[0].decode()
        picked = picker.owners(key, 1)
        assert picked == [] if first == members[0] else [p.address for p in picked] == [first]
    # A down peer's keys go to the next name in their ranking.
    down = picker.peers()[0]
    down.down = True
    for n in range(2000):
        key = f"k{n}".encode()
        order = [r.decode() for r in ranked(key, names) if r.decode() != down.address]
        picked = picker.owners(key, 1)
        assert picked == [] if order[0] == members[0] else [p.address for p in picked] == [order[0]]
        # Two replicas: the first two live names, this daemon left out.
        two = [p.address for p in picker.owners(key, 2)]
        assert two == [a for a in order[:2] if a != members[0]]


def test_a_member_list_change_keeps_the_peers_still_listed() -> None:
    picker = RendezvousPicker(FakeNode, members=["a:1", "b:1"])
    a = picker.peers()[0]
    dropped = picker.set_members(["a:1", "c:1"])
    assert [p.address for p in dropped] == ["b:1"]
    assert picker.peers()[0] is a
    # Learning that an address is this daemon ranks it as self from then on.
    assert picker.is_self("c:1") is not None
    assert [p.address for p in picker.peers()] == ["a:1"]
    assert "self=c:1" in repr(picker)


def test_no_peers_owns_every_key() -> None:
    picker: NoPeers[FakeNode] = NoPeers()
    assert picker.owners(b"k", 2) == [] and picker.peers() == []


async def test_dns_members_are_what_the_name_resolves_to() -> None:
    picker = RendezvousPicker(FakeNode, dns="localhost:7070")
    await picker.resolve()
    assert "127.0.0.1:7070" in [p.address for p in picker.peers()]


@contextlib.asynccontextmanager
async def silent_peer() -> AsyncIterator[tuple[int, list[int]]]:
    """A TCP peer that accepts and reads but never answers (a hung daemon)."""
    received: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                received.append(len(data))
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    async with server:
        yield server.sockets[0].getsockname()[1], received


async def test_a_hung_peer_costs_one_timeout_then_is_skipped(sock_dir: Path) -> None:
    async with (
        silent_peer() as (port, received),
        running_daemon(
            sock_dir,
            peer={
                "members": [f"127.0.0.1:{port}"],
                "token": TOKEN,
                "connect_timeout": 0.2,
                "breaker_failures": 1,
                "breaker_reset": 60,
            },
            lookup={"probe_timeout": 5.0},
            disk={"enabled": False},
        ) as d,
    ):
        assert d.peer_tier is not None
        async with await Client.connect(d.socket_path) as c:
            # The HELLO never gets an answer: the connect times out, the
            # probe fails, the key reads MISS, never stuck.
            assert (await c.lookup([b"a"], wait=3.0)).states == [State.MISS]
            assert received  # the HELLO reached the hung peer
            counters = d.peer_tier.counters
            address = f"127.0.0.1:{port}"
            assert counters.connects.value(address, "failed") == 1
            # Now down: its keys go nowhere (it is the only peer) without a request.
            assert (await c.lookup([b"b"], wait=3.0)).states == [State.MISS]
            assert counters.connects.value(address, "failed") == 1
            assert counters.requests.value(address, "lookup", "rejected") == 0
            assert f'kvtier_peer_up{{peer="{address}"}} 0.0' in d.metrics.render().decode()


async def test_pushes_past_the_backlog_are_dropped_not_queued(sock_dir: Path) -> None:
    async with (
        silent_peer() as (port, _),
        running_daemon(
            sock_dir,
            peer={
                "members": [f"127.0.0.1:{port}"],
                "token": TOKEN,
                "max_pending_push_bytes": 10_000,
                "connect_timeout": 5.0,
            },
            disk={"enabled": False},
        ) as d,
    ):
        async with await Client.connect(d.socket_path) as c:
            for i in range(5):
                # The PUT never waits for the push.
                await c.put(f"p{i}".encode(), b"x" * 600)
        dropped = d.service.counters.writes_dropped.value("peers", "backlog")
        # One 600-byte push in flight (600 + WRITE_OVERHEAD bytes) fills the backlog.
        assert dropped == 4
        assert all(d.ram.contains(f"p{i}".encode()) for i in range(5))


@contextlib.asynccontextmanager
async def two_daemons() -> AsyncIterator[tuple[Daemon, Daemon]]:
    dirs = [short_tmpdir(), short_tmpdir()]
    async with running_daemon(
        dirs[0], peer={"listen": "127.0.0.1:0", "token": TOKEN}, disk={"enabled": False}
    ) as a:
        address = f"127.0.0.1:{a.peer_port}"
        async with running_daemon(
            dirs[1],
            peer={"members": [address], "token": TOKEN},
            disk={"enabled": False},
        ) as b:
            yield a, b


async def test_keys_a_peer_owns_load_through_the_core_once(sock_dir: Path) -> None:
    async with two_daemons() as (a, b):
        assert b.peer_tier is not None
        async with await Client.connect(a.socket_path) as ca:
            await ca.put(b"blk", b"v" * 4096)
        async with await Client.connect(b.socket_path) as cb:
            replies = await asyncio.gather(*(cb.lookup([b"blk"], wait=3.0) for _ in range(16)))
            assert all(r.states == [State.HIT] for r in replies)
            assert bytes(await cb.get(b"blk") or b"") == b"v" * 4096
        assert a.peer_server is not None
        requests = a.peer_server.counters.requests
        assert requests.value("lookup", "ok") == 1
        assert requests.value("get", "ok") == 1
        assert b.peer_tier.counters.bytes.value(f"127.0.0.1:{a.peer_port}", "in") == 4096


@pytest.mark.parametrize("push", ["owner", "none"])
def test_push_setting_is_validated(push: str) -> None:
    from kvtier.config import load_config

    assert load_config(None, {"peer": {"push": push}}).peer.push == push

"""``locate`` as a pure table: the state of the tiers in, one Location out.

Real core maps (reservation table, probe maps) and plain sets stand in for
the RAM and disk indexes; nothing here starts a probe, a promotion or I/O.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import pytest

from kvtier.core.lookup import ABSENT, AT_DISK, AT_RAM, Locator, Where
from kvtier.core.probes import ProbeMap, Verdict
from kvtier.core.writes import End, Promotion, ReservationTable
from kvtier.model import ConnId

K = b"key"
NOW = 100.0


@dataclass
class FakeDisk:
    keys: set[bytes] = field(default_factory=set)
    scanning: bool = False
    scan_done: asyncio.Future[None] | None = None

    def contains(self, key: bytes) -> bool:
        return key in self.keys


def probe_map(name: str) -> ProbeMap:
    return ProbeMap(name, verdict_ttl=5.0, error_ttl=0.5, max_verdicts=100)


@dataclass
class World:
    """Everything ``locate`` reads, set up per row of the table."""

    loop: asyncio.AbstractEventLoop
    ram: set[bytes] = field(default_factory=set)
    disk: FakeDisk | None = field(default_factory=FakeDisk)
    pending: ReservationTable = field(default_factory=ReservationTable)
    probes: list[ProbeMap] = field(default_factory=lambda: [probe_map("s3"), probe_map("peer")])

    def locator(self) -> Locator:
        return Locator(self.ram, self.disk, self.pending, self.probes)

    def reserve(self) -> None:
        self.pending.add(K, ConnId(1), NOW + 30, 0, NOW, self.loop)

    def verdict(self, tier: int, verdict: Verdict) -> None:
        self.probes[tier].force(K, verdict, NOW)

    def probing(self, tier: int) -> asyncio.Future[Verdict]:
        return self.probes[tier].begin(K, self.loop).future


@pytest.fixture
def world() -> Iterator[World]:
    loop = asyncio.new_event_loop()
    yield World(loop)
    loop.close()


def test_ram_wins_over_everything(world: World) -> None:
    world.ram.add(K)
    world.disk.keys.add(K)  # type: ignore[union-attr]
    world.reserve()
    world.verdict(0, Verdict.PRESENT)
    assert world.locator().locate(K, NOW) is AT_RAM


def test_disk_then_pending(world: World) -> None:
    world.disk.keys.add(K)  # type: ignore[union-attr]
    assert world.locator().locate(K, NOW) is AT_DISK
    world.pending.add(K, Promotion("disk"), NOW + 30, 0, NOW, world.loop)
    loc = world.locator().locate(K, NOW)
    # Readable now, and the promotion under way is named so a GET joins it.
    assert loc.where is Where.DISK and loc.reservation is world.pending.get(K)


def test_pending_write(world: World) -> None:
    world.reserve()
    world.verdict(0, Verdict.PRESENT)  # a pending write comes before remote verdicts
    loc = world.locator().locate(K, NOW)
    res = world.pending.get(K)
    assert res is not None
    assert (loc.where, loc.reservation, loc.settles) == (Where.PENDING, res, res.done)


@pytest.mark.parametrize(
    ("verdicts", "inflight", "where", "remote", "unprobed"),
    [
        # no tier has answered: probe both
        ({}, (), Where.PROBING, -1, (0, 1)),
        # the first said absent, the second has not answered
        ({0: Verdict.ABSENT}, (), Where.PROBING, -1, (1,)),
        # an error verdict answers like absent (MISS), until it ages out
        ({0: Verdict.ERROR, 1: Verdict.ABSENT}, (), Where.ABSENT, -1, ()),
        # a PRESENT verdict wins over a tier still unknown: a load can start now
        ({1: Verdict.PRESENT}, (), Where.REMOTE, 1, ()),
        ({0: Verdict.PRESENT, 1: Verdict.ABSENT}, (), Where.REMOTE, 0, ()),
        # a probe in flight is joined, not started again
        ({0: Verdict.ABSENT}, (1,), Where.PROBING, -1, ()),
        ({}, (0,), Where.PROBING, -1, (1,)),
    ],
)
def test_remote_tiers(
    world: World,
    verdicts: dict[int, Verdict],
    inflight: tuple[int, ...],
    where: Where,
    remote: int,
    unprobed: tuple[int, ...],
) -> None:
    for tier, verdict in verdicts.items():
        world.verdict(tier, verdict)
    futures = {tier: world.probing(tier) for tier in inflight}
    loc = world.locator().locate(K, NOW)
    assert (loc.where, loc.remote, loc.unprobed) == (where, remote, unprobed)
    assert loc.inflight == tuple(futures.items())
    if inflight:
        assert loc.settles is futures[inflight[0]]


def test_verdicts_age_out(world: World) -> None:
    world.verdict(0, Verdict.ABSENT)
    world.verdict(1, Verdict.ABSENT)
    assert world.locator().locate(K, NOW) is ABSENT
    assert world.locator().locate(K, NOW + 5.0).unprobed == (0, 1)  # verdict_ttl passed


def test_a_probe_this_caller_saw_end_counts_as_its_verdict(world: World) -> None:
    world.verdict(0, Verdict.ABSENT)
    ended: asyncio.Future[Verdict] = world.loop.create_future()
    ended.set_result(Verdict.ERROR)  # not kept as a verdict (error_ttl 0, say)
    assert world.locator().locate(K, NOW).where is Where.PROBING
    assert world.locator().locate(K, NOW, seen={(1, K): ended}) is ABSENT


def test_not_indexed_while_scanning_is_never_absent(world: World) -> None:
    assert world.disk is not None
    world.disk.scanning = True
    world.disk.scan_done = world.loop.create_future()
    world.probes.clear()
    loc = world.locator().locate(K, NOW)
    assert (loc.where, loc.settles) == (Where.SCANNING, world.disk.scan_done)
    world.disk.scanning = False
    assert world.locator().locate(K, NOW) is ABSENT


def test_no_disk_no_remotes(world: World) -> None:
    world.disk = None
    world.probes.clear()
    assert world.locator().locate(K, NOW) is ABSENT
    world.ram.add(K)
    assert world.locator().locate(K, NOW) is AT_RAM


def test_locate_changes_nothing(world: World) -> None:
    before = (repr(world.pending), [repr(p) for p in world.probes])
    world.locator().locate(K, NOW)
    assert (repr(world.pending), [repr(p) for p in world.probes]) == before
    assert repr(world.locator()) == "<Locator disk=True pending=0 remotes=2>"


async def test_pending_changes_held_back_are_told_once_in_order_by_the_outermost_block() -> None:
    table = ReservationTable()
    told: list[Sequence[tuple[bytes, bool]]] = []
    table.watch(told.append)
    loop, owner = asyncio.get_running_loop(), ConnId(1)
    a = table.add(b"a", owner, 1.0, 0, 0.0, loop)
    assert told == [((b"a", True),)]  # outside a block: at once
    told.clear()
    with table.held_back():
        b = table.add(b"b", owner, 1.0, 0, 0.0, loop)
        with table.held_back():
            table.end(a, End.COMPLETED)
        assert told == []  # (the inner block tells nothing)
        table.end(b, End.ABORTED)
        assert not table.end(b, End.ABORTED)  # (ended once, told once)
    assert told == [[(b"b", True), (b"a", False), (b"b", False)]]

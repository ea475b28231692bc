"""Room held in RAM yields to the blocks that need it.

Room held for blocks about to arrive (reservations, rooms handed to
writers in place, rooms made ahead of a writer's next block, bodies being
received) is shown by kind in STATS (``ram.held_bytes``); rooms made
ahead and nobody uses, then reservations' room, give way to a store, a
promotion or a RESERVE before anything is refused for capacity; a store
refused all the same says what holds the room; a closed connection's
rooms go at once when its process is gone, after a short quarantine when
it lives on. On the defaults (write in place) and through staging."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtier import Client, PutStatus, ReserveStatus, State
from kvtier.core.shared.inplace import QUARANTINE_SECONDS
from kvtier.daemon import Daemon
from kvtier.errors import NoCapacityError
from kvtier.server.sockets import Peer, process_gone
from tests.helpers import running_daemon, shared_stats

MiB = 1 << 20
#: RAM alone, small enough to fill
SMALL: dict[str, Any] = {"ram": {"capacity": "8MiB"}, "disk": {"enabled": False}}


def held(d: Daemon) -> dict[str, int]:
    return d.ram.stats().held_bytes


def without_room(d: Daemon) -> float:
    value = d.metrics.registry.get_sample_value(
        "kvtier_reservations_total", {"event": "without_room"}
    )
    return value or 0.0


@pytest.mark.parametrize("write_in_place", [True, False], ids=["in-place", "staged"])
async def test_reservations_give_their_room_to_blocks_that_arrive_and_stay_pending(
    sock_dir: Path, write_in_place: bool
) -> None:
    async with (
        running_daemon(sock_dir, **SMALL, shared={"write_in_place": write_in_place}) as d,
        await Client.connect(d.socket_path) as writer,
        await Client.connect(d.socket_path) as other,
    ):
        announced = [b"r%d" % i for i in range(8)]
        assert await writer.reserve(announced, [MiB] * 8) == [ReserveStatus.GRANTED] * 8
        assert held(d)["reservations"] == 8 * MiB and d.ram.stats().reserved_bytes == 8 * MiB
        # RAM is all reservations' room: blocks that are here now take it
        # (cached blocks are evicted first, the reservations' room after)
        values = [os.urandom(MiB) for _ in range(3)]
        assert await other.put_many([b"a", b"b", b"c"], values) == [PutStatus.STORED] * 3
        assert bytes(await other.get(b"c") or b"") == values[2]
        assert held(d)["reservations"] <= 7 * MiB
        assert d.ram.stats().reclaimed_bytes >= MiB
        # the reservations are still pending: readers wait for their writer
        assert (await other.lookup(announced)).states == [State.PENDING] * 8
        # and their PUTs make their room when they arrive
        assert await writer.put_many(announced[:2], values[:2]) == [PutStatus.STORED] * 2
        assert bytes(await other.get(b"r1") or b"") == values[1]


async def test_a_reserve_with_no_room_to_hold_is_granted_without_it(sock_dir: Path) -> None:
    async with (
        running_daemon(sock_dir, **SMALL) as d,
        await Client.connect(d.socket_path) as c,
    ):
        assert (
            await c.reserve([b"r%d" % i for i in range(8)], [MiB] * 8)
            == [ReserveStatus.GRANTED] * 8
        )
        # another reservation takes no room from these: granted without room
        assert await c.reserve([b"late"], [MiB]) == [ReserveStatus.GRANTED]
        stats = await c.stats()
        assert stats["tiers"]["ram"]["held_bytes"]["reservations"] == 8 * MiB
        assert without_room(d) == 1
        assert (await c.lookup([b"late"])).states == [State.PENDING]
        await c.abort([b"r%d" % i for i in range(8)])
        assert await c.put(b"late", os.urandom(MiB)) is PutStatus.STORED


async def test_rooms_made_ahead_give_way_before_a_reservation_is_short_of_room(
    sock_dir: Path,
) -> None:
    """A writer in place holds the room the daemon made ahead of its next
    block; a RESERVE that needs it gets it (rooms handed out stay theirs)."""
    # (16 MiB: rooms out and made ahead may hold 2 MiB, an eighth)
    async with (
        running_daemon(sock_dir, ram={"capacity": "16MiB"}, disk={"enabled": False}) as d,
        await Client.connect(d.socket_path) as w,
        await Client.connect(d.socket_path, shared=False) as r,
    ):
        assert await w.put(b"w0", os.urandom(MiB)) is PutStatus.STORED
        assert await w.put(b"w1", os.urandom(MiB)) is PutStatus.STORED
        assert shared_stats(d)["in_place_prepared"] == 1
        before = held(d)
        assert before["ready"] == MiB and before["rooms"] == MiB
        # 16 MiB: 2 of blocks (evictable), 1 of the writer's spare room, 1
        # made ahead: 15 reservations fit only once the room made ahead yields
        assert (
            await r.reserve([b"r%d" % i for i in range(15)], [MiB] * 15)
            == [ReserveStatus.GRANTED] * 15
        )
        after = held(d)
        assert after["ready"] == 0 and after["rooms"] == MiB
        assert after["reservations"] == 15 * MiB
        assert without_room(d) == 0
        assert d.ram.stats().reclaimed_bytes == MiB


async def test_a_store_refused_for_capacity_says_what_holds_the_room(sock_dir: Path) -> None:
    async with (
        running_daemon(sock_dir, **SMALL) as d,
        await Client.connect(d.socket_path, shared=False) as c,
    ):
        for i in range(7):
            await c.put(b"k%d" % i, os.urandom(MiB))
        keys = [b"k%d" % i for i in range(7)]
        pinned = d.ram.pin_many(keys)  # seven blocks being read
        try:
            with pytest.raises(NoCapacityError) as err:
                await c.put(b"big", os.urandom(2 * MiB))
        finally:
            d.ram.unpin_many(keys, pinned)
        message = str(err.value)
        assert "held:" in message and "in 7 blocks being read or written" in message


async def test_a_closed_connections_rooms_wait_out_a_short_quarantine(sock_dir: Path) -> None:
    async with running_daemon(sock_dir) as d, await Client.connect(d.socket_path) as c:
        assert await c.put(b"b", os.urandom(MiB)) is PutStatus.STORED
        assert held(d)["rooms"] == MiB  # its room for the next block
        c.drop()  # its process lives on: a thread of it could still be copying
        assert d.server is not None
        for conn in list(d.server.connections):
            await conn.done.wait()
        assert shared_stats(d)["in_place_quarantined"] == 1
        assert d.shared is not None
        now = d.scheduler.now()
        d.shared.expire(now + QUARANTINE_SECONDS - 0.5)
        assert shared_stats(d)["in_place_quarantined"] == 1  # not before its time
        d.shared.expire(now + QUARANTINE_SECONDS + 0.1)
        assert shared_stats(d)["in_place_quarantined"] == 0
        assert d.ram.stats().reserved_bytes == 0
        assert held(d) == dict.fromkeys(held(d), 0)


def test_a_process_is_gone_once_it_exited_and_not_before() -> None:
    me = Peer(os.getpid(), os.getuid(), os.getgid())
    assert not process_gone(me) and not process_gone(None)
    assert not process_gone(Peer(0, 0, 0))  # (another namespace's: unknown)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    pid = child.pid
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
    assert process_gone(Peer(pid, 0, 0))
    child.wait()
    assert process_gone(Peer(pid, 0, 0))

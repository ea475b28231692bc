"""End to end against ``kvtier serve`` as a real child process."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier import Client, LookupMode, PutStatus, State
from tests.helpers import DaemonProcess, metric_value, running_daemon

BLOCK = 256 * 1024


def block_key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "big"), digest_size=32).digest()


def block_value(i: int) -> bytes:
    # Distinct content per block, cheap to build: a seed repeated.
    return hashlib.blake2b(i.to_bytes(8, "little")).digest() * (BLOCK // 64)


@pytest.fixture
def big_daemon(sock_dir: Path) -> Iterator[DaemonProcess]:
    proc = DaemonProcess(sock_dir, "--ram-capacity", "512MiB").start()
    yield proc
    assert proc.stop() == 0


@pytest.fixture
def small_daemon(sock_dir: Path) -> Iterator[DaemonProcess]:
    proc = DaemonProcess(sock_dir, "--ram-capacity", "64MiB", "--no-disk").start()
    yield proc
    assert proc.stop() == 0


async def test_thousand_blocks_pipelined_round_trip(big_daemon: DaemonProcess) -> None:
    keys = [block_key(i) for i in range(1000)]
    values = [block_value(i) for i in range(1000)]
    async with await Client.connect(big_daemon.socket_path) as client:
        statuses = await client.put_many(keys, values)  # 1,000 frames in flight at once
        assert statuses == [PutStatus.STORED] * 1000

        chain = [*keys[:600], block_key(5000), *keys[600:]]
        reply = await client.lookup(chain, mode=LookupMode.PREFIX)
        assert (reply.prefix_hits, reply.defer) == (600, False)

        got = await client.get_many(keys)
        assert all(g is not None and g == v for g, v in zip(got, values, strict=True))
        stats = await client.stats()
    assert stats["tiers"]["ram"]["blocks"] == 1000
    assert stats["tiers"]["ram"]["used_bytes"] == 1000 * BLOCK


async def test_capacity_is_respected_and_evictions_counted(small_daemon: DaemonProcess) -> None:
    capacity = 64 * 1024 * 1024
    # (over the socket: a writer in place keeps a room of RAM for its next block)
    async with await Client.connect(small_daemon.socket_path, stage_writes=False) as client:
        for start in range(0, 1000, 100):  # 250 MiB through a 64 MiB tier
            keys = [block_key(i) for i in range(start, start + 100)]
            await client.put_many(keys, [block_value(i) for i in range(start, start + 100)])
            ram = (await client.stats())["tiers"]["ram"]
            assert ram["used_bytes"] <= capacity
        assert ram["blocks"] == capacity // BLOCK
        # The most recent blocks are resident and intact; the oldest were evicted.
        assert await client.get(block_key(999)) == block_value(999)
        assert await client.get(block_key(0)) is None
    text = small_daemon.scrape()
    assert metric_value(text, "kvtier_tier_evictions_total", 'tier="ram"') == 1000 - 256
    assert metric_value(text, "kvtier_tier_used_bytes", 'tier="ram"') <= capacity
    # every block stored once: through shared memory (COMMIT), or the socket (PUT)
    stored = sum(
        metric_value(text, "kvtier_requests_total", f'op="{op}",outcome="ok"')
        for op in ("put", "commit")
        if f'op="{op}",outcome="ok"' in text
    )
    assert stored == 1000


def test_socket_permissions(small_daemon: DaemonProcess) -> None:
    path = small_daemon.socket_path
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700


async def test_sigterm_finishes_in_flight_replies(sock_dir: Path) -> None:
    """A 64 MiB reply is mid-flight when SIGTERM lands: it arrives whole, then exit 0."""
    from tests.helpers import RawConnection

    proc = DaemonProcess(sock_dir, "--ram-capacity", "256MiB").start()
    keys = [block_key(i) for i in range(64)]
    values = [bytes([i]) * (1024 * 1024) for i in range(64)]
    async with await Client.connect(proc.socket_path) as client:
        await client.put_many(keys, values)
    from kvtier import wire

    raw = RawConnection(proc.socket_path)
    raw.send_frame(wire.Op.GET, 1, wire.encode_keys(keys))
    header = wire.unpack_header(raw.recv_exact(wire.HEADER_SIZE))  # reply has begun
    assert header.data_len == 64 * 1024 * 1024
    proc.send_signal(signal.SIGTERM)
    meta = raw.recv_exact(header.meta_len)
    data = raw.recv_exact(header.data_len)
    out = wire.decode_get_reply(meta, data)
    assert all(o == v for o, v in zip(out, values, strict=True))
    assert raw.at_eof()
    raw.close()
    assert proc.wait() == 0
    assert not proc.socket_path.exists()


def test_stale_socket_is_replaced_and_live_one_is_not_stolen(sock_dir: Path) -> None:
    first = DaemonProcess(sock_dir).start()
    first.stop(signal.SIGKILL)  # leaves its socket file behind
    assert first.socket_path.exists()

    second = DaemonProcess(sock_dir).start()
    try:
        third = DaemonProcess(sock_dir)
        third.data_dir = sock_dir / "third"  # (the second's data directory is its own too)
        with pytest.raises(RuntimeError, match="another kvtier daemon is serving"):
            third.start()
        assert third.proc is not None and third.proc.returncode == 1
    finally:
        assert second.stop() == 0


def test_make_run_serves_and_ping_answers(sock_dir: Path) -> None:
    import subprocess
    import sys

    sock = sock_dir / "d.sock"
    env = {
        "KVTIER_SERVER__SOCKET_PATH": str(sock),
        "KVTIER_METRICS__PORT": "0",
        "KVTIER_RAM__CAPACITY": "64MiB",
        "KVTIER_DISK__PATH": str(sock_dir / "data"),
    }
    proc = DaemonProcess(sock_dir, env=env)
    proc.socket_path = sock
    proc.start(120, command=["make", "-s", "run"])  # the README's command
    ready = next(line for line in proc.lines if "kvtier ready" in line)
    assert f"disk={sock_dir / 'data'} (" in ready  # an empty disk tier is still a disk tier
    try:
        ping = subprocess.run(
            [sys.executable, "-m", "kvtier", "ping", "--socket", str(sock)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert ping.returncode == 0, ping.stderr
        assert ping.stdout.startswith("pong from kvtier/")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
    assert not sock.exists()
    assert (sock_dir / "data").is_dir()  # the embedded default serves RAM + disk


def test_world_writable_socket_directory_is_refused(sock_dir: Path) -> None:
    shared = sock_dir / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # anyone could replace the socket here
    proc = DaemonProcess(shared)
    with pytest.raises(RuntimeError, match="writable by every user"):
        proc.start()
    assert proc.proc is not None and proc.proc.returncode == 1
    assert not (shared / "d.sock").exists()


async def test_a_large_put_is_stored_in_steps_with_lookups_answered_between(
    sock_dir: Path,
) -> None:
    keys = [b"step-%04d" % i for i in range(5000)]
    async with (
        running_daemon(sock_dir, disk={"enabled": False}) as d,
        await Client.connect(d.socket_path) as writer,
        await Client.connect(d.socket_path) as reader,
    ):
        put = asyncio.ensure_future(writer.put_many(keys, [b"v" * 100] * 5000))
        for _ in range(10_000):  # each lookup is a round trip: the loop runs between
            states = (await reader.lookup([keys[0], keys[-1]])).states
            if states[0] is State.HIT:
                break
        # The first look that finds the PUT's first block: the rest is not
        # stored yet, so the lookup was answered between the PUT's steps.
        assert states == [State.HIT, State.MISS]
        assert await put == [PutStatus.STORED] * 5000  # in key order
        assert (await reader.lookup([keys[0], keys[-1]])).states == [State.HIT] * 2


async def test_a_large_durable_put_is_on_disk_when_acknowledged(sock_dir: Path) -> None:
    keys = [b"dur-%04d" % i for i in range(300)]
    async with (
        running_daemon(sock_dir, ram={"capacity": "1MiB"}) as d,
        await Client.connect(d.socket_path) as c,
    ):
        assert (
            await c.put_many(keys, [b"%04d" % i * 1000 for i in range(300)], durable=True)
            == [PutStatus.STORED] * 300
        )
        assert d.disk is not None and all(d.disk.contains(k) for k in keys)
        assert await c.get(keys[0]) == b"0000" * 1000  # from disk: RAM held a fraction

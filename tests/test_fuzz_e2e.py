"""An end-to-end fuzz, bounded to seconds: many hostile connections against one
real daemon while a bystander round-trips blocks; afterwards every map is
empty, memory is bounded and SIGTERM exits without waiting out its grace."""

from __future__ import annotations

import asyncio
import random
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier import Client, wire
from kvtier.model import Lookup, LookupMode, Reserve
from kvtier.wire import Op
from tests.helpers import DaemonProcess, metric_value, rss_bytes

SEED = 20261130
CONNECTIONS = 200


@pytest.fixture
def proc(sock_dir: Path) -> Iterator[DaemonProcess]:
    config = sock_dir / "kvtier.toml"
    config.write_text(
        "[server]\nshutdown_grace = 30.0\n"
        "[lookup]\nprobe_timeout = 0.5\nrequest_state_ttl = 0.5\nsweep_interval = 0.1\n"
        '[[remote_tiers]]\nkind = "memory"\nname = "mem"\n'
    )
    p = DaemonProcess(sock_dir, "--config", str(config), "--ram-capacity", "64MiB").start()
    yield p
    p.stop()


def frames(rng: random.Random) -> list[bytes]:
    """A script of valid requests, some of them to be mutated or cut."""
    keys = [rng.randbytes(rng.choice([1, 8, 32])) for _ in range(rng.randrange(1, 6))]
    out = []
    for rid in range(1, rng.randrange(2, 12)):
        op = rng.choice([Op.LOOKUP, Op.GET, Op.PUT, Op.RESERVE, Op.ABORT, Op.PING, Op.DELETE])
        data = b""
        if op == Op.LOOKUP:
            mode = rng.choice(list(LookupMode))
            meta = wire.encode_lookup(Lookup(keys, mode, 1, rng.choice([0.0, 5.0]), 0.0, b"t"))
        elif op == Op.PUT:
            values = [rng.randbytes(rng.randrange(0, 70_000)) for _ in keys]
            meta, parts = wire.encode_put(keys, values)
            data = b"".join(bytes(p) for p in parts)
        elif op == Op.RESERVE:
            meta = wire.encode_reserve(Reserve(keys, [rng.randrange(0, 5000)] * len(keys), 60.0))
        elif op == Op.PING:
            meta = rng.randbytes(16)
        else:
            meta = wire.encode_keys(keys)
        raw = wire.pack_header(op, rid, len(meta), len(data)) + meta + data
        if rng.random() < 0.25:  # mutate a header or body byte
            pos = rng.randrange(len(raw))
            raw = raw[:pos] + bytes([rng.randrange(256)]) + raw[pos + 1 :]
        out.append(raw)
    return out


async def hostile(path: Path, rng: random.Random) -> None:
    reader, writer = await asyncio.open_unix_connection(str(path))
    script = frames(rng)
    ending = rng.choice(["close", "half-close", "mid-frame-close", "mid-frame-half-close"])
    if ending.startswith("mid-frame"):
        cut = script.pop()
        script.append(cut[: rng.randrange(1, len(cut))])
    for raw in script:
        writer.write(raw)
    try:
        await writer.drain()
        if ending.endswith("half-close"):
            writer.get_extra_info("socket").shutdown(socket.SHUT_WR)
            while await reader.read(65536):  # read replies until the daemon closes
                pass
    except (ConnectionError, OSError):
        pass  # the daemon may close a connection whose framing it lost
    finally:
        writer.close()


async def bystander(path: Path, rng: random.Random, done: asyncio.Event) -> int:
    verified = 0
    async with await Client.connect(path) as c:
        while not done.is_set() or verified < 50:
            key = b"bystander-" + struct.pack("<I", verified)
            value = rng.randbytes(rng.randrange(1, 200_000))
            await c.put(key, value)
            assert await c.get(key) == value
            verified += 1
    return verified


async def test_hostile_connections_leave_nothing_behind(proc: DaemonProcess) -> None:
    rng = random.Random(SEED)
    rss_before = rss_bytes(proc.pid)
    done = asyncio.Event()
    by = asyncio.create_task(bystander(proc.socket_path, random.Random(SEED + 1), done))
    await asyncio.gather(
        *(hostile(proc.socket_path, random.Random(rng.random())) for _ in range(CONNECTIONS))
    )
    done.set()
    assert await by >= 50  # every bystander block came back byte for byte
    async with await Client.connect(proc.socket_path) as c:
        for _ in range(100):
            stats = await c.stats()
            maps = stats["maps"]
            busy = [
                maps[k] for k in ("probes_inflight", "reservations", "timers", "request_states")
            ]
            if stats["server"]["connections"] == 1 and busy == [0, 0, 0, 0]:
                break
            # A mutated LOOKUP may carry a reader-side bound: its request state
            # lives request_state_ttl (0.5 s here) after its last use.
            await asyncio.sleep(0.05)  # allow-sleep: request-state TTL and sweeps must pass
        assert stats["server"]["connections"] == 1  # only this one
        assert maps["probes_inflight"] == 0
        assert maps["reservations"] == 0
        assert maps["request_states"] == 0
        assert maps["timers"] == 0
        assert stats["server"]["requests_waiting"] == 0
    text = proc.scrape()
    assert metric_value(text, "kvtier_protocol_errors_total", 'code="truncated_frame"') >= 1
    assert rss_bytes(proc.pid) - rss_before < 256 * 1024 * 1024
    assert proc.stop() == 0
    assert not any("still busy" in line for line in proc.lines), proc.lines[-5:]

"""make soak: a long mixed workload against a real daemon, with misbehaving
clients and a failing S3, that verifies every byte and then checks the daemon
drained, kept its memory flat and shuts down promptly.

The daemon runs as ``kvtier serve`` (RAM, a disk tier, an S3 tier on the
Ceph RADOS Gateway the soak starts, behind a proxy that can go away or hold
requests).
Every block's bytes derive from its key, so every GET is verified. Prints a
report and exits non-zero on any wrong byte or anything left behind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import random
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvtier import Client, loops, wire
from kvtier.errors import KvtierError
from kvtier.model import Lookup, LookupMode, Reserve
from kvtier.wire import Op
from tests.ceph import CephS3
from tests.helpers import DaemonProcess, rss_bytes
from tests.s3server import ProxiedS3


def value_of(key: bytes, smallest: int = 1024, spread: int = 512 * 1024) -> bytes:
    """The one right value for ``key``: its size (``smallest`` plus up to
    ``spread`` bytes) and its bytes follow from the key."""
    digest = hashlib.sha256(key).digest()
    size = smallest + int.from_bytes(digest[:3], "big") % spread
    return (digest * (size // 32 + 1))[:size]


@dataclass
class Report:
    duration_s: float = 0.0
    puts: int = 0
    gets_verified: int = 0
    gets_missed: int = 0
    lookups: int = 0
    wrong_bytes: int = 0
    misbehaving_connections: int = 0
    s3_outages: int = 0
    client_errors: dict[str, int] = field(default_factory=dict)
    rss_mb: list[float] = field(default_factory=list)
    maps_after: dict[str, int] = field(default_factory=dict)
    connections_after: int = -1
    shutdown_s: float = 0.0
    exit_code: int | None = None

    def failures(self) -> list[str]:
        out = []
        if self.wrong_bytes:
            out.append(f"{self.wrong_bytes} GET(s) returned wrong bytes")
        if any(self.maps_after.get(k) for k in ("probes_inflight", "reservations", "timers")):
            out.append(f"maps did not drain: {self.maps_after}")
        if self.maps_after.get("request_states"):
            out.append(f"request states left: {self.maps_after}")
        if self.connections_after != 1:
            out.append(f"{self.connections_after} connection(s) open after the run (want 1)")
        if self.exit_code != 0:
            out.append(f"exit code {self.exit_code}")
        if len(self.rss_mb) >= 4:
            settled = self.rss_mb[len(self.rss_mb) // 4]  # after warm-up
            if self.rss_mb[-1] > settled * 1.5 + 64:
                out.append(f"RSS grew from {settled:.0f} MB to {self.rss_mb[-1]:.0f} MB")
        return out


class Soak:
    def __init__(self, proc: DaemonProcess, s3: ProxiedS3, seconds: float, seed: int) -> None:
        self.proc = proc
        self.s3 = s3
        self.until = time.monotonic() + seconds
        self.rng = random.Random(seed)
        self.report = Report()
        self.keys: list[bytes] = []

    def running(self) -> bool:
        return time.monotonic() < self.until

    def _error(self, exc: BaseException) -> None:
        name = type(exc).__name__
        self.report.client_errors[name] = self.report.client_errors.get(name, 0) + 1

    async def writer(self, n: int) -> None:
        rng = random.Random(self.rng.random())
        async with await Client.connect(self.proc.socket_path) as c:
            while self.running():
                keys = [rng.randbytes(32) for _ in range(rng.randrange(1, 8))]
                try:
                    if rng.random() < 0.3:
                        await c.reserve(keys, [len(value_of(k)) for k in keys], deadline=5.0)
                    await c.put_many(keys, [value_of(k) for k in keys], durable=rng.random() < 0.1)
                    self.report.puts += len(keys)
                    self.keys.extend(keys)
                    if len(self.keys) > 20_000:
                        del self.keys[:10_000]
                except KvtierError as exc:
                    self._error(exc)

    async def reader(self, n: int) -> None:
        rng = random.Random(self.rng.random())
        async with await Client.connect(self.proc.socket_path) as c:
            while self.running():
                if not self.keys:
                    await c.ping()
                    continue
                chain = [rng.choice(self.keys) for _ in range(rng.randrange(1, 16))]
                chain.append(rng.randbytes(32))  # and one nobody stored
                try:
                    reply = await c.lookup(
                        chain,
                        mode=LookupMode.PREFIX,
                        wait=rng.choice([0.0, 0.05]),
                        max_pending_wait=0.5,
                        request_tag=b"soak-%d" % n,
                    )
                    self.report.lookups += 1
                    values = await c.get_many(chain[: max(1, reply.prefix_hits)])
                    for key, value in zip(chain, values, strict=False):
                        if value is None:
                            self.report.gets_missed += 1
                        elif value != value_of(key):
                            self.report.wrong_bytes += 1
                        else:
                            self.report.gets_verified += 1
                    if rng.random() < 0.2:
                        await c.release(b"soak-%d" % n)
                except KvtierError as exc:
                    self._error(exc)

    async def misbehaver(self) -> None:
        """Reserve and vanish, half-close mid-frame, stall, send garbage."""
        rng = random.Random(self.rng.random())
        while self.running():
            self.report.misbehaving_connections += 1
            try:
                reader, writer = await asyncio.open_unix_connection(str(self.proc.socket_path))
            except OSError as exc:
                self._error(exc)
                continue
            keys = [rng.randbytes(32) for _ in range(3)]
            writer.write(frame(Op.RESERVE, 1, wire.encode_reserve(Reserve(keys, [4096] * 3, 60))))
            writer.write(frame(Op.LOOKUP, 2, wire.encode_lookup(Lookup(keys, wait=30.0))))
            how = rng.choice(["vanish", "half-close-mid-frame", "stall", "garbage"])
            meta, data = wire.encode_put(keys[:1], [value_of(keys[0])])
            whole = frame(Op.PUT, 3, meta, b"".join(bytes(d) for d in data))
            try:
                if how == "half-close-mid-frame":
                    writer.write(whole[: len(whole) // 2])
                    await writer.drain()
                    writer.write_eof()
                    while await reader.read(65536):
                        pass
                elif how == "stall":
                    for rid in range(10, 40):  # ask, never read the answers, then leave
                        writer.write(frame(Op.GET, rid, wire.encode_keys(self.keys[-3:] or keys)))
                    await writer.drain()
                    await asyncio.sleep(rng.random())  # allow-sleep: chaos pacing
                elif how == "garbage":
                    writer.write(rng.randbytes(rng.randrange(1, 4096)))
                    await writer.drain()
                else:
                    await writer.drain()
            except OSError:
                pass
            finally:
                writer.close()

    async def outages(self) -> None:
        """Take S3 away now and then, or hold its HEADs."""
        while self.running():
            await asyncio.sleep(self.rng.uniform(3, 8))  # allow-sleep: chaos pacing
            if not self.running():
                break
            self.report.s3_outages += 1
            if self.rng.random() < 0.5:
                await asyncio.to_thread(self.s3.proxy.go_away)
                await asyncio.sleep(self.rng.uniform(0.5, 3))  # allow-sleep: chaos pacing
                await asyncio.to_thread(self.s3.proxy.come_back)
            else:
                await asyncio.to_thread(self.s3.proxy.hold, "HEAD")
                await asyncio.sleep(self.rng.uniform(0.5, 3))  # allow-sleep: chaos pacing
                await asyncio.to_thread(self.s3.proxy.release)

    async def memory(self) -> None:
        while self.running():
            self.report.rss_mb.append(rss_bytes(self.proc.pid) / 2**20)
            await asyncio.sleep(2)  # allow-sleep: chaos pacing

    async def run(self) -> Report:
        started = time.monotonic()
        await asyncio.gather(
            *(self.writer(i) for i in range(4)),
            *(self.reader(i) for i in range(6)),
            *(self.misbehaver() for _ in range(4)),
            self.outages(),
            self.memory(),
        )
        self.report.duration_s = round(time.monotonic() - started, 1)
        async with await Client.connect(self.proc.socket_path) as c:
            for _ in range(600):  # request states age out after their TTL
                stats = await c.stats()
                maps = stats["maps"]
                self.report.maps_after = {k: v for k, v in maps.items() if k != "verdicts"}
                self.report.connections_after = stats["server"]["connections"]
                if self.report.connections_after == 1 and not any(self.report.maps_after.values()):
                    break
                await asyncio.sleep(0.1)  # allow-sleep: chaos pacing
        self.report.rss_mb.append(rss_bytes(self.proc.pid) / 2**20)
        return self.report


def frame(op: int, rid: int, meta: bytes, data: bytes = b"") -> bytes:
    return wire.pack_header(op, rid, len(meta), len(data)) + meta + data


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of workload")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the S3 server's access log
    # The proxy logs each S3 request the daemon abandons at its deadline.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="kvt-soak-", dir="/tmp") as tmp:
        s3 = CephS3()
        try:
            bucket = s3.new_bucket()
            tier = s3.tier_config(bucket, breaker_failures=5, breaker_reset=2.0)
            config = Path(tmp) / "kvtier.toml"
            config.write_text(
                "[server]\nshutdown_grace = 30.0\n"
                '[disk]\ncapacity = "512MiB"\n'
                "[lookup]\nprobe_timeout = 0.5\nload_timeout = 2.0\npending_deadline = 5.0\n"
                "request_state_ttl = 5.0\n"
                "[[remote_tiers]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in tier.items())
            )
            proc = DaemonProcess(
                Path(tmp), "--config", str(config), "--ram-capacity", "256MiB"
            ).start()
            soak = Soak(proc, s3, args.duration, args.seed)
            report = soak.report
            try:
                loops.run(soak.run())
            finally:
                t = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                with contextlib.suppress(Exception):
                    report.exit_code = proc.wait(60)
                report.shutdown_s = round(time.monotonic() - t, 2)
        finally:
            s3.close()
    failures = report.failures()
    rss = report.rss_mb
    print(
        f"soak {report.duration_s:.0f}s: {report.puts} blocks put, "
        f"{report.gets_verified} GETs verified byte for byte, {report.gets_missed} misses, "
        f"{report.wrong_bytes} wrong; {report.lookups} lookups; "
        f"{report.misbehaving_connections} misbehaving connections; "
        f"{report.s3_outages} S3 outages; client errors {report.client_errors}"
    )
    if rss:
        print(f"RSS MB: first {rss[0]:.0f}, max {max(rss):.0f}, last {rss[-1]:.0f}")
    print(f"after: connections {report.connections_after}, maps {report.maps_after}")
    print(f"SIGTERM -> exit {report.exit_code} in {report.shutdown_s}s")
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=2))
    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

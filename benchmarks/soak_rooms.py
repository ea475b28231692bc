"""make soak-rooms: same-host writers and readers on a small RAM tier.

Sixteen clients of one daemon (``kvtier serve``, a 32 MiB RAM tier, a disk
tier below), each on shared memory as a same-host engine is (blocks written
in place or staged, read in place), with Zipf-distributed keys, values of
4 to 256 KiB whose bytes follow from their key, RESERVE, PUT, GET, DELETE
and connections that close mid-work. RAM is always full: every store and
every disk read must make room by evicting, and room that writers or
closed connections hold must yield to them.

Checks, and exits non-zero on any: no GET returns a wrong byte; no store
fails for capacity that pinned blocks do not explain (the daemon's
error then names what holds the room); a RESERVE of a fresh key is
refused only for that reason too; and within 5 s of the last client
closing the daemon is idle: every map empty and ``ram.reserved_bytes`` 0.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import hashlib
import json
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvtier import Client, ReserveStatus, loops
from kvtier.errors import KvtierError, NoCapacityError
from tests.helpers import DaemonProcess

KiB = 1024


def value_of(key: bytes) -> bytes:
    """The one right value for ``key``: 4 to 256 KiB, its bytes from the key."""
    digest = hashlib.sha256(key).digest()
    size = 4 * KiB + int.from_bytes(digest[:3], "big") % (252 * KiB)
    return (digest * (size // 32 + 1))[:size]


class Zipf:
    """Keys ``0..n-1`` drawn with probability proportional to ``1 / (k+1)^s``."""

    def __init__(self, n: int, s: float, rng: random.Random) -> None:
        weights = [1.0 / (k + 1) ** s for k in range(n)]
        total, acc = sum(weights), 0.0
        self.cdf = []
        for w in weights:
            acc += w / total
            self.cdf.append(acc)
        self.rng = rng

    def draw(self) -> int:
        return min(bisect.bisect_left(self.cdf, self.rng.random()), len(self.cdf) - 1)


@dataclass
class Report:
    seconds: float = 0.0
    puts: int = 0
    gets_verified: int = 0
    gets_missed: int = 0
    wrong_bytes: int = 0
    deletes: int = 0
    reserves: int = 0
    reserves_refused: int = 0
    disconnects: int = 0
    drops: int = 0
    no_capacity: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    no_capacity_messages: list[str] = field(default_factory=list)
    idle_after_s: float | None = None
    after: dict[str, object] = field(default_factory=dict)

    def failures(self) -> list[str]:
        out = []
        if self.wrong_bytes:
            out.append(f"{self.wrong_bytes} GET(s) returned wrong bytes")
        if self.no_capacity:
            out.append(f"{self.no_capacity} store(s) failed for capacity")
        if self.reserves_refused:
            out.append(f"{self.reserves_refused} RESERVE(s) of fresh keys refused")
        if self.idle_after_s is None:
            out.append(f"not idle within 5 s of the last close: {self.after}")
        return out


class Workload:
    def __init__(self, socket: Path, seconds: float, clients: int, keys: int, seed: int) -> None:
        self.socket = socket
        self.until = time.monotonic() + seconds
        self.clients = clients
        self.keys = keys
        self.rng = random.Random(seed)
        self.report = Report()

    def running(self) -> bool:
        return time.monotonic() < self.until

    def _error(self, exc: BaseException) -> None:
        if isinstance(exc, NoCapacityError):
            self.report.no_capacity += 1
            if len(self.report.no_capacity_messages) < 5:
                self.report.no_capacity_messages.append(str(exc))
        name = type(exc).__name__
        self.report.errors[name] = self.report.errors.get(name, 0) + 1

    async def client(self, n: int) -> None:
        rng = random.Random(self.rng.random())
        zipf = Zipf(self.keys, 0.9, rng)
        r = self.report
        while self.running():
            # A connection lives for a few hundred operations, then closes,
            # sometimes with reservations or writes still open.
            async with await Client.connect(self.socket, name=f"soak-{n}") as c:
                for _ in range(rng.randrange(50, 400)):
                    if not self.running():
                        break
                    keys = [b"k-%d" % zipf.draw() for _ in range(rng.randrange(1, 6))]
                    keys = list(dict.fromkeys(keys))
                    op = rng.random()
                    try:
                        if op < 0.15:
                            fresh = [b"fresh-%d-%d" % (n, rng.getrandbits(48)) for _ in keys]
                            got = await c.reserve(fresh, [len(value_of(k)) for k in fresh])
                            r.reserves += len(fresh)
                            r.reserves_refused += got.count(ReserveStatus.REFUSED)
                            if rng.random() < 0.7:
                                await c.put_many(fresh, [value_of(k) for k in fresh])
                                r.puts += len(fresh)
                        elif op < 0.45:
                            await c.put_many(keys, [value_of(k) for k in keys])
                            r.puts += len(keys)
                        elif op < 0.95:
                            values = await c.get_many(keys)
                            for key, value in zip(keys, values, strict=True):
                                if value is None:
                                    r.gets_missed += 1
                                elif value != value_of(key):
                                    r.wrong_bytes += 1
                                else:
                                    r.gets_verified += 1
                        else:
                            await c.delete_many(keys)
                            r.deletes += len(keys)
                    except KvtierError as exc:
                        self._error(exc)
                if rng.random() < 0.3:
                    # Dropped mid-write, as a crashing engine's connection
                    # is: its rooms, bodies and reservations end with it.
                    fresh = [b"fresh-%d-%d" % (n, rng.getrandbits(48)) for _ in range(3)]
                    with contextlib.suppress(KvtierError):
                        await c.reserve(fresh, [len(value_of(k)) for k in fresh])
                    write = asyncio.ensure_future(c.put_many(fresh, [value_of(k) for k in fresh]))
                    await asyncio.sleep(0)  # allow-sleep: let the write start, then drop
                    c.drop()
                    with contextlib.suppress(KvtierError, ConnectionError):
                        await write
                    r.drops += 1
            r.disconnects += 1

    async def run(self) -> Report:
        started = time.monotonic()
        await asyncio.gather(*(self.client(i) for i in range(self.clients)))
        self.report.seconds = round(time.monotonic() - started, 1)
        closed = time.monotonic()
        async with await Client.connect(self.socket, shared=False) as c:
            while time.monotonic() - closed < 5.0:
                stats = await c.stats()
                maps = {k: v for k, v in stats["maps"].items() if k != "verdicts"}
                ram = stats["tiers"]["ram"]
                self.report.after = {
                    "maps": maps,
                    "ram": {k: v for k, v in ram.items() if "held" in k or "reserved" in k},
                    "connections": stats["server"]["connections"],
                }
                if (
                    not any(maps.values())
                    and ram["reserved_bytes"] == 0
                    and stats["server"]["connections"] == 1
                ):
                    self.report.idle_after_s = round(time.monotonic() - closed, 2)
                    break
                await asyncio.sleep(0.05)  # allow-sleep: polling another process's state
        return self.report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of workload")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--keys", type=int, default=4000, help="distinct keys the Zipf draws")
    parser.add_argument("--ram", default="32MiB")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", help="also write the report here")
    parser.add_argument("serve_args", nargs="*", help="more arguments for kvtier serve")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvt-rooms-", dir="/tmp") as tmp:
        proc = DaemonProcess(
            Path(tmp), "--ram-capacity", args.ram, "--disk-capacity", "1GiB", *args.serve_args
        ).start()
        work = Workload(proc.socket_path, args.duration, args.clients, args.keys, args.seed)
        try:
            report = loops.run(work.run())
        finally:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(60)
    r = report
    print(
        f"soak-rooms {r.seconds:.0f}s, {args.clients} same-host clients, RAM {args.ram}: "
        f"{r.puts} blocks put, {r.gets_verified} GETs verified byte for byte, "
        f"{r.gets_missed} misses, {r.wrong_bytes} wrong; {r.reserves} reserved "
        f"({r.reserves_refused} refused); {r.deletes} deleted; {r.disconnects} disconnects "
        f"({r.drops} dropped mid-write)"
    )
    print(f"errors {dict(Counter(r.errors))}")
    for message in r.no_capacity_messages:
        print(f"  e.g. {message}")
    print(f"idle after the last close: {r.idle_after_s} s; {r.after}; exit {code}")
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(r), indent=2))
    failures = r.failures()
    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    return 1 if failures or code != 0 else 0


if __name__ == "__main__":
    sys.exit(main())

"""make bench-hedging: what hedged reads do to a GET's tail when one owner stalls.

Three real daemons on loopback share blocks as peers (``replicas = 2``);
every block's owners are B and C. B is reached through a TCP proxy that
holds back one large response in ten (a block's bytes, not a probe's
answer) for 50 ms: an owner that answers probes at once and sometimes
stalls on the data, as a busy node or a congested link does. A, which
holds none of the blocks, looks each one up (its owners answer) and GETs
it; the GET's time is measured at A's client. The same run starts the
fleet twice: without hedges (``hedge_max_ratio = 0``), then with them
(``hedge_after = 10 ms``, ``hedge_max_ratio = 0.2``). Prints the table;
``--markdown`` writes it (docs/bench-hedging.md, included by ``make bench``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.report import publish
from kvtier import BlockingClient, State
from kvtier.daemon import READY_MESSAGE
from kvtier.tiers.rendezvous import ranked
from tests.helpers import free_port

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "bench-hedging"
BLOCK = 256 * 1024
STALL, STALL_SHARE = 0.050, 0.10


class StallingProxy:
    """Forwards a TCP port; holds back one large read in ten for ``STALL`` seconds."""

    def __init__(self, upstream: int, seed: int) -> None:
        self.port = free_port()
        self.upstream = upstream
        self.rng = random.Random(seed)
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        self.ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", self.port)
        )
        self.ready.set()
        self.loop.run_forever()
        server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, stall: bool) -> None:
            try:
                while data := await src.read(1 << 20):
                    if stall and len(data) >= 64 * 1024 and self.rng.random() < STALL_SHARE:
                        await asyncio.sleep(STALL)  # allow-sleep: the stall is what is measured
                    dst.write(data)
                    await dst.drain()
            finally:
                dst.close()

        await asyncio.gather(
            pump(reader, up_writer, False), pump(up_reader, writer, True), return_exceptions=True
        )

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


class Daemon:
    def __init__(self, tmp: Path, name: str, config: str) -> None:
        self.dir = tmp / name
        self.dir.mkdir()
        (self.dir / "kvtier.toml").write_text(config)
        self.socket = self.dir / "d.sock"
        serve = os.environ.get("KVTIER_SERVE", str(ROOT / ".venv" / "bin" / "kvtier"))
        self.proc = subprocess.Popen(
            [
                serve,
                "serve",
                "--socket",
                str(self.socket),
                "--metrics-port",
                "0",
                "--data-dir",
                str(self.dir / "data"),
                "--config",
                str(self.dir / "kvtier.toml"),
                "--ram-capacity",
                "256MiB",
            ],
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if READY_MESSAGE in line:
                break
        else:
            raise RuntimeError(f"daemon {name} did not start")
        threading.Thread(target=lambda: [None for _ in self.proc.stderr or ()], daemon=True).start()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def run(tmp: Path, blocks: int, hedge: str, seed: int, tag: str) -> list[float]:
    """GET times at A (seconds), one per block."""
    ports = [free_port() for _ in range(3)]
    proxy = StallingProxy(ports[1], seed)
    names = [f"127.0.0.1:{ports[0]}", f"127.0.0.1:{proxy.port}", f"127.0.0.1:{ports[2]}"]
    members = ", ".join(f'"{n}"' for n in names)
    daemons = []
    try:
        for i, name in enumerate("abc"):
            config = (
                f'[peer]\nlisten = "127.0.0.1:{ports[i]}"\nadvertise = "{names[i]}"\n'
                f'members = [{members}]\ntoken = "{TOKEN}"\nreplicas = 2\n'
                f"request_timeout = 5.0\n{hedge}"
                '[lookup]\nverdict_ttl = 60.0\nremote_hit = "hit"\n'
            )
            daemons.append(Daemon(tmp, f"{name}-{tag}", config))
        a, b, c = daemons
        wanted = [n.encode() for n in names[1:]]
        keys: list[bytes] = []
        n = 0
        while len(keys) < blocks:
            key = b"hedged-%d" % n
            n += 1
            if sorted(ranked(key, [m.encode() for m in names])[:2]) == sorted(wanted):
                keys.append(key)
        value = os.urandom(BLOCK)
        with BlockingClient(c.socket) as cc:
            for key in keys:
                cc.put(key, value)  # C keeps it and pushes it to B
        with BlockingClient(b.socket) as cb:
            deadline = time.monotonic() + 60
            while cb.lookup(keys).states.count(State.HIT) < len(keys):
                assert time.monotonic() < deadline, "pushes did not land"
        times = []
        with BlockingClient(a.socket) as ca:
            for key in keys:
                assert ca.lookup([key], wait=5.0).states == [State.HIT]
                started = time.perf_counter()
                got = ca.get(key)
                times.append(time.perf_counter() - started)
                assert got is not None and bytes(got) == value
        return times
    finally:
        for d in daemons:
            d.stop()
        proxy.close()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hedging")
    parser.add_argument("--blocks", type=int, default=300)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvt-bench-hedging-") as d:
        for tag, (label, hedge) in enumerate(
            (
                ("without hedges", "hedge_max_ratio = 0.0\n"),
                ("hedged", "hedge_after = 0.010\nhedge_max_ratio = 0.2\n"),
            )
        ):
            times = sorted(run(Path(d), args.blocks, hedge, seed=7, tag=str(tag)))
            p = [times[min(len(times) - 1, int(q * len(times)))] * 1e3 for q in (0.5, 0.9, 0.99)]
            rows.append((label, statistics.mean(times) * 1e3, *p))
            print(
                f"{label:16} mean {rows[-1][1]:6.1f} ms  p50 {p[0]:6.1f}  p90 {p[1]:6.1f}  "
                f"p99 {p[2]:6.1f}",
                flush=True,
            )
    out = [
        "## Hedged reads: a GET's tail when one owner stalls",
        "",
        f"Measured with `make bench-hedging`: three daemons, {args.blocks} blocks of",
        "256 KiB owned by two of them, one of which is reached through a proxy",
        f"that holds back one large response in ten for {STALL * 1e3:.0f} ms; the third",
        "daemon looks each block up and GETs it. Same run, the fleet started",
        "without hedges and then with them (`hedge_after = 0.010`,",
        "`hedge_max_ratio = 0.2`). GET time at the client, ms:",
        "",
        "| | mean | p50 | p90 | p99 |",
        "|---|---:|---:|---:|---:|",
        *(f"| {label} | {m:.1f} | {a:.1f} | {b:.1f} | {c:.1f} |" for label, m, a, b, c in rows),
    ]
    publish(out, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""make bench-hedging: what hedged reads do to a GET's tail when a holder stalls.

Three real daemons on loopback share blocks as peers. B, and in the S3
scenarios Ceph's RADOS Gateway (tests/ceph.py, started here), are
reached through TCP proxies that hold back one large read in ten (a
block's bytes, not a probe's answer) for 50 ms: a holder that answers
probes at once and sometimes stalls on the data, as a busy node, a
congested link or an object store's slow server does. A, which holds none
of the blocks, looks each one up and GETs it; the GET's time is measured
at A's client. Three scenarios (:data:`SCENARIOS`): blocks at two peers
(hedged to the next owner), blocks in S3 only (hedged to S3 again), blocks
at one peer and in S3 (hedged to S3 below). Each fleet is started twice in
the same run: without hedges (``hedge_max_ratio = 0``), then with them.
Prints the table; ``--markdown`` writes it (docs/bench-hedging.md,
included by ``make bench``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.report import publish
from kvtier import BlockingClient, State
from kvtier.tiers.rendezvous import ranked
from kvtier.tiers.s3 import CHECKSUM_META, object_checksum
from tests.ceph import CephS3
from tests.helpers import DaemonProcess
from tests.ports import free_port
from tests.s3server import ProxiedS3

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "bench-hedging"
BLOCK = 256 * 1024
STALL, STALL_SHARE = 0.050, 0.10
#: the hedged runs' settings
PEER_HEDGE_AFTER, S3_HEDGE_AFTER, HEDGE_RATIO = 0.010, 0.020, 0.2
#: a GET slower than this waited out a stall
SLOW = 0.040


class StallingProxy:
    """Forwards a TCP port; holds back one large response in ten for
    ``STALL`` seconds (one draw per request a connection forwards: a
    response's first large read)."""

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

        #: a request went up since the last draw: its response may stall
        asked = [False]

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, stall: bool) -> None:
            try:
                while data := await src.read(1 << 20):
                    if not stall:
                        asked[0] = True
                    elif asked[0] and len(data) >= 64 * 1024:
                        asked[0] = False
                        if self.rng.random() < STALL_SHARE:
                            await asyncio.sleep(STALL)  # allow-sleep: the stall is measured
                    dst.write(data)
                    await dst.drain()
            finally:
                dst.close()

        await asyncio.gather(
            pump(reader, up_writer, False), pump(up_reader, writer, True), return_exceptions=True
        )

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


def start_daemon(tmp: Path, name: str, config: str) -> DaemonProcess:
    """A daemon of its own directory under ``tmp``, with ``config``."""
    home = tmp / name
    home.mkdir()
    (home / "kvtier.toml").write_text(config)
    return DaemonProcess(
        home, "--config", str(home / "kvtier.toml"), "--ram-capacity", "256MiB"
    ).start()


@dataclass(frozen=True)
class Scenario:
    """Where the blocks are, and which holder a hedge reaches."""

    label: str
    #: owners of each block (peer.replicas)
    replicas: int
    #: C stores the blocks (and pushes them to their owners); else they are
    #: written straight into the bucket
    stored_by_c: bool
    #: daemons have an S3 tier (through the stalling proxy)
    s3: bool


SCENARIOS = (
    Scenario("a peer, hedged to the next owner", replicas=2, stored_by_c=True, s3=False),
    Scenario("S3, hedged to S3 again", replicas=1, stored_by_c=False, s3=True),
    Scenario("a peer, hedged to S3 below", replicas=1, stored_by_c=True, s3=True),
)
HEDGES = {
    False: ("hedge_max_ratio = 0.0\n", "hedge_max_ratio = 0.0\n"),
    True: (
        f"hedge_after = {PEER_HEDGE_AFTER}\nhedge_max_ratio = {HEDGE_RATIO}\n",
        f"hedge_after = {S3_HEDGE_AFTER}\nhedge_max_ratio = {HEDGE_RATIO}\n",
    ),
}


def s3_section(tier: dict[str, Any], hedge: str) -> str:
    return (
        "[[remote_tiers]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in tier.items()) + hedge
    )


def run(
    tmp: Path, s3: ProxiedS3, scenario: Scenario, blocks: int, hedged: bool, seed: int, tag: str
) -> tuple[list[float], Counter[str]]:
    """GET times at A (seconds), one per block, and A's hedges by outcome."""
    ports = [free_port() for _ in range(3)]
    proxy = StallingProxy(ports[1], seed)
    bucket = s3.new_bucket()
    s3_proxy = StallingProxy(int(s3.endpoint.rpartition(":")[2]), seed + 1)
    tier = s3.tier_config(bucket, endpoint_url=f"http://127.0.0.1:{s3_proxy.port}")
    names = [f"127.0.0.1:{ports[0]}", f"127.0.0.1:{proxy.port}", f"127.0.0.1:{ports[2]}"]
    members = ", ".join(f'"{n}"' for n in names)
    peer_hedge, s3_hedge = HEDGES[hedged]
    daemons = []
    try:
        for i, name in enumerate("abc"):
            config = (
                f'[peer]\nlisten = "127.0.0.1:{ports[i]}"\nadvertise = "{names[i]}"\n'
                f'members = [{members}]\ntoken = "{TOKEN}"\nreplicas = {scenario.replicas}\n'
                f"request_timeout = 5.0\n{peer_hedge}"
                '[lookup]\nverdict_ttl = 60.0\nremote_hit = "hit"\n'
                + (s3_section(tier, s3_hedge) if scenario.s3 else "")
            )
            daemons.append(start_daemon(tmp, f"{name}-{tag}", config))
        a, b, c = daemons
        # owners: B (and C with two replicas); A holds none
        owners = [n.encode() for n in names[1 : 1 + scenario.replicas]]
        keys: list[bytes] = []
        n = 0
        while len(keys) < blocks:
            key = b"hedged-%d" % n
            n += 1
            if sorted(ranked(key, [m.encode() for m in names])[: len(owners)]) == sorted(owners):
                keys.append(key)
        value = os.urandom(BLOCK)
        boto = s3.boto()
        if scenario.stored_by_c:
            with BlockingClient(c.socket_path) as cc:
                for key in keys:
                    cc.put(key, value)  # C keeps it, pushes it to its owners, writes it to S3
            with BlockingClient(b.socket_path) as cb:
                deadline = time.monotonic() + 60
                while cb.lookup(keys).states.count(State.HIT) < len(keys):
                    assert time.monotonic() < deadline, "pushes did not land"
        else:
            for key in keys:
                body = bytes(value)
                boto.put_object(
                    Bucket=bucket,
                    Key=tier["prefix"] + key.hex(),
                    Body=body,
                    Metadata={CHECKSUM_META: object_checksum(key, body)},
                )
        if scenario.s3:  # every block in the bucket before A reads
            deadline = time.monotonic() + 60
            listed = 0
            while listed < len(keys):
                assert time.monotonic() < deadline, "writes to S3 did not land"
                pages = boto.get_paginator("list_objects_v2").paginate(Bucket=bucket)
                listed = sum(page.get("KeyCount", 0) for page in pages)
        times = []
        with BlockingClient(a.socket_path) as ca:
            for key in keys:
                assert ca.lookup([key], wait=5.0).states == [State.HIT]
                started = time.perf_counter()
                got = ca.get(key)
                times.append(time.perf_counter() - started)
                assert got is not None and bytes(got) == value
            tiers = ca.stats()["tiers"]
        hedges = Counter[str]()
        for name in ("peers", "s3"):
            hedges.update(tiers.get(name, {}).get("hedges", {}))
        return times, hedges
    finally:
        for d in daemons:
            d.stop()
        proxy.close()
        s3_proxy.close()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hedging")
    parser.add_argument("--blocks", type=int, default=300)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    rows = []
    s3 = CephS3()
    try:
        with tempfile.TemporaryDirectory(prefix="kvt-bench-hedging-") as d:
            for n, scenario in enumerate(SCENARIOS):
                for hedged in (False, True):
                    tag = f"{n}{'h' if hedged else ''}"
                    times, hedges = run(Path(d), s3, scenario, args.blocks, hedged, 7, tag)
                    times.sort()
                    p = [
                        times[min(len(times) - 1, int(q * len(times)))] * 1e3
                        for q in (0.5, 0.9, 0.99)
                    ]
                    label = "hedged" if hedged else "without hedges"
                    won = f"{hedges['won']} / {hedges['lost']} / {hedges['skipped']}"
                    slow = sum(t > SLOW for t in times)
                    rows.append(
                        (scenario.label, label, statistics.mean(times) * 1e3, *p, slow, won)
                    )
                    print(
                        f"{scenario.label:34} {label:15} mean {rows[-1][2]:6.1f} ms  "
                        f"p50 {p[0]:6.1f}  p90 {p[1]:6.1f}  p99 {p[2]:6.1f}  "
                        f"over {SLOW * 1e3:.0f} ms {slow}  hedges {won}",
                        flush=True,
                    )
    finally:
        s3.close()
    out = [
        "## Hedged reads: a GET's tail when a holder stalls",
        "",
        f"Measured with `make bench-hedging`: three daemons (A, B, C), {args.blocks} blocks of",
        "256 KiB that A does not hold. B, and Ceph's RADOS Gateway in",
        "the S3 rows, are reached through a proxy that holds back one response",
        f"in ten for {STALL * 1e3:.0f} ms (a block's bytes, not a probe's answer);",
        "A looks each block up and GETs it. Where the blocks are:",
        "",
        "- *a peer, hedged to the next owner*: at B and C (`replicas = 2`), A asks B first;",
        "- *S3, hedged to S3 again*: in the bucket only;",
        "- *a peer, hedged to S3 below*: at B (`replicas = 1`) and in the bucket.",
        "",
        "Same run, each fleet started without hedges (`hedge_max_ratio = 0`) and",
        f"then with them (peers `hedge_after = {PEER_HEDGE_AFTER}`, S3 `hedge_after =",
        f"{S3_HEDGE_AFTER}`, `hedge_max_ratio = {HEDGE_RATIO}`). GET time at A's client, ms:",
        "",
        f"| blocks | | mean | p50 | p90 | p99 | GETs over {SLOW * 1e3:.0f} ms "
        "| hedges won / lost / skipped |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {where} | {label} | {m:.1f} | {a:.1f} | {b:.1f} | {c:.1f} | {n} | {h} |"
            for where, label, m, a, b, c, n, h in rows
        ),
        "",
        "A stall is a draw per response, so a hedge through the same proxy (S3",
        "asked again, or S3 below a peer) stalls too one time in ten: about one",
        "read in a hundred stalls twice, which is where these p99s sit. The",
        "GETs over the stall's length count the reads that waited it out.",
    ]
    publish(out, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())

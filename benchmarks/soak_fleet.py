"""make soak-fleet: three daemons sharing blocks while their nodes fail.

Three ``kvtier serve`` processes, each with a disk tier, peers with
``replicas = 2`` and one S3 tier on Ceph's RADOS Gateway, started here
(tests/ceph.py; ``--store moto`` puts moto's emulator there instead). Every
daemon's peer port sits behind a small TCP proxy (its advertised address)
that can add latency or cut every connection. Sixteen clients, spread over
the nodes, write blocks (some durable) and read them back, verifying every
byte: a block's bytes follow from its key. A driver injects one fault at a
time: SIGSTOP then SIGCONT, SIGKILL then a restart over the same data
directory, latency on a node's peer links, every peer connection of a
node cut, or block files on a node's disk corrupted behind its back (a
byte of the value flipped); and, with Ceph, the object store itself: RGW
hung (SIGSTOP, then SIGCONT) or killed and started again after an outage
of 10 to 30 s. The clients of a node pause while their own daemon is stopped
or dead (its engine would be down with it); every other request must
succeed.

The report: operations, wrong bytes (must be 0), client errors other than
a miss (must be 0), blocks acknowledged durable and then lost (must be 0),
p99 lookup latency during faults, how long after each fault lookups of the
affected keys settle (no RETRY or PENDING left), lookups that answered HIT
again, at the same node, for a block whose load had failed there (must be
0: a failed load is a MISS at once, at the daemon and at its lookup
process), each daemon's RSS and maps once idle (maps 0, nothing owed to
the store), and for each RGW outage how long after RGW answered again every
daemon had sent what it owed (within 120 s: the drain runs at the store's
pace, and here the fleet keeps writing as fast as two cores allow), and the
blocks written during the outage missing from the bucket at the end (must
be 0). Exits non-zero on any
failure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks import soak
from kvtier import Client, State, loops
from kvtier.errors import KvtierError
from kvtier.model import LookupMode
from kvtier.tiers.disk.format import HEADER
from kvtier.tiers.rendezvous import owner
from kvtier.wire.codecs import escape
from tests.ceph import CephS3
from tests.helpers import DaemonProcess, metric_value, rss_bytes
from tests.ports import free_port
from tests.s3server import ProxiedS3, S3Server

TOKEN = "soak-fleet-peer-token"
NODES = 3
CLIENTS = 16


def value_of(key: bytes) -> bytes:
    """The one right value for ``key``: 4 KiB to 36 KiB, following from the key."""
    return soak.value_of(key, smallest=4096, spread=32 * 1024)


class LinkProxy:
    """A TCP proxy in front of one daemon's peer port: adds latency, cuts links."""

    def __init__(self, port: int, upstream: int) -> None:
        self.port, self.upstream = port, upstream
        self.delay = 0.0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(
            self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True
        )
        self._writers -= {writer, up_writer}

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(256 * 1024):
                if self.delay:
                    await asyncio.sleep(self.delay)  # allow-sleep: the injected link latency
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    def cut(self) -> None:
        """Drop every connection through the proxy (peers reconnect)."""
        for writer in list(self._writers):
            writer.transport.abort()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.cut()
        if self._handlers:  # each ends once its cut connections read EOF
            await asyncio.wait(self._handlers, timeout=5)


@dataclass
class Report:
    seconds: float = 0.0
    puts: int = 0
    durable_puts: int = 0
    lookups: int = 0
    gets_verified: int = 0
    gets_missed: int = 0
    wrong_bytes: int = 0
    client_errors: dict[str, int] = field(default_factory=dict)
    durable_lost: int = 0
    #: block files corrupted by the driver, and the durable blocks among them
    #: (lost by the fault, not by the daemon: not counted as lost)
    corrupted_files: int = 0
    corrupted_durable: int = 0
    #: HIT answers whose GET, right after, found nothing
    hits_not_loaded: int = 0
    #: ... of a block whose load had already failed at that node: must be 0
    hits_after_failed_load: int = 0
    faults: list[dict[str, object]] = field(default_factory=list)
    #: blocks written while RGW was down (killed), and those of them the
    #: bucket did not hold at the end: must be 0
    written_in_outages: int = 0
    outage_writes_missing: int = 0
    #: ... not in the bucket's listing at the end (found by a HEAD all the same)
    outage_writes_unlisted: int = 0
    lookup_p99_ms_faults: float = 0.0
    lookup_p99_ms_calm: float = 0.0
    nodes_after: list[dict[str, object]] = field(default_factory=list)

    def failures(self) -> list[str]:
        out = []
        if self.wrong_bytes:
            out.append(f"{self.wrong_bytes} GET(s) returned wrong bytes")
        if self.client_errors:
            out.append(f"client errors other than a miss: {self.client_errors}")
        if self.durable_lost:
            out.append(f"{self.durable_lost} durable block(s) lost")
        if self.outage_writes_missing:
            out.append(
                f"{self.outage_writes_missing} block(s) written while the store was down "
                "never reached it"
            )
        for fault in self.faults:
            drained = fault.get("owed_sent_after_s")
            if fault["kind"] != "rgw-kill" or not isinstance(drained, float):
                continue
            if drained < 0:
                out.append(f"owed writes not all sent within 120 s of RGW's return: {fault}")
        if self.hits_after_failed_load:
            out.append(
                f"{self.hits_after_failed_load} lookup(s) answered HIT for a block whose "
                "load had failed at that node"
            )
        for node in self.nodes_after:
            if node.get("disk_evictions"):
                out.append(
                    f"node {node['node']} evicted from its disk: durable blocks may have gone "
                    "by capacity; give the disks more room"
                )
            maps = node.get("maps")
            if isinstance(maps, dict) and any(
                maps.get(k) for k in ("probes_inflight", "reservations", "request_states", "timers")
            ):
                out.append(f"node {node['node']} maps did not drain: {maps}")
            if node.get("owed_blocks"):
                out.append(f"node {node['node']} still owes the store {node['owed_blocks']} blocks")
        return out


class Fleet:
    def __init__(self, root: Path, s3: ProxiedS3, bucket: str) -> None:
        self.root = root
        self.s3, self.bucket = s3, bucket
        self.ports = [free_port() for _ in range(NODES)]  # the daemons' own peer ports
        self.links = [LinkProxy(free_port(), p) for p in self.ports]
        self.addresses = [f"127.0.0.1:{link.port}" for link in self.links]
        # Straight at the store: its faults are the store's own (signals to
        # RGW), and a proxy in this process would be the fleet's bottleneck.
        self.tier = s3.tier_config(
            bucket, endpoint_url=s3.endpoint, breaker_failures=5, breaker_reset=2.0
        )
        self.procs: list[DaemonProcess] = []

    def config(self, i: int) -> Path:
        d = self.root / f"node{i}"
        d.mkdir(exist_ok=True)
        members = ", ".join(json.dumps(a) for a in self.addresses)
        path = d / "kvtier.toml"
        path.write_text(
            "[server]\nshutdown_grace = 10.0\n"
            '[disk]\ncapacity = "16GiB"\n'
            "[lookup]\nprobe_timeout = 1.0\nload_timeout = 3.0\npending_deadline = 5.0\n"
            "request_state_ttl = 5.0\n"
            f'[peer]\nlisten = "127.0.0.1:{self.ports[i]}"\nadvertise = "{self.addresses[i]}"\n'
            f'members = [{members}]\ntoken = "{TOKEN}"\nreplicas = 2\n'
            "connect_timeout = 0.5\nrequest_timeout = 1.0\nbreaker_reset = 1.0\n"
            "[[remote_tiers]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in self.tier.items())
        )
        return path

    def start(self, i: int) -> DaemonProcess:
        return DaemonProcess(
            self.root / f"node{i}", "--config", str(self.config(i)), "--ram-capacity", "64MiB"
        ).start(60)

    def owner_of(self, key: bytes) -> int:
        name = owner(key, [a.encode() for a in self.addresses])
        assert name is not None
        return self.addresses.index(name.decode())


class Soak:
    def __init__(self, fleet: Fleet, seconds: float, seed: int) -> None:
        self.fleet = fleet
        self.until = time.monotonic() + seconds
        self.rng = random.Random(seed)
        self.report = Report()
        self.keys: list[bytes] = []
        #: durable PUTs acknowledged, by key: the node that acknowledged it
        self.durable: dict[bytes, int] = {}
        #: nodes whose daemon is stopped or dead: their clients pause
        self.down: set[int] = set()
        #: requests in flight per node (the driver waits for 0 before a fault)
        self.busy = [0] * NODES
        self.idle = [asyncio.Event() for _ in range(NODES)]
        self.fault_on = False
        self.latencies: list[tuple[bool, float]] = []
        #: durable blocks lost, by the node that acknowledged them
        self.lost_on: dict[int, int] = {}
        #: (node, key) whose load failed there after a HIT
        self.failed_loads: set[tuple[int, bytes]] = set()
        #: keys whose block file the driver corrupted
        self.corrupted: set[bytes] = set()
        #: the store is down now: the keys written meanwhile, to find in the bucket
        self.outage: list[bytes] | None = None
        self.outage_keys: list[bytes] = []

    def running(self) -> bool:
        return time.monotonic() < self.until

    def _error(self, exc: BaseException) -> None:
        name = type(exc).__name__
        self.report.client_errors[name] = self.report.client_errors.get(name, 0) + 1

    async def client(self, n: int) -> None:
        node = n % NODES
        rng = random.Random(self.rng.random())
        client: Client | None = None
        while self.running():
            if node in self.down:
                if client is not None:
                    client.drop()
                    client = None
                await asyncio.sleep(0.05)  # allow-sleep: the node's engine waits out its daemon
                continue
            self.busy[node] += 1
            self.idle[node].clear()
            try:
                if client is None or client.closed:
                    client = await Client.connect(self.fleet.procs[node].socket_path, timeout=10.0)
                if rng.random() < 0.4 or len(self.keys) < 50:
                    await self._write(client, node, rng)
                else:
                    await self._read(client, node, rng)
            except KvtierError as exc:
                self._error(exc)
                client = None
            finally:
                self.busy[node] -= 1
                if not self.busy[node]:
                    self.idle[node].set()
        if client is not None:
            await client.close()

    async def _write(self, c: Client, node: int, rng: random.Random) -> None:
        keys = [rng.randbytes(32) for _ in range(rng.randrange(1, 6))]
        durable = rng.random() < 0.2
        await c.put_many(keys, [value_of(k) for k in keys], durable=durable)
        self.report.puts += len(keys)
        self.keys.extend(keys)
        if self.outage is not None:
            self.outage.extend(keys)
        if durable:
            self.report.durable_puts += len(keys)
            for key in keys:
                self.durable[key] = node
        if len(self.keys) > 50_000:
            del self.keys[:25_000]

    async def _read(self, c: Client, node: int, rng: random.Random) -> None:
        chain = [rng.choice(self.keys) for _ in range(rng.randrange(1, 8))]
        started = time.monotonic()
        reply = await c.lookup(chain, mode=LookupMode.PREFIX, wait=rng.choice([0.0, 0.5]))
        self.latencies.append((self.fault_on, time.monotonic() - started))
        self.report.lookups += 1
        values = await c.get_many(chain[: max(1, reply.prefix_hits)])
        for i, (key, value) in enumerate(zip(chain, values, strict=False)):
            if value is None and i < reply.prefix_hits:  # HIT, then nothing to load
                self.report.hits_not_loaded += 1
                if (node, key) in self.failed_loads:
                    self.report.hits_after_failed_load += 1
                self.failed_loads.add((node, key))
            if value is None:
                self.report.gets_missed += 1
            elif value != value_of(key):
                self.report.wrong_bytes += 1
            else:
                self.report.gets_verified += 1

    async def _quiesce(self, node: int) -> None:
        """Stop ``node``'s clients from starting requests and wait for theirs to end."""
        self.down.add(node)
        if self.busy[node]:
            await self.idle[node].wait()

    async def driver(self) -> None:
        fleet = self.fleet
        while self.running():
            await asyncio.sleep(self.rng.uniform(8, 15))  # allow-sleep: calm between faults
            if not self.running():
                break
            node = self.rng.randrange(NODES)
            kinds = ["sigstop", "sigkill", "latency", "cut", "corrupt"]
            if isinstance(fleet.s3, CephS3):
                kinds += ["rgw-stop", "rgw-kill"]
            kind = self.rng.choice(kinds)
            if kind.startswith("rgw"):
                await self._store_fault(kind)
                continue
            affected = [k for k in self.keys[-5000:] if fleet.owner_of(k) == node][:64]
            self.fault_on = True
            started = time.monotonic()
            proc = fleet.procs[node]
            if kind == "sigstop":
                await self._quiesce(node)
                proc.send_signal(signal.SIGSTOP)
                await asyncio.sleep(self.rng.uniform(2, 6))  # allow-sleep: the fault's length
                proc.send_signal(signal.SIGCONT)
                self.down.discard(node)
            elif kind == "sigkill":
                await self._quiesce(node)
                proc.send_signal(signal.SIGKILL)
                await asyncio.to_thread(proc.wait)
                await asyncio.sleep(self.rng.uniform(1, 4))  # allow-sleep: the node stays down
                fleet.procs[node] = await asyncio.to_thread(fleet.start, node)
                self.down.discard(node)
            elif kind == "latency":
                fleet.links[node].delay = self.rng.uniform(0.05, 0.3)
                await asyncio.sleep(self.rng.uniform(4, 8))  # allow-sleep: the fault's length
                fleet.links[node].delay = 0.0
            elif kind == "corrupt":
                self.corrupt(node, self.rng.randrange(8, 64))
            else:
                fleet.links[node].cut()
            ended = time.monotonic()
            self.fault_on = False
            settle, hits = await self._settle(node, affected)
            self.report.faults.append(
                {
                    "kind": kind,
                    "node": node,
                    "seconds": round(ended - started, 2),
                    "affected_keys": len(affected),
                    "settled_after_s": settle,
                    "affected_hits": hits,
                }
            )

    async def _store_fault(self, kind: str) -> None:
        """RGW hung (SIGSTOP for 2-6 s) or killed and started again after 10-30
        s; then how long until every daemon has sent what it owed."""
        assert isinstance(self.fleet.s3, CephS3)
        cluster = self.fleet.s3.cluster
        self.fault_on = True
        started = time.monotonic()
        if kind == "rgw-stop":
            cluster.rgw_signal(signal.SIGSTOP)
            await asyncio.sleep(self.rng.uniform(2, 6))  # allow-sleep: the fault's length
            cluster.rgw_signal(signal.SIGCONT)
        else:
            self.outage = []
            await asyncio.to_thread(cluster.rgw_signal, signal.SIGKILL)
            await asyncio.sleep(self.rng.uniform(10, 30))  # allow-sleep: the outage's length
            await asyncio.to_thread(cluster.start_rgw)
            self.outage_keys += self.outage
            self.report.written_in_outages += len(self.outage)
            self.outage = None
        back = time.monotonic()
        self.fault_on = False
        self.report.faults.append(
            {
                "kind": kind,
                "node": -1,
                "seconds": round(back - started, 2),
                "owed_sent_after_s": await self._owed_sent(back),
            }
        )

    async def _writes(self) -> dict[int, dict[str, int]]:
        """Each live daemon's writes to the store (STATS ``writes.s3``)."""
        out = {}
        for node, proc in enumerate(self.fleet.procs):
            if node in self.down:
                continue
            with contextlib.suppress(KvtierError):
                async with await Client.connect(proc.socket_path) as c:
                    out[node] = (await c.stats())["writes"]["s3"]
        return out

    async def _owed_sent(self, since: float) -> float:
        """Seconds from ``since`` until every daemon has sent what it owed
        then: blocks are sent oldest first, so once a daemon has sent as many
        as it owed, the ones it owed have all gone (new writes keep coming)."""
        start = await self._writes()
        while True:
            now = await self._writes()
            if all(
                node not in now or now[node]["owed_sent"] - w["owed_sent"] >= w["owed_blocks"]
                for node, w in start.items()
            ):
                return round(time.monotonic() - since, 2)
            if time.monotonic() - since > 120:
                return -1.0
            await asyncio.sleep(0.1)  # allow-sleep: polling the daemons' STATS

    async def verify_outage_writes(self) -> None:
        """Every block written while the store was down is in the bucket."""
        if not self.outage_keys:
            return
        fleet = self.fleet

        def listed() -> set[str]:
            boto = fleet.s3.boto()
            names: set[str] = set()
            for page in boto.get_paginator("list_objects_v2").paginate(Bucket=fleet.bucket):
                names.update(o["Key"] for o in page.get("Contents", []))
            return names

        def absent(missing: list[str]) -> int:
            """Of the objects the listing lacks, those a HEAD does not find
            either (a listing after a crash of RGW may lag its objects)."""
            boto = fleet.s3.boto()
            gone = 0
            for name in missing:
                try:
                    boto.head_object(Bucket=fleet.bucket, Key=name)
                except boto.exceptions.ClientError:
                    gone += 1
            return gone

        names = await asyncio.to_thread(listed)
        prefix = fleet.tier["prefix"]
        # (a key whose first byte is 0xff is stored escaped: docs/s3.md)
        unlisted = [f"{prefix}{k.hex()}" for k in escape(self.outage_keys)]
        unlisted = [name for name in unlisted if name not in names]
        self.report.outage_writes_unlisted = len(unlisted)
        self.report.outage_writes_missing = await asyncio.to_thread(absent, unlisted)

    def corrupt(self, node: int, count: int) -> None:
        """Flip a byte of the value of ``count`` block files on ``node``'s
        disk, behind the daemon's back (its checksum must catch each)."""
        files = [p for p in (self.fleet.root / f"node{node}" / "data").rglob("*.blk")]
        for path in self.rng.sample(files, min(count, len(files))):
            try:
                data = bytearray(path.read_bytes())
            except FileNotFoundError:
                continue  # evicted meanwhile
            if len(data) <= HEADER.size:
                continue
            key_len = HEADER.unpack_from(data)[3]
            data[-1 - self.rng.randrange(64)] ^= 0x5A
            path.write_bytes(bytes(data))
            self.corrupted.add(bytes(data[HEADER.size : HEADER.size + key_len]))
            self.report.corrupted_files += 1

    async def _settle(self, node: int, keys: list[bytes]) -> tuple[float, int]:
        """Seconds until another node answers ``keys`` with no RETRY or PENDING."""
        if not keys:
            return 0.0, 0
        other = (node + 1) % NODES
        started = time.monotonic()
        async with await Client.connect(self.fleet.procs[other].socket_path) as c:
            while True:
                states = (await c.lookup(keys)).states
                if State.RETRY not in states and State.PENDING not in states:
                    return round(time.monotonic() - started, 2), states.count(State.HIT)
                if time.monotonic() - started > 60:
                    return -1.0, states.count(State.HIT)
                await asyncio.sleep(0.05)  # allow-sleep: polling as an engine's scheduler does

    async def verify_durable(self) -> None:
        """Every durable block is still served, with its bytes, by the node that took it."""
        by_node: dict[int, list[bytes]] = {}
        for key, node in self.durable.items():
            if key in self.corrupted:  # its file was damaged on purpose
                self.report.corrupted_durable += 1
                continue
            by_node.setdefault(node, []).append(key)
        for node, keys in by_node.items():
            async with await Client.connect(self.fleet.procs[node].socket_path) as c:
                for i in range(0, len(keys), 200):
                    chunk = keys[i : i + 200]
                    await c.lookup(chunk, wait=10.0)
                    for key, value in zip(chunk, await c.get_many(chunk), strict=True):
                        if value is None:
                            self.report.durable_lost += 1
                            self.lost_on[node] = self.lost_on.get(node, 0) + 1
                        elif value != value_of(key):
                            self.report.wrong_bytes += 1

    async def run(self) -> Report:
        for link in self.fleet.links:
            await link.start()
        started = time.monotonic()
        try:
            await asyncio.gather(*(self.client(n) for n in range(CLIENTS)), self.driver())
            self.report.seconds = round(time.monotonic() - started, 1)
            await self.verify_durable()
            await self._idle_stats()
            await self.verify_outage_writes()
        finally:
            for link in self.fleet.links:
                await link.close()
        during = [t for f, t in self.latencies if f]
        calm = [t for f, t in self.latencies if not f]
        if len(during) >= 2:
            self.report.lookup_p99_ms_faults = round(
                statistics.quantiles(during, n=100)[98] * 1000, 1
            )
        if len(calm) >= 2:
            self.report.lookup_p99_ms_calm = round(statistics.quantiles(calm, n=100)[98] * 1000, 1)
        return self.report

    async def _idle_stats(self) -> None:
        for i, proc in enumerate(self.fleet.procs):
            maps: dict[str, int] = {}
            async with await Client.connect(proc.socket_path) as c:
                for _ in range(200):  # request states and probes age out after their TTLs
                    stats = await c.stats()
                    maps = {k: v for k, v in stats["maps"].items() if k != "verdicts"}
                    if not any(maps.values()):
                        break
                    await asyncio.sleep(0.1)  # allow-sleep: TTLs pass in real time
            disk = stats["tiers"]["disk"]
            self.report.nodes_after.append(
                {
                    "node": i,
                    "rss_mb": round(rss_bytes(proc.pid) / 2**20),
                    "maps": maps,
                    "disk_blocks": disk["blocks"],
                    "disk_evictions": disk["evictions"],
                    "s3_puts": {
                        outcome: metric_value(
                            proc.scrape(),
                            "kvtier_s3_requests_total",
                            f'op="put",outcome="{outcome}",tier="s3"',
                        )
                        for outcome in ("ok", "exists", "error", "timeout", "rejected")
                    },
                    "owed_blocks": stats["writes"]["s3"]["owed_blocks"],
                    "owed_sent": stats["writes"]["s3"]["owed_sent"],
                    "writes_dropped": {
                        k: v for k, v in stats["writes"]["s3"].items() if k.startswith("dropped")
                    },
                }
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--seconds", type=float, default=float(os.environ.get("SOAK_SECONDS", "600"))
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--store",
        choices=["ceph", "moto"],
        default="ceph",
        help="the object store under the S3 tier: Ceph's RGW (its faults join the "
        "driver's), or moto's emulator",
    )
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="kvt-fleet-", dir="/tmp") as tmp:
        s3: ProxiedS3 = CephS3() if args.store == "ceph" else S3Server()
        fleet = Fleet(Path(tmp), s3, s3.new_bucket())
        try:
            fleet.procs = [fleet.start(i) for i in range(NODES)]
            soak = Soak(fleet, args.seconds, args.seed)
            report = loops.run(soak.run())
        finally:
            for proc in fleet.procs:
                with contextlib.suppress(Exception):
                    proc.stop()
            s3.close()
    faults = report.faults
    settles = [s for f in faults if isinstance(s := f.get("settled_after_s"), float)]
    print(
        f"soak-fleet {report.seconds:.0f}s, {NODES} daemons, {CLIENTS} clients: "
        f"{report.puts} blocks put ({report.durable_puts} durable), {report.lookups} lookups, "
        f"{report.gets_verified} GETs verified byte for byte, {report.gets_missed} misses, "
        f"{report.wrong_bytes} wrong; client errors {report.client_errors or 0}; "
        f"durable blocks lost {report.durable_lost}"
    )
    print(
        f"{report.corrupted_files} block files corrupted ({report.corrupted_durable} durable, "
        f"not verified); {report.hits_not_loaded} HIT answers found nothing to load, "
        f"{report.hits_after_failed_load} of them again after a failed load"
    )
    print(
        f"{len(faults)} faults: "
        + ", ".join(
            f"{k} x{sum(1 for f in faults if f['kind'] == k)}"
            for k in ("sigstop", "sigkill", "latency", "cut", "corrupt", "rgw-stop", "rgw-kill")
        )
        + f"; lookup p99 {report.lookup_p99_ms_faults} ms during faults, "
        f"{report.lookup_p99_ms_calm} ms otherwise; affected keys settled after "
        f"{max(settles) if settles else 0:.2f} s at most "
        f"(median {statistics.median(settles) if settles else 0:.2f} s)"
    )
    owed = [f["owed_sent_after_s"] for f in faults if f["kind"] == "rgw-kill"]
    print(
        f"store ({args.store}): {report.written_in_outages} blocks written while RGW was down, "
        f"{report.outage_writes_missing} of them missing from the bucket "
        f"({report.outage_writes_unlisted} not listed); owed writes all sent "
        f"{owed} s after each RGW restart"
    )
    for node in report.nodes_after:
        print(
            f"node {node['node']}: RSS {node['rss_mb']} MB, maps {node['maps']}, "
            f"disk {node['disk_blocks']} blocks, {node['disk_evictions']} evicted, "
            f"owed {node['owed_blocks']} (sent {node['owed_sent']}), {node['writes_dropped']}, "
            f"S3 PUTs {node['s3_puts']}"
        )
    if report.durable_lost:
        print(f"durable blocks lost, by the node that acknowledged them: {soak.lost_on}")
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=2))
    failures = report.failures()
    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

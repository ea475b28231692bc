"""Peer tier acceptance: real daemons as processes on loopback, each with its
own socket, data dir and peer port, sharing blocks over TCP."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import time
from collections.abc import Iterator

import pytest

from kvtier import BlockingClient, Client, State
from kvtier.errors import KvtierError
from kvtier.model import namespace_prefix
from kvtier.tiers.rendezvous import owner, ranked
from kvtier.tiers.s3 import CHECKSUM_META, object_checksum
from kvtier.tiers.sealing import Keyring, Keys, Sealer
from tests.helpers import DaemonProcess, metric_value, short_tmpdir
from tests.ports import free_port
from tests.s3server import ProxiedS3

TOKEN = "e2e-peer-token"
#: how long a lookup may wait for its keys to settle: it answers as soon as
#: they do, so this bounds only a failure (a busy machine may be slow);
#: under the client's 30 s call timeout
SETTLE = 20.0


class Fleet:
    """N daemons that list each other as peers."""

    def __init__(
        self,
        n: int,
        replicas: int = 1,
        extra: str = "",
        peer_extra: str = "",
        **lookup: float | str,
    ) -> None:
        self.replicas = replicas
        #: more of each daemon's configuration file, and of its [peer] section
        self.extra = extra
        self.peer_extra = peer_extra
        self.dirs = [short_tmpdir() for _ in range(n)]
        self.lookup = {"verdict_ttl": 0.5, **lookup}
        self.daemons: list[DaemonProcess] = []
        for attempt in range(3):
            # A free port is free when asked: another test's outgoing
            # connection may take it before a daemon binds. Then: new ports.
            self.ports = [free_port() for _ in range(n)]
            self.addresses = [f"127.0.0.1:{p}" for p in self.ports]
            try:
                # launched side by side, then each waited for
                self.daemons = [self.launch(i) for i in range(n)]
                for d in self.daemons:
                    d.ready()
                return
            except RuntimeError as exc:
                self.stop()
                self.daemons = []
                if "address already in use" not in str(exc) or attempt == 2:
                    raise

    def start(self, i: int) -> DaemonProcess:
        return self.launch(i).ready()

    def launch(self, i: int) -> DaemonProcess:
        members = ", ".join(f'"{a}"' for a in self.addresses)
        lookup = "\n".join(
            f"{k} = {v!r}" if not isinstance(v, str) else f'{k} = "{v}"'
            for k, v in self.lookup.items()
        )
        config = self.dirs[i] / "kvtier.toml"
        config.write_text(
            f'[peer]\nlisten = "{self.addresses[i]}"\nmembers = [{members}]\n'
            f'token = "{TOKEN}"\nbreaker_reset = 0.3\nrequest_timeout = 3.0\n'
            f"replicas = {self.replicas}\n{self.peer_extra}"
            f"[lookup]\n{lookup}\n{self.extra}"
        )
        return DaemonProcess(
            self.dirs[i], "--config", str(config), "--ram-capacity", "64MiB"
        ).launch()

    def key_owned_by(self, i: int, tag: str) -> bytes:
        for n in range(10_000):
            key = f"{tag}-{n}".encode()
            if owner(key, [a.encode() for a in self.addresses]) == self.addresses[i].encode():
                return key
        raise AssertionError("no key found")

    def keys_ranked(self, order: list[int], tag: str, count: int) -> list[bytes]:
        """Keys whose rendezvous ranking starts with the daemons ``order``."""
        names = [a.encode() for a in self.addresses]
        want = [self.addresses[i].encode() for i in order]
        keys = []
        for n in range(100_000):
            key = f"{tag}-{n}".encode()
            if ranked(key, names)[: len(want)] == want:
                keys.append(key)
                if len(keys) == count:
                    return keys
        raise AssertionError("no keys found")

    def peer_requests(self, i: int, op: str) -> float:
        text = self.daemons[i].scrape()
        return metric_value(text, "kvtier_peer_listener_requests_total", f'op="{op}",outcome="ok"')

    def stop(self) -> None:
        for d in self.daemons:
            d.stop()


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    f = Fleet(3)
    try:
        yield f
    finally:
        f.stop()


def until_metric(d: DaemonProcess, name: str, labels: str, at_least: float, what: str) -> None:
    """Scrape ``d`` until a sample reaches ``at_least`` (15 s at most); each
    scrape is a round trip to the daemon, so the loop is paced by them."""
    deadline = time.monotonic() + 15
    while metric_value(d.scrape(), name, labels) < at_least:
        assert time.monotonic() < deadline, what


def client(d: DaemonProcess) -> BlockingClient:
    return BlockingClient(d.socket_path)


def read(d: DaemonProcess, key: bytes) -> bytes | None:
    with client(d) as cl:
        value = cl.get(key)
        return None if value is None else bytes(value)


def test_a_block_stored_on_a_loads_from_c(fleet: Fleet) -> None:
    a, b, c = fleet.daemons
    value = bytes(range(256)) * 1024
    key = fleet.key_owned_by(0, "own-a")
    with client(a) as ca:
        ca.put(key, value)
    with client(c) as cc:
        first = cc.lookup([key]).states[0]
        assert first in (State.RETRY, State.PENDING)
        assert cc.lookup([key], wait=SETTLE).states == [State.HIT]
        assert bytes(cc.get(key) or b"") == value
    # A block whose owner is B reaches B by push from A, and C finds it there.
    pushed = fleet.key_owned_by(1, "own-b")
    with client(a) as ca:
        ca.put(pushed, b"pushed" * 1000)
    with client(b) as cb:
        assert cb.lookup([pushed], wait=SETTLE).states == [State.HIT]  # the push landed
    with client(c) as cc:
        assert cc.lookup([pushed], wait=SETTLE).states == [State.HIT]
        assert bytes(cc.get(pushed) or b"") == b"pushed" * 1000


def test_32_concurrent_lookups_send_one_lookup_and_one_transfer_to_the_owner(
    fleet: Fleet,
) -> None:
    a, _, c = fleet.daemons
    key = fleet.key_owned_by(0, "shared")
    with client(a) as ca:
        ca.put(key, b"x" * 65536)
    lookups_before = fleet.peer_requests(0, "lookup")
    gets_before = fleet.peer_requests(0, "get")

    async def readers() -> list[list[State]]:
        clients = [await Client.connect(c.socket_path) for _ in range(32)]
        try:
            replies = await asyncio.gather(*(cl.lookup([key], wait=SETTLE) for cl in clients))
            return [r.states for r in replies]
        finally:
            for cl in clients:
                await cl.close()

    states = asyncio.run(readers())
    assert states == [[State.HIT]] * 32
    assert fleet.peer_requests(0, "lookup") - lookups_before == 1
    assert fleet.peer_requests(0, "get") - gets_before == 1


def test_sigkill_mid_transfer_answers_miss_in_time_and_the_peer_rejoins() -> None:
    # "hit": a probed block reads HIT and is fetched by the GET, so the
    # transfer can be caught in flight.
    fleet = Fleet(2, remote_hit="hit", pending_deadline=10.0)  # one replica
    try:
        a, c = fleet.daemons
        key = fleet.key_owned_by(0, "kill")
        with client(a) as ca:
            ca.put(key, b"k" * 1_000_000)
        with client(c) as cc:
            cc.put(b"local-on-c", b"mine")
            assert cc.lookup([key], wait=SETTLE).states == [State.HIT]
            a.send_signal(signal.SIGSTOP)  # A takes the GET and never answers
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                reading = pool.submit(read, c, key)
                # C's load from A is under way once the key reads PENDING at C.
                while metric_value(c.scrape(), "kvtier_pending_writes") != 1:
                    assert not reading.done()
                a.send_signal(signal.SIGKILL)
                assert reading.result(timeout=30) is None  # MISS, not stuck
            # ended by the failed load, not by the pending deadline
            expired = metric_value(c.scrape(), "kvtier_pending_deadline_expired_total")
            assert expired == 0
            assert bytes(cc.get(b"local-on-c") or b"") == b"mine"  # C serves its own
        a.wait()
        # A comes back on the same port with its data dir: it rejoins.
        fleet.daemons[0] = a = fleet.start(0)
        again = fleet.key_owned_by(0, "after-restart")
        with client(a) as ca:
            ca.put(again, b"back")
        with client(c) as cc:
            deadline = time.monotonic() + 15
            while cc.lookup([again], wait=2.0).states != [State.HIT]:
                assert time.monotonic() < deadline, "A was not used again"
                time.sleep(0.2)  # allow-sleep: C's breaker reset and verdict TTL must pass
            assert bytes(cc.get(again) or b"") == b"back"
    finally:
        fleet.stop()


def test_a_hung_owner_costs_nothing_while_the_second_owner_holds_the_block() -> None:
    fleet = Fleet(3, replicas=2)
    try:
        a, b, c = fleet.daemons
        # B owns these keys, A comes second: a PUT on A keeps them on A and
        # pushes them to B.
        keys = fleet.keys_ranked([1, 0], "hung-owner", 4)
        b.send_signal(signal.SIGSTOP)  # B hangs: connected, never answering
        try:
            with client(a) as ca:
                ca.put_many(keys, [k * 100 for k in keys])
            with client(c) as cc:
                # C asks both owners at once; A answers, B's silence costs nothing.
                assert cc.lookup(keys, wait=SETTLE).states == [State.HIT] * 4
                assert [bytes(v or b"") for v in cc.get_many(keys)] == [k * 100 for k in keys]
        finally:
            b.send_signal(signal.SIGCONT)
        # Back: B has the blocks A pushed to it meanwhile (the owner's replica).
        with client(b) as cb:
            assert cb.lookup(keys, wait=SETTLE).states == [State.HIT] * 4
    finally:
        fleet.stop()


def test_two_replicas_put_each_block_on_its_two_owners() -> None:
    fleet = Fleet(3, replicas=2)
    try:
        a, b, c = fleet.daemons
        # Owned by B then C: stored on A, pushed to both.
        keys = fleet.keys_ranked([1, 2], "two-owners", 3)
        with client(a) as ca:
            ca.put_many(keys, [b"r" * 4096] * 3)
        for d in (b, c):
            until_metric(d, "kvtier_tier_blocks", 'tier="ram"', 3, "the pushes never arrived")
            with client(d) as cd:  # held locally: no peer is asked
                assert cd.lookup(keys).states == [State.HIT] * 3
        for i in (1, 2):  # A counts each push once its owner has answered
            sample = f'direction="out",peer="{fleet.addresses[i]}"'
            until_metric(a, "kvtier_peer_bytes_total", sample, 3 * 4096, "pushes not counted")
    finally:
        fleet.stop()


def test_a_daemon_never_dials_itself(fleet: Fleet) -> None:
    text = fleet.daemons[0].scrape()
    assert f'peer="{fleet.addresses[0]}"' not in text
    assert f'kvtier_peer_up{{peer="{fleet.addresses[1]}"}} 1.0' in text


def test_blocks_travel_sealed_between_peers_and_open_at_either_end() -> None:
    """A namespace with a key: a block pushed to its owner is sealed by the
    sender and opened by the owner's peer port; one loaded from its owner
    is sealed there and opened here. Both ends serve plain bytes."""
    keys = short_tmpdir()
    keyfile = keys / "tenant-a.key"
    keyfile.write_bytes(os.urandom(32))
    keyfile.chmod(0o600)
    fleet = Fleet(
        2,
        extra=f'[namespaces.tenant-a]\nencryption_key_file = "{keyfile}"\n'
        f'[namespaces.tenant-b]\nencryption_key_file = "{keyfile}"\n',
    )
    try:
        a, b = fleet.daemons
        names = [addr.encode() for addr in fleet.addresses]

        def owned_by(i: int, tag: str) -> bytes:
            return next(
                k
                for n in range(10_000)
                if owner(namespace_prefix(b"tenant-a") + (k := f"{tag}-{n}".encode()), names)
                == names[i]
            )

        pushed, kept = owned_by(1, "pushed"), owned_by(0, "kept")
        value = os.urandom(200_000)
        with BlockingClient(a.socket_path, namespace="tenant-a") as ca:
            ca.put(pushed, value)  # to B, its owner, in the background
            ca.put(kept, value[::-1])  # A owns it: it stays here
        until_metric(
            b, "kvtier_peer_listener_requests_total", 'op="put",outcome="ok"', 1, "no push"
        )
        with BlockingClient(b.socket_path, namespace="tenant-a") as cb:
            assert cb.lookup([pushed], wait=SETTLE).states == [State.HIT]  # the push landed
            assert bytes(cb.get(pushed) or b"") == value  # opened by B's peer port
            assert cb.lookup([kept], wait=SETTLE).states == [State.HIT]
            assert bytes(cb.get(kept) or b"") == value[::-1]  # sealed by A, opened by B
        sealed = metric_value(a.scrape(), "kvtier_sealed_bytes_total", 'tier="peers"')
        opened = metric_value(b.scrape(), "kvtier_opened_bytes_total", 'tier="peers"')
        assert sealed >= 2 * len(value) and opened >= 2 * len(value)  # both ways
        failures = metric_value(
            b.scrape(), "kvtier_seal_failures_total", 'reason="auth",tier="peers"'
        )
        assert failures == 0

        # A push forged by a holder of the token: tenant-a's sealed block
        # offered as tenant-b's (the same key material) is refused, never stored.
        keyring = Keyring.of(keyfile.read_bytes())
        sealer = Sealer(Keys({b"tenant-a": keyring, b"tenant-b": keyring}))
        as_a = bytes(sealer.seal(namespace_prefix(b"tenant-a") + b"x", value))
        forged = namespace_prefix(b"tenant-b") + b"x"

        async def push() -> None:
            peer = await Client.connect_tcp("127.0.0.1", fleet.ports[1], token=TOKEN.encode())
            async with peer:
                with pytest.raises(KvtierError, match="tag does not verify"):
                    await peer.put(forged, as_a)
                assert await peer.get(forged) is None

        asyncio.run(push())
        failures = metric_value(
            b.scrape(), "kvtier_seal_failures_total", 'reason="auth",tier="peers"'
        )
        assert failures == 1
    finally:
        fleet.stop()


def test_a_get_from_a_hung_owner_is_hedged_to_the_next_owner() -> None:
    """Two owners hold the block; the one a GET asks first hangs (SIGSTOP)
    after saying it holds it: past hedge_after the next owner is asked too,
    delivers, and wins; the hung request is cancelled."""
    fleet = Fleet(
        3,
        replicas=2,
        peer_extra="hedge_after = 0.05\nhedge_max_ratio = 1.0\n",
        verdict_ttl=60.0,
        remote_hit="hit",
    )
    a, b, c = fleet.daemons
    try:
        (key,) = fleet.keys_ranked([1, 2], "hedged", 1)  # owners: B, then C
        value = os.urandom(100_000)
        with client(b) as cb:
            cb.put(key, value)  # kept by B, pushed to C in the background; A has none
        with client(c) as cc:
            assert cc.lookup([key], wait=SETTLE).states == [State.HIT]
        c.send_signal(signal.SIGSTOP)  # B alone answers A's probe: A asks B first
        try:
            with client(a) as ca:
                assert ca.lookup([key], wait=SETTLE).states == [State.HIT]
        finally:
            c.send_signal(signal.SIGCONT)
        b.send_signal(signal.SIGSTOP)  # ...and B hangs before the GET
        try:
            with client(a) as ca:
                assert bytes(ca.get(key) or b"") == value  # from C, the hedge
            text = a.scrape()
            won, lost = ('outcome="won",tier="peers"', 'outcome="lost",tier="peers"')
            assert metric_value(text, "kvtier_hedged_reads_total", won) == 1
            assert metric_value(text, "kvtier_hedged_reads_total", lost) == 0
            with client(a) as ca:
                hedges = ca.stats()["tiers"]["peers"]["hedges"]
            assert hedges == {"won": 1, "lost": 0, "skipped": 0}
        finally:
            b.send_signal(signal.SIGCONT)
    finally:
        fleet.stop()


@pytest.mark.parametrize("tampered", [False, True])
def test_a_get_from_a_hung_owner_is_hedged_to_s3_which_holds_the_block_too(
    tampered: bool, s3: ProxiedS3
) -> None:
    """One owner (replicas = 1) holds the block, and S3 below the peers has
    it too (the owner wrote it through). The owner hangs (SIGSTOP) after
    saying it holds it: past hedge_after the daemon asks S3, which delivers
    and wins. An object whose bytes were changed in the bucket does not
    win: the GET waits for the owner (here until its request times out)
    and never returns those bytes."""
    bucket = s3.new_bucket()
    tier = s3.tier_config(bucket)
    fleet = Fleet(
        2,
        replicas=1,
        peer_extra="hedge_after = 0.05\nhedge_max_ratio = 1.0\n",
        extra="[[remote_tiers]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in tier.items()),
        verdict_ttl=60.0,
        remote_hit="hit",
    )
    a, b = fleet.daemons
    try:
        (key,) = fleet.keys_ranked([1], "hedged-to-s3", 1)  # owner: B
        value = os.urandom(100_000)
        path = f"/{bucket}/{tier['prefix']}{key.hex()}"
        stored = s3.proxy.when_completed("PUT", path)
        with client(b) as cb:
            cb.put(key, value)  # kept by B, written through to S3; A has none
        assert stored.wait(30)
        if tampered:  # other bytes under the block's checksum
            s3.boto().put_object(
                Bucket=bucket,
                Key=tier["prefix"] + key.hex(),
                Body=b"X" + value[1:],
                Metadata={CHECKSUM_META: object_checksum(key, value)},
            )
        with client(a) as ca:
            assert ca.lookup([key], wait=SETTLE).states == [State.HIT]  # B says so
        b.send_signal(signal.SIGSTOP)
        try:
            with client(a) as ca:
                got = ca.get(key)
                stats = ca.stats()["tiers"]
            won = 'outcome="won",tier="peers"'
            if tampered:
                # B timed out; S3's bytes failed their check, as the hedge
                # and then as the next place the GET looked
                assert got is None
                assert stats["peers"]["hedges"] == {"won": 0, "lost": 1, "skipped": 0}
                assert s3.proxy.counts[("GET", path)] == stats["s3"]["corrupt"] == 2
                return
            assert s3.proxy.counts[("GET", path)] == 1
            assert bytes(got or b"") == value  # from S3, the hedge
            assert stats["peers"]["hedges"] == {"won": 1, "lost": 0, "skipped": 0}
            text = a.scrape()
            assert metric_value(text, "kvtier_hedged_reads_total", won) == 1
        finally:
            b.send_signal(signal.SIGCONT)
    finally:
        fleet.stop()

"""One truth for what kvtier holds: the lookup process never answers what the
daemon would not.

A stateful property test (hypothesis's ``RuleBasedStateMachine``, seeded)
drives a real daemon, with its lookup process (and in one of its three
fleets an S3 tier on a real S3-compatible server), through random sequences of PUT, GET, DELETE,
RESERVE, ABORT, writers that stall inside a PUT body or close halfway,
evictions under a small RAM tier, block files corrupted or removed behind
the daemon's back, objects planted in the bucket by other daemons (sealed
under a key this one lacks, packed by a codec, plain but looking sealed),
lookups with a budget, two namespaces and reloads that change their quotas
or their users (which starts the lookup process again). After every step,
every key it has touched is looked up at the lookup process and at the
daemon itself (``lookup_process=False``), in each namespace: the answers
are equal. A GET returns the block's own bytes or nothing; a block whose
load failed is never answered HIT again; a budget only cuts a lookup's
tail; and what RAM holds and has promised stays within its capacity.

``make test`` runs a few hundred steps on three daemons (with a disk tier,
without, and with a disk and an S3 tier); ``make soak-lookups`` runs the same machine for
``LOOKUP_SOAK_SECONDS`` (default 600) with seeds from ``LOOKUP_SOAK_SEED``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Iterator

import hypothesis
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvtier import BlockingClient, State, wire
from kvtier.errors import NoCapacityError
from kvtier.model import Reserve, namespace_prefix
from kvtier.tiers.disk.format import block_path
from kvtier.tiers.s3 import CHECKSUM_META, object_checksum
from kvtier.tiers.sealing import Codec, Keyring, Keys, Sealer
from kvtier.wire import Op
from tests.ceph import CephS3
from tests.helpers import DaemonProcess, RawConnection, metric_value, short_tmpdir
from tests.s3server import ProxiedS3

NAMESPACES = ["", "team"]
#: the key other daemons seal their blocks under (this one never has it)
OTHER_KEY = os.urandom(32)
#: keys per namespace a run draws from (few, so that operations meet)
KEYS = 12
#: block sizes: below the arena's slots, in a slot, and past the in-place threshold
SIZES = [3000, 90_000, 600_000]
#: RAM: a few of the larger blocks, so that most go to the disk alone
#: how often a comparison is asked again while the daemon's own answer moves
#: under it (a write landing, a closed writer's EOF, a disk write finishing)
SETTLE_TRIES = 50


def config_text(ram_max: str, uids: list[int], s3: dict[str, object] | None) -> str:
    remote = ""
    if s3 is not None:
        remote = "[[remote_tiers]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in s3.items())
    # (a kept verdict outlives a run: a key's probe is not started again
    # between two of the comparison's lookups, which would read it RETRY)
    return (
        "[server]\nbody_timeout = 1.0\n[lookup]\npending_deadline = 2.0\nverdict_ttl = 600.0\n"
        f'[namespaces.team]\nram_max = "{ram_max}"\nuids = {uids}\n'
        f"[namespaces.default]\nuids = {uids}\n{remote}"
    )


class Fleet:
    """One daemon and its clients: per namespace, one that asks the lookup
    process first and one that asks the daemon only."""

    def __init__(self, disk: bool, s3: ProxiedS3 | None = None) -> None:
        """``s3``: with an S3 tier below, a bucket of its own there (its
        lookup process then refers every lookup of a key it does not hold:
        the daemon probes)."""
        self.dir = short_tmpdir()
        self.config = self.dir / "kvtier.toml"
        self.uids = [os.getuid()]
        self.s3 = s3
        self.bucket = self.s3.new_bucket() if self.s3 is not None else ""
        self.tier = (
            self.s3.tier_config(self.bucket, write_policy="none") if self.s3 is not None else None
        )
        self.config.write_text(config_text("1MiB", self.uids, self.tier))
        args = ["--config", str(self.config), "--ram-capacity", "1536KiB"]
        if not disk:
            args.append("--no-disk")
        self.disk = disk
        self.proc = DaemonProcess(self.dir, *args).start()
        self.reloads = 0
        self.at_process: dict[str, BlockingClient] = {}
        self.direct: dict[str, BlockingClient] = {}
        self._connect()

    def _connect(self) -> None:
        for ns in NAMESPACES:
            self.at_process[ns] = BlockingClient(self.proc.socket_path, namespace=ns)
            self.direct[ns] = BlockingClient(
                self.proc.socket_path, namespace=ns, lookup_process=False
            )

    def reload(self, ram_max: str, uids: list[int]) -> None:
        self.config.write_text(config_text(ram_max, uids, self.tier))
        start = len(self.proc.lines)
        self.proc.send_signal(signal.SIGHUP)
        self.proc.wait_for_line("reloaded", start)
        self.reloads += 1

    def answered(self) -> float:
        """Lookups the lookup processes answered, across restarts."""
        metrics = self.proc.scrape()
        return metric_value(metrics, "kvtier_lookup_process_lookups_total", 'outcome="answered"')

    def plant(self, ns: str, k: bytes, stored: bytes) -> None:
        """``stored`` as ``k``'s object in the bucket, as another daemon
        writes it (its checksum metadata included)."""
        assert self.s3 is not None and self.tier is not None
        key = namespace_prefix(ns.encode()) + k
        name = f"{self.tier['prefix']}{ns + '/' if ns else ''}{k.hex()}"
        self.s3.boto().put_object(
            Bucket=self.bucket,
            Key=name,
            Body=stored,
            Metadata={CHECKSUM_META: object_checksum(key, stored)},
        )

    def close(self) -> None:
        for c in (*self.at_process.values(), *self.direct.values()):
            c.close()
        assert self.proc.stop() == 0


class Truth(RuleBasedStateMachine):
    """Random operations; after each, both lookup paths agree."""

    fleet: Fleet
    #: comparisons made, in all runs (one after every step)
    checks = 0

    def __init__(self) -> None:
        super().__init__()
        self.run = os.urandom(4).hex()
        #: keys touched, per namespace
        self.touched: dict[str, set[bytes]] = {ns: set() for ns in NAMESPACES}
        #: keys whose load failed (a corrupt or missing file, an object that
        #: does not open), until stored again
        self.failed: dict[str, set[bytes]] = {ns: set() for ns in NAMESPACES}
        #: keys the bucket holds a readable object of (planted packed)
        self.in_bucket: dict[str, set[bytes]] = {ns: set() for ns in NAMESPACES}
        #: raw writers holding a reservation, or stalled inside a PUT body
        self.writers: list[RawConnection] = []
        self.rng = random.Random(self.run)

    def key(self, i: int) -> bytes:
        return f"{self.run}-{i:02d}".encode()

    def use(self, ns: str, i: int) -> bytes:
        k = self.key(i)
        self.touched[ns].add(k)
        return k

    def store(self, ns: str, k: bytes, value: bytes) -> None:
        try:
            self.fleet.at_process[ns].put(k, value)
        except NoCapacityError:
            return  # more than the namespace's ram_max: refused, nothing stored
        self.failed[ns].discard(k)

    @initialize()
    def started(self) -> None:
        assert self.fleet.proc.proc is not None and self.fleet.proc.proc.poll() is None

    # -- operations

    @rule(ns=st.sampled_from(NAMESPACES), i=st.integers(0, KEYS - 1), size=st.sampled_from(SIZES))
    def put(self, ns: str, i: int, size: int) -> None:
        k = self.use(ns, i)
        self.store(ns, k, bytes([i]) * size)

    @rule(ns=st.sampled_from(NAMESPACES), i=st.integers(0, KEYS - 1))
    def get(self, ns: str, i: int) -> None:
        k = self.use(ns, i)
        value = self.fleet.at_process[ns].get(k)
        assert value is None or set(bytes(value)) == {i}

    @rule(ns=st.sampled_from(NAMESPACES), i=st.integers(0, KEYS - 1))
    def delete(self, ns: str, i: int) -> None:
        self.fleet.at_process[ns].delete(self.use(ns, i))

    @rule(ns=st.sampled_from(NAMESPACES), i=st.integers(0, KEYS - 1), size=st.sampled_from(SIZES))
    def reserve_then_abort_or_put(self, ns: str, i: int, size: int) -> None:
        c = self.fleet.at_process[ns]
        k = self.use(ns, i)
        if c.reserve([k], sizes=[size], deadline=30.0) and self.rng.random() < 0.5:
            c.abort([k])
        else:
            self.store(ns, k, bytes([i]) * size)

    @precondition(lambda self: len(self.writers) < 4)
    @rule(i=st.integers(0, KEYS - 1), size=st.sampled_from(SIZES), body=st.booleans())
    def writer_stalls(self, i: int, size: int, body: bool) -> None:
        """A raw writer of the default namespace reserves a key and, maybe,
        sends half its PUT; then stays silent with the connection open."""
        k = self.use("", i)
        raw = RawConnection(self.fleet.proc.socket_path)
        deadline = self.rng.choice([0.2, 0.5])  # readers of the key wait this long at most
        raw.send_frame(Op.RESERVE, 1, wire.encode_reserve(Reserve([k], [size], deadline)))
        assert raw.recv_frame().header.status == 0
        if body:
            meta, parts = wire.encode_put([k], [bytes([i]) * size])
            frame = wire.pack_header(Op.PUT, 2, len(meta), size) + meta
            raw.send(frame + b"".join(bytes(p) for p in parts)[: size // 2])
        self.writers.append(raw)

    @precondition(lambda self: bool(self.writers))
    @rule(half_close=st.booleans())
    def writer_goes(self, half_close: bool) -> None:
        raw = self.writers.pop(0)
        if half_close:
            raw.sock.shutdown(1)
        raw.close()

    @precondition(lambda self: self.fleet.disk)
    @rule(ns=st.sampled_from(NAMESPACES), i=st.integers(0, KEYS - 1), remove=st.booleans())
    def file_damaged(self, ns: str, i: int, remove: bool) -> None:
        """Behind the daemon's back: a block file loses a byte of its value,
        or goes; a GET then finds it so (RAM let go of it first)."""
        k = self.use(ns, i)
        path = block_path(self.fleet.proc.data_dir, namespace_prefix(ns.encode()) + k)
        try:
            data = bytearray(path.read_bytes())
        except FileNotFoundError:
            return
        if remove:
            path.unlink(missing_ok=True)
        else:
            data[-1] ^= 0xFF
            path.write_bytes(bytes(data))
        value = self.fleet.direct[ns].get(k)
        if value is None:
            self.failed[ns].add(k)
        else:
            assert set(bytes(value)) == {i}  # RAM still held it: served from there

    @precondition(lambda self: self.fleet.s3 is not None)
    @rule(
        ns=st.sampled_from(NAMESPACES),
        i=st.integers(0, KEYS - 1),
        size=st.sampled_from(SIZES),
        sealed=st.booleans(),
    )
    def object_planted(self, ns: str, i: int, size: int, sealed: bool) -> None:
        """Another daemon sharing the bucket wrote ``k``'s object: sealed
        under a key this daemon does not have (it must never hand out those
        bytes: a GET finds nothing, or this daemon's own copy), or packed by
        its codec (it reads as the block)."""
        k = self.use(ns, i)
        value = bytes([i]) * size
        key = namespace_prefix(ns.encode()) + k
        if sealed:
            other = Sealer(Keys({ns.encode(): Keyring.of(OTHER_KEY)}))
            direct = self.fleet.direct[ns]
            # (a block this daemon holds is its own; one it holds on disk but
            # cannot bring into a namespace's RAM is not this rule's)
            local = direct.lookup([k], peek=True).states == [State.HIT]
            self.fleet.plant(ns, k, bytes(other.seal(key, value)))
            self.in_bucket[ns].discard(k)
            if direct.get(k) is None and not local:
                self.failed[ns].add(k)
        else:
            self.fleet.plant(ns, k, bytes(Sealer(codec=Codec.ZSTD).seal(key, value)))
            self.in_bucket[ns].add(k)

    @rule(ns=st.sampled_from(NAMESPACES), budget=st.sampled_from([1e-6, 1e-3, 0.1]))
    def budgeted_lookup(self, ns: str, budget: float) -> None:
        """A budget only cuts a lookup's tail: each key answers as without
        one, or MISS, and the MISSes it adds come after every key it keeps."""
        keys = sorted(self.touched[ns])
        if not keys:
            return
        c = self.fleet.at_process[ns]
        for _ in range(SETTLE_TRIES):
            before = c.lookup(keys, peek=True).states
            cut = c.lookup(keys, budget=budget, peek=True).states
            after = c.lookup(keys, peek=True).states
            if before == after:
                break
        kept = next((n for n in range(len(keys), -1, -1) if cut[:n] == before[:n]), 0)
        assert all(s is State.MISS for s in cut[kept:]) or before != after, (before, cut)

    @rule(ram_max=st.sampled_from(["512KiB", "1MiB"]), other_user=st.booleans())
    def reload(self, ram_max: str, other_user: bool) -> None:
        uids = [os.getuid(), 4242] if other_user else [os.getuid()]
        self.fleet.reload(ram_max, uids)

    # -- the invariant

    @invariant()
    def both_paths_agree(self) -> None:
        Truth.checks += 1
        for ns in NAMESPACES:
            keys = sorted(self.touched[ns])
            if not keys:
                continue
            at_process, direct = self.fleet.at_process[ns], self.fleet.direct[ns]
            for _ in range(SETTLE_TRIES):
                before = direct.lookup(keys).states
                seen = at_process.lookup(keys).states
                after = direct.lookup(keys).states
                if before == after:
                    break
            assert seen in (before, after), (ns, keys, before, seen, after)
            for k, state in zip(keys, seen, strict=True):
                if k in self.failed[ns] and k not in self.in_bucket[ns]:
                    assert state is not State.HIT, (ns, k)

    @invariant()
    def ram_within_capacity(self) -> None:
        """What RAM holds and has promised (blocks, reserved room, bodies
        being received into its arena) never exceeds its capacity."""
        ram = self.fleet.direct[""].stats()["tiers"]["ram"]
        assert ram["used_bytes"] + ram["reserved_bytes"] <= ram["capacity_bytes"], ram

    def teardown(self) -> None:
        for raw in self.writers:
            raw.close()
        for ns in NAMESPACES:
            keys = sorted(self.touched[ns])
            if keys:
                self.fleet.direct[ns].delete_many(keys)


@pytest.fixture(
    scope="module",
    params=[(True, False), (False, False), (True, True)],
    ids=["disk", "ram-only", "s3"],
)
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    disk, s3 = request.param
    f = Fleet(disk, request.getfixturevalue("ceph") if s3 else None)
    yield f
    f.close()


def run(fleet: Fleet, seed: int, examples: int, steps: int) -> None:
    """``examples`` runs of up to ``steps`` steps, drawn from ``seed``."""
    Truth.fleet = fleet
    run_state_machine_as_test(
        hypothesis.seed(seed)(Truth),
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            # a real daemon's timing varies between runs: report the steps
            # that diverged as they ran, without shrinking them
            phases=[Phase.explicit, Phase.generate],
        ),
    )


def test_the_lookup_process_answers_as_the_daemon_does(fleet: Fleet) -> None:
    answered, checks = fleet.answered(), Truth.checks
    run(fleet, seed=20261204, examples=12, steps=40)
    assert Truth.checks - checks >= 200  # a few hundred steps, each compared
    if fleet.s3 is not None:
        return  # (it refers what a remote tier may hold: the daemon answers those)
    for _ in range(10_000):  # its reports reach the daemon a few ms later
        if fleet.answered() > answered:
            break
    assert fleet.answered() > answered  # the lookup process answered, not only the daemon


def soak(seconds: float, first_seed: int) -> int:
    """The machine, seed after seed, for ``seconds``; returns the runs made."""
    runs = 0
    store = CephS3()
    fleets = [Fleet(disk=True), Fleet(disk=False), Fleet(disk=True, s3=store)]
    try:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            run(fleets[runs % len(fleets)], first_seed + runs, 10, 100)
            runs += 1
    finally:
        for f in fleets:
            f.close()
        store.close()
    return runs


if __name__ == "__main__":
    secs = float(os.environ.get("LOOKUP_SOAK_SECONDS", "600"))
    first = int(os.environ.get("LOOKUP_SOAK_SEED", str(random.randrange(1 << 30))))
    print(f"lookup soak: {secs:.0f} s from seed {first}", flush=True)
    made = soak(secs, first)
    print(
        f"lookup soak: {made} runs from seed {first}, {Truth.checks} steps compared, no divergence",
        flush=True,
    )

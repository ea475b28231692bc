"""The S3 tier against a real object store: Ceph's RADOS Gateway on loopback
(tests/ceph.py), reached through aiobotocore; requests are counted, held or
refused at a proxy in front of it."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kvtier import BlockingClient, Client, State
from kvtier.config import S3TierConfig
from kvtier.core.propagation import RemoteSpec, WritePolicy
from kvtier.daemon import Daemon
from kvtier.tiers.s3 import CHECKSUM_META, S3Tier
from tests.ceph import CephS3
from tests.helpers import (
    ROOT,
    DaemonProcess,
    running_daemon,
    short_tmpdir,
    wait_on_timers,
    wait_until,
)

H, M, P, R = State.HIT, State.MISS, State.PENDING, State.RETRY
K = bytes(range(32))
VALUE = b"kv-block-" * 20_000


def object_path(bucket: str, key: bytes, prefix: str = "fleet-a/") -> str:
    return f"/{bucket}/{prefix}{key.hex()}"


@pytest.fixture
async def daemon(
    s3: CephS3, sock_dir: Path, request: pytest.FixtureRequest
) -> AsyncIterator[Daemon]:
    marker = request.node.get_closest_marker("s3tier")
    overrides: dict[str, Any] = dict(marker.kwargs) if marker else {}
    lookup = overrides.pop("lookup", {})
    bucket = s3.new_bucket()
    async with running_daemon(
        sock_dir,
        remote_tier_configs=[s3.tier_config(bucket, **overrides)],
        disk={"enabled": False},
        lookup=lookup,
    ) as d:
        d.bucket = bucket  # type: ignore[attr-defined]
        yield d


def sample(d: Daemon, name: str, **labels: str) -> float:
    return d.metrics.registry.get_sample_value(name, labels) or 0.0


class Ahead:
    """A clock that runs ahead of real time by ``skew``: a test moves a
    breaker's time on instead of sleeping through its reset."""

    def __init__(self) -> None:
        self.skew = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.skew


def failing_fast(
    s3: CephS3,
    bucket: str,
    clock: Ahead,
    policy: WritePolicy,
    max_pending: int = 0,
    **overrides: Any,
) -> RemoteSpec:
    """An S3 tier whose requests fail within a second (one try) and whose
    breaker opens after two failures for 60 s of ``clock``."""
    cfg = S3TierConfig.model_validate(
        s3.tier_config(
            bucket,
            connect_timeout=0.5,
            read_timeout=0.5,
            op_timeout=1.0,
            max_attempts=1,
            breaker_failures=2,
            breaker_reset=60.0,
            **overrides,
        )
    )
    return RemoteSpec(S3Tier(cfg, clock=clock), policy, max_pending)


async def test_two_daemons_share_one_bucket(s3: CephS3, sock_dir: Path, tmp_path: Path) -> None:
    bucket = s3.new_bucket()
    config = tmp_path / "kvtier.toml"
    tier = s3.tier_config(bucket)
    config.write_text(
        "[[remote_tiers]]\n" + "\n".join(f"{k} = {json.dumps(v)}" for k, v in tier.items()) + "\n"
    )
    stored = s3.proxy.when_completed("PUT", object_path(bucket, K))
    a_dir, b_dir = sock_dir / "a", sock_dir / "b"
    a_dir.mkdir()
    b_dir.mkdir()
    a = DaemonProcess(a_dir, "--config", str(config)).start()
    try:
        async with await Client.connect(a.socket_path) as c:
            await c.put(K, VALUE)  # write-through to S3 in the background
        assert await asyncio.to_thread(stored.wait, 30)
    finally:
        assert a.stop() == 0

    b = DaemonProcess(b_dir, "--config", str(config)).start()  # empty RAM and disk
    try:
        async with await Client.connect(b.socket_path) as c:
            reply = await c.lookup([K], wait=30.0)
            assert reply.states == [H]  # probed in S3, promoted into RAM
            assert await c.get(K) == VALUE
            stats = await c.stats()
        assert stats["tiers"]["ram"]["blocks"] == 1
    finally:
        assert b.stop() == 0


async def test_64_lookups_one_head_then_64_gets_one_get(s3: CephS3, daemon: Daemon) -> None:
    bucket = daemon.bucket  # type: ignore[attr-defined]
    plant(s3, bucket, K)
    path = object_path(bucket, K)
    s3.proxy.hold("HEAD")
    clients = [await Client.connect(daemon.socket_path) for _ in range(8)]
    try:
        lookups = [asyncio.create_task(c.lookup([K], wait=30.0)) for c in clients for _ in range(8)]
        await asyncio.to_thread(s3.proxy.held.wait, 30)
        await wait_until(
            lambda: sample(daemon, "kvtier_probes_total", tier="s3", outcome="joined") == 63
        )
    finally:
        s3.proxy.release()
    replies = await asyncio.gather(*lookups)
    assert {tuple(r.states) for r in replies} == {(H,)}
    assert s3.proxy.counts[("HEAD", path)] == 1
    assert s3.proxy.counts[("GET", path)] == 1  # one promotion

    other = K[::-1]
    plant(s3, bucket, other)
    values = await asyncio.gather(*(c.get(other) for c in clients for _ in range(8)))
    assert all(v == VALUE for v in values)
    assert s3.proxy.counts[("GET", object_path(bucket, other))] == 1
    for c in clients:
        await c.close()


async def test_s3_outage_never_stalls_lookups_and_the_breaker_recovers(
    s3: CephS3, sock_dir: Path
) -> None:
    bucket = s3.new_bucket()
    clock = Ahead()
    tier = failing_fast(s3, bucket, clock, WritePolicy.WRITE_THROUGH, 1 << 28)
    uploaded = s3.proxy.when_completed("PUT", object_path(bucket, b"local"))
    async with (
        running_daemon(
            sock_dir,
            remote_tiers=[tier],
            disk={"enabled": False},
            lookup={"probe_timeout": 1.5, "error_ttl": 0.0},
        ) as daemon,
        await Client.connect(daemon.socket_path) as c,
    ):
        await c.put(b"local", b"served from RAM")
        assert await asyncio.to_thread(uploaded.wait, 30)  # no S3 traffic left in flight
        s3.proxy.go_away()
        try:
            for i in range(3):
                reply = await asyncio.wait_for(
                    c.lookup([b"local", bytes([i]) * 8], wait=10.0), timeout=15.0
                )
                assert reply.states == [H, M]  # local tiers keep serving; S3 errors read MISS
            assert sample(daemon, "kvtier_s3_breaker_state", tier="s3") == 2  # open
            assert (
                sample(daemon, "kvtier_s3_requests_total", tier="s3", op="head", outcome="rejected")
                >= 1
            )
            assert (await c.stats())["maps"]["probes_inflight"] == 0
        finally:
            s3.proxy.come_back()
        plant(s3, bucket, K)
        reply = await c.lookup([K], wait=10.0)
        assert reply.states == [M]  # still open: the probe was refused, not sent
        clock.skew += 60.0  # the breaker's reset interval passes
        reply = await c.lookup([K], wait=10.0)
        assert reply.states == [H]  # the trial request succeeded: S3 hits are back
        assert sample(daemon, "kvtier_s3_breaker_state", tier="s3") == 0


async def test_tampered_object_is_a_counted_miss(s3: CephS3, daemon: Daemon) -> None:
    bucket = daemon.bucket  # type: ignore[attr-defined]
    plant(s3, bucket, K, b"X" + VALUE[1:])  # bytes changed, checksum of the original kept
    async with await Client.connect(daemon.socket_path) as c:
        assert (await c.lookup([K], wait=10.0)).states == [M]  # HEAD yes, GET failed its check
        assert await c.get(K) is None
    assert sample(daemon, "kvtier_s3_corrupt_objects_total", tier="s3") == 1
    assert sample(daemon, "kvtier_promotions_total", tier="s3", outcome="absent") == 1


@pytest.mark.s3tier(hedge_after=0.05, hedge_max_ratio=1.0)
async def test_a_get_the_endpoint_holds_is_sent_again_and_the_first_answer_wins(
    s3: CephS3, daemon: Daemon
) -> None:
    """The endpoint holds the first GET: past hedge_after the object is asked
    for again, that answer (checksum-verified) is served, the held one dropped."""
    bucket = daemon.bucket  # type: ignore[attr-defined]
    plant(s3, bucket, K)
    s3.proxy.hold("GET", count=1)
    try:
        async with await Client.connect(daemon.socket_path) as c:
            assert await c.get(K) == VALUE
            stats = await c.stats()
    finally:
        s3.proxy.release()
    assert s3.proxy.counts[("GET", object_path(bucket, K))] == 2
    assert stats["tiers"]["s3"]["hedges"] == {"won": 1, "lost": 0, "skipped": 0}
    assert sample(daemon, "kvtier_hedged_reads_total", tier="s3", outcome="won") == 1


@pytest.mark.s3tier(hedge_after=0.05, hedge_max_ratio=0.0)
async def test_without_a_hedge_budget_a_held_get_is_waited_for(s3: CephS3, daemon: Daemon) -> None:
    bucket = daemon.bucket  # type: ignore[attr-defined]
    plant(s3, bucket, K)
    s3.proxy.hold("GET", count=1)
    async with await Client.connect(daemon.socket_path) as c:
        try:
            get = asyncio.create_task(c.get(K))
            await wait_on_timers(
                lambda: (
                    sample(daemon, "kvtier_hedged_reads_total", tier="s3", outcome="skipped") == 1
                )
            )
            assert not get.done()
        finally:
            s3.proxy.release()
        assert await get == VALUE
    assert s3.proxy.counts[("GET", object_path(bucket, K))] == 1


async def test_write_through_and_delete_reach_the_bucket(s3: CephS3, daemon: Daemon) -> None:
    bucket = daemon.bucket  # type: ignore[attr-defined]
    stored = s3.proxy.when_completed("PUT", object_path(bucket, K))
    async with await Client.connect(daemon.socket_path) as c:
        await c.put(K, VALUE)
        assert await asyncio.to_thread(stored.wait, 30)
        obj = s3.boto().get_object(Bucket=bucket, Key=f"fleet-a/{K.hex()}")
        assert obj["Body"].read() == VALUE
        assert obj["Metadata"][CHECKSUM_META] == _checksum(K, VALUE)
        assert await c.delete(K)
        listed = s3.boto().list_objects_v2(Bucket=bucket, Prefix="fleet-a/")
        assert listed.get("KeyCount", 0) == 0
    assert sample(daemon, "kvtier_s3_bytes_total", tier="s3", direction="out") == len(VALUE)


def plant(s3: CephS3, bucket: str, key: bytes, body: bytes = VALUE) -> None:
    """An object in the bucket as the tier writes it (prefix ``fleet-a/``),
    its checksum metadata ``VALUE``'s: another ``body`` is a tampered one."""
    s3.boto().put_object(
        Bucket=bucket,
        Key=f"fleet-a/{key.hex()}",
        Body=body,
        Metadata={CHECKSUM_META: _checksum(key, VALUE)},
    )


def _checksum(key: bytes, value: bytes) -> str:
    from kvtier.tiers.s3 import object_checksum

    return object_checksum(key, value)


async def test_a_hung_endpoint_opens_the_breaker_and_cold_lookups_answer_at_once(
    sock_dir: Path,
) -> None:
    """An endpoint that accepts connections and never answers: each request ends
    at its share of the probe deadline as a failure, the breaker opens after its
    threshold, and from then on cold lookups are answered without a request."""
    held: list[asyncio.StreamWriter] = []

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        await reader.read()  # until the client gives up

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    tier = {
        "kind": "s3",
        "bucket": "hung-bucket",
        "endpoint_url": f"http://127.0.0.1:{port}",
        "region": "us-east-1",
        "addressing_style": "path",
        "access_key_id": "k",
        "secret_access_key": "s",
        "breaker_failures": 2,
        "breaker_reset": 3600.0,
        "write_policy": "none",
    }
    try:
        async with (
            running_daemon(
                sock_dir,
                remote_tier_configs=[tier],
                disk={"enabled": False},
                lookup={"probe_timeout": 0.5, "error_ttl": 0.0},
            ) as daemon,
            await Client.connect(daemon.socket_path) as c,
        ):
            for i in range(2):  # each one waits out its request's deadline, then MISS
                assert (await c.lookup([bytes([i]) * 8], wait=30.0)).states == [M]

            def requests(outcome: str) -> float:
                return sample(
                    daemon, "kvtier_s3_requests_total", tier="s3", op="head", outcome=outcome
                )

            assert requests("timeout") == 2  # failures, not "cancelled"
            assert requests("cancelled") == 0
            assert sample(daemon, "kvtier_s3_breaker_state", tier="s3") == 2  # open
            assert (
                sample(daemon, "kvtier_probe_failures_total", tier="s3", kind="timeout") == 0
            )  # the request ended before the probe deadline, as an S3 error
            for i in range(2, 6):  # the breaker answers: no request is sent
                assert (await c.lookup([bytes([i]) * 8], wait=30.0)).states == [M]
            assert requests("rejected") == 4
            assert requests("timeout") == 2
    finally:
        for w in held:
            w.close()
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("fault", ["hang", "restart"])
async def test_blocks_an_outage_hid_read_hit_once_the_breaker_closes(
    s3: CephS3, sock_dir: Path, fault: str
) -> None:
    """RGW hangs (SIGSTOP), or is killed, while a reader GETs blocks the
    store said it has: the GETs time out or are refused, the breaker opens
    and refuses the rest. Those were errors, not the store's answer: once
    RGW answers again (SIGCONT, or started again) and the breaker closes,
    every block reads HIT at the next lookup, however long ``verdict_ttl``
    (``error_ttl`` 0 here: the default keeps an error 0.5 s)."""
    bucket = s3.new_bucket()
    keys = [b"hidden-%d" % i for i in range(8)]
    for key in keys:
        plant(s3, bucket, key)
    clock = Ahead()
    tier = failing_fast(s3, bucket, clock, WritePolicy.NONE, hedge_max_ratio=0.0)
    async with (
        running_daemon(
            sock_dir,
            remote_tiers=[tier],
            disk={"enabled": False},
            lookup={"remote_hit": "hit", "verdict_ttl": 600.0, "error_ttl": 0.0},
        ) as daemon,
        await Client.connect(daemon.socket_path, shared=False) as c,
    ):
        assert (await c.lookup(keys, wait=10.0)).states == [H] * 8  # the store said so
        down = signal.SIGSTOP if fault == "hang" else signal.SIGKILL
        await asyncio.to_thread(s3.cluster.rgw_signal, down)
        try:
            assert await c.get_many(keys) == [None] * 8  # failed, then refused
            assert sample(daemon, "kvtier_s3_breaker_state", tier="s3") == 2  # open
        finally:
            if fault == "hang":
                s3.cluster.rgw_signal(signal.SIGCONT)
            else:
                await asyncio.to_thread(s3.cluster.start_rgw)
        clock.skew += 60.0  # the breaker's reset interval passes
        for _ in range(20):  # lookups ask again: the trial request goes out
            await c.lookup(keys, wait=10.0)
            if sample(daemon, "kvtier_s3_breaker_state", tier="s3") == 0:
                break  # it succeeded: the breaker closed
        assert sample(daemon, "kvtier_s3_breaker_state", tier="s3") == 0
        assert (await c.lookup(keys, wait=10.0)).states == [H] * 8
        assert [bytes(v or b"") for v in await c.get_many(keys)] == [VALUE] * 8


@pytest.mark.parametrize("at_once", [False, True], ids=["one-after-the-other", "at-once"])
async def test_two_daemons_writing_the_same_blocks_upload_them_once(
    s3: CephS3, at_once: bool
) -> None:
    """Two daemons write the same 8 blocks through to one bucket: the PUTs
    are conditional (If-None-Match: *), so the store keeps the first of
    each and answers the other 412, a counted no-op. One after the other,
    every second PUT is one; at once, each block is stored and readable
    whichever wins, and no PUT fails."""
    bucket = s3.new_bucket()
    keys = [b"twice-%d" % i for i in range(8)]
    values = [bytes([i]) * 300_000 for i in range(8)]
    async with (
        running_daemon(
            short_tmpdir(), remote_tier_configs=[s3.tier_config(bucket)], disk={"enabled": False}
        ) as a,
        running_daemon(
            short_tmpdir(), remote_tier_configs=[s3.tier_config(bucket)], disk={"enabled": False}
        ) as b,
    ):

        async def write(d: Daemon) -> None:
            async with await Client.connect(d.socket_path) as c:
                await c.put_many(keys, values)
            await d.settle()  # (written through)

        if at_once:
            await asyncio.gather(write(a), write(b))
        else:
            await write(a)
            await write(b)

        def puts(outcome: str) -> float:
            return sum(
                sample(d, "kvtier_s3_requests_total", tier="s3", op="put", outcome=outcome)
                for d in (a, b)
            )

        assert puts("ok") + puts("exists") == 16 and puts("error") == 0
        if not at_once:
            assert (puts("ok"), puts("exists")) == (8, 8)
            assert sample(b, "kvtier_s3_requests_total", tier="s3", op="put", outcome="exists") == 8
        boto = s3.boto()
        for key, value in zip(keys, values, strict=True):
            assert (
                boto.get_object(Bucket=bucket, Key=f"fleet-a/{key.hex()}")["Body"].read() == value
            )


@pytest.mark.parametrize(
    ("status", "code", "outcome"),
    [(501, "NotImplemented", "ok"), (409, "ConditionalRequestConflict", "exists")],
    ids=["refused-header", "conflict"],
)
async def test_a_conditional_put_the_store_refuses_or_races_ends_cleanly(
    s3: CephS3, status: int, code: str, outcome: str
) -> None:
    """Answers RGW does not give on demand, given by the proxy in its place:
    a store that refuses ``If-None-Match`` (501) makes the tier write
    unconditionally from then on, and the block is stored; AWS's 409
    (another conditional write of the key under way) is the same no-op as
    412. Neither counts against the breaker, nothing is owed."""
    bucket = s3.new_bucket()
    async with (
        running_daemon(
            short_tmpdir(), remote_tier_configs=[s3.tier_config(bucket)], disk={"enabled": False}
        ) as d,
        await Client.connect(d.socket_path) as c,
    ):
        s3.proxy.answer("PUT", status, code)
        await c.put(K, VALUE)
        await d.settle()
        await c.put(K + b"2", VALUE)  # (conditional again after a 409; not after a 501)
        await d.settle()

        def puts(o: str) -> float:
            return sample(d, "kvtier_s3_requests_total", tier="s3", op="put", outcome=o)

        assert puts(outcome) >= 1 and puts("error") == 0
        assert sample(d, "kvtier_s3_breaker_state", tier="s3") == 0
        assert (await c.stats())["writes"]["s3"]["owed_blocks"] == 0
    boto = s3.boto()
    second = boto.get_object(Bucket=bucket, Key=f"fleet-a/{(K + b'2').hex()}")
    assert second["Body"].read() == VALUE
    if status == 501:  # stored by the unconditional PUT that followed
        assert boto.get_object(Bucket=bucket, Key=f"fleet-a/{K.hex()}")["Body"].read() == VALUE


def test_the_ceph_configuration_in_the_docs_serves_a_fleet(s3: CephS3, tmp_path: Path) -> None:
    """docs/s3.md's Ceph RGW configuration, as written, with only the
    endpoint, the bucket and the keys of this cluster put in: a daemon on it
    writes a block through to the bucket, and another reads it back."""
    doc = (ROOT / "docs" / "s3.md").read_text()
    section = doc[doc.index("## Ceph's RADOS Gateway") :]
    block = section[section.index("```toml\n") + 8 : section.index("```\n", 8)]
    ours = {
        "endpoint_url": s3.endpoint,
        "bucket": s3.new_bucket(),
        "access_key_id": s3.access_key,
        "secret_access_key": s3.secret_key,
    }
    for name, setting in ours.items():
        block, n = re.subn(rf"^{name} = .*$", f"{name} = {json.dumps(setting)}", block, flags=re.M)
        assert n == 1, f"the documented configuration sets {name} once"
    config = tmp_path / "kvtier.toml"
    config.write_text(block)
    key, value = b"documented", b"ceph" * 50_000
    writer_dir, reader_dir = short_tmpdir(), short_tmpdir()
    writer = DaemonProcess(writer_dir, "--config", str(config), "--no-disk").start()
    try:
        with BlockingClient(writer.socket_path) as c:
            c.put(key, value, durable=True)  # (no disk: durable once in the bucket)
    finally:
        assert writer.stop() == 0
    reader = DaemonProcess(reader_dir, "--config", str(config), "--no-disk").start()
    try:
        with BlockingClient(reader.socket_path) as c:
            assert c.lookup([key], wait=10.0).states == [H]
            assert c.get(key) == value
    finally:
        assert reader.stop() == 0


async def test_an_object_the_store_refuses_to_overwrite_but_cannot_serve_is_written_again(
    s3: CephS3, daemon: Daemon
) -> None:
    """A store that crashed in the middle of a PUT can keep a head it does
    not serve whole, and answer the next conditional PUT 412: the tier
    checks what a 412 claims (HEAD: length and checksum) and, where it does
    not hold, writes the block unconditionally."""
    bucket = daemon.bucket  # type: ignore[attr-defined]
    s3.boto().put_object(  # a head without this block's checksum
        Bucket=bucket, Key=f"fleet-a/{K.hex()}", Body=b"a torn leftover", Metadata={}
    )
    async with await Client.connect(daemon.socket_path) as c:
        await c.put(K, VALUE)
    await daemon.settle()
    put = "kvtier_s3_requests_total"
    assert sample(daemon, put, tier="s3", op="put", outcome="exists") == 1
    assert sample(daemon, put, tier="s3", op="put", outcome="ok") == 1
    got = s3.boto().get_object(Bucket=bucket, Key=f"fleet-a/{K.hex()}")["Body"].read()
    assert got == VALUE

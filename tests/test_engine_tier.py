"""The engine-facing tier against a real daemon process: lookups that never wait,
loads straight into the engine's rows, stores from them, failures as MISS."""

from __future__ import annotations

import asyncio
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier import BlockingClient, addresses
from kvtier.client import Client
from kvtier.integrations.engine import (
    Answer,
    DaemonLink,
    EngineTier,
    Rows,
    block_key,
    engine_namespace,
)
from tests.helpers import DaemonProcess, metric_value

BLOCK = 64 * 1024


def block(i: int) -> bytes:
    return bytes([i % 251]) * BLOCK


@pytest.fixture
def proc(sock_dir: Path) -> Iterator[DaemonProcess]:
    p = DaemonProcess(sock_dir, "--ram-capacity", "64MiB", "--no-disk").start()
    yield p
    p.stop()


@pytest.fixture
def tier(proc: DaemonProcess) -> Iterator[EngineTier]:
    t = EngineTier(proc.socket_path, namespace="model-a")
    yield t
    t.close()


def step(tier: EngineTier, request: str, keys: list[bytes]) -> list[Answer]:
    """One scheduler step: look up, flush, and (tests only) wait for the answers."""
    answers = [tier.lookup(request, k) for k in keys]
    tier.flush()
    tier.drain()
    return answers


def region(n: int) -> tuple[bytearray, list[memoryview]]:
    buf = bytearray(n * BLOCK)
    return buf, [memoryview(buf)[i * BLOCK : (i + 1) * BLOCK] for i in range(n)]


def test_store_then_load_into_rows_byte_for_byte(tier: EngineTier) -> None:
    keys = [b"k%d" % i for i in range(4)]
    src, rows = region(4)
    for i, row in enumerate(rows):
        row[:] = block(i)
    tier.store(1, keys, rows)
    tier.drain()
    assert [(d.job_id, d.ok, d.bytes) for d in tier.finished()] == [(1, True, 4 * BLOCK)]

    # The scheduler's first ask answers RETRY and never waits; the next step knows.
    assert step(tier, "req-1", [*keys, b"absent"]) == [Answer.RETRY] * 5
    assert step(tier, "req-1", [*keys, b"absent"]) == [Answer.HIT] * 4 + [Answer.MISS]

    dst, rows = region(4)
    tier.load(2, keys, rows)
    tier.drain()
    (done,) = tier.finished()
    assert done.ok and done.loaded == keys and done.bytes == 4 * BLOCK
    assert dst == src
    assert tier.counts["lookup_hit"] == 4 and tier.counts["lookup_miss"] == 1

    # Rows of one buffer, named by their starts (as the vLLM tier hands
    # them): from process memory, not a shared file, they go over the socket.
    more = [b"k%d" % i for i in range(4, 7)]
    tier.store(3, more, Rows(memoryview(src), [2 * BLOCK, 0, 3 * BLOCK], BLOCK))
    tier.drain()
    assert [(d.job_id, d.ok, d.bytes) for d in tier.finished()] == [(3, True, 3 * BLOCK)]
    dst, rows = region(3)
    tier.load(4, more, rows)
    tier.drain()
    assert [d.ok for d in tier.finished()] == [True]
    assert dst == block(2) + block(0) + block(3)


def test_a_failed_load_answers_miss_from_then_on(tier: EngineTier) -> None:
    keys = [b"here", b"gone"]
    _, rows = region(1)
    rows[0][:] = block(1)
    tier.store(1, keys[:1], rows)
    tier.drain()
    tier.finished()
    _, rows = region(2)
    tier.load(2, keys, rows)
    tier.drain()
    (done,) = tier.finished()
    assert (done.ok, done.loaded) == (False, [b"here"])
    tier.mark_failed([b"gone"])
    assert tier.lookup("req", b"gone") is Answer.MISS  # no lookup-HIT / load-fails loop


def test_a_block_being_written_reads_retry_until_it_lands(
    proc: DaemonProcess, tier: EngineTier
) -> None:
    with BlockingClient(proc.socket_path, namespace="model-a") as other_engine:
        other_engine.reserve([b"soon"])
        assert step(tier, "req", [b"soon"]) == [Answer.RETRY]
        assert step(tier, "req", [b"soon"]) == [Answer.RETRY]  # PENDING: ask again
        other_engine.put(b"soon", block(7))
        step(tier, "req", [b"soon"])
        assert step(tier, "req", [b"soon"]) == [Answer.HIT]


def test_namespaces_keep_models_apart(proc: DaemonProcess, tier: EngineTier) -> None:
    _, rows = region(1)
    tier.store(1, [b"shared-hash"], rows)
    tier.drain()
    other = EngineTier(proc.socket_path, namespace="model-b")
    try:
        step(other, "req", [b"shared-hash"])
        assert step(other, "req", [b"shared-hash"]) == [Answer.MISS]
    finally:
        other.close()


def test_finished_requests_leave_no_state_in_the_daemon(
    proc: DaemonProcess, tier: EngineTier
) -> None:
    for r in range(5):
        step(tier, f"req-{r}", [b"a", b"b"])
        tier.request_finished(f"req-{r}")
    tier.drain()
    with BlockingClient(proc.socket_path) as c:
        maps = c.stats()["maps"]
    assert maps["request_states"] == 0 and maps["reservations"] == 0
    assert repr(tier) == "<EngineTier requests=0 jobs=0 failed_keys=0 connected=True>"


def test_daemon_down_means_miss_and_failed_jobs_then_reconnects(sock_dir: Path) -> None:
    path = sock_dir / "later.sock"
    tier = EngineTier(path, backoff=(0.0, 0.0))
    try:
        assert step(tier, "req", [b"k"]) == [Answer.RETRY]
        assert tier.lookup("req", b"k") is Answer.MISS  # could not ask: MISS, not a hang
        _, rows = region(1)
        tier.load(1, [b"k"], rows)
        tier.store(2, [b"k"], rows)
        tier.drain()
        assert sorted((d.job_id, d.ok) for d in tier.finished()) == [(1, False), (2, False)]
        proc = DaemonProcess(sock_dir, "--no-disk", "--ram-capacity", "64MiB")
        proc.socket_path = path
        proc.start()
        try:
            tier.store(3, [b"k"], rows)
            tier.drain()
            assert [(d.job_id, d.ok) for d in tier.finished()] == [(3, True)]
        finally:
            proc.stop()
    finally:
        tier.close()


def test_the_daemon_link_bounds_every_call_and_names_blocks_apart(proc: DaemonProcess) -> None:
    link = DaemonLink(proc.socket_path, timeout=5.0)
    try:
        assert "open" in repr(link) and not link.connected
        assert link.call(lambda c: c.ping(b"x")) == b"x"
        assert link.connected
        gate = asyncio.Event()  # never set: the call outlives its bound
        started: list[int] = []

        async def stuck(client: Client) -> None:
            started.append(1)
            await gate.wait()

        with pytest.raises(TimeoutError):
            link.call(stuck, timeout=0.05)
        assert started == [1]
        assert link.call(lambda c: c.ping(b"y")) == b"y"  # the link is still good
    finally:
        link.close()
    assert "closed" in repr(link)
    a, b = block_key("page"), block_key(b"page", event_hash=-5)
    assert len(a) == len(b) == 32 and a == block_key(b"page") != block_key("other")
    assert b[-8:] == (-5).to_bytes(8, "big", signed=True) and b[:24] != a[:24]
    assert engine_namespace("org/Model 7B", "bf16", 16) == engine_namespace(
        "org/Model 7B", "bf16", 16
    )
    assert engine_namespace("org/Model 7B", "bf16", 16).startswith("org/Model-7B@")
    assert engine_namespace("m", "bf16") != engine_namespace("m", "fp8")


# -- stores the daemon reads from the engine's shared file itself (a region)


def test_store_jobs_from_a_shared_file_arrive_byte_for_byte(
    proc: DaemonProcess, tmp_path: Path
) -> None:
    n, jobs = 12, 4
    path = Path("/dev/shm") / f"kvtier-test-{os.getpid()}-{tmp_path.name}"
    with open(path, "w+b") as fh:
        fh.truncate(2 * n * BLOCK)
        mem = mmap.mmap(fh.fileno(), 0)
    tier = EngineTier(proc.socket_path, namespace="model-s")
    try:
        rows = [memoryview(mem)[i * BLOCK : (i + 1) * BLOCK] for i in range(2 * n)]
        for i in range(n):
            rows[i][:] = block(i)
        keys = [b"s%d" % i for i in range(n)]
        per = n // jobs
        for j in range(jobs):  # several in flight at once
            if j % 2 == 0:  # views of the rows
                tier.store(j, keys[j * per : (j + 1) * per], rows[j * per : (j + 1) * per])
                continue
            # or the rows as the vLLM tier names them: places in its pool, in any order
            order = list(reversed(range(j * per, (j + 1) * per)))
            places = Rows(memoryview(mem), [i * BLOCK for i in order], BLOCK)
            tier.store(j, [keys[i] for i in order], places)
            del places
        tier.drain()
        assert sorted((d.job_id, d.ok) for d in tier.finished()) == [(j, True) for j in range(jobs)]
        tier.load(9, keys, rows[n:])
        tier.drain()
        assert [d.ok for d in tier.finished()] == [True]
        assert all(bytes(rows[n + i]) == block(i) for i in range(n))
        assert tier._region.attached == 1  # the daemon read them from the file
    finally:
        tier.close()
        path.unlink()  # (first: a failed assertion's frame may still hold a row)
        del rows
        mem.close()


def test_a_lookup_carries_the_engine_budget_and_slow_loads_answer_miss(
    proc: DaemonProcess,
) -> None:
    """With a recompute cost per block, each lookup carries a budget: one so
    small that no load fits answers MISS where the blocks are HIT without."""
    keys = [b"b%d" % i for i in range(3)]
    plain = EngineTier(proc.socket_path, namespace="model-b")
    cheap = EngineTier(proc.socket_path, namespace="model-b", recompute_seconds_per_block=1e-9)
    try:
        _, rows = region(3)
        plain.store(1, keys, rows)
        plain.drain()
        assert [d.ok for d in plain.finished()] == [True]
        step(plain, "r", keys)
        assert step(plain, "r", keys) == [Answer.HIT] * 3
        step(cheap, "r", keys)
        assert step(cheap, "r", keys) == [Answer.MISS] * 3  # recomputing beats any load
        text = proc.scrape()
        assert metric_value(text, "kvtier_lookup_budget_cut_total", 'tier="ram"') >= 3
    finally:
        plain.close()
        cheap.close()
    with pytest.raises(ValueError, match="finite number of seconds"):
        EngineTier(proc.socket_path, recompute_seconds_per_block=float("nan"))


def test_rows_places_in_a_mapped_file_are_found_at_once_or_not_at_all() -> None:
    file = addresses.MappedFile("/dev/shm/pool", start=0x10000, end=0x20000, offset=0x4000)
    assert file.spans_at(0x10000, [0x2000, 0x0, 0x1000], 0x1000) == [
        (0x6000, 0x1000),
        (0x4000, 0x1000),
        (0x5000, 0x1000),
    ]
    assert file.spans_at(0x10000, [], 0x1000) == []
    assert file.spans_at(0x10000, [0xF000], 0x1001) is None  # ends past the mapping
    assert file.spans_at(0xF000, [0x0, 0x1000], 0x1000) is None  # starts before it
    rows = Rows(memoryview(bytearray(4 * BLOCK)), [3 * BLOCK, BLOCK], BLOCK)
    assert (len(rows), rows.nbytes, repr(rows)) == (2, 2 * BLOCK, f"<Rows 2 x {BLOCK} bytes>")
    assert [len(v) for v in rows.views()] == [BLOCK, BLOCK]

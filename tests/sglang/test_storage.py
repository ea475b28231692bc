"""kvtier behind SGLang's HiCache: built by SGLang's own StorageBackendFactory
from the dynamic backend config, moving pages of SGLang's real host KV pool,
against a real daemon process."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.observability.metrics_collector import StorageMetrics

from kvtier import BlockingClient
from kvtier.integrations.sglang import KvtierStorage
from tests.enginedaemon import start_with_disk
from tests.sglang.conftest import Daemon

PAGE = 16  # tokens per page
LAYERS, HEADS, HEAD_DIM = 2, 4, 64
#: bytes of one page's K (and of its V): layers x tokens x heads x head size x bf16
PART = LAYERS * PAGE * HEADS * HEAD_DIM * 2


def host_pool(
    allocator: str = "default",
    *,
    device_pages: int = 16,
    tokens: int = PAGE,
    heads: int = HEADS,
    layers: int = LAYERS,
) -> MHATokenToKVPoolHost:
    """SGLang's host KV pool on the CPU, page-first, as HiCache builds it:
    twice ``device_pages`` pages of ``tokens`` tokens of bf16 K and V."""
    device = MHATokenToKVPool(
        size=tokens * device_pages,
        page_size=tokens,
        dtype=torch.bfloat16,
        head_num=heads,
        head_dim=HEAD_DIM,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    return MHATokenToKVPoolHost(
        device._mha_buffer_info(),
        2.0,
        0,
        tokens,
        "page_first",
        pin_memory=False,
        device="cpu",
        allocator_type=allocator,
        device_capacity_tokens=tokens * device_pages,
        start_layer=0,
        end_layer=layers - 1,
    )


def storage_config(
    socket: Path, *, tp_rank: int = 0, metrics: bool = False, **extra: Any
) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=2,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=metrics,
        is_page_first_layout=True,
        model_name="org/tiny",
        extra_config={
            "backend_name": "kvtier",
            "module_path": "kvtier.integrations.sglang",
            "class_name": "KvtierStorage",
            "interface_v1": 1,
            "socket": str(socket),
            "timeout": 2.0,
            **extra,
        },
    )


class Engine:
    """One SGLang rank's L3 storage over its own host pool, as HiCache sets it up."""

    def __init__(self, socket: Path, allocator: str = "default", **config: Any) -> None:
        self.pool = host_pool(allocator)
        backend = StorageBackendFactory.create_backend(
            "dynamic", storage_config(socket, **config), self.pool
        )
        assert isinstance(backend, KvtierStorage), type(backend)
        backend.register_mem_pool_host(self.pool)
        self.storage = backend

    def fill(self, pages: int) -> tuple[torch.Tensor, list[bytes]]:
        """Host indices of ``pages`` new pages holding random bytes, and those bytes."""
        indices = self.pool.alloc(pages * PAGE)
        assert indices is not None
        return indices, [self.page_bytes(indices, i, random=True) for i in range(pages)]

    def page_bytes(self, indices: torch.Tensor, page: int, random: bool = False) -> bytes:
        """Page ``page`` of ``indices``: its K then its V bytes (written first if ``random``)."""
        ptrs, sizes = self.pool.get_page_buffer_meta(indices[page * PAGE : (page + 1) * PAGE])
        out = b""
        for ptr, size in zip(ptrs, sizes, strict=True):
            buf = memoryview((ctypes.c_ubyte * size).from_address(ptr)).cast("B")
            if random:
                buf[:] = os.urandom(size)
            out += bytes(buf)
        return out

    def close(self) -> None:
        self.storage.close()


def hashes(n: int, base: int = 0) -> list[str]:
    """SGLang-like page hashes (hex SHA-256 strings)."""
    return [f"{base + i:064x}" for i in range(n)]


@pytest.fixture
def eng(daemon: Daemon) -> Iterator[Engine]:
    e = Engine(daemon.socket_path)
    yield e
    e.close()


def test_sglang_builds_our_backend_and_pages_round_trip(eng: Engine, daemon: Daemon) -> None:
    storage = eng.storage
    assert storage.parts == 2  # an MHA page is its K and its V
    keys = hashes(4)
    src, pages = eng.fill(4)
    assert storage.batch_exists(keys) == 0
    assert storage.batch_set_v1(keys, src) == [True] * 4
    assert storage.batch_exists(keys) == 4
    # Into other pages of the pool: byte-identical, straight into its memory.
    dst = eng.pool.alloc(4 * PAGE)
    assert storage.batch_get_v1(keys, dst) == [True] * 4
    assert [eng.page_bytes(dst, i) for i in range(4)] == pages
    # One LOOKUP in prefix mode per batch_exists; a gap ends the prefix.
    lookups = daemon.total("kvtier_lookup_keys_total")
    chain = [keys[0], keys[1], hashes(1, base=99)[0], keys[2]]
    assert storage.batch_exists(chain) == 2
    counted = daemon.total_reaching("kvtier_lookup_keys_total", lookups + len(chain) * 2)
    assert counted - lookups == len(chain) * 2
    missing = eng.pool.alloc(2 * PAGE)
    assert storage.batch_get_v1([keys[3], hashes(1, base=99)[0]], missing) == [True, False]
    assert storage.counts["stored_bytes"] == 4 * 2 * PART
    assert daemon.stats()["tiers"]["ram"]["blocks"] == 8


def test_the_older_tensor_interface_round_trips(daemon: Daemon) -> None:
    eng = Engine(daemon.socket_path, interface_v1=0)
    storage = eng.storage
    assert storage.parts == 1  # a page is one tensor here
    value = torch.randint(0, 255, (PART,), dtype=torch.uint8)
    assert storage.exists("ab" * 32) is False
    assert storage.set("ab" * 32, value) is True
    assert storage.exists("ab" * 32) is True
    target = torch.zeros(PART, dtype=torch.uint8)
    got = storage.get("ab" * 32, target)
    assert got is target and torch.equal(target, value)
    assert storage.batch_get(["cd" * 32], [torch.zeros(PART, dtype=torch.uint8)]) == [None]
    eng.close()


def test_two_ranks_share_pages_and_other_models_and_ranks_do_not(
    daemon: Daemon,
) -> None:
    a = Engine(daemon.socket_path, allocator="shm")  # SGLang's memfd-backed host pool
    b = Engine(daemon.socket_path)
    other_rank = Engine(daemon.socket_path, tp_rank=1)
    other_model = Engine(daemon.socket_path, namespace="another-model")
    try:
        keys = hashes(2, base=10)
        src, pages = a.fill(2)
        assert a.storage.batch_set_v1(keys, src) == [True, True]
        dst = b.pool.alloc(2 * PAGE)
        assert b.storage.batch_get_v1(keys, dst) == [True, True]
        assert [b.page_bytes(dst, i) for i in range(2)] == pages
        assert other_rank.storage.batch_exists(keys) == 0  # its own shard of each page
        assert other_model.storage.batch_exists(keys) == 0
        # Namespaces are the daemon's, named at HELLO (the model by default).
        assert a.storage.namespace == other_rank.storage.namespace != "another-model"
        assert {a.storage.namespace, "another-model"} <= set(daemon.stats()["namespaces"])
    finally:
        for e in (a, b, other_rank, other_model):
            e.close()


def test_a_memfd_host_pool_is_read_by_the_daemon_itself(daemon: Daemon) -> None:
    a = Engine(daemon.socket_path, allocator="shm")  # SGLang's memfd-backed host pool
    plain = Engine(daemon.socket_path, allocator="shm", regions=False)
    try:
        assert len(a.storage.files) == 1 and plain.storage.files == []
        keys = hashes(4, base=70)
        src, pages = a.fill(4)
        received = daemon.total("kvtier_received_bytes_total")
        assert a.storage.batch_set_v1(keys, src) == [True] * 4
        # Keys and offsets crossed the socket; the daemon read the pages itself.
        assert daemon.total("kvtier_received_bytes_total") - received < 4096
        assert daemon.total("kvtier_shared_region_bytes_total", direction="in") == 4 * 2 * PART
        assert a.storage.batch_set_v1(hashes(2, base=80), a.fill(2)[0]) == [True] * 2
        assert a.storage.counts["regions_attached"] == 1  # once per connection
        # Loads take the shared arena (faster than the daemon writing the pool).
        missing = hashes(1, base=99)
        dst = a.pool.alloc(5 * PAGE)
        assert a.storage.batch_get_v1(keys + missing, dst) == [True] * 4 + [False]
        assert [a.page_bytes(dst, i) for i in range(4)] == pages
        assert daemon.total("kvtier_shared_region_bytes_total", direction="out") == 0
        # Turned off: the same pages over the socket.
        src, pages = plain.fill(2)
        received = daemon.total("kvtier_received_bytes_total")
        assert plain.storage.batch_set_v1(hashes(2, base=90), src) == [True] * 2
        assert daemon.total("kvtier_received_bytes_total") - received >= 2 * 2 * PART
        out = a.pool.alloc(2 * PAGE)
        assert a.storage.batch_get_v1(hashes(2, base=90), out) == [True] * 2
        assert [a.page_bytes(out, i) for i in range(2)] == pages
        assert daemon.stats()["shared"]["regions"] == 1
    finally:
        for e in (a, plain):
            e.close()


def test_a_page_another_writer_is_storing_waits_bounded_then_reads_as_a_miss(
    daemon: Daemon,
) -> None:
    e = Engine(daemon.socket_path, pending_wait=0.2)
    try:
        keys = hashes(1, base=20)
        names = e.storage.names(keys, e.storage.parts)
        with BlockingClient(daemon.socket_path, namespace=e.storage.namespace) as writer:
            writer.reserve(names, [PART] * len(names), deadline=60.0)  # storing, for a minute
            assert e.storage.batch_exists(keys) == 0  # after at most pending_wait
            assert writer.abort(names) == [True, True]
        assert e.storage.counts["lookups"] == 1
    finally:
        e.close()


def test_a_page_that_lands_while_its_lookup_waits_reads_as_a_hit(daemon: Daemon) -> None:
    reader = Engine(daemon.socket_path, pending_wait=30.0)
    try:
        keys = hashes(1, base=30)
        names = reader.storage.names(keys, reader.storage.parts)
        k, v = os.urandom(PART), os.urandom(PART)
        with BlockingClient(daemon.socket_path, namespace=reader.storage.namespace) as writer:
            writer.reserve(names, [PART, PART], deadline=60.0)
            answer: list[int] = []
            waiting = threading.Thread(
                target=lambda: answer.append(reader.storage.batch_exists(keys))
            )
            waiting.start()
            # The writer's PUT lands: a lookup already waiting wakes to HIT,
            # one that comes later finds it.
            writer.put_many(names, [k, v])
            waiting.join(30)
        assert answer == [1]
        dst = reader.pool.alloc(PAGE)
        assert reader.storage.batch_get_v1(keys, dst) == [True]
        assert reader.page_bytes(dst, 0) == k + v
    finally:
        reader.close()


def test_the_daemon_killed_and_restarted_means_misses_then_recovery(workdir: Path) -> None:
    d = start_with_disk(workdir)
    e = Engine(d.socket_path, allocator="shm")
    try:
        keys = hashes(2, base=40)
        src, pages = e.fill(2)
        assert e.storage.batch_set_v1(keys, src) == [True, True]
        d.proc.kill()
        d.proc.wait(30)
        # Down: misses and failed stores; no exception reaches SGLang's threads.
        dst = e.pool.alloc(2 * PAGE)
        assert e.storage.batch_exists(keys) == 0
        assert e.storage.batch_get_v1(keys, dst) == [False, False]
        assert e.storage.batch_set_v1(keys, src) == [False, False]
        assert e.storage.counts["store_failures"] >= 1
        # Back (RAM starts empty): dialled again once the backoff has passed.
        d = start_with_disk(workdir)
        for _ in range(100_000):
            if e.storage.batch_set_v1(keys, src) == [True, True]:
                break
        assert e.storage.batch_exists(keys) == 2
        assert e.storage.batch_get_v1(keys, dst) == [True, True]
        assert [e.page_bytes(dst, i) for i in range(2)] == pages
        assert e.storage.counts["regions_attached"] == 2  # handed again to the new daemon
        maps = d.stats()["maps"]
        assert maps["reservations"] == 0 and maps["probes_inflight"] == 0
        assert maps["request_states"] == 0 and maps["timers"] == 0
    finally:
        e.close()
        d.stop()


def test_clear_deletes_what_this_backend_stored_and_stats_are_sglangs(daemon: Daemon) -> None:
    e = Engine(daemon.socket_path, metrics=True)
    try:
        keys = hashes(3, base=50)
        src, _ = e.fill(3)
        assert e.storage.batch_set_v1(keys, src) == [True] * 3
        assert e.storage.batch_get_v1(keys, e.pool.alloc(3 * PAGE)) == [True] * 3
        stats = e.storage.get_stats()
        assert isinstance(stats, StorageMetrics)
        assert stats.backup_pgs == [3] and stats.prefetch_pgs == [3]
        assert len(stats.backup_bandwidth) == 1 and stats.backup_bandwidth[0] > 0
        assert e.storage.get_stats().backup_pgs == []  # since the last call
        e.storage.clear()
        assert e.storage.batch_exists(keys) == 0
        assert e.storage.counts["cleared"] == 6
        assert daemon.stats()["tiers"]["ram"]["blocks"] == 0
    finally:
        e.close()


def test_a_bad_setting_is_refused_when_sglang_builds_the_backend(daemon: Daemon) -> None:
    with pytest.raises(ValueError, match="timeout"):
        StorageBackendFactory.create_backend(
            "dynamic", storage_config(daemon.socket_path, timeout=0), None
        )


def test_the_plain_calls_agree_with_the_batched_ones_on_a_page(daemon: Daemon) -> None:
    """On a zero-copy engine (a page is its K and V blocks), a page stored
    with the plain ``set`` exists for ``exists`` and ``batch_exists`` on this
    engine and another, and reads back with ``get``: one rule names a page's
    blocks, whichever call stores or looks."""
    eng, other = Engine(daemon.socket_path), Engine(daemon.socket_path)
    storage = eng.storage
    assert storage.parts == 2
    key = "ef" * 32
    value = torch.randint(0, 255, (2 * PART,), dtype=torch.uint8)
    assert storage.exists(key) is False
    assert storage.set(key, value) is True
    assert storage.exists(key) is True
    assert other.storage.exists(key) is True
    assert other.storage.batch_exists([key, "00" * 32]) == 1
    target = torch.zeros(2 * PART, dtype=torch.uint8)
    assert other.storage.get(key, target) is target
    assert torch.equal(target, value)
    # A page stored by the batched zero-copy call is found by the plain one too.
    keys = hashes(2, base=500)
    src, _ = eng.fill(2)
    assert storage.batch_set_v1(keys, src) == [True, True]
    assert [other.storage.exists(k) for k in keys] == [True, True]
    eng.close()
    other.close()


def test_a_prefill_rate_sends_budgets_and_pages_slower_to_load_read_as_misses(
    eng: Engine, daemon: Daemon
) -> None:
    """``recompute_tokens_per_second``: each lookup carries the seconds its
    pages would take to recompute; at a (fictitious) trillion tokens a
    second even RAM is slower, and SGLang recomputes."""
    keys = hashes(2, base=500)
    src, _ = eng.fill(2)
    assert eng.storage.batch_set_v1(keys, src) == [True] * 2
    assert eng.storage.batch_exists(keys) == 2
    fast = Engine(daemon.socket_path, recompute_tokens_per_second=1e12)
    try:
        assert fast.storage.batch_exists(keys) == 0
    finally:
        fast.close()
    assert daemon.total("kvtier_lookup_budget_cut_total") >= 2


def test_sglangs_soft_retention_leases_the_pages_it_stores(eng: Engine, daemon: Daemon) -> None:
    """SGLang's own HiCacheStorageExtraInfo with its soft-retention fields
    (priority, retention_seconds): the pages stored are leased to the
    request's session, and its lookups count a return (docs/retention.md)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    info = HiCacheStorageExtraInfo(
        prefix_keys=None,
        extra_info={"priority": 80, "retention_seconds": 120, "session_id": "agent-3"},
    )
    keys = hashes(3, base=500)
    src, _ = eng.fill(3)
    assert eng.storage.batch_set_v1(keys, src, info) == [True] * 3
    assert eng.storage.batch_exists(keys, info) == 3
    r = daemon.stats()["retention"]
    assert r["leased_blocks"] == 3 * 2 and r["sessions"] == 1  # (a page: its K and its V)
    assert r["returns_asked"] == 6 and r["returns_held"] == 6
    assert list(r["leased_bytes_by_priority"].values()) == [{"80": 6 * PART}]

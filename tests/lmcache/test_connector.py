"""kvtier behind LMCache: built by LMCache's own CreateConnector over its
LocalCPUBackend, against a real daemon process."""

from __future__ import annotations

import os
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector import CreateConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

from kvtier import BlockingClient
from kvtier.integrations.lmcache import KvtierConnector
from tests.enginedaemon import start_with_disk
from tests.lmcache.conftest import Daemon, Loop

CHUNK = 256
#: (layers, K and V, tokens, kv heads, head size): 512 KiB float16 chunks
KV_SHAPE = (2, 2, CHUNK, 4, 64)


def engine(
    socket: Path,
    namespace: str = "",
    kv_shape: tuple[int, int, int, int, int] = KV_SHAPE,
    **settings: Any,
) -> tuple[LMCacheEngineConfig, LocalCPUBackend]:
    """An engine's LMCache config naming kvtier as its remote plugin, and its CPU backend."""
    extra = {
        "remote_storage_plugin.kvtier.module_path": "kvtier.integrations.lmcache",
        "remote_storage_plugin.kvtier.class_name": "KvtierConnector",
        "kvtier.socket": str(socket),
        "kvtier.timeout": 1.0,
        **settings,
    }
    if namespace:
        extra["kvtier.namespace"] = namespace
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK,
        local_cpu=True,
        max_local_cpu_size=0.25,
        remote_storage_plugins=["kvtier"],
        extra_config=extra,
    )
    return config, LocalCPUBackend(config, metadata(kv_shape))


def metadata(kv_shape: tuple[int, int, int, int, int] = KV_SHAPE) -> LMCacheMetadata:
    """The model an engine runs, as LMCache describes it: one worker, float16."""
    return LMCacheMetadata(
        model_name="tiny",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.float16,
        kv_shape=kv_shape,
        chunk_size=CHUNK,
    )


class Engine:
    """One engine's remote connector, as LMCache builds and wraps it."""

    def __init__(self, loop: Loop, socket: Path, namespace: str = "", **settings: Any) -> None:
        self.loop = loop
        self.config, self.backend = engine(socket, namespace, **settings)
        self.connector = CreateConnector(
            "plugin://kvtier", loop.loop, self.backend, self.config, plugin_name="kvtier"
        )

    @property
    def ours(self) -> KvtierConnector:
        inner = self.connector.getWrappedConnector()
        assert isinstance(inner, KvtierConnector), type(inner)
        return inner

    def chunk(self, seed: int, tokens: int = CHUNK) -> tuple[Any, bytes]:
        ours = self.ours
        obj = self.backend.allocate(ours.meta_shapes, ours.meta_dtypes, ours.meta_fmt)
        assert obj is not None
        view = memoryview(obj.byte_array).cast("B")
        data = os.urandom(len(view) * tokens // CHUNK)
        view[: len(data)] = data
        obj = ours.reshape_partial_chunk(obj, len(data))
        return obj, data

    def run(self, coro: Any, timeout: float = 30.0) -> Any:
        return self.loop.run(coro, timeout)

    def put(self, keys: list[CacheEngineKey], objs: list[Any]) -> None:
        """Store chunks as LMCache's RemoteBackend does: it takes a reference
        for the put, which LMCache's connector wrapper drops when put returns."""
        for obj in objs:
            obj.ref_count_up()
        self.run(self.connector.batched_put(keys, objs))

    def close(self) -> None:
        self.run(self.connector.close())


def key(n: int) -> CacheEngineKey:
    return CacheEngineKey("tiny", 1, 0, n, torch.float16)


def bytes_of(obj: Any) -> bytes:
    return bytes(memoryview(obj.byte_array).cast("B"))


@pytest.fixture
def eng(daemon: Daemon, lmcache_loop: Loop) -> Iterator[Engine]:
    e = Engine(lmcache_loop, daemon.socket_path)
    yield e
    e.close()


def test_lmcache_builds_our_connector_and_round_trips_chunks(eng: Engine, daemon: Daemon) -> None:
    assert isinstance(eng.ours, KvtierConnector)  # not LMCache's silent all-miss fallback
    full, full_bytes = eng.chunk(1)
    part, part_bytes = eng.chunk(2, tokens=100)
    assert eng.run(eng.connector.exists(key(1))) is False
    eng.put([key(1), key(2)], [full, part])
    full.ref_count_down()
    part.ref_count_down()
    assert eng.connector.exists_sync(key(1)) is True
    got = eng.run(eng.connector.batched_get([key(1), key(2), key(3)]))
    assert bytes_of(got[0]) == full_bytes
    assert bytes_of(got[1]) == part_bytes and got[1].meta.shape[2] == 100  # tokens restored
    assert got[2] is None
    one = eng.run(eng.connector.get(key(1)))
    assert bytes_of(one) == full_bytes
    for obj in (*got[:2], one):
        obj.ref_count_down()
    # One LOOKUP in prefix mode for a whole chain, tagged with the lookup id.
    lookups = daemon.total("kvtier_lookup_keys_total")
    chain = [key(1), key(2), key(3), key(1)]
    assert eng.run(eng.connector.batched_async_contains("req-1", chain)) == 2
    counted = daemon.total_reaching("kvtier_lookup_keys_total", lookups + len(chain))
    assert counted - lookups == len(chain)
    assert eng.run(eng.connector.ping()) == 0
    assert eng.connector.remove_sync(key(1)) is True
    assert eng.run(eng.connector.exists(key(1))) is False
    assert eng.ours.counts["stored_bytes"] == len(full_bytes) + len(part_bytes)
    # The partial chunk ends its prefix: stored with the TAIL hint, the full one without.
    assert eng.ours.counts["tail_chunks"] == 1
    assert daemon.total("kvtier_put_hints_total", hint="tail") == 1


def test_two_engines_share_blocks_and_namespaces_keep_them_apart(
    daemon: Daemon, lmcache_loop: Loop
) -> None:
    a, b = Engine(lmcache_loop, daemon.socket_path), Engine(lmcache_loop, daemon.socket_path)
    other = Engine(lmcache_loop, daemon.socket_path, namespace="another-model")
    try:
        obj, data = a.chunk(7)
        a.put([key(7)], [obj])
        obj.ref_count_down()
        got = b.run(b.connector.get(key(7)))
        assert bytes_of(got) == data
        got.ref_count_down()
        assert other.run(other.connector.exists(key(7))) is False
        assert daemon.stats()["tiers"]["ram"]["blocks"] == 1
        # Namespaces are the daemon's, named at HELLO: the model and its
        # layout by default, not a prefix of the keys.
        assert a.ours.namespace == b.ours.namespace and a.ours.namespace.startswith("tiny@")
        assert a.run(a.connector.exists(key(7))) is True  # a lookup, counted by namespace
        assert {a.ours.namespace, "another-model"} <= set(daemon.stats()["namespaces"])
        assert len(a.ours.key(key(7))) == 32
    finally:
        for e in (a, b, other):
            e.close()


def test_a_block_another_writer_is_storing_reads_as_a_miss_at_once(
    eng: Engine, daemon: Daemon
) -> None:
    name = eng.ours.key(key(9))
    with BlockingClient(daemon.socket_path, namespace=eng.ours.namespace) as writer:
        writer.reserve([name], [512 * 1024], deadline=60.0)  # storing, for a minute
        assert eng.run(eng.connector.batched_async_contains("r", [key(9)]), timeout=5) == 0
        assert eng.run(eng.connector.exists(key(9)), timeout=5) is False
        assert writer.abort([name]) == [True]


def test_the_daemon_killed_and_restarted_means_misses_then_recovery(
    workdir: Path, lmcache_loop: Loop
) -> None:
    d = start_with_disk(workdir)
    e = Engine(lmcache_loop, d.socket_path)
    try:
        obj, data = e.chunk(5)
        e.put([key(5)], [obj])
        d.proc.kill()
        d.proc.wait(30)
        # Down: misses and dropped stores, no exception reaches the engine.
        assert e.run(e.connector.exists(key(5))) is False
        assert e.run(e.connector.get(key(5))) is None
        assert e.run(e.connector.batched_async_contains("r", [key(5)])) == 0
        e.put([key(6)], [obj])
        assert e.ours.counts.get("store_failures", 0) >= 1
        assert e.run(e.connector.ping()) == 1
        # Back (RAM starts empty): the connection is dialled again once the
        # backoff after the failures has passed (each ping is a round trip).
        d = start_with_disk(workdir)
        for _ in range(100_000):
            if e.run(e.connector.ping()) == 0:
                break
        assert e.run(e.connector.ping()) == 0
        e.put([key(5)], [obj])
        obj.ref_count_down()
        got = e.run(e.connector.get(key(5)))
        assert got is not None and bytes_of(got) == data
        got.ref_count_down()
        maps = d.stats()["maps"]
        assert maps["reservations"] == 0 and maps["probes_inflight"] == 0
        assert maps["request_states"] == 0 and maps["timers"] == 0
    finally:
        e.close()
        d.stop()


def test_a_prefill_rate_sends_budgets_and_chunks_slower_to_load_read_as_misses(
    eng: Engine, daemon: Daemon, lmcache_loop: Loop
) -> None:
    """``kvtier.recompute_tokens_per_second``: each lookup carries the seconds
    its chunks would take to recompute; at a (fictitious) trillion tokens a
    second even RAM is slower, and LMCache recomputes."""
    chunk, _ = eng.chunk(7)
    eng.put([key(7)], [chunk])
    chunk.ref_count_down()
    assert eng.run(eng.connector.batched_async_contains("plain", [key(7)])) == 1
    rate: dict[str, Any] = {"kvtier.recompute_tokens_per_second": 1e12}
    fast = Engine(lmcache_loop, daemon.socket_path, **rate)
    try:
        assert fast.ours.recompute_seconds_per_chunk == CHUNK / 1e12
        assert fast.run(fast.connector.batched_async_contains("budget", [key(7)])) == 0
    finally:
        fast.close()
    assert daemon.total("kvtier_lookup_budget_cut_total") >= 1


def test_buffers_come_in_one_call_when_lmcache_has_room_else_one_by_one() -> None:
    """``batched_allocate`` is asked without eviction (LMCache evicts for it
    as if the batch were one chunk's layers); when it has no room for the
    whole batch, each buffer is asked for alone, evicting as LMCache does."""
    calls: list[tuple[str, int, bool]] = []

    class Backend:
        def __init__(self, room: int) -> None:
            self.room = room

        def batched_allocate(
            self, shapes: Any, dtypes: Any, n: int, fmt: Any, eviction: bool = True
        ) -> Any:
            calls.append(("batched", n, eviction))
            return [object() for _ in range(n)] if n <= self.room else None

        def allocate(self, shapes: Any, dtypes: Any, fmt: Any) -> Any:
            calls.append(("one", 1, True))
            self.room -= 1
            return object() if self.room >= 0 else None

    def connector(room: int) -> Any:
        return types.SimpleNamespace(
            local_cpu_backend=Backend(room), meta_shapes=[], meta_dtypes=[], meta_fmt=None
        )

    assert len(KvtierConnector._allocate(connector(4), 3)) == 3
    assert calls == [("batched", 3, False)]
    calls.clear()
    got = KvtierConnector._allocate(connector(2), 3)
    assert [g is not None for g in got] == [True, True, False]
    assert calls == [("batched", 3, False), ("one", 1, True), ("one", 1, True), ("one", 1, True)]


def test_a_requests_retention_tags_lease_its_chunks(eng: Engine, daemon: Daemon) -> None:
    """LMCache's own request tags (request_configs "lmcache.tag.*", which
    LMCache keeps on each CacheEngineKey): the chunks stored are leased to
    the session, and its lookups count a return (docs/retention.md)."""
    configs = {
        "lmcache.tag.session_id": "agent-5",
        "lmcache.tag.retention_seconds": "10m",
        "lmcache.tag.priority": 75,
    }
    keys = [CacheEngineKey("tiny", 1, 0, 700 + i, torch.float16, configs) for i in range(2)]
    assert keys[0].tags is not None  # (LMCache's own parsing of the configs)
    chunks = [eng.chunk(700 + i)[0] for i in range(2)]
    eng.put(keys, chunks)
    for chunk in chunks:
        chunk.ref_count_down()
    assert eng.run(eng.connector.batched_async_contains("req-9", keys)) == 2
    r = daemon.stats()["retention"]
    assert r["leased_blocks"] == 2 and r["sessions"] == 1
    assert r["returns_asked"] == 2 and r["returns_held"] == 2
    assert [list(by) for by in r["leased_bytes_by_priority"].values()] == [["75"]]

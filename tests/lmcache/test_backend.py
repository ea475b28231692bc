"""kvtier as LMCache's storage plugin: :class:`KvtierBackend`, built by
LMCache's own ``CreateStorageBackends`` from the config the docs give,
against a real daemon process."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.storage_backend import CreateStorageBackends
from lmcache.v1.storage_backend.remote_backend import RemoteBackend

from kvtier.integrations.lmcache import KvtierBackend, KvtierConnector
from tests.enginedaemon import start_with_disk
from tests.lmcache.conftest import Daemon, Loop
from tests.lmcache.test_connector import CHUNK, KV_SHAPE, bytes_of, key, metadata


class Plugged:
    """One engine's storage backends, as LMCache builds them from its config."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        socket: Path,
        kv_shape: tuple[int, int, int, int, int] = KV_SHAPE,
    ) -> None:
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK,
            local_cpu=True,
            max_local_cpu_size=0.25,
            storage_plugins=["kvtier"],
            extra_config={
                "storage_plugin.kvtier.module_path": "kvtier.integrations.lmcache",
                "storage_plugin.kvtier.class_name": "KvtierBackend",
                "kvtier.socket": str(socket),
                "kvtier.timeout": 1.0,
            },
        )
        self.backends = CreateStorageBackends(config, metadata(kv_shape), loop, "cpu")
        self.local = self.backends["LocalCPUBackend"]

    @property
    def ours(self) -> KvtierBackend:
        backend = self.backends["kvtier"]
        assert isinstance(backend, KvtierBackend), type(backend)
        return backend

    def chunk(self, seed: int, tokens: int = CHUNK) -> tuple[Any, bytes]:
        connector = self.ours.connector
        obj = self.local.allocate(connector.meta_shapes, connector.meta_dtypes, connector.meta_fmt)
        assert obj is not None
        view = memoryview(obj.byte_array).cast("B")
        data = os.urandom(len(view) * tokens // CHUNK)
        view[: len(data)] = data
        return connector.reshape_partial_chunk(obj, len(data)), data

    def store(self, keys: list[CacheEngineKey], objs: list[Any]) -> None:
        """As LMCache's storage manager stores: a put task, waited for here."""
        done: set[CacheEngineKey] = set()
        stored = threading.Event()

        def on_complete(k: CacheEngineKey) -> None:
            done.add(k)
            if len(done) == len(keys):
                stored.set()

        self.ours.batched_submit_put_task(keys, objs, on_complete_callback=on_complete)
        assert stored.wait(30)

    def close(self) -> None:
        for backend in self.backends.values():
            backend.close()


@pytest.fixture
def plugged(daemon: Daemon, lmcache_loop: Loop) -> Iterator[Plugged]:
    p = Plugged(lmcache_loop.loop, daemon.socket_path)
    yield p
    p.close()


def test_lmcache_builds_our_backend_and_it_loads_in_the_callers_thread(
    plugged: Plugged, lmcache_loop: Loop
) -> None:
    ours = plugged.ours
    assert isinstance(ours, RemoteBackend) and isinstance(ours.connector, KvtierConnector)
    full, full_bytes = plugged.chunk(1)
    part, part_bytes = plugged.chunk(2, tokens=100)
    plugged.store([key(1), key(2)], [full, part])
    # every reference the put took is given back (LMCache evicts a chunk
    # only when nothing holds it)
    assert full.get_ref_count() == part.get_ref_count() == 1
    full.ref_count_down()
    part.ref_count_down()
    assert ours.contains(key(1)) and not ours.contains(key(3))
    # LMCache's loop held up for the whole load: it is read in this thread.
    held, free = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        free.wait(30)

    lmcache_loop.loop.call_soon_threadsafe(hold)
    assert held.wait(30)
    try:
        got = ours.batched_get_blocking([key(1), key(2), key(3)])
        one = ours.get_blocking(key(1))
    finally:
        free.set()
    assert got[0] is not None and bytes_of(got[0]) == full_bytes
    assert got[1] is not None and bytes_of(got[1]) == part_bytes
    assert got[1].meta.shape[2] == 100  # the partial chunk's tokens restored
    assert got[2] is None
    assert one is not None and bytes_of(one) == full_bytes
    for obj in (got[0], got[1], one):
        obj.ref_count_down()
    reader = ours.reader
    assert reader is not None and reader.blocks_read == 3
    assert ours.connector.counts["loaded_bytes"] == 2 * len(full_bytes) + len(part_bytes)
    assert "DirectReader" in repr(ours)


def test_loads_read_as_misses_while_the_daemon_is_down_and_come_back_after(
    workdir: Path, lmcache_loop: Loop
) -> None:
    d = start_with_disk(workdir)
    plugged = Plugged(lmcache_loop.loop, d.socket_path)
    ours = plugged.ours
    try:
        obj, data = plugged.chunk(5)
        plugged.store([key(5)], [obj])
        got = ours.batched_get_blocking([key(5)])[0]
        assert got is not None
        got.ref_count_down()
        d.proc.kill()
        d.proc.wait(30)
        # Down: misses, no exception reaches the engine; the reader is gone
        # and the next loads go through LMCache's loop until it is dialled again.
        assert ours.batched_get_blocking([key(5), key(6)]) == [None, None]
        assert ours.reader is None
        assert ours.batched_get_blocking([key(5)]) == [None]
        # Back: stored again once the connector has dialled the daemon again
        # (each attempt is a round trip), then read in this thread again.
        d = start_with_disk(workdir)
        connector = ours.connector
        for _ in range(100_000):
            if lmcache_loop.run(connector.ping()) == 0:
                break
        plugged.store([key(5)], [obj])
        obj.ref_count_down()
        for _ in range(100_000):
            got = ours.batched_get_blocking([key(5)])[0]
            assert got is not None and bytes_of(got) == data
            got.ref_count_down()
            if ours.reader is not None:
                break
        reader = ours.reader
        assert reader is not None
        before = reader.blocks_read
        got = ours.batched_get_blocking([key(5)])[0]
        assert got is not None and bytes_of(got) == data
        assert reader.blocks_read == before + 1
        got.ref_count_down()
    finally:
        plugged.close()
        d.stop()

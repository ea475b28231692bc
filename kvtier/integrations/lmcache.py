"""kvtier behind LMCache: :class:`KvtierBackend` and its :class:`KvtierConnector`.

LMCache loads kvtier as a storage plugin; in the engine's LMCache config::

    storage_plugins: ["kvtier"]
    extra_config:
      storage_plugin.kvtier.module_path: kvtier.integrations.lmcache
      storage_plugin.kvtier.class_name: KvtierBackend
      kvtier.socket: /run/user/1000/kvtier/kvtier.sock   # optional
      kvtier.namespace: llama-3-8b                        # optional

The backend is LMCache's own ``RemoteBackend`` over the connector, except
that its loads are read in the engine's thread (no hop onto LMCache's
event loop and back). The connector alone also works as a remote storage
plugin (``remote_storage_plugins: ["kvtier"]`` with
``remote_storage_plugin.kvtier.module_path`` / ``class_name:
KvtierConnector``); its loads then run on LMCache's loop. (With that form,
do not also set ``remote_url: "plugin://kvtier"``: LMCache 0.5.6 would
build two backends and write every chunk twice.)

A chunk is stored as its bytes alone under a 32-byte key derived from
LMCache's key (and the namespace); a partial chunk's shape is restored from
its length, as LMCache's own file connector does. Loads land straight in
the ``MemoryObj`` LMCache allocates (no intermediate copy); stores send the
chunk's memory and return once the daemon has it (LMCache frees the
``MemoryObj`` as soon as ``put`` returns).

The promises of every kvtier integration: a lookup never waits longer than
its bound (``kvtier.timeout``, default 1 s; LMCache waits on ``contains``
without one); a PENDING block (another writer is storing it) reads as a
miss; the daemon down means misses and dropped stores, never an exception,
and the connection is dialled again with backoff. ``batched_async_contains``
is one LOOKUP in prefix mode tagged with LMCache's lookup id. The
connector runs on LMCache's event loop, the backend's loads in the
caller's thread; imports LMCache, torch and the kvtier client only.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
from lmcache.v1.storage_backend.connector.instrumented_connector import (
    InstrumentedRemoteConnector,
)
from lmcache.v1.storage_backend.remote_backend import RemoteBackend

from kvtier.backoff import Backoff
from kvtier.client import Client
from kvtier.client.direct import DirectReader
from kvtier.client.redial import Redial
from kvtier.errors import KvtierError
from kvtier.integrations.dialects import from_lmcache_tags
from kvtier.integrations.engine import block_key, engine_namespace
from kvtier.model import HIT, LookupMode, PutHint, Retention

log = logging.getLogger("kvtier.lmcache")

#: how long a lookup, and any one request, may take by default (seconds)
DEFAULT_TIMEOUT = 1.0
#: the name LMCache's config gives kvtier (``storage_plugins``)
PLUGIN = "kvtier"


def lmcache_namespace(local_cpu_backend: Any) -> str:
    """The model and KV layout LMCache runs with, as a daemon namespace."""
    meta = getattr(local_cpu_backend, "metadata", None)
    model = str(getattr(meta, "model_name", "") or "lmcache")
    layout = [getattr(meta, f, None) for f in ("kv_dtype", "kv_shape", "world_size", "use_mla")]
    return engine_namespace(model, *layout)


class KvtierConnector(RemoteConnector):
    """An LMCache ``RemoteConnector`` over a kvtier daemon's socket."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        local_cpu_backend: Any,
        config: Any,
        plugin_name: str | None = None,
    ) -> None:
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        extra: dict[str, Any] = dict(getattr(config, "extra_config", None) or {})
        socket = extra.get("kvtier.socket")
        self.socket_path: Path | None = Path(socket) if socket else None
        #: the daemon namespace of this engine's chunks: the model and its KV
        #: layout, unless the config names one
        self.namespace = str(extra.get("kvtier.namespace") or lmcache_namespace(local_cpu_backend))
        self.timeout = float(extra.get("kvtier.timeout", DEFAULT_TIMEOUT))
        #: the engine's prefill rate: each lookup's budget is the seconds
        #: recomputing its chunks would take (docs/lmcache.md); 0: no budget
        rate = float(extra.get("kvtier.recompute_tokens_per_second", 0.0))
        if rate < 0 or not math.isfinite(rate):
            raise ValueError("kvtier.recompute_tokens_per_second: a rate >= 0")
        chunk = int(getattr(config, "chunk_size", 256) or 256)
        self.recompute_seconds_per_chunk = chunk / rate if rate > 0 else 0.0
        self._redial = Redial(self._dial, what="kvtier daemon")
        #: what this connector did, for the engine's logs and the tests
        self.counts: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"<KvtierConnector {self.socket_path or 'default socket'} {self._redial!r}>"

    async def _dial(self) -> Client:
        return await Client.connect(
            self.socket_path, timeout=self.timeout, namespace=self.namespace
        )

    def _count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def key(self, key: CacheEngineKey) -> bytes:
        """The daemon's key for one of LMCache's: 32 bytes."""
        return block_key(key.to_string())

    # ------------------------------------------------------------ lookups

    async def exists(self, key: CacheEngineKey) -> bool:
        return await self.batched_async_contains("", [key]) == 1

    def exists_sync(self, key: CacheEngineKey) -> bool:
        future = asyncio.run_coroutine_threadsafe(self.exists(key), self.loop)
        try:
            return future.result(self.timeout * 2)
        except TimeoutError:
            future.cancel()
            return False

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(
        self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False
    ) -> int:
        """How many of ``keys``, from the first, the daemon can serve now."""
        if not keys:
            return 0
        try:
            client = await self._redial.client()
            reply = await client.lookup(
                [self.key(k) for k in keys],
                mode=LookupMode.PREFIX,
                request_tag=lookup_id.encode()[:255],
                budget=len(keys) * self.recompute_seconds_per_chunk,
                retention=_lease(keys[0]),
                timeout=self.timeout,
            )
        except KvtierError as exc:
            log.debug("lookup failed (%s): every key reads as a miss", exc)
            self._count("lookup_failures")
            return 0
        self._count("lookups")
        hits = reply.prefix_hits
        # Only HIT counts: a PENDING block is another writer's, not ours to wait for.
        raw = reply.raw_states
        return next((i for i in range(hits) if raw[i] != HIT), hits)

    # ------------------------------------------------------------ loads

    def _allocate(self, n: int) -> list[MemoryObj | None]:
        """``n`` chunks' buffers from LMCache's allocator: in one call where
        it has room for all without evicting (LMCache's ``batched_allocate``:
        one pass of its allocator for the batch; its eviction is written for
        a batch of one chunk's layers, not of chunks), else one by one, each
        evicting as LMCache's ``allocate`` does (None where none is left)."""
        backend = self.local_cpu_backend
        shapes, dtypes, fmt = self.meta_shapes, self.meta_dtypes, self.meta_fmt
        if n > 1 and hasattr(backend, "batched_allocate"):
            objs = backend.batched_allocate(shapes, dtypes, n, fmt, eviction=False)
            if objs is not None:
                return list(objs)
        return [backend.allocate(shapes, dtypes, fmt) for _ in range(n)]

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return (await self.batched_get([key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """Each chunk received straight into a ``MemoryObj``; None where missing."""
        objs = self._allocate(len(keys))
        wanted = [i for i, obj in enumerate(objs) if obj is not None]
        sizes: list[int | None] = [None] * len(keys)
        if not wanted:
            return self._landed(objs, sizes)
        try:
            client = await self._redial.client()
            got = await client.get_many_into(
                [self.key(keys[i]) for i in wanted],
                [_bytes_of(obj) for obj in objs if obj is not None],
                timeout=self.timeout,
            )
        except KvtierError as exc:
            log.debug("load failed (%s): every chunk reads as a miss", exc)
            self._count("load_failures")
        else:
            for i, size in zip(wanted, got, strict=True):
                sizes[i] = size
        return self._landed(objs, sizes)

    def batched_get_direct(
        self, reader: DirectReader, keys: list[CacheEngineKey]
    ) -> list[MemoryObj | None]:
        """:meth:`batched_get` in the calling thread, through ``reader``
        (:class:`KvtierBackend`'s loads): the chunks are asked for first,
        and LMCache's buffers taken while the daemon answers. A failed read
        closes the reader and reads as misses."""
        objs: list[MemoryObj | None] = []

        def buffers() -> list[memoryview | None]:
            objs.extend(self._allocate(len(keys)))
            return [None if obj is None else _bytes_of(obj) for obj in objs]

        try:
            sizes = reader.read_into([self.key(k) for k in keys], buffers)
        except KvtierError as exc:
            log.debug("load failed (%s): every chunk reads as a miss", exc)
            self._count("load_failures")
            sizes = [None] * len(objs)
        return self._landed(objs, sizes) if objs else [None] * len(keys)

    def _landed(
        self, objs: list[MemoryObj | None], sizes: Sequence[int | None]
    ) -> list[MemoryObj | None]:
        """The chunks a load filled (``sizes``: the bytes each buffer got,
        None for none), shaped as their lengths say; every other buffer
        given back to LMCache."""
        out: list[MemoryObj | None] = []
        for obj, size in zip(objs, sizes, strict=True):
            if obj is not None and size is not None:
                try:
                    out.append(self.reshape_partial_chunk(obj, size))
                except ValueError as exc:  # not a chunk of this engine's shape
                    log.warning("discarding a block of %d bytes: %s", size, exc)
                else:
                    self._count("loaded_bytes", size)
                    continue
            if obj is not None:
                obj.ref_count_down()
            out.append(None)
        return out

    # ------------------------------------------------------------ stores

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self.batched_put([key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        """Send the chunks and return once the daemon has every byte (LMCache
        frees them as soon as this returns). A failed store is dropped."""
        blobs = [_bytes_of(obj) for obj in memory_objs]
        # A partial chunk ends its request's prefix: no longer prompt shares it
        # (the next one carries more tokens in that chunk), so it goes first.
        hints = [
            PutHint.TAIL if len(b) < self.full_chunk_size_bytes else PutHint.NONE for b in blobs
        ]
        try:
            client = await self._redial.client()
            await client.put_many(
                [self.key(k) for k in keys],
                blobs,
                hints=hints,
                retention=_lease(keys[0]) if keys else None,
                timeout=self.timeout * 10,
            )
        except KvtierError as exc:
            log.debug("store of %d chunk(s) dropped: %s", len(keys), exc)
            self._count("store_failures")
            return
        self._count("stored_bytes", sum(len(b) for b in blobs))
        self._count("tail_chunks", sum(1 for h in hints if h))

    # ------------------------------------------------------------ the rest

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        try:
            await (await self._redial.client()).ping(timeout=self.timeout)
        except KvtierError:
            return 1
        return 0

    def remove_sync(self, key: CacheEngineKey) -> bool:
        async def remove() -> bool:
            client = await self._redial.client()
            return await client.delete(self.key(key), timeout=self.timeout)

        future = asyncio.run_coroutine_threadsafe(remove(), self.loop)
        try:
            return future.result(self.timeout * 2)
        except (KvtierError, TimeoutError):
            return False

    async def list(self) -> list[str]:
        return []  # the daemon does not enumerate its blocks

    async def close(self) -> None:
        await self._redial.close()


class KvtierBackend(RemoteBackend):
    """kvtier as an LMCache storage backend: LMCache's own ``RemoteBackend``
    over a :class:`KvtierConnector` (its lookups, stores, health checks and
    metrics), whose loads run in the caller's thread.

    LMCache calls a backend's ``batched_get_blocking`` from the engine's
    thread; a remote backend then hands the load to its event loop and
    waits for the result, two thread hand-offs a load that cost as much as
    copying a 256 KiB chunk. Here the load is read through a
    :class:`~kvtier.client.direct.DirectReader`, in that thread: the chunks
    land in LMCache's buffers by one copy each. Where the daemon offers no
    shared memory, or while it cannot be reached (dialled again after a
    backoff), loads take the connector's path through the loop."""

    #: LMCache's wrapper around the connector (:meth:`init_connection`)
    connection: RemoteConnector | None

    def __init__(
        self,
        config: Any,
        dst_device: str = "cpu",
        metadata: Any = None,
        local_cpu_backend: Any = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        if local_cpu_backend is None or loop is None:
            raise ValueError(
                "kvtier's LMCache backend needs LMCache's local CPU backend "
                "(local_cpu: true) and its event loop"
            )
        self._reader: DirectReader | None = None
        #: held while a reader is dialled: concurrent loads share one attempt
        self._dialling = threading.Lock()
        self._reader_backoff = Backoff()
        super().__init__(config, metadata, loop, local_cpu_backend, dst_device, plugin_name=PLUGIN)

    def __repr__(self) -> str:
        return f"<KvtierBackend {self._reader!r} {self._reader_backoff!r} {self.connection!r}>"

    def __str__(self) -> str:
        return "KvtierBackend"

    def init_connection(self) -> None:
        """The connector, wrapped as LMCache wraps a remote plugin's (its
        metrics, and the reference its serializer takes for a put, dropped
        once the put is done)."""
        if self.connection is None:
            self.connection = InstrumentedRemoteConnector(
                KvtierConnector(self.loop, self.local_cpu_backend, self.config)
            )

    @property
    def connector(self) -> KvtierConnector:
        connection = self.connection
        assert isinstance(connection, InstrumentedRemoteConnector), connection
        inner = connection.getWrappedConnector()
        assert isinstance(inner, KvtierConnector), inner
        return inner

    @property
    def reader(self) -> DirectReader | None:
        """The reader loads go through now; None: through LMCache's loop."""
        reader = self._reader
        return reader if reader is not None and not reader.closed else None

    def _direct(self) -> DirectReader | None:
        """The reader, dialled if there is none and the backoff allows; None:
        loads take the loop."""
        reader = self._reader
        if reader is not None and not reader.closed:
            return reader
        with self._dialling:
            reader = self._reader
            if reader is not None and not reader.closed:
                return reader
            self._reader = None
            now = time.monotonic()
            if now < self._reader_backoff.not_before:
                return None
            connector = self.connector
            try:
                reader = DirectReader.connect(
                    connector.socket_path, namespace=connector.namespace, timeout=connector.timeout
                )
            except KvtierError as exc:
                delay = self._reader_backoff.failed(now)
                log.info("loads go through the loop (%s); next attempt in %.2fs", exc, delay)
                return None
            self._reader_backoff.succeeded()
            self._reader = reader
            return reader

    def batched_get_blocking(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        reader = self._direct()
        if reader is None:
            return list(super().batched_get_blocking(keys))
        if self._mla_worker_id_as0_mode:
            keys = [key.with_new_worker_id(0) for key in keys]
        started = time.perf_counter()
        objs = self.connector.batched_get_direct(reader, keys)
        self.stats_monitor.update_interval_remote_time_to_get_sync(
            (time.perf_counter() - started) * 1000
        )
        if any(obj is None for obj in objs):
            self._get_blocking_failed_count += 1
        return [None if obj is None else self.deserializer.deserialize(obj) for obj in objs]

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        return self.batched_get_blocking([key])[0]

    def close(self) -> None:
        with self._dialling:
            reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()
        super().close()


def _lease(key: CacheEngineKey) -> Retention | None:
    """The retention lease the request's tags ask for (its keys carry them:
    kvtier/integrations/dialects.py); a malformed one is logged, and none."""
    try:
        return from_lmcache_tags(key.tags)
    except ValueError as exc:
        log.warning("the retention tags are ignored: %s", exc)
        return None


def _bytes_of(obj: MemoryObj) -> memoryview:
    """A chunk's memory as bytes (LMCache's ``byte_array`` needs a cast)."""
    return memoryview(obj.byte_array).cast("B")


__all__ = ["KvtierBackend", "KvtierConnector"]

"""kvtier as an LMCache remote backend: :class:`KvtierConnector`.

LMCache loads it as a remote storage plugin; in the engine's LMCache
config::

    remote_storage_plugins: ["kvtier"]
    extra_config:
      remote_storage_plugin.kvtier.module_path: kvtier.integrations.lmcache
      remote_storage_plugin.kvtier.class_name: KvtierConnector
      kvtier.socket: /run/user/1000/kvtier/kvtier.sock   # optional
      kvtier.namespace: llama-3-8b                        # optional

(Do not also set ``remote_url: "plugin://kvtier"``: LMCache 0.5.6 would
build two backends and write every chunk twice. The plugin list alone is
what registers the connector's class with LMCache.)

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
is one LOOKUP in prefix mode tagged with LMCache's lookup id. Runs on
LMCache's event loop; imports LMCache, torch and the kvtier client only.
"""

from __future__ import annotations

import asyncio
import logging
import math
from pathlib import Path
from typing import Any

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvtier.client import Client
from kvtier.client.redial import Redial
from kvtier.errors import KvtierError
from kvtier.integrations.engine import block_key, engine_namespace
from kvtier.model import HIT, LookupMode, PutHint

log = logging.getLogger("kvtier.lmcache")

#: how long a lookup, and any one request, may take by default (seconds)
DEFAULT_TIMEOUT = 1.0


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
        out: list[MemoryObj | None] = [None] * len(keys)
        if not wanted:
            return out
        try:
            client = await self._redial.client()
            sizes = await client.get_many_into(
                [self.key(keys[i]) for i in wanted],
                [_bytes_of(objs[i]) for i in wanted],
                timeout=self.timeout,
            )
        except KvtierError as exc:
            log.debug("load failed (%s): every chunk reads as a miss", exc)
            self._count("load_failures")
            sizes = [None] * len(wanted)
        for i, size in zip(wanted, sizes, strict=True):
            obj = objs[i]
            assert obj is not None
            if size is None:
                obj.ref_count_down()
                continue
            try:
                out[i] = self.reshape_partial_chunk(obj, size)
            except ValueError as exc:  # not a chunk of this engine's shape
                log.warning("discarding a block of %d bytes: %s", size, exc)
                obj.ref_count_down()
                continue
            self._count("loaded_bytes", size)
        for i, obj in enumerate(objs):
            if i not in wanted and obj is not None:
                obj.ref_count_down()
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
                [self.key(k) for k in keys], blobs, hints=hints, timeout=self.timeout * 10
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


def _bytes_of(obj: MemoryObj) -> memoryview:
    """A chunk's memory as bytes (LMCache's ``byte_array`` needs a cast)."""
    return memoryview(obj.byte_array).cast("B")


__all__ = ["KvtierConnector"]

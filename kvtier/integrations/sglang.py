"""kvtier as SGLang's HiCache storage (L3): :class:`KvtierStorage`.

SGLang builds it from its dynamic backend config::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{
        "backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang",
        "class_name": "KvtierStorage",
        "interface_v1": 1,
        "socket": "/run/user/1000/kvtier/kvtier.sock",
        "namespace": "llama-3-8b"}'

(``socket``, ``namespace``, ``timeout``, ``pending_wait`` and ``regions``
are optional; see docs/sglang.md.) With ``interface_v1`` SGLang calls
:meth:`~KvtierStorage.batch_get_v1` and :meth:`~KvtierStorage.batch_set_v1`
with host-pool indices: each page's buffers (K and V for MHA, one for MLA)
are resolved through the host pool and move straight between the pool's
memory and the daemon, one block per buffer, with no intermediate copy.
When the pool lives in memory files (``allocator: shm`` in the same extra
config: memfds), their descriptors are handed to the daemon once per
connection and the daemon reads stored pages out of them itself (regions:
nothing but keys and offsets cross the socket); ``"regions": false`` turns
that off. Loads take the daemon's shared memory either way (a lease and
one copy here), which measured faster than the daemon writing into the pool.

A page's blocks are named by SGLang's page hash, this rank's suffix (model,
tensor-, pipeline- and context-parallel rank, as SGLang's own file backend
keys its files; MLA pages are shared by the tensor-parallel ranks) and the
buffer's index, then hashed into the namespace (:func:`block_key`).

The promises of every kvtier integration: SGLang's controller threads never
wait on the daemon longer than ``timeout`` (default 1 s) plus, for
``batch_exists``, ``pending_wait``; ``batch_exists`` is one LOOKUP in prefix
mode in which a block another writer is still storing is waited for at most
``pending_wait`` (default 0.5 s, to be kept below SGLang's prefetch timeout)
and then reads as a miss; the daemon down means misses and failed stores,
never an exception, and the connection is dialled again with backoff.
Imports SGLang, torch, the kvtier client and its engine layer only.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvtier.client import Client
from kvtier.errors import KvtierError
from kvtier.integrations.dialects import from_sglang
from kvtier.integrations.engine import DaemonLink, Regions, block_key, engine_namespace
from kvtier.model import HIT, LookupMode, Retention

log = logging.getLogger("kvtier.sglang")

#: how long one request may take by default (seconds)
DEFAULT_TIMEOUT = 1.0
#: how long ``batch_exists`` waits for blocks another writer is storing
DEFAULT_PENDING_WAIT = 0.5
#: keys per DELETE when clearing
CLEAR_BATCH = 1024
#: what a failed call reads as: a miss, never an exception in SGLang's threads
FAILURES = (KvtierError, OSError, TimeoutError)


@dataclass(slots=True, frozen=True)
class PoolFile:
    """One memory file of the host pool: where it is mapped, and its descriptor."""

    address: int
    size: int
    fd: int


def pool_files(mem_pool_host: Any) -> list[PoolFile]:
    """The memory files the host pool lives in (SGLang's ``allocator: shm``),
    or none when it is ordinary process memory."""
    allocator = getattr(mem_pool_host, "allocator", None)
    fds = getattr(allocator, "fds", None) or []
    mms = getattr(allocator, "mms", None) or []
    files = []
    for fd, mm in zip(fds, mms, strict=False):
        if fd is None or not isinstance(mm, mmap.mmap):
            continue
        address = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        files.append(PoolFile(address, len(mm), fd))
    return files


def place_in(
    files: Sequence[PoolFile], ptrs: Sequence[int], sizes: Sequence[int]
) -> list[tuple[int, int, int]] | None:
    """Each buffer as (file index, offset, size), or None if one lies outside them."""
    out = []
    for ptr, size in zip(ptrs, sizes, strict=True):
        for i, f in enumerate(files):
            if f.address <= ptr and ptr + size <= f.address + f.size:
                out.append((i, ptr - f.address, size))
                break
        else:
            return None
    return out


_HEX = frozenset("0123456789abcdefABCDEF")


def event_hash(page: str) -> int | None:
    """SGLang's KV-event hash of the page named ``page`` (its page hash's first
    64 bits as a signed integer, as SGLang's ``hash_str_to_int64`` makes it),
    or None for a name that is not a page hash."""
    head = page[:16]
    if len(head) < 16 or not all(c in _HEX for c in head):
        return None
    value = int(head, 16)
    return value - (1 << 64) if value >= 1 << 63 else value


def sglang_namespace(config: HiCacheStorageConfig) -> str:
    """The model and the layout of its pages, as a daemon namespace (the
    ranks are told apart inside it, by :func:`rank_suffix`)."""
    return engine_namespace(config.model_name or "sglang", config.is_mla_model)


def rank_suffix(config: HiCacheStorageConfig) -> str:
    """What tells this rank's pages apart from another's with the same hash."""
    model = "-".join((config.model_name or "").split("/"))
    shard = f"_{config.pp_size}_{config.pp_rank}" if config.pp_size > 1 else ""
    if config.attn_cp_size > 1:
        shard += f"_cp{config.attn_cp_rank}_{config.attn_cp_size}"
    if config.is_mla_model:  # MLA pages are the same on every tensor-parallel rank
        return f"_{model}{shard}"
    return f"_{model}_{config.tp_rank}_{config.tp_size}{shard}"


def _view(address: int, size: int) -> memoryview:
    """``size`` bytes of the host pool at ``address``, without a copy."""
    return memoryview((ctypes.c_ubyte * size).from_address(address)).cast("B")


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError("kvtier reads and writes contiguous CPU tensors only")
    return _view(tensor.data_ptr(), tensor.numel() * tensor.element_size())


class KvtierStorage(HiCacheStorage):
    """A ``HiCacheStorage`` over a kvtier daemon's socket."""

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None
    ) -> None:
        extra: dict[str, Any] = dict(storage_config.extra_config or {})
        extra.update(kwargs or {})
        #: the daemon namespace of this engine's pages: the model and its
        #: layout, unless the config names one
        self.namespace = str(extra.get("namespace") or sglang_namespace(storage_config))
        self.timeout = float(extra.get("timeout", DEFAULT_TIMEOUT))
        self.pending_wait = float(extra.get("pending_wait", DEFAULT_PENDING_WAIT))
        if self.timeout <= 0 or self.pending_wait < 0:
            raise ValueError("kvtier: timeout must be > 0 and pending_wait >= 0")
        #: the engine's prefill rate: each lookup's budget is the seconds
        #: recomputing its pages would take (docs/sglang.md); 0: no budget
        self.recompute_tokens_per_second = float(extra.get("recompute_tokens_per_second", 0.0))
        if self.recompute_tokens_per_second < 0 or not math.isfinite(
            self.recompute_tokens_per_second
        ):
            raise ValueError("kvtier: recompute_tokens_per_second must be >= 0")
        self.suffix = rank_suffix(storage_config)
        self.metrics_enabled = bool(storage_config.enable_storage_metrics)
        #: SGLang calls the zero-copy page interface (else whole pages as tensors)
        self.zero_copy = bool(int(extra.get("interface_v1", 0)))
        self.link = DaemonLink(
            extra.get("socket"),
            timeout=self.timeout,
            name="kvtier-sglang",
            namespace=self.namespace,
        )
        self.mem_pool_host: Any = None
        #: buffers per page in the host pool (K and V: 2; MLA: 1)
        self.parts = 1
        #: hand the pool's memory files to the daemon, which then copies pages itself
        self.use_regions = bool(extra.get("regions", True))
        #: the host pool's memory files (none: pages go over the socket)
        self.files: list[PoolFile] = []
        #: the files as regions of the daemon's, per connection (touched on the
        #: link's loop thread only)
        self._regions = Regions()
        #: guards the counters and the metric lists: SGLang calls from several threads
        self._lock = threading.Lock()
        #: the blocks this backend stored: what ``clear`` deletes
        self._stored: set[bytes] = set()
        #: what this backend did, for the engine's logs and the tests
        self.counts: dict[str, int] = {}
        #: per batch since the last ``get_stats``: pages, and GB/s
        self._pages: dict[str, list[float]] = {"get": [], "set": []}
        self._bandwidth: dict[str, list[float]] = {"get": [], "set": []}

    def __repr__(self) -> str:
        return f"<KvtierStorage {self.suffix!r} parts={self.parts} {self.link!r}>"

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        if not self.zero_copy:
            return  # the tensor interface only: a page is one block
        page = torch.arange(mem_pool_host.page_size, dtype=torch.int64)
        ptrs, _ = mem_pool_host.get_page_buffer_meta(page)
        self.parts = len(ptrs)
        if self.use_regions:
            self.files = pool_files(mem_pool_host)

    def names(self, keys: Sequence[str], parts: int = 1) -> list[bytes]:
        """The daemon's keys of ``keys``' pages, ``parts`` blocks per page;
        each ends with SGLang's event hash of its page (:func:`event_hash`)."""
        out: list[bytes] = []
        for key in keys:
            name, h = key + self.suffix, event_hash(key)
            if parts == 1:
                out.append(block_key(name, h))
            else:
                out.extend(block_key(f"{name}#{j}", h) for j in range(parts))
        return out

    # ------------------------------------------------------------ lookups

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many of ``keys``' pages, from the first, the daemon holds whole."""
        if not keys:
            return 0
        names = self.names(keys, self.parts)

        budget = 0.0
        if self.recompute_tokens_per_second > 0:
            page = int(getattr(self.mem_pool_host, "page_size", 0) or 1)
            budget = len(keys) * page / self.recompute_tokens_per_second

        lease = self._lease(extra_info)

        async def lookup(client: Client) -> int:
            reply = await client.lookup(
                names,
                mode=LookupMode.PREFIX,
                wait=self.pending_wait,
                budget=budget,
                retention=lease,
                timeout=self.timeout,
            )
            raw = reply.raw_states  # only HIT counts: PENDING past the wait is a miss
            return next((i for i in range(reply.prefix_hits) if raw[i] != HIT), reply.prefix_hits)

        try:
            hits = self.link.call(lookup, self.timeout + self.pending_wait)
        except FAILURES as exc:
            log.debug("lookup failed (%s): every page reads as a miss", exc)
            self._count("lookup_failures")
            return 0
        self._count("lookups")
        return hits // self.parts

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ------------------------------------------------------------ zero-copy pages

    def _page_buffers(
        self, keys: Sequence[str], host_indices: torch.Tensor
    ) -> tuple[list[int], list[int]]:
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if len(ptrs) != len(keys) * self.parts:
            raise ValueError(
                f"{len(ptrs)} page buffers for {len(keys)} keys of {self.parts} buffers each"
            )
        return list(ptrs), list(sizes)

    async def _region_ids(self, client: Client) -> list[int] | None:
        """The pool's files as regions of ``client``'s connection (handed over
        once per connection); None when the daemon cannot take them."""
        before = self._regions.attached
        ids = await self._regions.ids(client, [f.fd for f in self.files], self.timeout)
        if self._regions.attached > before:
            self._count("regions_attached", self._regions.attached - before)
        return ids

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Each page received straight into the host pool; per page, whether it landed whole."""
        if not keys:
            return []
        # Loads take the daemon's shared memory (a lease, then one copy in this
        # process): measured twice as fast as the daemon writing into a memfd pool.
        ptrs, sizes = self._page_buffers(keys, host_indices)
        views = [_view(p, n) for p, n in zip(ptrs, sizes, strict=True)]
        return self._receive(self.names(keys, self.parts), views, self.parts)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Each page sent straight from the host pool; all True once the daemon has every byte."""
        if not keys:
            return []
        ptrs, sizes = self._page_buffers(keys, host_indices)
        names = self.names(keys, self.parts)
        places = place_in(self.files, ptrs, sizes) if self.files else None
        stored = self._put_in_place(names, places, len(keys)) if places is not None else None
        if stored is None:
            views = [_view(p, n) for p, n in zip(ptrs, sizes, strict=True)]
            stored = self._put(names, views, len(keys))
        lease = self._lease(extra_info)
        if lease is not None and any(stored):  # (however the pages went: one RETAIN)
            try:
                self.link.call(lambda c: c.retain(names, lease, timeout=self.timeout), self.timeout)
            except FAILURES as exc:
                log.debug("retain failed (%s): the pages are stored unleased", exc)
        return stored

    @staticmethod
    def _lease(extra_info: HiCacheStorageExtraInfo | None) -> Retention | None:
        """The call's retention lease (kvtier/integrations/dialects.py); a
        malformed one is logged and read as none."""
        try:
            return from_sglang(extra_info)
        except ValueError as exc:
            log.warning("the retention hint is ignored: %s", exc)
            return None

    # ------------------------------------------------------------ tensors (the older interface)

    def get(
        self,
        key: str,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> list[torch.Tensor | None]:
        """Each page received into its target tensor; None where missing."""
        if target_locations is None:
            raise ValueError("kvtier loads into the target tensors SGLang passes")
        views = self._page_parts(target_locations)
        landed = self._receive(self.names(keys, self.parts), views, self.parts)
        return [t if ok else None for t, ok in zip(target_locations, landed, strict=True)]

    def set(
        self,
        key: str,
        value: Any = None,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        if values is None:
            raise ValueError("kvtier stores the value tensors SGLang passes")
        views = self._page_parts(values)
        return all(self._put(self.names(keys, self.parts), views, len(keys)))

    def _page_parts(self, tensors: Any) -> list[memoryview]:
        """Each page tensor's bytes as the page's ``parts`` blocks, equal
        pieces in order: a page has the same block names (:meth:`names`)
        whichever interface stored it, so every lookup agrees on it."""
        parts = self.parts
        out: list[memoryview] = []
        for tensor in tensors:
            view = _tensor_bytes(tensor)
            size, rest = divmod(view.nbytes, parts)
            if rest:
                raise ValueError(
                    f"kvtier: a page of {view.nbytes} bytes does not split into its {parts} parts"
                )
            out.extend(view[i * size : (i + 1) * size] for i in range(parts))
        return out

    def _receive(self, names: list[bytes], views: list[memoryview], parts: int) -> list[bool]:
        """Blocks ``names`` received into ``views``, ``parts`` per page; per
        page, whether every part landed whole (all False if the call failed)."""
        pages = len(views) // parts
        started = time.perf_counter()
        try:
            sizes = self.link.call(lambda c: c.get_many_into(names, views, timeout=self.timeout))
        except FAILURES as exc:
            log.debug("load failed (%s): every page reads as a miss", exc)
            self._count("load_failures")
            return [False] * pages
        whole = [s == v.nbytes for s, v in zip(sizes, views, strict=True)]
        out = [all(whole[i * parts : (i + 1) * parts]) for i in range(pages)]
        nbytes = sum(v.nbytes for v, ok in zip(views, whole, strict=True) if ok)
        self._count("loaded_bytes", nbytes)
        self._observe("get", sum(out), nbytes, time.perf_counter() - started)
        return out

    def _put(self, names: list[bytes], views: list[memoryview], pages: int) -> list[bool]:
        started = time.perf_counter()
        try:
            self.link.call(lambda c: c.put_many(names, views, timeout=self.timeout))
        except FAILURES as exc:
            log.debug("store of %d page(s) dropped: %s", pages, exc)
            self._count("store_failures")
            return [False] * pages
        return self._stored_now(names, sum(v.nbytes for v in views), pages, started)

    def _stored_now(
        self, names: list[bytes], nbytes: int, pages: int, started: float
    ) -> list[bool]:
        """Bookkeeping of a store the daemon took: what ``clear`` deletes, counts, metrics."""
        with self._lock:
            self._stored.update(names)
        self._count("stored_bytes", nbytes)
        self._observe("set", pages, nbytes, time.perf_counter() - started)
        return [True] * pages

    # ------------------------------------------------------------ regions: the daemon copies

    async def _store_in_place(
        self, client: Client, names: list[bytes], places: list[tuple[int, int, int]]
    ) -> bool:
        """One PUT_REGION per pool file; False when the daemon takes no region."""
        ids = await self._region_ids(client)
        if ids is None:
            return False
        for f, region in enumerate(ids):
            mine = [i for i, (which, _, _) in enumerate(places) if which == f]
            if mine:
                keys = [names[i] for i in mine]
                spans = [(places[i][1], places[i][2]) for i in mine]
                await client.put_region(region, keys, spans, timeout=self.timeout)
        return True

    def _put_in_place(
        self, names: list[bytes], places: list[tuple[int, int, int]], pages: int
    ) -> list[bool] | None:
        """Pages the daemon reads out of the pool itself; None when it takes no
        region (the caller goes over the socket)."""
        started = time.perf_counter()
        try:
            taken = self.link.call(lambda c: self._store_in_place(c, names, places))
        except FAILURES as exc:
            log.debug("store of %d page(s) dropped: %s", pages, exc)
            self._count("store_failures")
            return [False] * pages
        if not taken:
            return None
        return self._stored_now(names, sum(p[2] for p in places), pages, started)

    # ------------------------------------------------------------ the rest

    def clear(self) -> None:
        """Delete every block this backend stored (SGLang's
        ``clear_hicache_storage_backend``). Blocks other engines stored, even
        under the same names, are theirs to drop: the daemon is shared."""
        with self._lock:
            names, self._stored = list(self._stored), set()
        for start in range(0, len(names), CLEAR_BATCH):
            batch = names[start : start + CLEAR_BATCH]

            async def delete(client: Client, batch: list[bytes] = batch) -> list[bool]:
                return await client.delete_many(batch, timeout=self.timeout)

            try:
                self.link.call(delete)
            except FAILURES as exc:
                log.warning("clear: %d block(s) left in the daemon: %s", len(names) - start, exc)
                with self._lock:
                    self._stored.update(names[start:])
                return
        self._count("cleared", len(names))

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (None unless its
        storage metrics are on)."""
        if not self.metrics_enabled:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        metrics = StorageMetrics()
        with self._lock:
            metrics.prefetch_pgs.extend(int(n) for n in self._pages["get"])
            metrics.backup_pgs.extend(int(n) for n in self._pages["set"])
            metrics.prefetch_bandwidth.extend(self._bandwidth["get"])
            metrics.backup_bandwidth.extend(self._bandwidth["set"])
            for series in (*self._pages.values(), *self._bandwidth.values()):
                series.clear()
        return metrics

    def close(self) -> None:
        self.link.close()

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] = self.counts.get(name, 0) + n

    def _observe(self, what: str, pages: int, nbytes: int, seconds: float) -> None:
        if not self.metrics_enabled:
            return
        with self._lock:
            self._pages[what].append(pages)
            self._bandwidth[what].append(nbytes / max(seconds, 1e-9) / 1e9)


__all__ = ["KvtierStorage", "PoolFile", "place_in", "pool_files", "rank_suffix"]

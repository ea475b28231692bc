"""The test's own part of LMCache on vLLM's CPU build: the copy between
vLLM's paged KV cache and LMCache's chunks.

LMCache 0.5.6 moves a chunk between the engine's KV cache and its own
buffers with a device connector (``CreateGPUConnector``) and ships one for
CUDA, XPU, MUSA and HPU, none for the CPU: on vLLM's CPU build it logs
``RuntimeError: No supported cpu connector found.`` and runs degraded
(everything recomputed). ``CpuPagedConnector`` is that copy, with tensor
indexing, between vLLM's CPU attention layout (per layer ``[blocks, heads,
2 * block_size, head_size]``: a block's keys, then its values) and
LMCache's ``KV_2LTD`` chunks (``[2, layers, tokens, heads * head_size]``).
vLLM loads ``CpuLMCacheConnector``: its own ``LMCacheConnectorV1``, with
LMCache made to build that copy, and its cache engine closed with vLLM's
(vLLM 0.32 does not pass its connector's shutdown on to LMCache). Everything else is
LMCache's (its connector, cache engine, CPU backend, storage-plugin loading)
and kvtier's (its LMCache backend).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1


class CpuPagedConnector:
    """LMCache's ``GPUConnectorInterface``, by its methods (LMCache is imported
    only once vLLM's worker has started: imported before, it trips vLLM's
    kernel rebinding)."""

    def __init__(self, num_layers: int, hidden: int) -> None:
        self.num_layers = num_layers
        self.hidden = hidden
        self.kvcaches: list[torch.Tensor] | None = None

    def initialize_kvcaches_ptr(self, **kwargs: Any) -> None:
        if "kvcaches" in kwargs:
            self.kvcaches = kwargs["kvcaches"]

    def _token_major(self, **kwargs: Any) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Each layer as a ``[2, blocks, block_size, heads, head_size]`` view,
        and the slots of ``kwargs``' slot mapping."""
        self.initialize_kvcaches_ptr(**kwargs)
        assert self.kvcaches is not None, "no KV caches registered"
        views = []
        for kv in self.kvcaches:
            # [blocks, heads, block_size, 2 * head_size] holding, per block
            # and head, the block's keys then its values (cpu_attn.py)
            blocks, heads, size, twice = kv.shape
            assert heads * twice == 2 * self.hidden, kv.shape
            split = kv.view(blocks, heads, 2, size, twice // 2)
            views.append(split.permute(2, 0, 3, 1, 4))  # [2, blocks, block_size, heads, head_size]
        return views, kwargs["slot_mapping"]

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        views, slots = self._token_major(**kwargs)
        where = slots[start:end]
        for layer, kv in enumerate(views):
            size = kv.shape[2]
            picked = kv[:, where // size, where % size]  # [2, tokens, heads, head_size]
            memory_obj.tensor[:, layer].copy_(picked.reshape(2, end - start, self.hidden))
        memory_obj.metadata.fmt = KV_2LTD()

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        views, slots = self._token_major(**kwargs)
        assert memory_obj.metadata.fmt == KV_2LTD(), memory_obj.metadata.fmt
        where = slots[start:end]
        for layer, kv in enumerate(views):
            size = kv.shape[2]
            chunk = memory_obj.tensor[:, layer].reshape(2, end - start, kv.shape[3], kv.shape[4])
            kv[:, where // size, where % size] = chunk

    def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, start, end, **kwargs)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.hidden])


def KV_2LTD() -> Any:
    from lmcache.v1.memory_management import MemoryFormat

    return MemoryFormat.KV_2LTD


def _create(config: Any, metadata: Any, engine: Any, layout_hints: Any = None) -> CpuPagedConnector:
    layers, _, _, heads, dim = metadata.kv_shape
    return CpuPagedConnector(layers, heads * dim)


class CpuLMCacheConnector(LMCacheConnectorV1):  # type: ignore[misc]
    """vLLM's LMCache connector, its device copies made by ``CpuPagedConnector``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from lmcache.v1 import gpu_connector

        gpu_connector.CreateGPUConnector = _create
        super().__init__(*args, **kwargs)

    def shutdown(self) -> None:
        # vLLM 0.32's LMCacheConnectorV1 does not pass its shutdown on to
        # LMCache, whose storage thread then keeps the engine's process
        # alive; LMCache's own whole shutdown aborts in ZeroMQ closing its
        # offload server (src/signaler.cpp:238), so only its cache engines
        # (their storage and kvtier's connector) are closed
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        for instance in list(LMCacheEngineBuilder._instances):
            LMCacheEngineBuilder.destroy(instance)

"""Scenario 3: vLLM's real v1 Scheduler and OffloadingConnector over kvtier.

Two engines share one kvtier daemon. Each is vLLM's own ``Scheduler`` with
the ``OffloadingConnector`` built from ``kv_connector_extra_config`` alone
(``TieringOffloadingSpec``: the CPU primary tier in its shared region, and
kvtier as the secondary tier). Only the worker is simulated, as vLLM's unit
tests do: a "GPU" KV cache in host memory, a forward pass that writes bytes
derived from the engine and the token prefix into each computed token slot,
and transfers that copy between those blocks and the primary region's rows.

Engine A serves a prompt; its blocks reach kvtier through vLLM's store path.
Engine B, cold, serves a prompt sharing that prefix: vLLM's lookup finds the
prefix in kvtier, promotes it into B's primary region and loads it into B's
GPU blocks. The test checks that B computed only the tail, that the prefix
bytes in B's GPU cache are A's bytes (A's engine tag), and the daemon's
counters.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from tests.vllm.conftest import MODEL, Daemon

BLOCK_TOKENS = 16
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
KV_HEADS = 2
HEAD_SIZE = 16
GPU_BLOCKS = 64
# k and v, per layer, float32
BLOCK_BYTES = 2 * BLOCK_TOKENS * KV_HEADS * HEAD_SIZE * 4 * len(LAYERS)
TOKEN_BYTES = BLOCK_BYTES // BLOCK_TOKENS
MAX_STEPS = 100


def token_kv(engine: bytes, prefix: list[int]) -> bytes:
    """What the simulated forward pass writes for the last token of prefix."""
    digest = hashlib.blake2b(np.asarray(prefix, dtype=np.int64).tobytes(), digest_size=31)
    return (engine + digest.digest()) * (TOKEN_BYTES // 32)


@dataclass
class Engine:
    """vLLM's scheduler with a simulated worker beside it."""

    tag: bytes
    scheduler: Scheduler
    gpu: np.ndarray  # (GPU_BLOCKS, BLOCK_BYTES): the worker's KV cache
    # Tokens each request had scheduled for computation, step by step.
    computed: dict[str, list[int]] = field(default_factory=dict)
    # The GPU blocks each request was given.
    blocks: dict[str, list[int]] = field(default_factory=dict)
    loaded_jobs: int = 0
    stored_jobs: int = 0

    @property
    def manager(self) -> TieringOffloadingManager:
        connector = self.scheduler.connector
        assert isinstance(connector, OffloadingConnector)
        manager = connector.scheduler.manager
        assert isinstance(manager, TieringOffloadingManager)
        return manager

    def kvtier(self) -> Any:
        (tier,) = self.manager.secondary_tiers
        return tier

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        assert isinstance(meta, OffloadingConnectorMetadata)
        report = OffloadingWorkerMetadata()
        received: set[str] = set()
        for job_id, job in meta.load_jobs.items():
            self._copy(job.src_spec.block_ids, job.dst_spec.block_ids, to_gpu=True)
            report.mark_completed(job_id)
            self.loaded_jobs += 1
            if not job.sync:
                received.add(job.req_id)
        sampled = self._forward(out)
        for job_id, job in meta.store_jobs.items():
            self._copy(job.dst_spec.block_ids, job.src_spec.block_ids, to_gpu=False)
            report.mark_completed(job_id)
            self.stored_jobs += 1
        req_ids = list(out.num_scheduled_tokens)
        self.scheduler.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=[sampled.get(r, []) for r in req_ids],
                kv_connector_output=KVConnectorOutput(
                    finished_recving=received, kv_connector_worker_meta=report
                ),
            ),
        )
        return out

    def _copy(self, chunk_ids: Any, block_ids: Any, *, to_gpu: bool) -> None:
        rows = np.asarray(self.manager.primary_tier.get_kv_memoryview())
        try:
            for chunk, block in zip(chunk_ids.tolist(), block_ids.tolist(), strict=True):
                if to_gpu:
                    self.gpu[block] = rows[chunk, :BLOCK_BYTES]
                else:
                    rows[chunk, :BLOCK_BYTES] = self.gpu[block]
        finally:
            del rows  # no view of vLLM's region outlives the transfer

    def _forward(self, out: SchedulerOutput) -> dict[str, list[int]]:
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        sampled: dict[str, list[int]] = {}
        for req_id, count in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            tokens = request.all_token_ids
            (block_ids,) = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            self.blocks[req_id] = list(block_ids)
            start = starts[req_id]
            for pos in range(start, start + count):
                block, slot = divmod(pos, BLOCK_TOKENS)
                view = self.gpu[block_ids[block], slot * TOKEN_BYTES : (slot + 1) * TOKEN_BYTES]
                view[:] = np.frombuffer(token_kv(self.tag, tokens[: pos + 1]), np.uint8)
            self.computed.setdefault(req_id, []).append(count)
            if start + count >= request.num_prompt_tokens:
                sampled[req_id] = [7]
        return sampled

    def serve(self, request: Request) -> None:
        """Run steps until the request is done and its stores have landed."""
        self.scheduler.add_request(request)
        connector = self.scheduler.connector
        assert isinstance(connector, OffloadingConnector)
        for _ in range(MAX_STEPS):
            if not self.scheduler.has_requests() and not connector.has_pending_push_work():
                break
            out = self.step()
            if not out.num_scheduled_tokens:
                # Nothing to run: vLLM waits on the tier's answers; wait for
                # them rather than spin (tests only).
                self.kvtier().drain_jobs()
        else:
            pytest.fail(f"engine {self.tag!r} did not finish in {MAX_STEPS} steps")
        self.kvtier().drain_jobs()

    def token_bytes(self, request: Request, pos: int) -> bytes:
        block, slot = divmod(pos, BLOCK_TOKENS)
        row = self.gpu[self.blocks[request.request_id][block]]
        return bytes(row[slot * TOKEN_BYTES : (slot + 1) * TOKEN_BYTES])


_ids = itertools.count()


def make_request(tokens: list[int]) -> Request:
    params = SamplingParams(max_tokens=1)
    params.update_from_generation_config({}, 2)
    return Request(
        request_id=f"req-{next(_ids)}",
        prompt_token_ids=tokens,
        sampling_params=params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK_TOKENS, sha256),
    )


def make_engine(tag: bytes, daemon: Daemon, model: Path) -> Engine:
    config = VllmConfig(
        model_config=ModelConfig(model=MODEL, skip_tokenizer_init=True, dtype="float32"),
        scheduler_config=SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=64,  # chunked prefill: several steps per prompt
            max_model_len=2048,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK_TOKENS, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            engine_id=f"kvtier-test-{tag.decode()}-{next(_ids)}",
            # Everything the operator writes to turn kvtier on:
            kv_connector_extra_config={
                "spec_name": "TieringOffloadingSpec",
                "cpu_bytes_to_use": 64 * BLOCK_BYTES,
                "tier_poll_interval_s": 0,  # service tiers per step: deterministic
                "secondary_tiers": [
                    {
                        "type": "KvtierTier",
                        "module_path": "kvtier.integrations.vllm",
                        "socket_path": str(daemon.socket_path),
                        "namespace": "tiny-llama/fp32/page16/",
                    }
                ],
            },
        ),
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks = GPU_BLOCKS
    kv_cache_config = KVCacheConfig(
        num_blocks=GPU_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                list(LAYERS),
                FullAttentionSpec(
                    block_size=BLOCK_TOKENS,
                    num_kv_heads=KV_HEADS,
                    head_size=HEAD_SIZE,
                    dtype=torch.float32,
                ),
            )
        ],
    )
    scheduler = Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK_TOKENS,
        log_stats=True,
    )
    return Engine(tag, scheduler, np.zeros((GPU_BLOCKS, BLOCK_BYTES), np.uint8))


@pytest.fixture
def engines(
    daemon: Daemon, hf_model: Path, caplog: pytest.LogCaptureFixture
) -> Iterator[tuple[Engine, Engine]]:
    init_none_hash(sha256)
    a = make_engine(b"A", daemon, hf_model)
    b = make_engine(b"B", daemon, hf_model)
    yield a, b
    for engine in (a, b):
        engine.scheduler.shutdown()
    # vLLM unmaps and removes its shared region only if no tier still holds
    # a view of it.
    kept = [r.getMessage() for r in caplog.records if "Keeping" in r.getMessage()]
    assert kept == []


def test_second_engine_loads_the_shared_prefix_from_kvtier(
    engines: tuple[Engine, Engine], daemon: Daemon
) -> None:
    a, b = engines
    prefix = [100 + i for i in range(6 * BLOCK_TOKENS)]  # 6 full blocks
    first = make_request(prefix + [900 + i for i in range(20)])
    second = make_request(prefix + [500 + i for i in range(40)])

    a.serve(first)
    assert a.loaded_jobs == 0 and a.stored_jobs > 0
    # A's 7 full blocks went to kvtier through vLLM's store and cascade: read
    # by the daemon from vLLM's shared CPU-tier file (a region), else sent.
    assert daemon.total("kvtier_requests_total", op="put_region", outcome="ok") > 0
    stored = daemon.total("kvtier_received_bytes_total") + daemon.total(
        "kvtier_shared_region_bytes_total", direction="in"
    )
    assert stored >= 7 * BLOCK_BYTES
    sent_before = daemon.total("kvtier_sent_bytes_total")

    b.serve(second)
    # B computed only what follows the shared prefix ...
    assert sum(b.computed[second.request_id]) == len(second.prompt_token_ids) - len(prefix)
    assert b.loaded_jobs >= 1
    # ... and its GPU cache holds A's bytes for the prefix, its own after it.
    tokens = second.prompt_token_ids
    assert tokens is not None
    for pos in range(len(tokens)):
        engine = b"A" if pos < len(prefix) else b"B"
        assert b.token_bytes(second, pos) == token_kv(engine, tokens[: pos + 1]), pos
    # The prefix crossed the daemon's socket once: 6 blocks, not recomputed.
    assert daemon.total("kvtier_sent_bytes_total") - sent_before >= 6 * BLOCK_BYTES
    # Nothing is left in flight at the daemon: A's stores were reserved and
    # completed; no probe is running and both requests' tags are released.
    granted = daemon.total("kvtier_reservations_total", event="granted")
    assert granted == daemon.total("kvtier_reservations_total", event="completed") > 0
    assert daemon.total("kvtier_probes_inflight") == 0
    assert daemon.total("kvtier_request_states") == 0

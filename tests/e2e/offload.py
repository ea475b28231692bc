"""The test's part of the vLLM path: vLLM's own tiering spec with a worker
that copies blocks with plain memory copies.

On a CPU, vLLM refuses its CPU offload (``CPU Offloading is currently only
supported on CUDA-alike and XPU GPUs``) and its copy worker needs CUDA
streams, events and ``swap_blocks_batch``. Both caches are host memory
here, so :class:`CopyWorker` copies a block's bytes between vLLM's KV cache
and the primary tier's shared region with one memory copy per run of
consecutive blocks (``copy_``), as the GPU's copy engine would. Everything else
(the scheduler, the OffloadingConnector, the tiering manager, its primary
tier, kvtier's secondary tier) is vLLM's and kvtier's own code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


def _runs(from_ids: Sequence[int], to_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """The copies as (from, to, count) runs of consecutive blocks on both sides."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(from_ids, to_ids, strict=True):
        s, d = int(s), int(d)
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


class CopyWorker(OffloadingWorker):
    """Whole blocks between the engine's KV cache and the primary tier's
    region, one copy per KV tensor, done when submitted."""

    def __init__(
        self, device: list[torch.Tensor], host: list[torch.Tensor], region: SharedOffloadRegion
    ) -> None:
        self.device, self.host, self.region = device, host, region
        self.finished: list[TransferResult] = []

    def _copy(
        self,
        job_id: int,
        src: list[torch.Tensor],
        dst: list[torch.Tensor],
        from_ids: Sequence[int],
        to_ids: Sequence[int],
    ) -> bool:
        runs = _runs(from_ids, to_ids)
        nbytes = 0
        for a, b in zip(src, dst, strict=True):
            for s, d, n in runs:  # (one memory copy per run, as a DMA engine moves it)
                b[d : d + n].copy_(a[s : s + n])
            nbytes += a.shape[1] * len(from_ids)
        self.finished.append(TransferResult(job_id, True, nbytes, 0.0))
        return True

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        assert len(src_spec.group_sizes) == 1, "one KV cache group"
        return self._copy(job_id, self.device, self.host, src_spec.block_ids, dst_spec.block_ids)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        assert len(dst_spec.group_sizes) == 1, "one KV cache group"
        return self._copy(job_id, self.host, self.device, src_spec.block_ids, dst_spec.block_ids)

    def get_finished(self) -> list[TransferResult]:
        out, self.finished = self.finished, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        pass  # every copy is done when it is submitted

    def shutdown(self) -> None:
        self.region.cleanup()


class CpuTieringSpec(TieringOffloadingSpec):
    """vLLM's TieringOffloadingSpec, its worker a :class:`CopyWorker`
    (offloaded blocks the size of the engine's: one block per chunk)."""

    _copy_worker: CopyWorker | None = None

    def get_worker(self, kv_caches: Any) -> OffloadingWorker:
        if self._copy_worker is None:
            assert self.blocks_per_chunk == 1, "the copy worker copies whole engine blocks"
            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=0,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            device, host = [], []
            for t in kv_caches.tensors:
                device.append(t.tensor.view(torch.int8).view(-1, t.page_size_bytes))
                host.append(region.create_next_worker_view(t.page_size_bytes))
            self._copy_worker = CopyWorker(device, host, region)
        return self._copy_worker

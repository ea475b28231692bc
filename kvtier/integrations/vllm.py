"""kvtier as a secondary offload tier of vLLM (``vllm.v1.kv_offload.tiering``).

Turn it on in vLLM's offloading config (``kv_connector_extra_config``)::

    {"type": "KvtierTier", "module_path": "kvtier.integrations.vllm",
     "socket_path": "/run/kvtier/kvtier.sock"}

The tier's blocks live in a daemon namespace named after the model and a
hash of its KV layout (``namespace`` names another), so two models never
share blocks and each can have its quota (docs/tenancy.md).

Everything here runs in vLLM's scheduler process and never blocks it: the
answers, jobs and reconnects are :class:`~kvtier.integrations.engine.EngineTier`'s.
kvtier HIT is vLLM HIT, MISS is MISS, PENDING and RETRY are RETRY (ask again
next step); a key whose ``max_pending_wait`` ran out answers MISS. Loads land
in the primary tier's rows, stores are sent from them; a failed load's keys
answer MISS from then on, so vLLM never loops on a promotion that cannot be
delivered. Imports vLLM (only here) and kvtier's client side.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvtier.integrations.dialects import from_vllm
from kvtier.integrations.engine import Answer, EngineTier, RemovalWatch, Rows, engine_namespace
from kvtier.model import Retention

log = logging.getLogger("kvtier.vllm")

#: vLLM metric name -> (our count's name, or a prefix of names by label), doc, labels
_METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "vllm:kv_offload_kvtier_lookups": (
        "lookup_",
        "Lookups answered by the kvtier tier, by answer (hit, miss, retry)",
        ("answer",),
    ),
    "vllm:kv_offload_kvtier_load_bytes": ("load_bytes", "Bytes loaded from kvtier", ()),
    "vllm:kv_offload_kvtier_store_bytes": ("store_bytes", "Bytes stored to kvtier", ()),
    "vllm:kv_offload_kvtier_load_failures": (
        "load_failures",
        "Load jobs from kvtier that did not deliver every block",
        (),
    ),
    "vllm:kv_offload_kvtier_store_failures": (
        "store_failures",
        "Store jobs to kvtier that failed",
        (),
    ),
}

_ANSWERS = {
    Answer.HIT: LookupResult.HIT,
    Answer.MISS: LookupResult.MISS,
    Answer.RETRY: LookupResult.RETRY,
}


def vllm_namespace(spec: Any) -> str:
    """The model and the KV layout of its blocks, as a daemon namespace; the
    default namespace where vLLM gives no offloading config (tests)."""
    config = getattr(spec, "config", None)
    if config is None:
        return ""
    parallel = config.parallel
    return engine_namespace(
        config.model.name,
        config.model.dtype,
        [g.tokens_per_block for g in config.groups],
        config.worker_kv_bytes_per_block,
        (parallel.tp_size, parallel.pp_size, parallel.pcp_size, parallel.dcp_size),
        config.kv_cache_layout,
    )


def vllm_tokens_per_block(spec: Any) -> int:
    """The tokens one offloaded block holds (vLLM's own block size without
    an offloading config: tests)."""
    config = getattr(spec, "config", None)
    if config is None or not config.groups:
        return int(getattr(spec, "block_size", 16) or 16)
    return int(config.groups[0].tokens_per_block)


class KvtierTier(SecondaryTierManager):
    """A vLLM secondary tier backed by the local kvtier daemon."""

    medium: ClassVar[Medium] = Medium.CPU

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        *,
        socket_path: str | None = None,
        namespace: str = "",
        max_pending_wait: float = 2.0,
        timeout: float = 10.0,
        reserve_stores: bool = True,
        failed_ttl: float = 30.0,
        enable_kv_events: bool = False,
        locality: str | None = None,
        regions: bool = True,
        recompute_tokens_per_second: float = 0.0,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise ValueError(f"unknown kvtier tier setting(s): {sorted(unknown)}")
        super().__init__(
            offloading_spec=offloading_spec,
            primary_kv_view=primary_kv_view,
            tier_type=tier_type,
            backpressure_detector=backpressure_detector,
        )
        #: the primary region as bytes: row ``i`` is [i * block, (i + 1) * block)
        self._flat = primary_kv_view.cast("B") if primary_kv_view.ndim != 1 else primary_kv_view
        self._engine = EngineTier(
            socket_path,
            namespace=namespace or vllm_namespace(offloading_spec),
            max_pending_wait=max_pending_wait,
            timeout=timeout,
            reserve_stores=reserve_stores,
            failed_ttl=failed_ttl,
            regions=regions,
            recompute_seconds_per_block=vllm_tokens_per_block(offloading_spec)
            / recompute_tokens_per_second
            if recompute_tokens_per_second > 0
            else 0.0,
        )
        #: KV events for vLLM's stream (``enable_kv_events``, as vLLM's fs tier
        #: takes it): stores as they finish; removals as the daemon reports them
        self._events: list[OffloadingEvent] | None = None
        #: the daemon's event stream this tier follows, while events are on
        self.removal_watch: RemovalWatch | None = None
        self.locality = Locality(locality) if locality is not None else None
        if enable_kv_events:
            config = getattr(offloading_spec, "kv_events_config", None)
            if config is not None and not config.enable_kv_cache_events:
                log.warning(
                    "enable_kv_events is set on tier %r but KV cache events are off "
                    "globally; the tier emits none",
                    tier_type,
                )
            else:
                self._events = []
                self.removal_watch = self._engine.watch_removals()
        #: jobs submitted and not reported yet
        self._jobs: dict[int, TransferJob] = {}
        #: the engine tier's counts when get_stats last reported them
        self._reported: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"<KvtierTier jobs={len(self._jobs)} {self._engine!r}>"

    def _rows(self, job: TransferJob) -> Rows:
        size = self.block_size_bytes
        ids = job.chunk_ids
        chunks = ids.tolist() if hasattr(ids, "tolist") else [int(c) for c in ids]
        return Rows(self._flat, [c * size for c in chunks], size)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        lease = _lease_of(req_context)
        return _ANSWERS[self._engine.lookup(req_context.req_id, bytes(key), lease)]

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._jobs[job_metadata.job_id] = job_metadata
        keys = [bytes(k) for k in job_metadata.keys]
        lease = _lease_of(job_metadata.req_context)
        self._engine.store(job_metadata.job_id, keys, self._rows(job_metadata), lease)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._jobs[job_metadata.job_id] = job_metadata
        keys = [bytes(k) for k in job_metadata.keys]
        self._engine.load(job_metadata.job_id, keys, self._rows(job_metadata).views())

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        for done in self._engine.finished():
            job = self._jobs.pop(done.job_id, None)
            if job is None:
                continue
            successful = None
            if job.is_promotion and not done.ok:
                loaded = set(done.loaded)
                successful = [k for k in job.keys if bytes(k) in loaded]
                self._engine.mark_failed([bytes(k) for k in job.keys if bytes(k) not in loaded])
            if self._events is not None and done.ok and not job.is_promotion:
                self._events.append(self._event(list(job.keys), removed=False))
            results.append(
                JobResult(
                    job_id=done.job_id,
                    success=done.ok,
                    successful_keys=successful,
                    transfer_time=done.seconds,
                    transfer_bytes=done.bytes,
                )
            )
        return results

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Blocks stored to kvtier since the last call, then blocks the daemon
        no longer holds (evicted from its last local tier, or deleted), all
        with medium STORAGE; stores are marked ``removal_expected`` so vLLM's
        tracker keeps them self-describing after the CPU tier lets them go."""
        if self._events is None:
            return []
        out, self._events = self._events, []
        gone = self._engine.removed()
        if gone:
            out.append(self._event([OffloadKey(k) for k in gone], removed=True))
        return out

    def _event(self, keys: list[OffloadKey], *, removed: bool) -> OffloadingEvent:
        return OffloadingEvent(
            keys=keys,
            medium=Medium.STORAGE,
            removed=removed,
            locality=self.locality,
            ownership=self.tier_type,
            removal_expected=not removed,
        )

    def has_pending_work(self) -> bool:
        return bool(self._jobs)

    def drain_jobs(self) -> None:
        self._engine.drain()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._engine.request_finished(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._engine.flush()

    def shutdown(self) -> None:
        self._engine.close()
        # vLLM unmaps its shared region at shutdown only if no view of it is
        # left; the jobs' row views went with the jobs, this is the last one.
        self._flat.release()

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        return {
            name: OffloadingCounterMetadata(doc, labels)
            for name, (_, doc, labels) in _METRICS.items()
        }

    def get_stats(self) -> OffloadingConnectorStats | None:
        """What the tier counted since the last call, as vLLM's counters."""
        counts = dict(self._engine.counts)
        stats = OffloadingConnectorStats()
        for name, (ours, _, labels) in _METRICS.items():
            for key, value in counts.items():
                if labels and key.startswith(ours):
                    label: tuple[str, ...] = (key[len(ours) :],)
                elif key == ours:
                    label = ()
                else:
                    continue
                delta = value - self._reported.get(key, 0)
                if delta:
                    stats.increase_counter(name, delta, label)
        self._reported = counts
        return None if stats.is_empty() else stats


@dataclass(frozen=True, slots=True)
class _Lease:
    """A request's retention lease as read once from its context (None: none)."""

    retention: Retention | None


def _lease_of(req_context: ReqContext | None) -> Retention | None:
    """The retention lease a request asks for (kv_hints, kv_transfer_params:
    kvtier/integrations/dialects.py), read once per request; a malformed
    hint is logged and read as none."""
    if req_context is None:
        return None
    known: _Lease | None = req_context.get_state(_Lease)
    if known is None:
        try:
            lease = from_vllm(
                req_context.kv_transfer_params, getattr(req_context, "kv_hints", None)
            )
        except ValueError as exc:
            log.warning("request %s: its retention hint is ignored: %s", req_context.req_id, exc)
            lease = None
        known = _Lease(lease)
        req_context.set_state(known)
    return known.retention

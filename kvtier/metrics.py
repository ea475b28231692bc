"""Prometheus metrics: one registry per daemon, served over HTTP.

Every series is documented in docs/metrics.md. Label children used on the
request path are bound once, so recording a request costs a dict lookup.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvtier.tiers.base import TierStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)


class _TierCollector(Collector):
    """Reads tier occupancy at scrape time, so the data path never updates gauges."""

    def __init__(self, sources: Callable[[], Iterable[TierStats]]) -> None:
        self._sources = sources

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        used = GaugeMetricFamily(
            "kvtier_tier_used_bytes", "Bytes resident in a tier", labels=["tier"]
        )
        blocks = GaugeMetricFamily(
            "kvtier_tier_blocks", "Blocks resident in a tier", labels=["tier"]
        )
        cap = GaugeMetricFamily(
            "kvtier_tier_capacity_bytes", "Configured capacity of a tier", labels=["tier"]
        )
        evictions = CounterMetricFamily(
            "kvtier_tier_evictions", "Blocks evicted from a tier to make room", labels=["tier"]
        )
        for st in self._sources():
            used.add_metric([st.name], st.used_bytes)
            blocks.add_metric([st.name], st.blocks)
            cap.add_metric([st.name], st.capacity_bytes)
            evictions.add_metric([st.name], st.evictions)
        yield from (used, blocks, cap, evictions)


@dataclass(slots=True)
class StateSnapshot:
    """Sizes of the service's maps, read at scrape time."""

    probes_inflight: dict[str, int] = field(default_factory=dict)
    verdicts_cached: dict[str, int] = field(default_factory=dict)
    pending_writes: int = 0
    request_states: int = 0


_DISK_COUNTERS = (
    ("reads", "kvtier_disk_reads", "Blocks read from the disk tier"),
    ("read_bytes", "kvtier_disk_read_bytes", "Value bytes read from the disk tier"),
    ("writes", "kvtier_disk_writes", "Blocks written to the disk tier"),
    ("written_bytes", "kvtier_disk_written_bytes", "Value bytes written to the disk tier"),
    (
        "corrupt_discarded",
        "kvtier_disk_corrupt_blocks",
        "Torn or corrupt block files discarded (never served)",
    ),
    ("enospc", "kvtier_disk_full_errors", "Writes that failed because the disk was full"),
    ("write_errors", "kvtier_disk_write_errors", "Writes that failed for any reason"),
)


class _DiskCollector(Collector):
    def __init__(self, source: Callable[[], TierStats | None]) -> None:
        self._source = source

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        st = self._source()
        if st is None:
            return
        for field_name, name, doc in _DISK_COUNTERS:
            yield CounterMetricFamily(name, doc, value=st.extra.get(field_name, 0))
        total = st.extra.get("index_buckets_total", 1) or 1
        yield GaugeMetricFamily(
            "kvtier_disk_index_rebuild_progress",
            "Fraction of the disk index rebuilt since start (1 = complete)",
            value=st.extra.get("index_buckets_scanned", 0) / total,
        )


class _StateCollector(Collector):
    def __init__(self, source: Callable[[], StateSnapshot | None]) -> None:
        self._source = source

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snap = self._source()
        if snap is None:
            return
        inflight = GaugeMetricFamily(
            "kvtier_probes_inflight", "Remote existence probes in flight", labels=["tier"]
        )
        verdicts = GaugeMetricFamily(
            "kvtier_verdicts_cached", "Probe verdicts held for reuse", labels=["tier"]
        )
        for tier, n in snap.probes_inflight.items():
            inflight.add_metric([tier], n)
        for tier, n in snap.verdicts_cached.items():
            verdicts.add_metric([tier], n)
        yield inflight
        yield verdicts
        yield GaugeMetricFamily(
            "kvtier_pending_writes",
            "Blocks reading PENDING: reservations and promotions in flight",
            value=snap.pending_writes,
        )
        yield GaugeMetricFamily(
            "kvtier_request_states",
            "Request tags with reader-side PENDING state",
            value=snap.request_states,
        )


class Metrics:
    """All series of one daemon."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # `*_created` timestamps double the series count for no operational
        # value; the switch is process-wide, which suits a daemon.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvtier_requests",
            "Requests handled, by operation and outcome",
            ["op", "outcome"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "kvtier_request_duration_seconds",
            "Time from a request frame's arrival to its reply being queued, by operation",
            ["op"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.lookup_keys = Counter(
            "kvtier_lookup_keys", "Keys answered by LOOKUP, by state", ["state"], registry=r
        )
        self.connections_open = Gauge(
            "kvtier_connections_open", "Client connections currently open", registry=r
        )
        self.connections = Counter("kvtier_connections", "Client connections accepted", registry=r)
        self.protocol_errors = Counter(
            "kvtier_protocol_errors",
            "Frames rejected before reaching the service, by error code",
            ["code"],
            registry=r,
        )
        self.received_bytes = Counter(
            "kvtier_received_bytes", "Bytes of frames received from clients", registry=r
        )
        self.sent_bytes = Counter(
            "kvtier_sent_bytes", "Bytes of frames sent to clients", registry=r
        )
        # -- lookup core
        self.probes = Counter(
            "kvtier_probes",
            "Remote-tier key probes by outcome: started (backend asked), joined (a probe "
            "was in flight), cached (answered by a kept verdict)",
            ["tier", "outcome"],
            registry=r,
        )
        self.probe_verdicts = Counter(
            "kvtier_probe_verdicts", "Probe results by verdict", ["tier", "verdict"], registry=r
        )
        self.probe_failures = Counter(
            "kvtier_probe_failures",
            "Keys whose probe failed, by kind: error, timeout, bad_result",
            ["tier", "kind"],
            registry=r,
        )
        self.probe_superseded = Counter(
            "kvtier_probe_superseded",
            "Probe results dropped because the key was invalidated meanwhile",
            ["tier"],
            registry=r,
        )
        self.probe_batch_size = Histogram(
            "kvtier_probe_batch_size",
            "Keys per batch_lookup call",
            ["tier"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096),
            registry=r,
        )
        self.reservations = Counter(
            "kvtier_reservations",
            "Pending-write events: granted, refused, completed, aborted, released, expired",
            ["event"],
            registry=r,
        )
        self.pending_deadline_expired = Counter(
            "kvtier_pending_deadline_expired",
            "PENDING blocks aborted at their write deadline",
            registry=r,
        )
        self.lookup_pending_expired = Counter(
            "kvtier_lookup_pending_expired",
            "PENDING keys answered MISS to a request past its max_pending_wait",
            registry=r,
        )
        self.lookup_deferred_seconds = Histogram(
            "kvtier_lookup_deferred_seconds",
            "How long a request tag was deferred behind one PENDING key",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
            registry=r,
        )
        self.promotions = Counter(
            "kvtier_promotions",
            "Loads from a lower tier into RAM by outcome: started, completed, absent, failed",
            ["tier", "outcome"],
            registry=r,
        )
        self.demotions = Counter(
            "kvtier_demotions",
            "Blocks evicted from RAM and written to a lower tier (write-back), by outcome",
            ["tier", "outcome"],
            registry=r,
        )
        self.writes_dropped = Counter(
            "kvtier_tier_writes_dropped",
            "Background writes to a lower tier that were given up: cause backlog (too many "
            "bytes already in flight) or failed (the tier refused after its retries)",
            ["tier", "cause"],
            registry=r,
        )
        self.s3_requests = Counter(
            "kvtier_s3_requests",
            "S3 requests by operation (head, get, put, delete) and outcome (ok, not_found, "
            "error, timeout, rejected: refused by the open circuit breaker)",
            ["tier", "op", "outcome"],
            registry=r,
        )
        self.s3_seconds = Histogram(
            "kvtier_s3_request_duration_seconds",
            "S3 request latency, retries included",
            ["tier", "op"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.s3_bytes = Counter(
            "kvtier_s3_bytes",
            "Object bytes moved, by direction (in, out)",
            ["tier", "direction"],
            registry=r,
        )
        self.s3_retries = Counter(
            "kvtier_s3_retries", "Retries botocore made, by operation", ["tier", "op"], registry=r
        )
        self.s3_corrupt = Counter(
            "kvtier_s3_corrupt_objects",
            "Objects whose checksum did not match; answered as a miss, never served",
            ["tier"],
            registry=r,
        )
        self.s3_breaker = Gauge(
            "kvtier_s3_breaker_state",
            "Circuit breaker state: 0 closed, 1 half-open (one trial request), 2 open",
            ["tier"],
            registry=r,
        )
        self._state_source: Callable[[], StateSnapshot | None] = lambda: None
        r.register(_StateCollector(lambda: self._state_source()))
        self._tier_sources: list[Callable[[], TierStats]] = []
        r.register(_TierCollector(lambda: [source() for source in self._tier_sources]))
        self._request_children: dict[tuple[str, str], Counter] = {}
        self._latency_children: dict[str, Histogram] = {}

    def __repr__(self) -> str:
        return f"<Metrics tiers={len(self._tier_sources)}>"

    def set_disk_source(self, source: Callable[[], TierStats]) -> None:
        self.registry.register(_DiskCollector(source))

    def set_state_source(self, source: Callable[[], StateSnapshot]) -> None:
        self._state_source = source

    def add_tier(self, stats: Callable[[], TierStats]) -> None:
        self._tier_sources.append(stats)

    def observe_request(self, op: str, outcome: str, seconds: float) -> None:
        child = self._request_children.get((op, outcome))
        if child is None:
            child = self._request_children[(op, outcome)] = self.requests.labels(op, outcome)
        child.inc()
        hist = self._latency_children.get(op)
        if hist is None:
            hist = self._latency_children[op] = self.request_seconds.labels(op)
        hist.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


async def start_metrics_server(metrics: Metrics, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve ``/metrics`` (and ``/healthz``); returns the runner and the bound port."""

    async def handle_metrics(request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def handle_health(request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    app = web.Application()
    app.router.add_get("/metrics", handle_metrics)
    app.router.add_get("/healthz", handle_health)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    bound = port
    for addr in runner.addresses:  # (host, port) of each bound socket
        bound = int(addr[1])
        break
    return runner, bound

"""Prometheus metrics: one registry per daemon, served over HTTP.

Every series is documented in docs/metrics.md. Label children used on the
request path are bound once, so recording a request costs a dict lookup.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

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
        self._tier_sources: list[Callable[[], TierStats]] = []
        r.register(_TierCollector(lambda: [source() for source in self._tier_sources]))
        self._request_children: dict[tuple[str, str], Counter] = {}
        self._latency_children: dict[str, Histogram] = {}

    def __repr__(self) -> str:
        return f"<Metrics tiers={len(self._tier_sources)}>"

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

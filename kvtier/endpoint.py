"""The metrics port: ``/metrics`` for Prometheus, ``/healthz`` and ``/readyz`` for probes.

An aiohttp server on the daemon's event loop; the probes report the state
the daemon hands in (:meth:`kvtier.daemon.Daemon.health`), the scrape what
:class:`~kvtier.metrics.Metrics` collects. Only the daemon starts it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from kvtier.metrics import CONTENT_TYPE, Metrics

#: the daemon's state for the probes: (alive, ready, details shown to the caller)
Health = Callable[[], tuple[bool, bool, dict[str, Any]]]


def _always_healthy() -> tuple[bool, bool, dict[str, Any]]:
    return True, True, {}


async def start_metrics_server(
    metrics: Metrics, host: str, port: int, health: Health = _always_healthy
) -> tuple[web.AppRunner, int]:
    """Serve ``/metrics``, ``/healthz`` (liveness) and ``/readyz`` (readiness);
    returns the runner and the bound port. The probes answer 200 or 503 with
    the daemon's state as JSON."""

    async def handle_metrics(request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    def probe(ok: bool, details: dict[str, Any]) -> web.Response:
        return web.json_response({"ok": ok, **details}, status=200 if ok else 503)

    async def handle_health(request: web.Request) -> web.Response:
        alive, _, details = health()
        return probe(alive, details)

    async def handle_ready(request: web.Request) -> web.Response:
        _, ready, details = health()
        return probe(ready, details)

    app = web.Application()
    app.router.add_get("/metrics", handle_metrics)
    app.router.add_get("/healthz", handle_health)
    app.router.add_get("/readyz", handle_ready)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    bound = port
    for addr in runner.addresses:  # (host, port) of each bound socket
        bound = int(addr[1])
        break
    return runner, bound

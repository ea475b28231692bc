"""The probes on the metrics port reflect the daemon's real state."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kvtier.config import load_config
from kvtier.daemon import Daemon


def probe(port: int, path: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def test_not_ready_while_the_disk_index_is_scanning_if_so_configured(
    sock_dir: Path,
) -> None:
    config = load_config(
        None,
        {
            "server": {"socket_path": sock_dir / "d.sock"},
            "metrics": {"port": 0},
            "ram": {"capacity": "64MiB"},
            "disk": {"path": sock_dir / "data", "capacity": "64MiB", "ready_after_scan": True},
        },
    )
    d = Daemon(config)
    assert d.disk is not None
    # Hold every disk I/O thread: the index scan at start waits behind them.
    hold = threading.Event()
    busy = [d.disk.executor.submit(hold.wait) for _ in range(config.disk.io_threads)]
    task = asyncio.create_task(d.run())
    try:
        await d.ready.wait()
        assert d.metrics_port is not None
        status, body = await asyncio.to_thread(probe, d.metrics_port, "/readyz")
        assert (status, body["state"], body["disk"]) == (503, "serving", "scanning")
        status, body = await asyncio.to_thread(probe, d.metrics_port, "/healthz")
        assert status == 200 and body["ok"] is True
        hold.set()
        assert d.disk.scan_done is not None
        await d.disk.scan_done
        status, body = await asyncio.to_thread(probe, d.metrics_port, "/readyz")
        assert (status, body["disk"]) == (200, "ready")
        d.stop()
        alive, ready, details = d.health()  # stopping: neither alive nor ready
        assert (alive, ready, details["state"]) == (False, False, "stopping")
    finally:
        hold.set()
        for f in busy:
            f.result()
        d.stop()
        await task

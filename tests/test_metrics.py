from __future__ import annotations

import re
from pathlib import Path

from kvtier import Client
from kvtier.daemon import Daemon

DOCS = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"


async def test_every_series_is_documented(daemon: Daemon) -> None:
    async with await Client.connect(daemon.socket_path) as client:
        await client.put(b"k", b"v")
        await client.lookup([b"k", b"x"])
    text = daemon.metrics.render().decode()
    families = set(re.findall(r"^# TYPE (kvtier_\w+) ", text, flags=re.M))
    assert len(families) >= 10
    documented = DOCS.read_text()
    missing = sorted(f for f in families if f"`{f}" not in documented)
    assert not missing, f"series missing from docs/metrics.md: {missing}"


async def test_metrics_endpoint_serves_series(daemon: Daemon) -> None:
    import aiohttp

    async with await Client.connect(daemon.socket_path) as client:
        await client.put(b"k", b"value")
        await client.lookup([b"k", b"x"])
        url = f"http://127.0.0.1:{daemon.metrics_port}/metrics"
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            body = await resp.text()
        assert resp.status == 200
        assert 'kvtier_lookup_keys_total{state="hit"} 1.0' in body
        assert 'kvtier_lookup_keys_total{state="miss"} 1.0' in body
        assert 'kvtier_tier_used_bytes{tier="ram"} 5.0' in body
        assert "kvtier_connections_open 1.0" in body
        assert 'kvtier_request_duration_seconds_count{op="put"} 1.0' in body

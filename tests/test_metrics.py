from __future__ import annotations

import re
from pathlib import Path

from kvtier import Client
from kvtier.daemon import Daemon
from tests.helpers import running_daemon

DOCS = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"


async def test_every_series_is_documented(sock_dir: Path) -> None:
    # With peers configured (the listed one never answers), a peer port and
    # the KV-event publisher.
    async with running_daemon(
        sock_dir,
        peer={"listen": "127.0.0.1:0", "members": ["127.0.0.1:9"], "token": "t"},
        events={"endpoint": f"ipc://{sock_dir}/kv-events"},
    ) as daemon:
        await _served_and_documented(daemon)


async def _served_and_documented(daemon: Daemon) -> None:
    async with await Client.connect(daemon.socket_path) as client:
        await client.put(b"k", b"v")
        await client.lookup([b"k", b"x"])
    text = daemon.metrics.render().decode()
    families = {
        re.sub(r"_total$", "", f) for f in re.findall(r"^# TYPE (kvtier_\w+) ", text, flags=re.M)
    }
    rows = re.findall(r"^\| `(kvtier_\w+)` \|", DOCS.read_text(), flags=re.M)
    documented = {re.sub(r"_total$", "", name) for name in rows}
    missing = sorted(families - documented)
    assert not missing, f"series missing from docs/metrics.md: {missing}"
    # Every documented series is served by this daemon (RAM + disk, no S3 tier).
    absent = sorted(f for f in documented - families if not f.startswith("kvtier_s3_"))
    assert not absent, f"documented but not served: {absent}"


async def test_metrics_endpoint_serves_series(daemon: Daemon) -> None:
    import aiohttp

    # The daemon's own lookup: counted as it is answered (the lookup
    # process's are counted within milliseconds, as it reports them).
    async with await Client.connect(daemon.socket_path, lookup_process=False) as client:
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


def _row(family: str) -> str:
    for line in DOCS.read_text().splitlines():
        if line.startswith(f"| `{family}` |"):
            return line
    raise AssertionError(f"{family} has no row in docs/metrics.md")


def test_every_label_value_is_documented() -> None:
    from kvtier.core.counts import Dropped, ProbeFailure, ProbeUse, Promoted, Written
    from kvtier.core.probes import Verdict
    from kvtier.core.writes import End
    from kvtier.model import State
    from kvtier.server.connection import TRUNCATED
    from kvtier.server.gate import Refusal
    from kvtier.tiers.peer import PeerOutcome
    from kvtier.tiers.s3 import S3Outcome
    from kvtier.wire import Op

    values: dict[str, list[str]] = {
        "kvtier_requests_total": [op.name.lower() for op in Op] + ["unknown", "ok"],
        "kvtier_lookup_keys_total": [s.name.lower() for s in State],
        "kvtier_protocol_errors_total": [
            "malformed",
            "unsupported_version",
            "unknown_opcode",
            "frame_too_large",
            TRUNCATED,
        ],
        "kvtier_probes_total": [u.value for u in ProbeUse],
        "kvtier_probe_verdicts_total": [v.value for v in Verdict],
        "kvtier_probe_failures_total": [f.value for f in ProbeFailure],
        "kvtier_reservations_total": ["granted", "refused"] + [e.value for e in End],
        "kvtier_promotions_total": [p.value for p in Promoted],
        "kvtier_demotions_total": [w.value for w in Written],
        "kvtier_tier_writes_dropped_total": [d.value for d in Dropped],
        "kvtier_s3_requests_total": [o.value for o in S3Outcome],
        "kvtier_connections_refused_total": ["not_allowed", "no_credentials"],
        "kvtier_peer_requests_total": [o.value for o in PeerOutcome],
        "kvtier_peer_listener_refused_total": [r.value for r in Refusal],
        "kvtier_retention_blocks_total": [
            "granted",
            "renewed",
            "released",
            "expired",
            "capped",
            "evicted",
            "broken",
        ],
        "kvtier_retention_return_blocks_total": ["asked", "held"],
    }
    missing = {
        family: [v for v in vals if f"`{v}`" not in _row(family)] for family, vals in values.items()
    }
    assert not {k: v for k, v in missing.items() if v}, f"undocumented label values: {missing}"

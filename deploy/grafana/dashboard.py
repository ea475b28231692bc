"""Generate deploy/grafana/kvtier.json, the kvtier dashboard, from code.

Run ``python deploy/grafana/dashboard.py`` after changing a panel; a test
fails when the JSON and this file differ, and when a panel uses a series
docs/metrics.md does not document.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("kvtier.json")


def sel(expr: str) -> str:
    """``expr`` restricted to the instances chosen on the dashboard."""
    return expr.replace("SEL", 'instance=~"$instance"')


#: (title, [(PromQL, legend)], unit) per panel, by row
ROWS: list[tuple[str, list[tuple[str, list[tuple[str, str]], str]]]] = [
    (
        "Hit ratio",
        [
            (
                "Lookup hit ratio",
                [(sel("kvtier:lookup_hit_ratio:rate5m{SEL}"), "{{instance}}")],
                "percentunit",
            ),
            (
                "Remote tiers: probes that found the block",
                [(sel("kvtier:probe_present_ratio:rate5m{SEL}"), "{{instance}} {{tier}}")],
                "percentunit",
            ),
            (
                "Blocks loaded from each lower tier, per looked-up key",
                [(sel("kvtier:promotion_ratio:rate5m{SEL}"), "{{instance}} {{tier}}")],
                "percentunit",
            ),
        ],
    ),
    (
        "Latency",
        [
            (
                "LOOKUP and GET latency",
                [
                    (
                        sel(
                            f"histogram_quantile({q}, sum by (op, le) (rate("
                            'kvtier_request_duration_seconds_bucket{SEL, op=~"lookup|get"}[5m])))'
                        ),
                        "{{op}} p" + q[2:],
                    )
                    for q in ("0.50", "0.99")
                ],
                "s",
            ),
            (
                "PENDING: reader wait and expirations",
                [
                    (
                        sel(
                            "histogram_quantile(0.99, sum by (le) "
                            "(rate(kvtier_lookup_deferred_seconds_bucket{SEL}[5m])))"
                        ),
                        "deferred wait p99 (s)",
                    ),
                    (
                        sel("sum(rate(kvtier_pending_deadline_expired_total{SEL}[5m]))"),
                        "writes past their deadline /s",
                    ),
                    (
                        sel("sum(rate(kvtier_lookup_pending_expired_total{SEL}[5m]))"),
                        "readers given up on /s",
                    ),
                    (sel("sum(kvtier_pending_writes{SEL})"), "pending writes"),
                ],
                "short",
            ),
        ],
    ),
    (
        "Throughput",
        [
            (
                "Requests by op",
                [(sel("sum by (op) (rate(kvtier_requests_total{SEL}[5m]))"), "{{op}}")],
                "reqps",
            ),
            (
                "Bytes",
                [
                    (sel("sum(rate(kvtier_received_bytes_total{SEL}[5m]))"), "received"),
                    (sel("sum(rate(kvtier_sent_bytes_total{SEL}[5m]))"), "sent"),
                    (
                        sel("sum(rate(kvtier_shared_leased_bytes_total{SEL}[5m]))"),
                        "read in shared memory",
                    ),
                ],
                "Bps",
            ),
            (
                "Errors by op and outcome",
                [
                    (
                        sel(
                            "sum by (op, outcome) "
                            '(rate(kvtier_requests_total{SEL, outcome!="ok"}[5m]))'
                        ),
                        "{{op}} {{outcome}}",
                    )
                ],
                "reqps",
            ),
        ],
    ),
    (
        "Tiers",
        [
            (
                "Usage",
                [
                    (
                        sel(
                            "sum by (tier) (kvtier_tier_used_bytes{SEL}) / "
                            "sum by (tier) (kvtier_tier_capacity_bytes{SEL})"
                        ),
                        "{{tier}}",
                    )
                ],
                "percentunit",
            ),
            (
                "Disk tier's filesystem: free",
                [
                    (
                        sel(
                            "kvtier_disk_filesystem_free_bytes{SEL} / "
                            "kvtier_disk_filesystem_size_bytes{SEL}"
                        ),
                        "{{instance}}",
                    )
                ],
                "percentunit",
            ),
            (
                "Evictions",
                [
                    (
                        sel("sum by (tier) (rate(kvtier_tier_evictions_total{SEL}[5m]))"),
                        "{{tier}}",
                    )
                ],
                "ops",
            ),
            (
                "Background writes dropped",
                [
                    (
                        sel(
                            "sum by (tier, cause) (rate(kvtier_tier_writes_dropped_total{SEL}[5m]))"
                        ),
                        "{{tier}} {{cause}}",
                    )
                ],
                "ops",
            ),
        ],
    ),
    (
        "S3 and peers",
        [
            (
                "S3 breaker (0 closed, 1 half-open, 2 open)",
                [(sel("max by (tier) (kvtier_s3_breaker_state{SEL})"), "{{tier}}")],
                "short",
            ),
            (
                "S3 requests by outcome",
                [
                    (
                        sel("sum by (outcome) (rate(kvtier_s3_requests_total{SEL}[5m]))"),
                        "{{outcome}}",
                    )
                ],
                "reqps",
            ),
            (
                "Peers up",
                [(sel("min by (peer) (kvtier_peer_up{SEL})"), "{{peer}}")],
                "short",
            ),
            (
                "Peer requests by outcome",
                [
                    (
                        sel("sum by (outcome) (rate(kvtier_peer_requests_total{SEL}[5m]))"),
                        "{{outcome}}",
                    )
                ],
                "reqps",
            ),
        ],
    ),
    (
        "Shared memory",
        [
            (
                "Leases",
                [
                    (sel("sum(kvtier_shared_leases{SEL})"), "held"),
                    (
                        sel("sum by (end) (rate(kvtier_shared_leases_ended_total{SEL}[5m]))"),
                        "ended {{end}} /s",
                    ),
                ],
                "short",
            ),
            (
                "Arena",
                [
                    (sel("sum(kvtier_shared_arena_allocated_bytes{SEL})"), "allocated"),
                    (sel("sum(kvtier_shared_staging_allocated_bytes{SEL})"), "staging"),
                ],
                "bytes",
            ),
        ],
    ),
    (
        "Load costs, budgets and hedges",
        [
            (
                "Time to first byte by source (estimated from its loads)",
                [(sel("kvtier_source_latency_seconds{SEL}"), "{{instance}} {{tier}}")],
                "s",
            ),
            (
                "Keys a lookup's budget answered MISS, by the tier they would load from",
                [
                    (
                        sel("sum by (tier) (rate(kvtier_lookup_budget_cut_total{SEL}[5m]))"),
                        "{{tier}}",
                    )
                ],
                "short",
            ),
            (
                "Hedged reads, by tier and outcome",
                [
                    (
                        sel("sum by (tier, outcome) (rate(kvtier_hedged_reads_total{SEL}[5m]))"),
                        "{{tier}} {{outcome}}",
                    )
                ],
                "short",
            ),
        ],
    ),
    (
        "Namespaces",
        [
            (
                "RAM held by namespace, against its max",
                [
                    (
                        sel('sum by (namespace) (kvtier_namespace_bytes{SEL, tier="ram"})'),
                        "{{namespace}}",
                    ),
                    (
                        sel(
                            "sum by (namespace) "
                            '(kvtier_namespace_ram_limit_bytes{SEL, limit="max"})'
                        ),
                        "{{namespace}} max",
                    ),
                ],
                "bytes",
            ),
            (
                "Lookup hit ratio by namespace",
                [
                    (
                        sel(
                            "sum by (namespace) "
                            '(rate(kvtier_namespace_lookup_keys_total{SEL, state="hit"}[5m]))'
                            " / sum by (namespace) "
                            "(rate(kvtier_namespace_lookup_keys_total{SEL}[5m]))"
                        ),
                        "{{namespace}}",
                    )
                ],
                "percentunit",
            ),
            (
                "RAM evictions by namespace",
                [
                    (
                        sel("sum by (namespace) (rate(kvtier_namespace_evictions_total{SEL}[5m]))"),
                        "{{namespace}}",
                    )
                ],
                "short",
            ),
        ],
    ),
]


def panel(pid: int, title: str, targets: list[tuple[str, str]], unit: str, x: int, y: int) -> Any:
    return {
        "id": pid,
        "type": "timeseries",
        "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(targets)
        ],
    }


def dashboard() -> dict[str, Any]:
    panels: list[Any] = []
    pid, y = 1, 0
    for row_title, row_panels in ROWS:
        panels.append(
            {
                "id": pid,
                "type": "row",
                "title": row_title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        pid, y = pid + 1, y + 1
        for i, (title, targets, unit) in enumerate(row_panels):
            x = (i % 3) * 8
            if i and i % 3 == 0:
                y += 8
            panels.append(panel(pid, title, targets, unit, x, y))
            pid += 1
        y += 8
    return {
        "title": "kvtier",
        "uid": "kvtier",
        "description": "kvtier sidecars: hit ratio, latency, throughput, tiers, health",
        "tags": ["kvtier"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "30s",
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "query": "prometheus",
                    "label": "Prometheus",
                },
                {
                    "name": "instance",
                    "type": "query",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": "label_values(kvtier_connections_open, instance)",
                    "includeAll": True,
                    "multi": True,
                    "current": {"text": "All", "value": "$__all"},
                    "refresh": 2,
                },
            ]
        },
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    sys.stdout.write(f"wrote {OUT}\n")

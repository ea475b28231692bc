"""Building a daemon is apart from running it: build() wires every part and starts nothing."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import pytest

from kvtier.build import PEER_TIER, build
from kvtier.config import load_config
from kvtier.core.propagation import WritePolicy
from kvtier.server.server import Server
from kvtier.tiers.peer import PeerTier
from kvtier.tiers.s3 import S3Tier


def test_build_wires_every_part_and_starts_nothing(tmp_path: Path) -> None:
    config = load_config(
        None,
        {
            "server": {"socket_path": tmp_path / "d.sock"},
            "ram": {"capacity": "16MiB"},
            "disk": {"path": tmp_path / "data", "capacity": "64MiB"},
            "peer": {
                "listen": "127.0.0.1:0",
                "advertise": "127.0.0.1:7070",
                "members": ["127.0.0.1:7070", "127.0.0.1:7071"],
                "token": "a-long-enough-shared-secret",
            },
            "remote_tiers": [
                {
                    "kind": "s3",
                    "name": "s3",
                    "bucket": "kvtier-blocks",
                    "region": "us-east-1",
                    "endpoint_url": "http://127.0.0.1:9",
                    "access_key_id": "k",
                    "secret_access_key": "s",
                }
            ],
        },
    )
    threads = threading.active_count()
    parts = build(config)
    # Nothing started: no socket, no data directory, no thread, no task.
    assert not (tmp_path / "d.sock").exists() and not (tmp_path / "data").exists()
    assert threading.active_count() == threads
    assert parts.scheduler.deadline_count == 0 and parts.scheduler.timer_count == 0
    # One scheduler, shared by the service and what it owns.
    assert parts.service.scheduler is parts.scheduler
    # The peer tier comes first among the remote tiers, pushing to owners.
    assert [spec.tier.name for spec in parts.remotes] == [PEER_TIER, "s3"]
    assert isinstance(parts.remotes[0].tier, PeerTier)
    assert parts.remotes[0].policy is WritePolicy.WRITE_THROUGH
    assert isinstance(parts.remotes[1].tier, S3Tier)
    assert isinstance(parts.peer_server, Server) and parts.peer_server is not parts.server
    if hasattr(os, "memfd_create"):
        assert parts.shared is not None and parts.server.ops.shared_offer is not None
        assert parts.server.ops.shared_offer.path == f"{tmp_path / 'd.sock'}.shm"
    with pytest.raises(RuntimeError, match="not been started"):
        parts.server.spawn(_nothing())
    # Every source of metrics is registered, each family once.
    text = parts.metrics.render().decode()
    for family in (
        "kvtier_requests",
        "kvtier_peer_listener_requests",
        "kvtier_lookup_keys",
        "kvtier_tier_used_bytes",
        "kvtier_disk_reads",
        "kvtier_s3_breaker_state",
        "kvtier_peer_up",
    ):
        assert len(re.findall(rf"^# TYPE {family}(_total)? ", text, re.M)) == 1, family
    assert 'kvtier_tier_capacity_bytes{tier="ram"} 1.6777216e+07' in text
    assert "remotes=['peers', 's3']" in repr(parts)


def test_build_without_disk_peers_or_remote_tiers(tmp_path: Path) -> None:
    config = load_config(
        None,
        {
            "server": {"socket_path": tmp_path / "d.sock"},
            "ram": {"capacity": "8MiB"},
            "disk": {"enabled": False},
            "shared": {"enabled": False},
        },
    )
    parts = build(config)
    assert parts.disk is None and parts.peer_tier is None and parts.remotes == []
    assert parts.shared is None and parts.arena is None and parts.peer_server is None
    text = parts.metrics.render().decode()
    assert "kvtier_disk_reads" not in text and "kvtier_shared_leases" not in text
    assert "kvtier_requests" in text


async def _nothing() -> None:
    return None

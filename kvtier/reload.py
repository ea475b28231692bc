"""Live settings: what SIGHUP re-reads and applies without a restart.

On SIGHUP the daemon re-reads its configuration from the same sources
(file, environment, flags). A bad file changes nothing. Of the settings
that differ, those in :data:`LIVE` are applied at once; every other one is
logged as waiting for a restart (sockets, capacities, tiers, policies:
they shape objects built at startup).

Invariants: a reload either applies a setting fully or not at all; the
daemon's ``config`` shows what is in force (applied settings only).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvtier.config import Config
from kvtier.core.propagation import Writer
from kvtier.core.shared.blocks import SharedBlocks

log = logging.getLogger("kvtier.daemon")

#: the settings a reload applies, and what each changes
LIVE: dict[str, str] = {
    "log.level": "the daemon's log level",
    "lookup.pending_deadline": "the deadline of pending writes started from now on",
    "disk.max_pending_write_bytes": "the bound of background writes to the disk in flight",
    "peer.members": "the static peer list (connections to peers still listed are kept)",
    "peer.max_pending_push_bytes": "the bound of pushes to peers in flight",
    "shared.lease_timeout": "the timeout of leases granted from now on",
    "shared.staging_timeout": "the idle timeout of staging rooms, from their next use",
    "namespaces": "namespaces' quotas, weights and users (docs/tenancy.md), for the next "
    "block each tier makes room for and the next HELLO",
    "server.configured_namespaces_only": "whether a HELLO may name an unconfigured namespace",
}


def changed(old: Config, new: Config) -> list[str]:
    """Dotted names of the settings that differ (a list-valued section as a whole)."""
    a, b = old.model_dump(mode="json"), new.model_dump(mode="json")
    out: list[str] = []
    for section in a:
        if isinstance(a[section], dict) and isinstance(b[section], dict):
            keys = sorted(set(a[section]) | set(b[section]))
            out += [f"{section}.{k}" for k in keys if a[section].get(k) != b[section].get(k)]
        elif a[section] != b[section]:
            out.append(section)
    return out


@dataclass
class Live:
    """What a reload can reach in a running daemon."""

    #: background writers, by tier name
    writers: dict[str, Writer] = field(default_factory=dict)
    #: sets the peer member list; returns peers dropped (closed by the caller)
    set_members: Callable[[list[str]], object] | None = None
    shared: SharedBlocks | None = None
    #: applies a configuration's namespaces (quotas, users); False: it cannot
    #: live (quotas where the tiers were built without namespaces), nothing changed
    set_namespaces: Callable[[Config], bool] | None = None


def apply(config: Config, new: Config, live: Live) -> tuple[list[str], list[str]]:
    """Apply the live settings of ``new`` to ``live`` and ``config`` (kept as
    what is in force). Returns (applied, waiting for a restart)."""
    applied: list[str] = []
    waiting: list[str] = []
    for name in changed(config, new):
        if name.startswith("namespaces."):  # one table: all of them go in at once
            if live.set_namespaces is not None and live.set_namespaces(new):
                config.namespaces = dict(new.namespaces)
                applied.append(name)
            else:
                waiting.append(name)
        elif name in LIVE and _apply_one(name, new, live):
            section, key = name.split(".", 1)
            setattr(getattr(config, section), key, getattr(getattr(new, section), key))
            applied.append(name)
        else:
            waiting.append(name)
    return applied, waiting


def _apply_one(name: str, new: Config, live: Live) -> bool:
    value: Any
    if name == "log.level":
        logging.getLogger().setLevel(new.log.level.upper())
    elif name == "lookup.pending_deadline":
        pass  # read where each pending write starts: setting it is applying it
    elif name == "disk.max_pending_write_bytes":
        return _bound(live, "disk", new.disk.max_pending_write_bytes)
    elif name == "peer.max_pending_push_bytes":
        return _bound(live, "peers", new.peer.max_pending_push_bytes)
    elif name == "peer.members":
        if live.set_members is None:
            return False  # peering is off: turning it on needs a restart
        value = list(new.peer.members)
        live.set_members(value)
    elif name == "server.configured_namespaces_only":
        return live.set_namespaces is not None and live.set_namespaces(new)
    elif name in ("shared.lease_timeout", "shared.staging_timeout"):
        if live.shared is None:
            return False
        setattr(live.shared, name.split(".")[1], getattr(new.shared, name.split(".")[1]))
    return True


def _bound(live: Live, tier: str, value: int) -> bool:
    writer = live.writers.get(tier)
    if writer is None:
        return False
    writer.max_pending = value
    return True

"""What the core counts, and the typed outcomes it counts by.

The service bumps these plain counters; ``kvtier.metrics`` reads them at
scrape time. No Prometheus here, no sockets. Every outcome is an enum whose
value is the label the docs (docs/metrics.md) name.

Imports only the plain counters; never Prometheus.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvtier.counters import Counts, Histograms

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
DEFERRED_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ProbeUse(enum.Enum):
    STARTED = "started"  # a backend probe was queued
    JOINED = "joined"  # a probe was already in flight
    CACHED = "cached"  # a kept verdict answered


class ProbeFailure(enum.Enum):
    ERROR = "error"
    TIMEOUT = "timeout"
    BAD_RESULT = "bad_result"


class Promoted(enum.Enum):
    STARTED = "started"
    COMPLETED = "completed"
    ABSENT = "absent"  # the tier no longer had it
    FAILED = "failed"
    SUPERSEDED = "superseded"  # the key was stored or invalidated meanwhile
    CANCELLED = "cancelled"  # deadline or shutdown


class Written(enum.Enum):
    """How a background write to a lower tier ended."""

    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Dropped(enum.Enum):
    """Why a background write to a lower tier was given up."""

    BACKLOG = "backlog"  # no room: in flight past the bound, or past the owed bound
    FAILED = "failed"  # the tier failed it, and it keeps no owed blocks
    GONE = "gone"  # owed, and no tier of this daemon held it any more when sent


class CoreCounters:
    def __init__(self) -> None:
        self.lookup_keys = Counts("state")
        self.probes = Counts("tier", "outcome")
        self.probe_verdicts = Counts("tier", "verdict")
        self.probe_failures = Counts("tier", "kind")
        self.probe_superseded = Counts("tier")
        self.probe_late = Counts("tier")
        self.probe_batch_size = Histograms(BATCH_BUCKETS, "tier")
        self.reservations = Counts("event")
        self.pending_deadline_expired = Counts().bind()
        self.lookup_pending_expired = Counts().bind()
        self.lookup_deferred_seconds = Histograms(DEFERRED_BUCKETS).bind()
        self.promotions = Counts("tier", "outcome")
        self.demotions = Counts("tier", "outcome")
        self.writes_dropped = Counts("tier", "cause")
        #: writes a remote tier missed (or was behind for), owed and sent again
        self.writes_owed = Counts("tier")
        #: blocks stored with a writer's hint, by hint; and lookups that only peeked
        self.put_hints = Counts("hint")
        self.put_tail = self.put_hints.bind("tail")
        self.lookup_peeks = Counts().bind()
        #: keys a lookup's budget answered MISS, by the tier they would have loaded from
        self.lookup_budget_cut = Counts("tier")
        #: leased blocks RAM evicted that no tier kept (docs/retention.md)
        self.retention_broken = Counts().bind()
        #: lookups of a session that came back within its lease: blocks asked,
        #: and the leading run of them the local tiers held
        self.retention_returns = Counts("blocks")
        self.retention_return_asked = self.retention_returns.bind("asked")
        self.retention_return_held = self.retention_returns.bind("held")

    def __repr__(self) -> str:
        return (
            f"<CoreCounters lookup_keys={self.lookup_keys.total():g} "
            f"promotions={self.promotions.total():g}>"
        )


#: namespaces counted apart at most; later ones are counted together as OTHER
MAX_COUNTED_NAMESPACES = 1024
#: where namespaces past the limit are counted (not a valid namespace name)
OTHER_NAMESPACE = b"\x00other"


@dataclass(slots=True)
class NamespaceCounts:
    """One namespace's lookup answers, by key."""

    hits: int = 0
    misses: int = 0


@dataclass(slots=True, frozen=True)
class NamespaceStats:
    """What one namespace holds and how it is served; metrics and ``kvtier
    stats --namespace`` read the fields by name."""

    name: str
    ram_bytes: int
    ram_blocks: int
    disk_bytes: int
    disk_blocks: int
    evictions: int
    hits: int
    misses: int
    ram_min: int
    ram_max: int | None

    def as_dict(self) -> dict[str, int | None]:
        return {
            "bytes": self.ram_bytes,
            "blocks": self.ram_blocks,
            "disk_bytes": self.disk_bytes,
            "disk_blocks": self.disk_blocks,
            "evictions": self.evictions,
            "hits": self.hits,
            "misses": self.misses,
            "ram_min": self.ram_min,
            "ram_max": self.ram_max,
        }


@dataclass(slots=True, frozen=True)
class MapSizes:
    """Sizes of the service's maps (all drain to 0 when idle), read at scrape time."""

    probes_inflight: dict[str, int]
    verdicts_cached: dict[str, int]
    pending_writes: int
    request_states: int
    timers: int
    #: blocks (and their bytes) each remote tier is owed (drains to 0 once
    #: its store takes writes)
    owed_blocks: dict[str, int]
    owed_bytes: dict[str, int]

"""What every part of the service works with, made once by the service.

The limits and settings, the local tiers, the pending writes, the remote
tiers' probes, the locator over all of them, the counters, the lifecycle,
the clock and the sources' load costs: :class:`Context` holds one reference to each, so that the
parts (:mod:`~kvtier.core.answers`, :mod:`~kvtier.core.loads`,
:mod:`~kvtier.core.stores`) read the same ones. Invariants: made once,
never changed; it owns nothing (each part's own state stays in the part).
Imports the core's parts' types, the tiers and the shared records.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.config import DiskConfig, LookupConfig
from kvtier.core.costs import Costs
from kvtier.core.counts import CoreCounters
from kvtier.core.lifecycle import Lifecycle
from kvtier.core.lookup import Locator
from kvtier.core.probing import RemoteProbes
from kvtier.core.writing import PendingWrites
from kvtier.model import Limits
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.ram import RamTier


@dataclass(frozen=True, slots=True, repr=False)
class Context:
    """One reference to each thing the service's parts share."""

    limits: Limits
    cfg: LookupConfig
    disk_cfg: DiskConfig
    ram: RamTier
    disk: DiskTier | None
    pending: PendingWrites
    probing: RemoteProbes
    #: where a key is, for the daemon's own clients (every tier)
    locator: Locator
    counters: CoreCounters
    life: Lifecycle
    #: the clock every deadline and TTL is read on
    now: Callable[[], float]
    #: what a load costs from each source, learnt from the loads done
    costs: Costs = field(default_factory=Costs)

    def __repr__(self) -> str:
        return f"<Context {self.life!r} {self.pending!r}>"

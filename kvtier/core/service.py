"""The cache service: the verbs (lookup, get, put, delete, reserve) over the
tiers, as one facade over the parts that own their state.

The server decodes a request into a record of :mod:`kvtier.model`, calls
one verb and encodes what it returns. One calling convention: a verb checks
its request, decides and starts what it needs synchronously, then returns
its answer now, or the awaitable that gives it once the I/O it started is
done (``lookup``, ``get``, ``delete``). ``put``, ``reserve``, ``abort`` and
``release`` never wait.

The parts, each with the state it owns:

* :class:`~kvtier.core.answers.Answers`: LOOKUP, the readers' bounds, the
  answers counted;
* :class:`~kvtier.core.loads.Loads`: GET, disk reads and promotions into RAM;
* :class:`~kvtier.core.stores.Stores`: PUT and its rooms, durability,
  DELETE, RESERVE/ABORT, and the write propagation;
* :class:`~kvtier.core.writing.PendingWrites`: the pending writes and their
  deadlines (nothing is pending forever);
* :class:`~kvtier.core.probing.RemoteProbes`: the probes in flight (shared,
  and they always end);
* :class:`~kvtier.core.holdings.Holdings`: what the local tiers hold, told
  to the kept verdicts, the lookup process's feed and the events.

Every part asks :class:`~kvtier.core.lookup.Locator` where a key is; no
other code decides the order of the tiers. A request reaches the remote
tiers through :class:`~kvtier.core.probing.Reach`; a peer's request
(:attr:`Service.local`) reaches the local tiers only.

Imports the core, the tiers, the shared records and the errors; never the
wire, the server or metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from kvtier.config import DiskConfig, LookupConfig
from kvtier.core.answers import Answers
from kvtier.core.context import Context
from kvtier.core.costs import Costs
from kvtier.core.counts import (
    OTHER_NAMESPACE,
    CoreCounters,
    MapSizes,
    NamespaceCounts,
    NamespaceStats,
)
from kvtier.core.events import EventLog, Subscription
from kvtier.core.holdings import Holdings
from kvtier.core.lifecycle import Lifecycle
from kvtier.core.loads import Loads
from kvtier.core.local import LocalView, SealedView
from kvtier.core.lookup import Locator
from kvtier.core.probing import Reach, RemoteProbes
from kvtier.core.propagation import Propagation, RemoteSpec, WritePolicy, Writer
from kvtier.core.retainer import Retainer
from kvtier.core.stores import Stores
from kvtier.core.timers import Scheduler
from kvtier.core.writing import PendingWrites
from kvtier.model import (
    BlockEvent,
    Buffer,
    EventKind,
    EventTier,
    FeedRecords,
    Limits,
    Retention,
    Spawn,
    Subscriber,
    namespace_name,
)
from kvtier.tiers.base import LocalTier, Tier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.ram import RamTier
from kvtier.tiers.sealing import Sealer
from kvtier.tiers.shares import Shares

log = logging.getLogger("kvtier.service")


class Service:
    """The verbs over the tiers; a facade over :class:`Answers`,
    :class:`Loads` and :class:`Stores`."""

    def __init__(
        self,
        limits: Limits,
        ram: RamTier,
        *,
        lookup: LookupConfig | None = None,
        disk: DiskTier | None = None,
        disk_cfg: DiskConfig | None = None,
        remotes: Sequence[RemoteSpec] = (),
        scheduler: Scheduler,
        counters: CoreCounters | None = None,
    ) -> None:
        self.limits = limits
        self.ram = ram
        self.disk = disk
        self.cfg = cfg = lookup if lookup is not None else LookupConfig()
        disk_cfg = disk_cfg if disk_cfg is not None else DiskConfig()
        self.counters = counters = counters if counters is not None else CoreCounters()
        #: the one scheduler loop (built with the daemon's parts)
        self.scheduler = scheduler
        now = scheduler.now
        self.life = life = Lifecycle()
        #: what a load costs from each source (the lookups' budgets read it)
        self.costs = costs = Costs()
        self.pending = PendingWrites(ram, scheduler, counters)
        self.probing = RemoteProbes(
            [spec.tier for spec in remotes],
            verdict_ttl=cfg.verdict_ttl,
            error_ttl=cfg.error_ttl,
            max_verdicts=cfg.max_verdicts,
            probe_timeout=cfg.probe_timeout,
            scheduler=scheduler,
            counters=counters,
            task=life.task,
            on_present=lambda slot, key, at: self.loads.probed_present(slot, key, at),
            costs=costs,
        )
        self.remotes = self.probing.slots
        table = self.pending.table
        locator = Locator(ram.resident(), disk, table, [s.probes for s in self.remotes])
        self.reach = Reach(locator, self.remotes)
        # Requests from peer daemons see the local tiers only: with no remote
        # tier to consult, no key is ever REMOTE or PROBING, so nothing is
        # forwarded and two daemons can never bounce a probe.
        self.local_reach = Reach(Locator(ram.resident(), disk, table, []), ())
        #: what this node holds, as events for routers (SUBSCRIBE)
        self.events = EventLog()
        local: list[tuple[EventTier, LocalTier]] = [(EventTier.RAM, ram)]
        if disk is not None:
            local.append((EventTier.DISK, disk))
        #: the one place where what the local tiers hold changes is told, and
        #: tells the kept verdicts, the lookup process's feed and the events
        self.holdings = Holdings(local, table, self.events, self.probing.invalidate_many)
        writers = [spec.writer(self.probing.invalidate) for spec in remotes]
        if disk is not None:
            for w in writers:  # (what a remote tier is owed is kept beside the blocks)
                if w.outbox is not None:
                    w.owed_file = disk.owed_file(w.name)
            policy = WritePolicy(disk_cfg.write_policy)
            pending = disk_cfg.max_pending_write_bytes
            writers.insert(
                0, Writer(disk.name, policy, pending, disk.write, disk.contains, True, True)
            )

        async def copy_of(key: bytes) -> Buffer | None:
            value = ram.peek(key)
            if value is None and disk is not None:  # (after a crash: the file itself)
                value = await disk.read_found(key)
            return value

        self.propagation = Propagation(
            [w for w in writers if w.policy is not WritePolicy.NONE or w.local],
            counters,
            life.task,
            lambda: life.closing,
            hold=lambda _key, value: ram.hold(value),
            let_go=lambda _key, value: ram.let_go(value),
            copy_of=copy_of,
            kept_locally=disk.contains if disk is not None else lambda _key: False,
        )
        # A demoted block must outlive its arena slot, which is reused at once.
        ram.keep_evicted = any(w.policy is WritePolicy.WRITE_BACK for w in self.propagation.writers)
        #: what every part works with
        c = Context(
            limits,
            cfg,
            disk_cfg,
            ram,
            disk,
            self.pending,
            self.probing,
            locator,
            counters,
            life,
            now,
            costs,
        )
        self.stores = Stores(c, self.propagation)
        self.loads = Loads(c, self.stores, [t.name for t in self.tiers()[1:]])
        self.answers = Answers(c, self.loads)
        # The verbs are the parts' own; lookup and get reach the remote tiers.
        stores, loads, answers = self.stores, self.loads, self.answers
        self.lookup = partial(answers.lookup, reach=self.reach)
        self.get = partial(loads.get, reach=self.reach)
        self.delete = stores.delete
        self.put, self.stage, self.drop_staged = stores.put, stores.stage, stores.drop_staged
        self.stage_room, self.stage_many = stores.stage_room, stores.stage_many
        self.stage_rooms, self.make_durable = stores.stage_rooms, stores.make_durable
        self.write_room, self.reserve = stores.write_room, stores.reserve
        self.reserve_arriving, self.abort = stores.reserve_arriving, stores.abort
        self.connection_closed = stores.connection_closed
        self.unpin, self.release, self.looked_up = loads.unpin, answers.release, answers.looked_up
        #: retention leases (docs/retention.md)
        leasing = [spec.tier for spec in remotes if spec.tier.keeps_leases]

        def forward(keys: Sequence[bytes], retention: Retention) -> None:
            if self.life.closing:
                return  # (the peers' leases end by their time)
            for tier in leasing:
                self.life.task(tier.retain_copies(list(keys), retention))

        self.retainer = Retainer(ram, now, counters, self.holds, disk, forward if leasing else None)

    def __repr__(self) -> str:
        return (
            f"<Service ram={self.ram!r} disk={self.disk!r} {self.loads!r} "
            f"remotes={self.remotes!r} {self.pending!r} {self.answers!r}>"
        )

    def local(self, source: str, sealer: Sealer) -> LocalView:
        """The service as a peer daemon sees it: its pushes stored as from
        ``source``, its blocks travelling through ``sealer``."""
        parts = (self.answers, self.loads, self.stores, self.local_reach, self.limits)
        return SealedView(*parts, source=source, sealer=sealer, retainer=self.retainer)

    # ------------------------------------------------------------ lifecycle

    def start(self, spawn: Spawn) -> None:
        """Attach to the daemon's task group and start periodic sweeps."""
        self.life.start(spawn)
        self.scheduler.every(self.cfg.sweep_interval, self.sweep)
        self.propagation.open()  # (what the tiers were owed when the last run stopped)

    def begin_shutdown(self) -> None:
        """Wake every waiting lookup and GET so that it answers now."""
        self.life.begin_shutdown()
        self.events.close()

    def close(self) -> None:
        """End every pending write, probe and disk read (waiters answered MISS)."""
        self.pending.end_all()
        self.probing.abandon_all()
        self.loads.close()
        self.propagation.close()

    def sweep(self) -> None:
        now = self.scheduler.now()
        self.retainer.expire()
        self.probing.expire(now)
        self.answers.deferrals.expire(now)
        if self.disk is not None and self.disk.fsync == "batch" and not self.life.closing:
            self.life.task(self._sync_disk())

    async def _sync_disk(self) -> None:
        assert self.disk is not None
        try:
            await self.disk.sync()
        except OSError as exc:
            log.warning("disk: periodic sync failed: %s", exc)

    # ------------------------------------------------------------ RETENTION

    def retain(
        self,
        keys: Sequence[bytes],
        retention: Retention,
        lookup: bool = False,
        whole: bool = False,
    ) -> None:
        """``retention`` for the resident ones of ``keys`` (a chain); ``lookup``:
        a lookup asked for them (a return within the lease is counted);
        ``whole``: the session's whole prompt (its other leases end)."""
        if lookup:
            self.retainer.looked_up(keys, retention, whole)
        else:
            self.retainer.retain(keys, retention)

    def retain_arriving(self, keys: Sequence[bytes], retention: Retention) -> None:
        """``retention`` for the ones of ``keys`` (a chain a leased lookup
        asked for) not under it yet: those in RAM now, and those on their
        way into RAM (read from the disk, promoted from a remote tier) as
        they land. A session that comes back has its blocks back in RAM
        under its lease."""
        ram, arriving, holds = self.ram, self.loads.arriving, self.retainer.holds
        landed: list[bytes] = []
        loads: list[tuple[bytes, Any]] = []
        for key in keys:
            if ram.contains(key):
                if not holds(key, retention):
                    landed.append(key)
            elif (load := arriving(key)) is not None:
                loads.append((key, load))
        if landed:
            self.retainer.retain(landed, retention)
        if loads:
            self.retainer.on_arrival(loads, retention)

    def release_retention(self, session: bytes, namespace: bytes) -> int:
        return self.retainer.release(session, namespace)

    # ------------------------------------------------------------ EVENTS

    def subscribe(self, limit: int) -> Subscription:
        return self.events.subscribe(limit)

    def unsubscribe(self, sub: Subscriber) -> None:
        self.events.unsubscribe(sub)

    def snapshot(self) -> list[BlockEvent]:
        """Every block held now, as SNAPSHOT events at the current sequence
        number, then SNAPSHOT_END (taken in one step: later events follow it)."""
        seq, ram, disk = self.events.seq, self.ram.resident(), self.disk
        out = [BlockEvent(seq, EventKind.SNAPSHOT, k, EventTier.RAM) for k in list(ram)]
        if disk is not None:
            out += [
                BlockEvent(seq, EventKind.SNAPSHOT, k, EventTier.DISK)
                for k in disk.indexed()
                if k not in ram
            ]
        out.append(BlockEvent(seq, EventKind.SNAPSHOT_END))
        return out

    # ------------------------------------------------------------ LOOKUP PROCESS

    def feed(self, write: Callable[[FeedRecords], None]) -> None:
        """Start the lookup process's feed (docs/lookup-process.md): a
        snapshot of what is held and pending now, then every change, through
        ``write``, in the step it is made (:class:`~kvtier.core.holdings.Holdings`)."""
        disk = self.disk
        self.holdings.feed(write, disk.scan_done if disk is not None else None)

    def stop_feed(self) -> None:
        """The lookup process is gone: write no more."""
        self.holdings.stop_feed()

    def holds(self, key: bytes) -> bool:
        """Whether a local tier (RAM, the disk) holds ``key`` now."""
        return self.holdings.holds(key)

    # ------------------------------------------------------------ STATS

    def namespace_stats(self) -> list[NamespaceStats]:
        """What each namespace holds (with quotas: RAM and disk) and its lookups."""
        ram = self.ram.budget.shares
        disk = self.disk.budget.shares if self.disk is not None else None
        counted = self.answers.namespace_counts
        # Configured namespaces first, then in the order first seen: a
        # namespace keeps its place (and its series, when they are capped).
        names: dict[bytes, None] = dict.fromkeys(ram.quotas if ram is not None else ())
        names.update(dict.fromkeys(counted))
        for shares in (ram, disk):
            if shares is not None:
                names.update(dict.fromkeys(ns for ns, n in shares.used.items() if n))
        out = []
        for ns in names:
            counts = counted.get(ns, NamespaceCounts())
            quota = ram.quota(ns) if ram is not None else None
            out.append(
                NamespaceStats(
                    name="other" if ns == OTHER_NAMESPACE else namespace_name(ns),
                    ram_bytes=ram.used.get(ns, 0) if ram is not None else 0,
                    ram_blocks=_blocks(ram, ns),
                    disk_bytes=disk.used.get(ns, 0) if disk is not None else 0,
                    disk_blocks=_blocks(disk, ns),
                    evictions=ram.evictions.get(ns, 0) if ram is not None else 0,
                    hits=counts.hits,
                    misses=counts.misses,
                    ram_min=quota.min if quota is not None else 0,
                    ram_max=quota.max if quota is not None else None,
                )
            )
        return out

    def map_sizes(self) -> MapSizes:
        owing = [(w.name, w.outbox) for w in self.propagation.writers if w.outbox is not None]
        return MapSizes(
            probes_inflight={s.name: s.probes.inflight_count for s in self.remotes},
            verdicts_cached={s.name: s.probes.verdict_count for s in self.remotes},
            pending_writes=len(self.pending.table),
            request_states=len(self.answers.deferrals),
            timers=self.scheduler.deadline_count,
            owed_blocks={name: len(box) for name, box in owing},
            owed_bytes={name: box.bytes for name, box in owing},
        )

    def tiers(self) -> list[Tier]:
        local: list[Tier] = [self.ram] + ([self.disk] if self.disk is not None else [])
        return local + [s.tier for s in self.remotes]

    def stats(self) -> dict[str, Any]:
        sizes = self.map_sizes()
        return {
            "tiers": {st.name: st.as_dict() for st in (t.stats() for t in self.tiers())},
            "maps": {
                "probes_inflight": sum(sizes.probes_inflight.values()),
                "verdicts": sum(sizes.verdicts_cached.values()),
                "reservations": sizes.pending_writes,
                "request_states": sizes.request_states,
                "timers": sizes.timers,
            },
            "probes": {
                s.name: {"inflight": s.probes.inflight_count, "verdicts": s.probes.verdict_count}
                for s in self.remotes
            },
            "namespaces": {n.name: n.as_dict() for n in self.namespace_stats()},
            "writes": self.propagation.stats(),
            "retention": self.retainer.stats(),
            "sources": self.source_costs(),
            "lookup_budget_cut": {
                tier: int(n) for (tier,), n in self.counters.lookup_budget_cut.samples()
            },
        }

    def source_costs(self) -> dict[str, dict[str, float]]:
        """What a load costs from each source now (every tier a lookup may
        load from: their priors until loads are observed)."""
        costs = self.costs
        return {
            t.name: {
                "ttfb_seconds": (e := costs.of(t.name)).ttfb,
                "throughput_bytes": e.throughput,
                "block_bytes": e.block_bytes,
                "loads_in_flight": self.loads.occupancy.inflight.get(t.name, 0),
                "loads": e.loads,
            }
            for t in self.tiers()
        }


def _blocks(shares: Shares | None, ns: bytes) -> int:
    policy = shares.policies.get(ns) if shares is not None else None
    return len(policy) if policy is not None else 0

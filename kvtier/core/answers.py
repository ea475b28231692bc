"""LOOKUP's answers: the states of a lookup's keys, the prefix an engine may
load, and the work the answer needs started (probes, promotions, disk reads
ahead of the GET it foresees).

:class:`Answers` owns the readers' side of a request: the request tags'
bounds on PENDING (:class:`~kvtier.core.deferral.DeferralTracker`) and the
answers counted by state and namespace. It answers the daemon's own
lookups and hears of the lookup process's (:meth:`Answers.looked_up`),
doing after each what the other does, so the two cannot drift.

Invariants: a lookup never waits on I/O to answer (it decides from the
locator, starts the work, and answers now); a waiting lookup ends when its
keys settle, its ``wait`` passes, its caller stops listening or shutdown
begins, and never cancels the shared futures it waits on; a key past its
reader's bound answers MISS for that request, never a hit; a peek touches
nothing and reads nothing ahead. Imports the core's parts and the shared
records.
"""

from __future__ import annotations

import asyncio
from asyncio import FIRST_COMPLETED
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any

from kvtier.core.checks import check_lookup
from kvtier.core.context import Context
from kvtier.core.costs import budget_cut
from kvtier.core.counts import (
    MAX_COUNTED_NAMESPACES,
    OTHER_NAMESPACE,
    NamespaceCounts,
)
from kvtier.core.deferral import DeferralTracker
from kvtier.core.loads import Loads
from kvtier.core.lookup import (
    Location,
    LookupPlan,
    SeenProbes,
    Where,
    plan_lookup,
    prefix_answer,
    waits_for,
)
from kvtier.core.probing import Reach, RemoteSlot
from kvtier.core.writes import Promotion
from kvtier.model import (
    DEFAULT_NAMESPACE,
    HIT,
    MISS,
    NAMESPACE_MARK,
    PENDING,
    RETRY,
    STATE_NAMES,
    Lookup,
    LookupMode,
    LookupReply,
)


class Answers:
    """LOOKUP: states, the prefix answer, waits, and the readers' bounds."""

    def __init__(
        self,
        c: Context,
        loads: Loads,
    ) -> None:
        #: what every part of the service works with
        self.c = c
        self.loads = loads
        #: LOOKUP's answers counted by state, bound once
        self._state_counters = {
            state: c.counters.lookup_keys.bind(name) for state, name in STATE_NAMES.items()
        }
        #: lookup answers by namespace (at most MAX_COUNTED_NAMESPACES apart)
        self.namespace_counts: dict[bytes, NamespaceCounts] = {}
        #: the request tags' bounds on PENDING
        self.deferrals = DeferralTracker(c.cfg.request_state_ttl, c.cfg.max_request_states)

    def __repr__(self) -> str:
        return f"<Answers namespaces={len(self.namespace_counts)} {self.deferrals!r}>"

    def lookup(
        self, req: Lookup, cutoff: asyncio.Future[None] | None = None, *, reach: Reach
    ) -> LookupReply | Awaitable[LookupReply]:
        """The states of ``req.keys`` and the prefix answer: now, or (with
        ``wait``, while some key can still settle) the awaitable that answers
        once all settled, ``wait`` passes, ``cutoff`` resolves (the caller
        stopped listening) or shutdown begins."""
        check_lookup(self.c.limits, req)
        if req.peek:
            self.c.counters.lookup_peeks.value += 1
        now = self.c.now()
        # Probes a waiting lookup has seen end: a key whose probe failed is
        # answered MISS rather than probed again in a loop.
        seen: SeenProbes | None = {} if req.wait > 0 else None
        reply, waits, bound_at = self._look(req, reach, now, seen)
        if not waits or req.wait <= 0 or (bound_at is not None and now >= bound_at):
            return self._count(reply, req.keys)
        assert seen is not None
        return self._wait(req, cutoff, reach, now + req.wait, seen, waits, bound_at)

    async def _wait(
        self,
        req: Lookup,
        cutoff: asyncio.Future[None] | None,
        reach: Reach,
        deadline: float,
        seen: SeenProbes,
        waits: list[asyncio.Future[Any]],
        bound_at: float | None,
    ) -> LookupReply:
        life = self.c.life
        while True:
            now = self.c.now()
            until = deadline if bound_at is None else min(deadline, bound_at)
            if now < until and not life.closing and not (cutoff and cutoff.done()):
                if cutoff is not None:
                    waits.append(cutoff)
                # asyncio.wait never cancels what it waits on: shared probe and
                # write futures survive this caller going away.
                await asyncio.wait(
                    life.waits(*waits), timeout=until - now, return_when=FIRST_COMPLETED
                )
                now = self.c.now()
            reply, waits, bound_at = self._look(req, reach, now, seen)
            until = deadline if bound_at is None else min(deadline, bound_at)
            if not waits or now >= until or life.closing or (cutoff and cutoff.done()):
                return self._count(reply, req.keys)

    def _look(
        self, req: Lookup, reach: Reach, now: float, seen: SeenProbes | None
    ) -> tuple[LookupReply, list[asyncio.Future[Any]], float | None]:
        """Answer ``req`` as things stand, starting the work its keys need;
        with ``seen`` (a waiting lookup) also what can change the answer."""
        keys = req.keys
        disk = self.c.disk
        slots = reach.remotes
        scan = disk.scan_done if disk is not None and disk.scanning else None
        if not slots and not self.c.pending.table and scan is None:
            # The fast path. HIT is 1 and MISS is 0: membership tests map
            # straight onto states.
            states = bytearray(map(self.c.ram.resident().__contains__, keys))
            on_disk: list[int] = []
            if disk is not None and states.count(MISS):
                for i in range(len(states)):
                    if not states[i] and disk.contains(keys[i]):
                        states[i] = HIT
                        on_disk.append(i)
            settles: list[asyncio.Future[Any] | None] = []
            if req.budget > 0:
                self._cut(req, states, *self._sources_local(keys, states, on_disk))
        else:
            locate = reach.locator.locate
            locations = [locate(key, now, seen) for key in keys]
            plan = plan_lookup(
                locations,
                remotes=len(slots),
                remote_hit_reads_hit=self.c.cfg.remote_hit == "hit",
                closing=self.c.life.closing,
                scan=scan,
            )
            states, settles, on_disk = plan.states, plan.settles, plan.on_disk
            for slot, n in zip(slots, plan.cached, strict=True):
                slot.cached.value += n
            if req.budget > 0:  # (before the work starts: what it cut is not loaded)
                self._cut(req, states, *self._sources(keys, locations, states, slots), plan)
            if plan.joins or plan.probe or plan.promote:
                self._start(plan, keys, slots, now, seen)
        hits, defer, bound_at = self._after_look(req, states, on_disk, now)
        unsettled = seen is not None and settles and (PENDING in states or RETRY in states)
        waits = waits_for(states, settles, req.mode) if unsettled else []
        return LookupReply(bytes(states), hits, defer), waits, bound_at

    def _after_look(
        self,
        req: Lookup,
        states: bytearray,
        on_disk: list[int],
        now: float,
        reported: bool = False,
    ) -> tuple[int, bool, float | None]:
        """What every answered lookup does once its keys' states are known:
        the reader's bound on PENDING (which may turn one MISS), the prefix
        answer, the touches, the disk hits read ahead. Returns the prefix
        answer and when the bound will pass, if armed. ``reported``: the
        lookup process answered it, and the daemon hears of it now."""
        keys = req.keys
        bound_at: float | None = None
        if req.max_pending_wait > 0:
            bound = req.max_pending_wait
            result = self.deferrals.observe(
                req.request_tag, keys, states, bound, now, reported=reported
            )
            if result.ends_deferral is not None:
                self.c.counters.lookup_deferred_seconds.observe(result.ends_deferral)
            if result.expired_index is not None:
                # Past the reader's bound: a MISS for this request, never a hit.
                states[result.expired_index] = MISS
                if result.newly_expired:
                    self.c.counters.lookup_pending_expired.inc()
            bound_at = result.expires_at
        window = req.window if req.mode == LookupMode.SLIDING_WINDOW else 0
        hits, defer = prefix_answer(states, window)
        # A HIT is a read to come: the eviction policy hears of it (later,
        # before the next write, so the reply does not wait for it).
        touched = len(keys) if req.mode == LookupMode.KEYS else hits
        if touched and HIT in states and not req.peek:
            self.c.ram.touch_later(keys, touched)
        if on_disk and self.c.disk_cfg.promote_on_lookup and not req.peek:
            # Start loading the usable disk hits into RAM: the GET comes next.
            limit = hits if req.mode != LookupMode.KEYS else len(keys)
            for i in on_disk:
                if i >= limit:
                    break
                if states[i] == HIT:  # not one the reader's bound expired
                    self.loads.load_from_disk(keys[i])  # a key listed twice is read once
        return hits, defer, bound_at

    def _sources_local(
        self, keys: Sequence[bytes], states: bytearray, on_disk: list[int]
    ) -> tuple[list[tuple[str, int] | None], dict[str, int]]:
        """Where each HIT of a lookup that only local tiers answer loads
        from, and its bytes; and how many of them load already, per source."""
        ram, disk = self.c.ram, self.c.disk
        from_disk = set(on_disk)
        out: list[tuple[str, int] | None] = []
        loading = 0
        for i, (key, state) in enumerate(zip(keys, states, strict=True)):
            if state != HIT:
                out.append(None)
            elif disk is not None and i in from_disk:
                out.append((disk.name, disk.budget.size_of(key)))
                loading += self.loads.arriving(key) is not None
            else:
                out.append((ram.name, ram.budget.size_of(key)))
        return out, ({disk.name: loading} if disk is not None and loading else {})

    def _sources(
        self,
        keys: Sequence[bytes],
        locations: Sequence[Location],
        states: bytearray,
        slots: Sequence[RemoteSlot],
    ) -> tuple[list[tuple[str, int] | None], dict[str, int]]:
        """Where the bytes of each key that may load (HIT, PENDING, RETRY)
        come from, and how many where known: RAM and the disk their own; a
        remote hit its tier's (of that tier's mean size); a pending write
        RAM's when a client writes it, its source tier's when it is a
        promotion; a key still unknown the first tier that would be probed
        for it (or the disk, while its index is rebuilt). A key past the cut
        then starts none of that work, and is counted by that tier. And how
        many of the keys load already (promotions), per source."""
        ram, disk = self.c.ram, self.c.disk
        out: list[tuple[str, int] | None] = []
        loading: dict[str, int] = {}
        for key, loc, state in zip(keys, locations, states, strict=True):
            where = loc.where
            if state == MISS:
                out.append(None)
            elif where is Where.RAM:
                out.append((ram.name, ram.budget.size_of(key)))
            elif where is Where.DISK and disk is not None:
                out.append((disk.name, disk.budget.size_of(key)))
            elif where is Where.REMOTE:
                out.append((slots[loc.remote].name, 0))
            elif where is Where.PENDING and loc.reservation is not None:
                owner = loc.reservation.owner
                source = owner.source if isinstance(owner, Promotion) else ram.name
                out.append((source, loc.reservation.size))
                if isinstance(owner, Promotion):
                    loading[source] = loading.get(source, 0) + 1
            elif where is Where.PROBING:
                first = min((*loc.unprobed, *(t for t, _ in loc.inflight)))
                out.append((slots[first].name, 0))
            elif disk is not None:
                out.append((disk.name, 0))  # (SCANNING: the disk may hold it)
            else:
                out.append(None)
        return out, loading

    def _cut(
        self,
        req: Lookup,
        states: bytearray,
        sources: list[tuple[str, int] | None],
        loading: Mapping[str, int],
        plan: LookupPlan | None = None,
    ) -> None:
        """Answer MISS for the keys past the prefix worth loading within
        ``req.budget`` (:func:`~kvtier.core.costs.budget_cut`), counted by the
        tier each would have loaded from; the plan's work for them is not
        started. ``loading``: the keys' own loads in flight per source."""
        cut = budget_cut(
            [s[0] if s is not None else None for s in sources],
            [s[1] if s is not None else 0 for s in sources],
            self.c.costs,
            req.budget,
            self.loads.occupancy.inflight,
            loading,
        )
        if cut == len(states):
            return
        counted = self.c.counters.lookup_budget_cut
        for i in range(cut, len(states)):
            source = sources[i]
            if source is not None:
                counted.inc(source[0])
            states[i] = MISS
        if plan is not None:
            plan.on_disk = [i for i in plan.on_disk if i < cut]
            plan.probe = [(i, t) for i, t in plan.probe if i < cut]
            plan.promote = [(i, t) for i, t in plan.promote if i < cut]
            plan.joins = [j for j in plan.joins if j[0] < cut]
            for i in range(cut, len(states)):
                plan.settles[i] = None

    def _start(
        self,
        plan: LookupPlan,
        keys: Sequence[bytes],
        slots: Sequence[RemoteSlot],
        now: float,
        seen: SeenProbes | None,
    ) -> None:
        """Start what ``plan`` says the lookup needs: probes and promotions."""
        settles = plan.settles
        for i, t, fut in plan.joins:
            slots[t].joined.value += 1
            if seen is not None:
                seen[(t, keys[i])] = fut
        for i, t in plan.probe:
            slot, key = slots[t], keys[i]
            probe = slot.probes.inflight(key)  # a key listed twice is probed once
            if probe is None:
                probe = self.c.probing.begin(slot, key)
            if settles[i] is None:
                settles[i] = probe.future
            if seen is not None:
                seen[(t, key)] = probe.future
        table = self.c.pending.table
        for i, t in plan.promote:
            res = table.get(keys[i]) or self.loads.promote(slots[t], keys[i], now)
            settles[i] = res.done

    def _count(self, reply: LookupReply, keys: list[bytes], times: int = 1) -> LookupReply:
        raw = reply.raw_states
        for state, cell in self._state_counters.items():
            n = raw.count(state)
            if n:
                cell.value += n * times
        if keys:  # a request's keys are one namespace's (a client's connection)
            k = keys[0]  # its namespace, as model.namespace_of reads it
            ns = k[2 : 2 + k[1]] if k[0] == NAMESPACE_MARK and len(k) > 1 else DEFAULT_NAMESPACE
            counts = self.namespace_counts.get(ns)
            if counts is None:
                counts = self._count_namespace(ns)
            counts.hits += raw.count(HIT) * times
            counts.misses += raw.count(MISS) * times
        return reply

    def _count_namespace(self, ns: bytes) -> NamespaceCounts:
        if len(self.namespace_counts) >= MAX_COUNTED_NAMESPACES:
            ns = OTHER_NAMESPACE
            if ns in self.namespace_counts:
                return self.namespace_counts[ns]
        counts = self.namespace_counts[ns] = NamespaceCounts()
        return counts

    def looked_up(self, req: Lookup, states: bytes, count: int = 1) -> None:
        """A lookup the lookup process answered (``count`` times alike): what
        the daemon's own lookup does after its answer (touches, once; the
        disk hits read ahead, the reader's bound, the counts, each time), as
        things stand now."""
        if req.peek:
            self.c.counters.lookup_peeks.value += count
        ram, disk = self.c.ram.resident(), self.c.disk
        keys = req.keys
        on_disk: list[int] = []
        if disk is not None:
            on_disk = [i for i, k in enumerate(keys) if states[i] == HIT and k not in ram]
            on_disk = [i for i in on_disk if disk.contains(keys[i])]
        answered = bytearray(states)
        hits, defer, _ = self._after_look(req, answered, on_disk, self.c.now(), reported=True)
        self._count(LookupReply(states, hits, defer), keys, count)

    def release(self, tag: bytes) -> bool:
        """Forget a request tag's reader-side state."""
        existed = self.deferrals.get(tag) is not None
        deferred = self.deferrals.release(tag, self.c.now())
        if deferred is not None:
            self.c.counters.lookup_deferred_seconds.observe(deferred)
        return existed

"""The cache service: the verbs (lookup, get, put, delete, reserve) over the
tiers, and the one place that acts on what the pure modules decide.

The server decodes a request into a record of :mod:`kvtier.model`, calls
one verb and encodes what it returns. One calling convention: a verb checks
its request, decides and starts what it needs synchronously, then returns
its answer now, or the awaitable that gives it once the I/O it started is
done (``lookup``, ``get``, ``delete``). ``put``, ``reserve``, ``abort`` and
``release`` never wait.

Every verb asks :class:`~kvtier.core.lookup.Locator` where a key is and acts
on the answer; no other code decides the order of the tiers. The pure halves
decide (:mod:`~kvtier.core.lookup`, :mod:`~kvtier.core.writes`,
:mod:`~kvtier.core.probes`); their acting halves have modules of their own:
:class:`~kvtier.core.writing.PendingWrites` (nothing is pending forever) and
:class:`~kvtier.core.probing.RemoteProbes` (probes are shared and always end).

Imports the core, the tiers, the shared records and the errors; never the
wire, the server or metrics.
"""

from __future__ import annotations

import asyncio
import logging
from asyncio import FIRST_COMPLETED
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from kvtier.config import DiskConfig, LookupConfig
from kvtier.core.checks import check_keys, check_lookup, check_seconds, check_sizes, check_values
from kvtier.core.counts import (
    MAX_COUNTED_NAMESPACES,
    OTHER_NAMESPACE,
    CoreCounters,
    MapSizes,
    NamespaceCounts,
    NamespaceStats,
    Promoted,
)
from kvtier.core.deferral import DeferralTracker
from kvtier.core.events import EventLog, Subscription
from kvtier.core.holdings import Holdings
from kvtier.core.lookup import (
    Location,
    Locator,
    LookupPlan,
    SeenProbes,
    Where,
    plan_lookup,
    prefix_answer,
    waits_for,
)
from kvtier.core.probes import Verdict
from kvtier.core.probing import RemoteProbes, RemoteSlot
from kvtier.core.propagation import Propagation, RemoteSpec, WritePolicy, Writer
from kvtier.core.timers import Scheduler
from kvtier.core.writes import End, Promotion, Reservation
from kvtier.core.writing import PendingWrites
from kvtier.errors import (
    KvtierError,
    NoCapacityError,
    TierError,
    ValueTooLargeError,
)
from kvtier.model import (
    DEFAULT_NAMESPACE,
    HIT,
    MISS,
    NAMESPACE_MARK,
    PENDING,
    RETRY,
    STATE_NAMES,
    BlockEvent,
    Buffer,
    ConnId,
    EventKind,
    EventTier,
    FeedRecords,
    Limits,
    Lookup,
    LookupMode,
    LookupReply,
    PutHint,
    PutStatus,
    Reserve,
    ReserveStatus,
    Spawn,
    Subscriber,
    namespace_name,
)
from kvtier.tiers.base import LocalTier, Tier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.ram import RamTier
from kvtier.tiers.shares import Shares

log = logging.getLogger("kvtier.service")

#: a GET gives up on a key after this many rounds of waiting on writes that
#: ended without the block (each round is bounded by a write deadline)
MAX_READ_ROUNDS = 8


class Service:
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
        self.cfg = lookup if lookup is not None else LookupConfig()
        self.disk_cfg = disk_cfg if disk_cfg is not None else DiskConfig()
        self.counters = counters if counters is not None else CoreCounters()
        #: the one scheduler loop (built with the daemon's parts)
        self.scheduler = scheduler
        #: the clock every deadline and TTL is read on
        self._now = self.scheduler.now
        self._spawn: Spawn | None = None
        #: shutdown has begun: waits end, no new backend work starts
        self.closing = False
        #: reads from the disk into RAM in flight, by key: every GET of the key joins one
        self._disk_loads: dict[bytes, asyncio.Future[None]] = {}
        self._closing: asyncio.Future[None] | None = None
        self.pending = PendingWrites(ram, self.scheduler, self.counters)
        #: LOOKUP's answers counted by state, bound once
        self._state_counters = {
            state: self.counters.lookup_keys.bind(name) for state, name in STATE_NAMES.items()
        }
        #: lookup answers by namespace (at most MAX_COUNTED_NAMESPACES apart)
        self.namespace_counts: dict[bytes, NamespaceCounts] = {}
        self.deferrals = DeferralTracker(self.cfg.request_state_ttl, self.cfg.max_request_states)
        self.probing = RemoteProbes(
            [spec.tier for spec in remotes],
            verdict_ttl=self.cfg.verdict_ttl,
            error_ttl=self.cfg.error_ttl,
            max_verdicts=self.cfg.max_verdicts,
            probe_timeout=self.cfg.probe_timeout,
            scheduler=self.scheduler,
            counters=self.counters,
            task=self._task,
            on_present=self._probed_present,
        )
        self.remotes = self.probing.slots
        self.locator = Locator(
            ram.resident(), disk, self.pending.table, [s.probes for s in self.remotes]
        )
        # Requests from peer daemons see the local tiers only: with no remote
        # tier to consult, no key is ever REMOTE or PROBING, so nothing is
        # forwarded and two daemons can never bounce a probe.
        self.local_locator = Locator(ram.resident(), disk, self.pending.table, [])
        #: what this node holds, as events for routers (SUBSCRIBE)
        self.events = EventLog()
        local: list[tuple[EventTier, LocalTier]] = [(EventTier.RAM, ram)]
        if disk is not None:
            local.append((EventTier.DISK, disk))
        #: the one place where what the local tiers hold changes is told, and
        #: tells the kept verdicts, the lookup process's feed and the events
        self.holdings = Holdings(local, self.pending.table, self.events, self._invalidate)
        writers = [spec.writer(self._invalidate) for spec in remotes]
        if disk is not None:
            policy = WritePolicy(self.disk_cfg.write_policy)
            pending = self.disk_cfg.max_pending_write_bytes
            writers.insert(0, Writer(disk.name, policy, pending, disk.write, disk.contains, True))
        self.propagation = Propagation(
            [w for w in writers if w.policy is not WritePolicy.NONE or w.local],
            self.counters,
            self._task,
            lambda: self.closing,
            hold=lambda _key, value: ram.hold(value),
            let_go=lambda _key, value: ram.let_go(value),
        )
        #: promotions counted by source tier and outcome, bound once
        self._promoted = {
            tier.name: {o: self.counters.promotions.bind(tier.name, o.value) for o in Promoted}
            for tier in self.tiers()[1:]
        }
        # A demoted block must outlive its arena slot, which is reused at once.
        ram.keep_evicted = any(w.policy is WritePolicy.WRITE_BACK for w in self.propagation.writers)

    def __repr__(self) -> str:
        return (
            f"<Service ram={self.ram!r} disk={self.disk!r} disk_loads={len(self._disk_loads)} "
            f"remotes={self.remotes!r} {self.pending!r} {self.deferrals!r}>"
        )

    # ------------------------------------------------------------ lifecycle

    def start(self, spawn: Spawn) -> None:
        """Attach to the daemon's task group and start periodic sweeps."""
        self._spawn = spawn
        self._closing = asyncio.get_running_loop().create_future()
        self.scheduler.every(self.cfg.sweep_interval, self.sweep)

    def begin_shutdown(self) -> None:
        """Wake every waiting lookup and GET so that it answers now."""
        self.closing = True
        if self._closing is not None and not self._closing.done():
            self._closing.set_result(None)
        self.events.close()

    def close(self) -> None:
        """End every pending write, probe and disk read (waiters answered MISS)."""
        self.pending.end_all()
        self.probing.abandon_all()
        loads, self._disk_loads = self._disk_loads, {}
        for done in loads.values():  # a read whose task never ran
            if not done.done():
                done.set_result(None)

    def sweep(self) -> None:
        now = self.scheduler.now()
        self.probing.expire(now)
        self.deferrals.expire(now)
        if self.disk is not None and self.disk.fsync == "batch" and not self.closing:
            self._task(self._sync_disk())

    async def _sync_disk(self) -> None:
        assert self.disk is not None
        try:
            await self.disk.sync()
        except OSError as exc:
            log.warning("disk: periodic sync failed: %s", exc)

    def _task(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        if self._spawn is None:
            coro.close()
            raise RuntimeError("service not started")
        task: asyncio.Task[None] = self._spawn(coro)
        return task

    # ------------------------------------------------------------ LOOKUP

    def lookup(
        self, req: Lookup, cutoff: asyncio.Future[None] | None = None, *, local: bool = False
    ) -> LookupReply | Awaitable[LookupReply]:
        """The states of ``req.keys`` and the prefix answer: now, or (with
        ``wait``, while some key can still settle) the awaitable that answers
        once all settled, ``wait`` passes, ``cutoff`` resolves (the caller
        stopped listening) or shutdown begins.

        ``local``: answer from the local tiers only (a peer's request)."""
        check_lookup(self.limits, req)
        if req.peek:
            self.counters.lookup_peeks.value += 1
        locator = self.local_locator if local else self.locator
        now = self._now()
        # Probes a waiting lookup has seen end: a key whose probe failed is
        # answered MISS rather than probed again in a loop.
        seen: SeenProbes | None = {} if req.wait > 0 else None
        reply, waits, bound_at = self._look(req, locator, now, seen)
        if not waits or req.wait <= 0 or (bound_at is not None and now >= bound_at):
            return self._answer(reply, req.keys)
        assert seen is not None
        return self._wait_for_lookup(req, cutoff, locator, now + req.wait, seen, waits, bound_at)

    async def _wait_for_lookup(
        self,
        req: Lookup,
        cutoff: asyncio.Future[None] | None,
        locator: Locator,
        deadline: float,
        seen: SeenProbes,
        waits: list[asyncio.Future[Any]],
        bound_at: float | None,
    ) -> LookupReply:
        while True:
            now = self._now()
            until = deadline if bound_at is None else min(deadline, bound_at)
            if now < until and not self.closing and not (cutoff and cutoff.done()):
                if self._closing is not None:
                    waits.append(self._closing)
                if cutoff is not None:
                    waits.append(cutoff)
                # asyncio.wait never cancels what it waits on: shared probe and
                # write futures survive this caller going away.
                await asyncio.wait(waits, timeout=until - now, return_when=FIRST_COMPLETED)
                now = self._now()
            reply, waits, bound_at = self._look(req, locator, now, seen)
            until = deadline if bound_at is None else min(deadline, bound_at)
            if not waits or now >= until or self.closing or (cutoff and cutoff.done()):
                return self._answer(reply, req.keys)

    def _look(
        self, req: Lookup, locator: Locator, now: float, seen: SeenProbes | None
    ) -> tuple[LookupReply, list[asyncio.Future[Any]], float | None]:
        """Answer ``req`` as things stand, starting the work its keys need;
        with ``seen`` (a waiting lookup) also what can change the answer."""
        keys = req.keys
        disk = self.disk
        slots = self.remotes if locator is self.locator else []
        scan = disk.scan_done if disk is not None and disk.scanning else None
        if not slots and not self.pending.table and scan is None:
            # The fast path. HIT is 1 and MISS is 0: membership tests map
            # straight onto states.
            states = bytearray(map(self.ram.resident().__contains__, keys))
            on_disk: list[int] = []
            if disk is not None and states.count(MISS):
                for i in range(len(states)):
                    if not states[i] and disk.contains(keys[i]):
                        states[i] = HIT
                        on_disk.append(i)
            settles: list[asyncio.Future[Any] | None] = []
        else:
            locate = locator.locate
            locations = [locate(key, now, seen) for key in keys]
            plan = plan_lookup(
                locations,
                remotes=len(slots),
                remote_hit_reads_hit=self.cfg.remote_hit == "hit",
                closing=self.closing,
                scan=scan,
            )
            states, settles, on_disk = plan.states, plan.settles, plan.on_disk
            for slot, n in zip(slots, plan.cached, strict=True):
                slot.cached.value += n
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
                self.counters.lookup_deferred_seconds.observe(result.ends_deferral)
            if result.expired_index is not None:
                # Past the reader's bound: a MISS for this request, never a hit.
                states[result.expired_index] = MISS
                if result.newly_expired:
                    self.counters.lookup_pending_expired.inc()
            bound_at = result.expires_at
        window = req.window if req.mode == LookupMode.SLIDING_WINDOW else 0
        hits, defer = prefix_answer(states, window)
        # A HIT is a read to come: the eviction policy hears of it (later,
        # before the next write, so the reply does not wait for it).
        touched = len(keys) if req.mode == LookupMode.KEYS else hits
        if touched and HIT in states and not req.peek:
            self.ram.touch_later(keys, touched)
        if on_disk and self.disk_cfg.promote_on_lookup and not req.peek:
            # Start loading the usable disk hits into RAM: the GET comes next.
            limit = hits if req.mode != LookupMode.KEYS else len(keys)
            for i in on_disk:
                if i >= limit:
                    break
                if states[i] == HIT:  # not one the reader's bound expired
                    self._load_from_disk(keys[i])  # a key listed twice is read once
        return hits, defer, bound_at

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
                probe = self.probing.begin(slot, key)
            if settles[i] is None:
                settles[i] = probe.future
            if seen is not None:
                seen[(t, key)] = probe.future
        table = self.pending.table
        for i, t in plan.promote:
            res = table.get(keys[i]) or self._promote(slots[t], keys[i], now)
            settles[i] = res.done

    def _answer(self, reply: LookupReply, keys: list[bytes], times: int = 1) -> LookupReply:
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

    def namespace_stats(self) -> list[NamespaceStats]:
        """What each namespace holds (with quotas: RAM and disk) and its lookups."""
        ram = self.ram.budget.shares
        disk = self.disk.budget.shares if self.disk is not None else None
        # Configured namespaces first, then in the order first seen: a
        # namespace keeps its place (and its series, when they are capped).
        names: dict[bytes, None] = dict.fromkeys(ram.quotas if ram is not None else ())
        names.update(dict.fromkeys(self.namespace_counts))
        for shares in (ram, disk):
            if shares is not None:
                names.update(dict.fromkeys(ns for ns, n in shares.used.items() if n))
        out = []
        for ns in names:
            counts = self.namespace_counts.get(ns, NamespaceCounts())
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

    # ------------------------------------------------------------ promotions

    def _probed_present(self, slot: RemoteSlot, key: bytes, now: float) -> None:
        """A probe found ``key`` in ``slot``: start loading it, so the next lookup
        finds it PENDING or HIT."""
        if (
            self.cfg.remote_hit == "promote"
            and not self.closing
            and self.locator.locate(key, now).where is Where.REMOTE
        ):
            self._promote(slot, key, now)

    def _invalidate(self, key: bytes) -> None:
        """``key`` changed here: no remote tier's kept verdict answers for it now."""
        for slot in self.remotes:
            slot.probes.invalidate(key)

    def _promote(self, slot: RemoteSlot, key: bytes, now: float) -> Reservation:
        """Load ``key`` from a remote tier into RAM; a tier that claimed the
        block and could not deliver it is told ABSENT for the key (no
        lookup-says-HIT / load-fails livelock)."""

        async def load() -> Buffer | None:
            values = await slot.tier.batch_load([key])
            if len(values) != 1:
                raise TierError(f"{slot.name}: batch_load returned {len(values)} values for 1 key")
            return values[0]

        def failed() -> None:
            slot.probes.force(key, Verdict.ABSENT, self._now())

        return self._start_promotion(slot.name, key, now, load, failed)

    def _load_from_disk(self, key: bytes) -> asyncio.Future[None]:
        """Read ``key`` from the disk into RAM, once for every reader: a GET
        that finds a read of the key in flight joins it. A disk hit reads HIT
        meanwhile (the block is readable now), so this is no pending write."""
        done = self._disk_loads.get(key)
        if done is None:
            done = self._disk_loads[key] = asyncio.get_running_loop().create_future()
            self._task(self._disk_load(key, done))
        return done

    async def _disk_load(self, key: bytes, done: asyncio.Future[None]) -> None:
        disk = self.disk
        assert disk is not None
        promoted = self._promoted[disk.name]
        promoted[Promoted.STARTED].value += 1
        outcome = Promoted.FAILED
        try:
            async with asyncio.timeout(self.cfg.load_timeout):
                value = await disk.read(key)
            if value is None:
                outcome = Promoted.ABSENT
            elif self._store_local(key, value, disk.name) is PutStatus.STORED:
                outcome = Promoted.COMPLETED
            else:
                outcome = Promoted.SUPERSEDED  # a client stored it meanwhile
        except asyncio.CancelledError:
            outcome = Promoted.CANCELLED
            raise
        except Exception as exc:
            log.warning("%s: loading key %s failed: %s", disk.name, key.hex(), exc)
        finally:
            promoted[outcome].value += 1
            if self._disk_loads.get(key) is done:
                del self._disk_loads[key]
            if not done.done():
                done.set_result(None)

    def _start_promotion(
        self,
        source: str,
        key: bytes,
        now: float,
        load: Callable[[], Awaitable[Buffer | None]],
        failed: Callable[[], None] | None,
    ) -> Reservation:
        """A promotion is a pending write whose writer is a load from a lower
        tier: readers of the key wait on it like on any write, so concurrent
        GETs of one key share one load, and its deadline bounds it."""
        res = self.pending.reserve(key, Promotion(source), self.cfg.pending_deadline, 0, now)
        self._promoted[source][Promoted.STARTED].value += 1
        res.task = self._task(self._promotion(source, res, load, failed))
        return res

    async def _promotion(
        self,
        source: str,
        res: Reservation,
        load: Callable[[], Awaitable[Buffer | None]],
        failed: Callable[[], None] | None,
    ) -> None:
        """Load, then store into RAM if the reservation still holds the key (a
        client's PUT may have completed it first). The reservation ends in
        ``finally`` whatever the load did."""
        key = res.key
        outcome = Promoted.FAILED
        try:
            async with asyncio.timeout(self.cfg.load_timeout):
                value = await load()
            if value is None:
                outcome = Promoted.ABSENT
            elif self.pending.table.get(key) is res:
                self._store_local(key, value, source)  # completes res
                outcome = Promoted.COMPLETED
            else:
                outcome = Promoted.SUPERSEDED
        except asyncio.CancelledError:
            outcome = Promoted.CANCELLED
            raise
        except Exception as exc:
            log.warning("%s: loading key %s failed: %s", source, key.hex(), exc)
        finally:
            if failed is not None and outcome in (Promoted.FAILED, Promoted.ABSENT):
                failed()
            self._promoted[source][outcome].value += 1
            if outcome is not Promoted.COMPLETED:  # a completed one ended with its store
                self.pending.end(res, End.ABORTED)

    # ------------------------------------------------------------ RESERVE / ABORT / RELEASE

    def reserve(self, req: Reserve, owner: ConnId) -> list[ReserveStatus]:
        check_keys(self.limits, req.keys)
        check_seconds("deadline", req.deadline)
        check_sizes(self.limits, req.sizes)
        deadline = req.deadline or self.cfg.pending_deadline
        now = self._now()
        statuses: list[ReserveStatus] = []
        locate = self.locator.locate
        for key, size in zip(req.keys, req.sizes, strict=True):
            where = locate(key, now).where
            if where is Where.RAM or where is Where.DISK or where is Where.REMOTE:
                statuses.append(ReserveStatus.PRESENT)
                continue
            if where is Where.PENDING:
                statuses.append(ReserveStatus.PENDING)
                continue
            if size:
                try:
                    evicted = self.ram.reserve(size, key)
                except (NoCapacityError, ValueTooLargeError):
                    statuses.append(ReserveStatus.REFUSED)
                    self.counters.reservations.inc("refused")
                    continue
                self._evicted(evicted)  # announced, and written back where the policy says
            self.pending.reserve(key, owner, deadline, size, now)
            self.counters.reservations.inc("granted")
            statuses.append(ReserveStatus.GRANTED)
        return statuses

    def reserve_arriving(self, keys: Sequence[bytes], owner: ConnId) -> None:
        """Reserve, without holding room, the ``keys`` whose blocks ``owner``
        is copying into their staged slots now (a PUT_REGION): other readers
        find them PENDING, not MISS, until they are stored (the store ends
        the reservation), the copy fails (:meth:`abort`) or the connection
        closes. Keys held anywhere, or already pending, are left as they are."""
        now = self._now()
        deadline = self.cfg.pending_deadline
        locate, pending = self.locator.locate, self.pending
        for key in keys:
            if key not in pending.table and locate(key, now).where is Where.ABSENT:
                pending.reserve(key, owner, deadline, 0, now)
                self.counters.reservations.inc("granted")

    def abort(self, keys: Sequence[bytes], owner: ConnId) -> list[bool]:
        """End ``owner``'s reservations of ``keys``; other writers' are untouched."""
        check_keys(self.limits, keys)
        out = []
        table = self.pending.table
        for key in keys:
            res = table.get(key)
            out.append(
                res is not None and res.owner == owner and self.pending.end(res, End.ABORTED)
            )
        return out

    def release(self, tag: bytes) -> bool:
        """Forget a request tag's reader-side state."""
        existed = self.deferrals.get(tag) is not None
        deferred = self.deferrals.release(tag, self._now())
        if deferred is not None:
            self.counters.lookup_deferred_seconds.observe(deferred)
        return existed

    def write_room(self) -> asyncio.Future[None] | None:
        """None while every local tier can queue the writes stores make;
        else the future that resolves once it can (:meth:`Propagation.room`)."""
        return self.propagation.room()

    def connection_closed(self, owner: ConnId) -> None:
        """A writer went away: its reservations end at once."""
        n = self.pending.end_owned_by(owner, End.RELEASED)
        if n:
            log.info("%s closed; released %d reservation(s)", owner, n)

    # ------------------------------------------------------------ GET

    def get(
        self, keys: Sequence[bytes], *, local: bool = False
    ) -> list[Buffer | None] | Awaitable[list[Buffer | None]]:
        """Values of ``keys``, each present one pinned until :meth:`unpin`: now,
        or (when some key must be loaded or waited for) the awaitable that
        returns them. Each key is checked, pinned and located once; the loads
        it needs start before this returns.

        ``local``: from the local tiers only (a peer's request)."""
        check_keys(self.limits, keys)
        values: list[Buffer | None] = list(map(self.ram.pin, keys))
        if None not in values:
            return values
        locate = (self.local_locator if local else self.locator).locate
        now = self._now()
        below: list[tuple[int, asyncio.Future[Any]]] = []
        for i, value in enumerate(values):
            if value is None and (settles := self._read_step(keys[i], locate(keys[i], now), now)):
                below.append((i, settles))
        if not below:
            return values
        return self._get_below(keys, values, below, locate)

    def _read_step(self, key: bytes, loc: Location, now: float) -> asyncio.Future[Any] | None:
        """Act on where ``key`` is for a read: join the write, promotion or
        disk read in flight, or start one from the disk or the remote tier that holds the
        key (the first that may, while none has answered; a load of an absent
        block answers absent, which is kept), or wait for the disk index.
        Returns what to wait for; None when there is nothing to read."""
        where = loc.where
        if where is Where.ABSENT or self.closing:
            return None
        if loc.reservation is not None:  # a write or a promotion is under way
            return loc.reservation.done
        if where is Where.DISK:
            return self._load_from_disk(key)
        if where is Where.REMOTE:
            return self._promote(self.remotes[loc.remote], key, now).done
        if where is Where.PROBING:
            first = min((*loc.unprobed, *(i for i, _ in loc.inflight)))
            return self._promote(self.remotes[first], key, now).done
        return loc.settles  # SCANNING: the disk index may still name it

    async def _get_below(
        self,
        keys: Sequence[bytes],
        values: list[Buffer | None],
        below: list[tuple[int, asyncio.Future[Any]]],
        locate: Callable[[bytes, float], Location],
    ) -> list[Buffer | None]:
        try:
            found = await asyncio.gather(*(self._read(keys[i], f, locate) for i, f in below))
        except BaseException:
            self.unpin(keys, values)
            raise
        for (i, _), value in zip(below, found, strict=True):
            values[i] = value
        return values

    async def _read(
        self,
        key: bytes,
        settles: asyncio.Future[Any],
        locate: Callable[[bytes, float], Location],
    ) -> Buffer | None:
        """``key`` pinned in RAM once what it waits for settles; None if absent.
        A write that ended without the block sends the key round again, at
        most ``MAX_READ_ROUNDS`` times (each round bounded by a deadline)."""
        for _ in range(MAX_READ_ROUNDS):
            await self._until(settles)
            value = self.ram.pin(key)
            if value is not None or self.closing:
                return value
            now = self._now()
            step = self._read_step(key, locate(key, now), now)
            if step is None:
                return None
            settles = step
        return None

    async def _until(self, fut: asyncio.Future[Any]) -> None:
        """Wait for ``fut`` (never cancelling it: it is shared) or for shutdown."""
        waits: list[asyncio.Future[Any]] = [fut]
        if self._closing is not None:
            waits.append(self._closing)
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)

    def unpin(self, keys: Sequence[bytes], values: Sequence[Buffer | None]) -> None:
        unpin = self.ram.unpin
        for key, value in zip(keys, values, strict=True):
            if value is not None:
                unpin(key, value)

    # ------------------------------------------------------------ PUT / DELETE

    def put(
        self,
        keys: Sequence[bytes],
        values: Sequence[Buffer],
        *,
        source: str | None = None,
        copy: bool = False,
        hints: bytes | None = None,
    ) -> list[PutStatus]:
        """Store into RAM; lower tiers follow their write policy.

        ``source``: the tier the blocks came from (a peer's push): they are
        kept locally and never written back out to a remote tier. ``copy``:
        the values' memory is about to be reused; RAM keeps copies.
        ``hints``: one :class:`~kvtier.model.PutHint` per key (a TAIL block
        is admitted at the cold end of RAM's eviction order)."""
        check_keys(self.limits, keys)
        check_values(self.limits, values, self.ram.capacity)
        if len(keys) > 1:  # one eviction pass for the batch
            self._evicted(self.ram.make_room(keys, values))
        if hints is None:
            return [
                self._store_local(k, v, source, copy) for k, v in zip(keys, values, strict=True)
            ]
        self.counters.put_tail.value += sum(1 for h in hints if h & PutHint.TAIL)
        return [
            self._store_local(k, v, source, copy, bool(h & PutHint.TAIL))
            for k, v, h in zip(keys, values, hints, strict=True)
        ]

    def stage(self, length: int, key: bytes) -> memoryview | None:
        """Room in RAM's shared arena to receive a PUT body of ``length`` bytes
        for ``key`` in place; None when it must be received into a buffer of
        its own (or ``key`` is resident: the body will not be kept). Give it
        back with :meth:`drop_staged` unless a PUT stores it.

        A reservation of ``key`` that holds room gives it up here when the
        body gets a slot: the slot is that room, so the block is counted once
        from RESERVE to the last byte of its PUT. A body received into a
        buffer of its own leaves the reservation its room until it is
        stored, so it is counted all along too."""
        if self.ram.contains(key):
            return None
        res = self.pending.table.get(key)
        if res is None or not res.size or not self.ram.stages(length):
            return self.stage_room(length, key)
        held = res.size
        self.pending.claim(res)
        view = self.stage_room(length, key)
        if view is None and self.pending.table.get(key) is res:
            self.pending.hold(res, held)  # no slot after all: the room stays the reservation's
        return view

    def stage_room(self, length: int, namespace: bytes) -> memoryview | None:
        """Room in RAM's shared arena for a block of ``length`` bytes, made in
        the share of ``namespace``'s namespace (a key of it, or its key
        prefix: a block whose key comes later, written in place by a client)
        as its PUT would make it; None when there is none. Give it back with
        :meth:`drop_staged` unless a PUT stores it."""
        view, evicted = self.ram.stage(length, namespace)
        self._evicted(evicted)
        return view

    def stage_many(
        self,
        lengths: Sequence[int],
        keys: Sequence[bytes],
        ready: Sequence[memoryview] = (),
    ) -> list[memoryview | None]:
        """:meth:`stage` for a batch, with the room for all of it made first
        in one eviction pass (:meth:`RamTier.make_room_for`). ``ready``:
        rooms made ahead (:meth:`stage_rooms`), one for each of the first
        blocks, of their lengths; the rest get rooms now."""
        ram, table = self.ram, self.pending.table
        for key in keys:
            res = table.get(key)
            if res is not None and res.size:  # its room is the slot's now
                self.pending.claim(res)
        n = len(ready)
        lengths, keys = lengths[n:], keys[n:]
        self._evicted(ram.make_room_for(keys, lengths))
        staged: list[memoryview | None] = list(ready)
        staged.extend(self.stage(length, key) for length, key in zip(lengths, keys, strict=True))
        return staged

    def stage_rooms(self, length: int, count: int, namespace: bytes) -> list[memoryview]:
        """``count`` rooms of ``length`` bytes for blocks whose keys come later
        (:meth:`stage_room`), made in one eviction pass; fewer when RAM has
        no more."""
        self._evicted(self.ram.make_room_for([namespace] * count, [length] * count))
        rooms = []
        for _ in range(count):
            view = self.stage_room(length, namespace)
            if view is None:
                break
            rooms.append(view)
        return rooms

    def drop_staged(self, value: Buffer) -> None:
        self.ram.drop_staged(value)

    def make_durable(
        self, keys: Sequence[bytes], values: Sequence[Buffer | None]
    ) -> Awaitable[None]:
        """A durable PUT: the awaitable that returns once the blocks are on disk
        (per its fsync policy); call it in the same step as the store.

        What RAM holds under each key is held from now until written, so no
        eviction between the store and the write can lose it; a value in the
        shared arena that RAM no longer holds may be reused already, so only a
        value of the caller's own memory stands in for it. A block found in
        neither fails the request: durability is never acknowledged unmet."""
        disk, ram = self.disk, self.ram
        held: list[tuple[bytes, Buffer]] = []
        missing: list[bytes] = []
        if disk is not None:
            for key, value in zip(keys, values, strict=True):
                kept = ram.peek(key)
                if kept is None and value is not None and not ram.in_arena_memory(value):
                    kept = value
                if kept is None:
                    missing.append(key)
                    continue
                ram.hold(kept)
                held.append((key, kept))
        return self._write_durably(held, missing)

    async def _write_durably(self, held: list[tuple[bytes, Buffer]], missing: list[bytes]) -> None:
        disk, ram = self.disk, self.ram
        try:
            if disk is not None:  # (each write announces itself: _disk_writing)
                await asyncio.gather(*(disk.write(k, v, durable=True) for k, v in held))
        finally:
            for _, v in held:
                ram.let_go(v)
        if missing:
            raise TierError(
                f"{len(missing)} block(s) left RAM before reaching the disk (first: "
                f"{missing[0].hex()}); they are not durable, store them again"
            )

    def _store_local(
        self,
        key: bytes,
        value: Buffer,
        promoted_from: str | None = None,
        copy: bool = False,
        cold: bool = False,
    ) -> PutStatus:
        """Store into RAM and complete a pending write of ``key``, if any."""
        res = self.pending.table.get(key)
        if res is not None:
            self.pending.claim(res)
        try:
            stored, evicted = self.ram.put(key, value, copy=copy, cold=cold)
        except KvtierError:
            if res is not None:
                self.pending.end(res, End.ABORTED)
            raise
        if res is not None:
            self.pending.end(res, End.COMPLETED)
        self._evicted(evicted)
        local = self.propagation.local
        # A client's block flows down by each tier's policy; a promoted one is
        # kept on the local disk when it came from a remote tier, else nowhere.
        if stored and (promoted_from is None or (local and promoted_from not in local)):
            # (None: its namespace was over its max with it, and it went at
            # once, demoted with the evicted where the policy says so)
            kept = self.ram.peek(key)
            if kept is not None:
                self.propagation.stored(key, kept, promoted_from)
        return PutStatus.STORED if stored else PutStatus.EXISTS

    def _evicted(self, evicted: list[tuple[bytes, Buffer]]) -> None:
        """RAM evicted these (the holdings heard of it): write-back tiers take them."""
        if evicted:
            self.propagation.evicted(evicted)

    def delete(
        self, keys: Sequence[bytes], *, local: bool = False
    ) -> list[bool] | Awaitable[list[bool]]:
        """Delete ``keys`` from every tier: True where a tier held the key. The
        local tiers answer now; with remote tiers, the awaitable that also asks
        them. ``local``: the local tiers only (a peer's request)."""
        check_keys(self.limits, keys)
        deleted = self.delete_local(keys)
        if local or not self.remotes:
            return deleted
        return self._delete_remote(keys, deleted)

    async def _delete_remote(self, keys: Sequence[bytes], deleted: list[bool]) -> list[bool]:
        results = await asyncio.gather(
            *(slot.tier.delete(keys) for slot in self.remotes), return_exceptions=True
        )
        for slot, result in zip(self.remotes, results, strict=True):
            if isinstance(result, BaseException):
                if isinstance(result, asyncio.CancelledError):
                    raise result
                raise TierError(f"{slot.name}: delete failed: {result}") from result
            deleted = [a or bool(b) for a, b in zip(deleted, result, strict=True)]
        for key in keys:
            self._invalidate(key)
        return deleted

    def delete_local(self, keys: Sequence[bytes]) -> list[bool]:
        """Delete from RAM and disk only."""
        disk = self.disk
        out = [self.ram.remove(k) | (disk is not None and disk.discard(k)) for k in keys]
        for key in keys:  # (the held ones were by the holdings; the others' kept verdicts too)
            self._invalidate(key)
        return out

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

    def looked_up(self, req: Lookup, states: bytes, count: int = 1) -> None:
        """A lookup the lookup process answered (``count`` times alike): what
        the daemon's own lookup does after its answer (touches, once; the
        disk hits read ahead, the reader's bound, the counts, each time), as
        things stand now."""
        if req.peek:
            self.counters.lookup_peeks.value += count
        ram, disk = self.ram.resident(), self.disk
        keys = req.keys
        on_disk: list[int] = []
        if disk is not None:
            on_disk = [i for i, k in enumerate(keys) if states[i] == HIT and k not in ram]
            on_disk = [i for i in on_disk if disk.contains(keys[i])]
        answered = bytearray(states)
        hits, defer, _ = self._after_look(req, answered, on_disk, self._now(), reported=True)
        self._answer(LookupReply(states, hits, defer), keys, count)

    # ------------------------------------------------------------ STATS

    def map_sizes(self) -> MapSizes:
        return MapSizes(
            probes_inflight={s.name: s.probes.inflight_count for s in self.remotes},
            verdicts_cached={s.name: s.probes.verdict_count for s in self.remotes},
            pending_writes=len(self.pending.table),
            request_states=len(self.deferrals),
            timers=self.scheduler.deadline_count,
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
        }


# ---------------------------------------------------------------- pending writes


def _blocks(shares: Shares | None, ns: bytes) -> int:
    policy = shares.policies.get(ns) if shares is not None else None
    return len(policy) if policy is not None else 0

"""The cache service: the verbs (lookup, get, put, delete, reserve) over the tiers.

The service knows nothing of sockets, frames or Prometheus: the server
decodes a request into a record of :mod:`kvtier.model`, calls one verb and
encodes what it returns. One calling convention: ``try_*`` answers now or
returns None when the answer needs I/O; the async verb of the same name
then gives the complete answer. ``put``, ``reserve``, ``abort`` and
``release`` never wait.

Every verb asks :class:`~kvtier.core.locate.Locator` where a key is and acts
on the answer; no other code decides the order of the tiers.

Where the two invariants live:

* *A probe is shared while in flight, and always ends*: remote existence
  probes go through one :class:`~kvtier.core.probes.ProbeMap` per remote
  tier. A probe is a future in the map plus a key queued on the scheduler,
  which flushes each tick's keys into one ``batch_lookup`` task per tier.
  Callers only ever wait on the future (never on the task), so a caller
  going away cannot cancel a probe; the task resolves every key it covered
  in ``finally``.
* *Nothing is pending forever*: every PENDING key is a reservation of
  :class:`~kvtier.core.writes.PendingWrites` with a deadline timer in the
  scheduler; however it ends, its ``done`` future is resolved.

Imports the core, the tiers, the shared records and the errors; never the
wire, the server or metrics.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Sequence
from typing import Any

from kvtier.config import DiskConfig, LookupConfig
from kvtier.core import limits as check
from kvtier.core.counts import CoreCounters, MapSizes, ProbeFailure, ProbeUse
from kvtier.core.deferral import DeferralTracker
from kvtier.core.locate import Location, Locator, Where
from kvtier.core.pending import End, Reservation
from kvtier.core.prefix import prefix_answer
from kvtier.core.probes import Probe, ProbeMap, Verdict
from kvtier.core.propagation import Propagation, RemoteSpec, WritePolicy, Writer
from kvtier.core.scheduler import Scheduler
from kvtier.core.writes import PendingWrites
from kvtier.errors import KvtierError, NoCapacityError, TierError, ValueTooLargeError
from kvtier.model import (
    HIT,
    MISS,
    PENDING,
    RETRY,
    STATE_NAMES,
    Buffer,
    ConnId,
    Limits,
    Lookup,
    LookupMode,
    LookupReply,
    PutStatus,
    Reserve,
    ReserveStatus,
    Spawn,
)
from kvtier.tiers.base import Tier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.ram import RamTier

log = logging.getLogger("kvtier.service")

#: a GET gives up on a key after this many rounds of waiting on writes that
#: ended without the block (each round is bounded by a write deadline)
_MAX_READ_ROUNDS = 8


class RemoteSlot:
    """A remote tier, its probe map and its probe counters (bound once)."""

    def __init__(self, index: int, tier: Tier, probes: ProbeMap, counters: CoreCounters) -> None:
        self.index = index
        self.tier = tier
        self.probes = probes
        self.name = tier.name
        self.started = counters.probes.bind(tier.name, ProbeUse.STARTED.value)
        self.joined = counters.probes.bind(tier.name, ProbeUse.JOINED.value)
        self.cached = counters.probes.bind(tier.name, ProbeUse.CACHED.value)

    def __repr__(self) -> str:
        return f"<RemoteSlot {self.name} {self.probes!r}>"


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
        scheduler: Scheduler | None = None,
        counters: CoreCounters | None = None,
    ) -> None:
        self.limits = limits
        self.ram = ram
        self.disk = disk
        self.cfg = lookup if lookup is not None else LookupConfig()
        self.disk_cfg = disk_cfg if disk_cfg is not None else DiskConfig()
        self.counters = counters if counters is not None else CoreCounters()
        self.scheduler = scheduler or Scheduler(
            batch_window=self.cfg.probe_batch_window, max_batch=self.cfg.probe_max_batch
        )
        self._spawn: Spawn | None = None
        self._closing: asyncio.Future[None] | None = None
        self.pending = PendingWrites(
            ram,
            self.scheduler,
            self.counters,
            load_timeout=self.cfg.load_timeout,
            task=self._task,
            complete=lambda key, value, source: self._store_local(key, value, source),
        )
        self.deferrals = DeferralTracker(self.cfg.request_state_ttl, self.cfg.max_request_states)
        self.remotes = [
            RemoteSlot(
                i,
                spec.tier,
                ProbeMap(
                    spec.tier.name,
                    verdict_ttl=self.cfg.verdict_ttl,
                    error_ttl=self.cfg.error_ttl,
                    max_verdicts=self.cfg.max_verdicts,
                ),
                self.counters,
            )
            for i, spec in enumerate(remotes)
        ]
        for slot in self.remotes:
            self.scheduler.add_prober(slot.name, self._dispatcher(slot))
        self.locator = Locator(
            ram.resident(), disk, self.pending.table, [s.probes for s in self.remotes]
        )
        self.propagation = Propagation(
            self._writers(remotes), self.counters, self._task, self._closing_now
        )
        self._state_counters = {
            state: self.counters.lookup_keys.bind(name) for state, name in STATE_NAMES.items()
        }

    def _writers(self, remotes: Sequence[RemoteSpec]) -> list[Writer]:
        writers: list[Writer] = []
        if self.disk is not None:
            writers.append(
                Writer(
                    self.disk.name,
                    WritePolicy(self.disk_cfg.write_policy),
                    self.disk_cfg.max_pending_write_bytes,
                    self.disk.write,
                    self.disk.contains,
                    local=True,
                )
            )
        for spec in remotes:
            if spec.policy is not WritePolicy.NONE:
                tier = spec.tier

                async def write(key: bytes, value: Buffer, tier: Tier = tier) -> None:
                    await tier.batch_store([key], [value])
                    self._invalidate(key)

                writers.append(
                    Writer(tier.name, spec.policy, spec.max_pending, write, _never, local=False)
                )
        return writers

    def __repr__(self) -> str:
        return (
            f"<Service ram={self.ram!r} disk={self.disk!r} remotes={self.remotes!r} "
            f"{self.pending!r} {self.deferrals!r}>"
        )

    # ------------------------------------------------------------ lifecycle

    def start(self, spawn: Spawn) -> None:
        """Attach to the daemon's task group and start periodic sweeps."""
        self._spawn = spawn
        self._closing = asyncio.get_running_loop().create_future()
        self.scheduler.every(self.cfg.sweep_interval, self.sweep)

    def begin_shutdown(self) -> None:
        """Wake every waiting lookup and GET so that it answers now."""
        if self._closing is not None and not self._closing.done():
            self._closing.set_result(None)

    def close(self) -> None:
        """End every pending write and probe (waiters answered MISS)."""
        self.pending.end_all()
        for slot in self.remotes:
            slot.probes.abandon_all()

    def sweep(self) -> None:
        now = self.scheduler.now()
        for slot in self.remotes:
            slot.probes.expire(now)
        self.deferrals.expire(now)
        if self.disk is not None and self.disk.fsync == "batch" and not self._closing_now():
            self._task(self._sync_disk())

    async def _sync_disk(self) -> None:
        assert self.disk is not None
        try:
            await self.disk.sync()
        except OSError as exc:
            log.warning("disk: periodic sync failed: %s", exc)

    def _now(self) -> float:
        return self.scheduler.now()

    def _closing_now(self) -> bool:
        return self._closing is not None and self._closing.done()

    def _task(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        if self._spawn is None:
            coro.close()
            raise RuntimeError("service not started")
        task: asyncio.Task[None] = self._spawn(coro)
        return task

    # ------------------------------------------------------------ LOOKUP

    def try_lookup(self, req: Lookup) -> LookupReply | None:
        """The answer now; None when the request asks to wait (``wait > 0``)."""
        check.check_lookup(self.limits, req)
        if req.wait > 0:
            return None
        reply, _, _ = self._evaluate(req, self._now(), None)
        self._count(reply.raw_states)
        return reply

    async def lookup(self, req: Lookup, cutoff: asyncio.Future[None] | None = None) -> LookupReply:
        """Re-evaluate whenever a key settles, until all settled, ``wait`` passes,
        ``cutoff`` resolves (the caller stopped listening) or shutdown begins."""
        check.check_lookup(self.limits, req)
        deadline = self._now() + req.wait
        # Probes this lookup has already seen end: a key whose probe failed is
        # answered MISS rather than probed again in a loop (errors are not kept
        # as verdicts for long, possibly not at all).
        seen: dict[tuple[int, bytes], asyncio.Future[Verdict]] = {}
        while True:
            now = self._now()
            reply, waits, bound_at = self._evaluate(req, now, seen)
            until = deadline if bound_at is None else min(deadline, bound_at)
            if not waits or now >= until or self._closing_now() or (cutoff and cutoff.done()):
                self._count(reply.raw_states)
                return reply
            if self._closing is not None:
                waits.append(self._closing)
            if cutoff is not None:
                waits.append(cutoff)
            # asyncio.wait never cancels what it waits on: shared probe and
            # write futures survive this caller going away.
            await asyncio.wait(waits, timeout=until - now, return_when=asyncio.FIRST_COMPLETED)

    def _evaluate(
        self,
        req: Lookup,
        now: float,
        seen: dict[tuple[int, bytes], asyncio.Future[Verdict]] | None,
    ) -> tuple[LookupReply, list[asyncio.Future[Any]], float | None]:
        """States of ``req.keys`` now; with ``seen`` (a waiting lookup) also the
        futures whose settling can change the answer."""
        keys = req.keys
        disk = self.disk
        disk_only: list[int] = []  # indices of HITs that are on disk but not in RAM
        futures: list[asyncio.Future[Any] | None] = []
        if not self.remotes and not self.pending.table and (disk is None or not disk.scanning):
            # The fast path. HIT is 1 and MISS is 0: membership tests map
            # straight onto states.
            states = bytearray(map(self.ram.resident().__contains__, keys))
            if disk is not None and states.count(MISS):
                on_disk = disk.contains
                for i in range(len(states)):
                    if not states[i] and on_disk(keys[i]):
                        states[i] = HIT
                        disk_only.append(i)
        else:
            states = bytearray(len(keys))
            locate = self.locator.locate
            for i, key in enumerate(keys):
                loc = locate(key, now, seen)
                if loc.where is Where.DISK and loc.reservation is None:
                    disk_only.append(i)
                states[i], fut = self._lookup_state(key, loc, now, seen)
                futures.append(fut)
        bound_at: float | None = None
        if req.max_pending_wait > 0:
            result = self.deferrals.observe(
                req.request_tag, keys, states, req.max_pending_wait, now
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
        if disk_only and self.disk_cfg.promote_on_lookup:
            # Start loading the usable disk hits into RAM: the GET comes next.
            limit = hits if req.mode != LookupMode.KEYS else len(keys)
            for i in disk_only:
                if i >= limit:
                    break
                if states[i] == HIT:
                    self._promote_from_disk(keys[i], now)
        collected: list[asyncio.Future[Any]] = []
        if seen is not None and futures:
            # Wait only on keys that can still change the answer: in prefix
            # mode, those before the first MISS.
            stop = len(states)
            if req.mode == LookupMode.PREFIX:
                first_miss = states.find(MISS)
                stop = first_miss if first_miss >= 0 else stop
            for i, fut in enumerate(futures[:stop]):
                if fut is not None and states[i] in (PENDING, RETRY):
                    collected.append(fut)
        return LookupReply(bytes(states), hits, defer), collected, bound_at

    def _lookup_state(
        self,
        key: bytes,
        loc: Location,
        now: float,
        seen: dict[tuple[int, bytes], asyncio.Future[Verdict]] | None,
    ) -> tuple[int, asyncio.Future[Any] | None]:
        """Act on where ``key`` is for a lookup: its state, and what settles it."""
        where = loc.where
        if where is Where.RAM or where is Where.DISK:
            return HIT, None
        if where is Where.PENDING:
            return PENDING, loc.settles
        if where is Where.REMOTE:
            slot = self.remotes[loc.remote]
            slot.cached.value += 1
            if self.cfg.remote_hit == "hit":
                return HIT, None
            return PENDING, self._promote(slot, key, now).done
        self._count_cached(loc)
        if where is Where.PROBING:
            settles = loc.settles
            for i, fut in loc.inflight:
                self.remotes[i].joined.value += 1
                if seen is not None:
                    seen[(i, key)] = fut
            if not self._closing_now():  # no new backend work once shutdown has begun
                for i in loc.unprobed:
                    probe = self._begin_probe(self.remotes[i], key)
                    if seen is not None:
                        seen[(i, key)] = probe.future
                    settles = settles or probe.future
            if settles is not None:
                return RETRY, settles
            if self.disk is not None and self.disk.scanning:
                return RETRY, self.disk.scan_done
            return MISS, None
        if where is Where.SCANNING:
            # Not indexed yet is not absent: the disk may still hold it.
            return RETRY, loc.settles
        return MISS, None

    def _count_cached(self, loc: Location) -> None:
        """Count the remote tiers whose kept verdict answered for this key."""
        if not self.remotes:
            return
        busy = set(loc.unprobed).union(i for i, _ in loc.inflight)
        for slot in self.remotes:
            if slot.index not in busy:
                slot.cached.value += 1

    def _count(self, raw: bytes) -> None:
        for state, cell in self._state_counters.items():
            n = raw.count(state)
            if n:
                cell.value += n

    # ------------------------------------------------------------ probes

    def _begin_probe(self, slot: RemoteSlot, key: bytes) -> Probe:
        probe = slot.probes.begin(key, asyncio.get_running_loop())
        slot.started.value += 1
        self.scheduler.enqueue_probe(slot.name, key)
        return probe

    def _dispatcher(self, slot: RemoteSlot) -> Any:
        def dispatch(keys: list[bytes]) -> None:
            probes = [p for p in (slot.probes.inflight(k) for k in keys) if p is not None]
            if not probes:
                return  # every key was invalidated before its batch left
            self.counters.probe_batch_size.observe(len(probes), slot.name)
            self._task(self._run_probe(slot, probes))

        return dispatch

    async def _run_probe(self, slot: RemoteSlot, probes: list[Probe]) -> None:
        """One ``batch_lookup`` for ``probes``; every probe is resolved, whatever happens."""
        keys = [p.key for p in probes]
        verdicts: list[Verdict] | None = None
        failure = ProbeFailure.ERROR
        try:
            async with asyncio.timeout(self.cfg.probe_timeout):
                answers = await slot.tier.batch_lookup(keys)
                found = [bool(a) for a in answers]  # an iterable may fail mid-way
            if len(found) != len(keys):
                failure = ProbeFailure.BAD_RESULT
                raise TierError(
                    f"{slot.name}: batch_lookup returned {len(found)} results for {len(keys)} keys"
                )
            verdicts = [Verdict.PRESENT if f else Verdict.ABSENT for f in found]
        except TimeoutError:
            failure = ProbeFailure.TIMEOUT
            log.warning(
                "%s: probe of %d key(s) timed out after %.3fs",
                slot.name,
                len(keys),
                self.cfg.probe_timeout,
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("%s: probe of %d key(s) failed: %s", slot.name, len(keys), exc)
        finally:
            now = self._now()
            if verdicts is None:
                self.counters.probe_failures.inc(slot.name, failure.value, n=len(keys))
            for i, probe in enumerate(probes):
                verdict = verdicts[i] if verdicts is not None else Verdict.ERROR
                owned = slot.probes.complete(probe, verdict, now)
                self.counters.probe_verdicts.inc(slot.name, verdict.value)
                if not owned:
                    self.counters.probe_superseded.inc(slot.name)
                elif (
                    verdict is Verdict.PRESENT
                    and self.cfg.remote_hit == "promote"
                    and not self._closing_now()
                    and self.locator.locate(probe.key, now).where is Where.REMOTE
                ):
                    # Start loading now, so the next lookup finds it PENDING or HIT.
                    self._promote(slot, probe.key, now)

    def _invalidate(self, key: bytes) -> None:
        for slot in self.remotes:
            slot.probes.invalidate(key)

    # ------------------------------------------------------------ promotions

    def _promote(self, slot: RemoteSlot, key: bytes, now: float) -> Reservation:
        async def load() -> Buffer | None:
            values = await slot.tier.batch_load([key])
            if len(values) != 1:
                raise TierError(f"{slot.name}: batch_load returned {len(values)} values for 1 key")
            return values[0]

        def failed() -> None:
            # The tier claimed the block and could not deliver: answer MISS for
            # it until the verdict ages out (no HIT / failed-load livelock).
            slot.probes.force(key, Verdict.ABSENT, self._now())

        return self.pending.promote(slot.name, key, self.cfg.pending_deadline, now, load, failed)

    def _promote_from_disk(self, key: bytes, now: float) -> Reservation:
        assert self.disk is not None
        disk = self.disk
        return self.pending.promote(
            disk.name, key, self.cfg.pending_deadline, now, lambda: disk.read(key), _nothing
        )

    # ------------------------------------------------------------ RESERVE / ABORT / RELEASE

    def reserve(self, req: Reserve, owner: ConnId) -> list[ReserveStatus]:
        check.check_keys(self.limits, req.keys)
        check.check_seconds("deadline", req.deadline)
        check.check_sizes(self.limits, req.sizes)
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
                    evicted = self.ram.reserve(size)
                except (NoCapacityError, ValueTooLargeError):
                    statuses.append(ReserveStatus.REFUSED)
                    self.counters.reservations.inc("refused")
                    continue
                for victim, _ in evicted:
                    self._invalidate(victim)
            self.pending.reserve(key, owner, deadline, size, now)
            self.counters.reservations.inc("granted")
            statuses.append(ReserveStatus.GRANTED)
        return statuses

    def abort(self, keys: Sequence[bytes], owner: ConnId) -> list[bool]:
        """End ``owner``'s reservations of ``keys``; other writers' are untouched."""
        check.check_keys(self.limits, keys)
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

    def connection_closed(self, owner: ConnId) -> None:
        """A writer went away: its reservations end at once."""
        n = self.pending.end_owned_by(owner, End.RELEASED)
        if n:
            log.info("%s closed; released %d reservation(s)", owner, n)

    # ------------------------------------------------------------ GET

    def try_get(self, keys: Sequence[bytes]) -> list[Buffer | None] | None:
        """Values of ``keys`` now, each present one pinned until :meth:`unpin`;
        None (nothing pinned) when some key must be waited for or loaded."""
        check.check_keys(self.limits, keys)
        pin = self.ram.pin
        values = [pin(k) for k in keys]
        now = self._now()
        locate = self.locator.locate
        for key, value in zip(keys, values, strict=True):
            if value is None and locate(key, now).where is not Where.ABSENT:
                self.unpin(keys, values)
                return None
        return values

    async def get(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        """Values of ``keys``, each present one pinned until :meth:`unpin`.

        A key on disk or in a remote tier is promoted into RAM first;
        concurrent readers of one key share one promotion, hence one load.
        """
        check.check_keys(self.limits, keys)
        pin = self.ram.pin
        values = [pin(k) for k in keys]
        missing = [i for i, v in enumerate(values) if v is None]
        if not missing:
            return values
        try:
            found = await asyncio.gather(*(self._read_through(keys[i]) for i in missing))
        except BaseException:
            self.unpin(keys, values)
            raise
        for i, value in zip(missing, found, strict=True):
            values[i] = value
        return values

    async def _read_through(self, key: bytes) -> Buffer | None:
        for _ in range(_MAX_READ_ROUNDS):
            value = self.ram.pin(key)
            if value is not None:
                return value
            if self._closing_now():
                return None
            now = self._now()
            loc = self.locator.locate(key, now)
            where = loc.where
            res: Reservation | None
            if where is Where.PENDING or (where is Where.DISK and loc.reservation is not None):
                res = loc.reservation
            elif where is Where.DISK:
                res = self._promote_from_disk(key, now)
            elif where is Where.REMOTE:
                res = self._promote(self.remotes[loc.remote], key, now)
            elif where is Where.PROBING:
                # No answer yet: load from the first tier that may hold it (a
                # load of an absent block answers absent, which is kept).
                first = min((*loc.unprobed, *(i for i, _ in loc.inflight)))
                res = self._promote(self.remotes[first], key, now)
            elif where is Where.SCANNING:
                assert loc.settles is not None
                await self._wait_or_closing(loc.settles)
                continue
            else:
                return None
            assert res is not None
            await self._wait_or_closing(res.done)
        return None

    async def _wait_or_closing(self, fut: asyncio.Future[Any]) -> None:
        waits: list[asyncio.Future[Any]] = [fut]
        if self._closing is not None:
            waits.append(self._closing)
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)

    def unpin(self, keys: Sequence[bytes], values: Sequence[Buffer | None]) -> None:
        unpin = self.ram.unpin
        for key, value in zip(keys, values, strict=True):
            if value is not None:
                unpin(key)

    # ------------------------------------------------------------ PUT / DELETE

    def put(self, keys: Sequence[bytes], values: Sequence[Buffer]) -> list[PutStatus]:
        """Store into RAM; lower tiers follow their write policy."""
        check.check_keys(self.limits, keys)
        check.check_values(self.limits, values, self.ram.capacity)
        return [self._store_local(k, v) for k, v in zip(keys, values, strict=True)]

    async def make_durable(self, keys: Sequence[bytes], values: Sequence[Buffer]) -> None:
        """Return once the blocks are on disk (per the disk's fsync policy).

        Without a disk tier there is nothing to wait for.
        """
        disk = self.disk
        if disk is None:
            return
        await asyncio.gather(
            *(disk.write(k, v, durable=True) for k, v in zip(keys, values, strict=True))
        )

    def _store_local(
        self, key: bytes, value: Buffer, promoted_from: str | None = None
    ) -> PutStatus:
        """Store into RAM and complete a pending write of ``key``, if any."""
        res = self.pending.claim(key)
        try:
            stored, evicted = self.ram.put(key, value)
        except KvtierError:
            if res is not None:
                self.pending.end(res, End.ABORTED)
            raise
        if res is not None:
            self.pending.end(res, End.COMPLETED)
        self._invalidate(key)
        for victim, _ in evicted:
            self._invalidate(victim)
        self.propagation.evicted(evicted)
        if stored:
            self.propagation.stored(key, value, promoted_from)
        return PutStatus.STORED if stored else PutStatus.EXISTS

    def try_delete(self, keys: Sequence[bytes]) -> list[bool] | None:
        """Delete from the local tiers now; None when remote tiers must be asked."""
        check.check_keys(self.limits, keys)
        if self.remotes:
            return None
        return self._delete_local(keys)

    async def delete(self, keys: Sequence[bytes]) -> list[bool]:
        check.check_keys(self.limits, keys)
        out = self._delete_local(keys)
        if not self.remotes:
            return out
        results = await asyncio.gather(
            *(slot.tier.delete(keys) for slot in self.remotes), return_exceptions=True
        )
        for slot, result in zip(self.remotes, results, strict=True):
            if isinstance(result, BaseException):
                if isinstance(result, asyncio.CancelledError):
                    raise result
                raise TierError(f"{slot.name}: delete failed: {result}") from result
            out = [a or bool(b) for a, b in zip(out, result, strict=True)]
        for key in keys:
            self._invalidate(key)
        return out

    def _delete_local(self, keys: Sequence[bytes]) -> list[bool]:
        disk = self.disk
        out = [self.ram.remove(k) | (disk is not None and disk.discard(k)) for k in keys]
        for key in keys:
            self._invalidate(key)
        return out

    # ------------------------------------------------------------ STATS

    def map_sizes(self) -> MapSizes:
        return MapSizes(
            probes_inflight={s.name: s.probes.inflight_count for s in self.remotes},
            verdicts_cached={s.name: s.probes.verdict_count for s in self.remotes},
            pending_writes=len(self.pending.table),
            request_states=len(self.deferrals),
        )

    def tiers(self) -> list[Tier]:
        local: list[Tier] = [self.ram] + ([self.disk] if self.disk is not None else [])
        return local + [s.tier for s in self.remotes]

    def stats(self) -> dict[str, Any]:
        tiers: dict[str, Any] = {}
        for st in (t.stats() for t in self.tiers()):
            tiers[st.name] = {
                "capacity_bytes": st.capacity_bytes,
                "used_bytes": st.used_bytes,
                "blocks": st.blocks,
                "evictions": st.evictions,
                **st.extra,
            }
        sizes = self.map_sizes()
        return {
            "tiers": tiers,
            "maps": {
                "probes_inflight": sum(sizes.probes_inflight.values()),
                "verdicts": sum(sizes.verdicts_cached.values()),
                "reservations": sizes.pending_writes,
                "request_states": sizes.request_states,
            },
            "probes": {
                s.name: {"inflight": s.probes.inflight_count, "verdicts": s.probes.verdict_count}
                for s in self.remotes
            },
        }


def _never(_key: bytes) -> bool:
    return False


def _nothing() -> None:
    return None

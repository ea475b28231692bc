"""The cache service: lookup / get / put / delete / reserve orchestration.

The service knows nothing about sockets or frames: the server decodes a
request, calls one method here, and encodes what it returns. A method
returns its answer directly when it needs no I/O (the common case: a
lookup answered from local indexes) and a coroutine otherwise; the server
runs those as tasks.

Where the two invariants live:

* *A probe is shared while in flight, and always ends*: remote existence
  probes go through one :class:`~kvtier.probes.ProbeMap` per remote tier.
  A probe is a future in the map plus a key queued on the scheduler, which
  flushes each tick's keys into one ``batch_lookup`` task per tier. Callers
  only ever wait on the future (never on the task), so a caller going away
  cannot cancel a probe; the task resolves every key it covered in
  ``finally``.
* *Nothing is pending forever*: every PENDING key is a
  :class:`~kvtier.reservations.Reservation` with a deadline timer in the
  scheduler; however it ends, its ``done`` future is resolved.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.config import DiskConfig, LookupConfig
from kvtier.deferral import DeferralTracker
from kvtier.errors import (
    BadArgumentError,
    BadKeyError,
    BatchTooLargeError,
    KvtierError,
    NoCapacityError,
    TierError,
    ValueTooLargeError,
)
from kvtier.metrics import Metrics, StateSnapshot
from kvtier.prefix import HIT, MISS, PENDING, RETRY, prefix_answer
from kvtier.probes import Probe, ProbeMap, Verdict
from kvtier.protocol.codec import (
    Buffer,
    Lookup,
    LookupMode,
    LookupReply,
    PutStatus,
    Reserve,
    ReserveStatus,
)
from kvtier.reservations import End, Reservation, ReservationTable
from kvtier.scheduler import Scheduler
from kvtier.tiers.base import Tier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.ram import RamTier

log = logging.getLogger("kvtier.service")

_STATE_NAMES = {MISS: "miss", HIT: "hit", PENDING: "pending", RETRY: "retry"}
#: a GET gives up on a key after this many rounds of waiting on writes that
#: ended without the block (each round is bounded by a write deadline)
_MAX_READ_ROUNDS = 8

#: starts a background task in the daemon's task group
Spawn = Callable[[Coroutine[Any, Any, Any]], "asyncio.Task[Any]"]


@dataclass(slots=True, frozen=True)
class Limits:
    max_key_bytes: int
    max_batch: int
    max_block_bytes: int


@dataclass(slots=True)
class Writer:
    """A lower tier that PUTs flow to, and how (its write policy)."""

    name: str
    policy: str  # "write-through" | "write-back" | "none"
    max_pending: int
    write: Callable[[bytes, Buffer], Awaitable[None]]
    holds: Callable[[bytes], bool]  # already there: nothing to write
    local: bool
    pending: int = 0


class RemoteSlot:
    """A remote tier with its probe map."""

    def __init__(self, tier: Tier, probes: ProbeMap, metrics: Metrics) -> None:
        self.tier = tier
        self.probes = probes
        self.name = tier.name
        # Counters bound once: lookups touch them per key.
        self.started = metrics.probes.labels(tier.name, "started")
        self.joined = metrics.probes.labels(tier.name, "joined")
        self.cached = metrics.probes.labels(tier.name, "cached")

    def __repr__(self) -> str:
        return f"<RemoteSlot {self.name} {self.probes!r}>"


class Service:
    def __init__(
        self,
        limits: Limits,
        ram: RamTier,
        metrics: Metrics,
        *,
        lookup: LookupConfig | None = None,
        remotes: Sequence[Tier] = (),
        remote_policies: Sequence[tuple[str, int]] = (),
        scheduler: Scheduler | None = None,
        spawn: Spawn | None = None,
        disk: DiskTier | None = None,
        disk_cfg: DiskConfig | None = None,
    ) -> None:
        self.limits = limits
        self.ram = ram
        self.metrics = metrics
        self.cfg = lookup if lookup is not None else LookupConfig()
        self.disk = disk
        self.disk_cfg = disk_cfg if disk_cfg is not None else DiskConfig()
        self.writers: list[Writer] = []
        self._local_names = {ram.name} | ({disk.name} if disk is not None else set())
        if disk is not None:
            self.writers.append(
                Writer(
                    disk.name,
                    self.disk_cfg.write_policy,
                    self.disk_cfg.max_pending_write_bytes,
                    disk.write,
                    disk.contains,
                    local=True,
                )
            )
        for tier, (policy, max_pending) in zip(remotes, remote_policies, strict=False):
            if policy != "none":
                self.writers.append(
                    Writer(
                        tier.name,
                        policy,
                        max_pending,
                        self._remote_writer(tier),
                        lambda _key: False,
                        local=False,
                    )
                )
        self.scheduler = scheduler or Scheduler(
            batch_window=self.cfg.probe_batch_window, max_batch=self.cfg.probe_max_batch
        )
        self._spawn = spawn
        self.reservations = ReservationTable()
        self.deferrals = DeferralTracker(self.cfg.request_state_ttl, self.cfg.max_request_states)
        self.remotes = [
            RemoteSlot(
                tier,
                ProbeMap(
                    tier.name,
                    verdict_ttl=self.cfg.verdict_ttl,
                    error_ttl=self.cfg.error_ttl,
                    max_verdicts=self.cfg.max_verdicts,
                ),
                metrics,
            )
            for tier in remotes
        ]
        for slot in self.remotes:
            self.scheduler.add_prober(slot.name, self._dispatcher(slot))
        self._closing: asyncio.Future[None] | None = None
        self._state_counters = {
            state: metrics.lookup_keys.labels(name) for state, name in _STATE_NAMES.items()
        }
        metrics.set_state_source(self.snapshot)

    def __repr__(self) -> str:
        return (
            f"<Service ram={self.ram!r} disk={self.disk!r} remotes={self.remotes!r} "
            f"{self.reservations!r} {self.deferrals!r}>"
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
        for res in self.reservations.all():
            self._end(res, End.ABORTED)
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

    def _task(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        if self._spawn is None:
            raise RuntimeError("service not started")
        task: asyncio.Task[None] = self._spawn(coro)
        return task

    # ------------------------------------------------------------ validation

    def check_keys(self, keys: Sequence[bytes], uniform_len: int = 0) -> None:
        """Batch size and key lengths; ``uniform_len`` (all keys that long) checks once."""
        if len(keys) > self.limits.max_batch:
            raise BatchTooLargeError(
                f"batch of {len(keys)} keys exceeds the maximum of {self.limits.max_batch}"
            )
        limit = self.limits.max_key_bytes
        if uniform_len and 0 < uniform_len <= limit:
            return
        for i, key in enumerate(keys):
            if not 0 < len(key) <= limit:
                raise BadKeyError(f"key {i} is {len(key)} bytes; keys must be 1..{limit} bytes")

    @staticmethod
    def _check_seconds(name: str, value: float) -> None:
        if math.isnan(value) or value < 0 or math.isinf(value):
            raise BadArgumentError(f"{name} must be a finite number >= 0, got {value}")

    # ------------------------------------------------------------ LOOKUP

    def lookup(
        self, req: Lookup, conn_id: int = 0, cutoff: asyncio.Future[None] | None = None
    ) -> LookupReply | Coroutine[Any, Any, LookupReply]:
        """Answer now, or with ``wait > 0`` once keys settle, ``wait`` passes, or
        ``cutoff`` resolves (the caller stopped listening for more)."""
        self.check_keys(req.keys, req.key_len)
        self._check_seconds("wait", req.wait)
        self._check_seconds("max_pending_wait", req.max_pending_wait)
        if req.max_pending_wait > 0 and not req.request_tag:
            raise BadArgumentError("max_pending_wait needs a request tag to accrue against")
        if req.mode == LookupMode.SLIDING_WINDOW and req.window <= 0:
            raise BadArgumentError("sliding-window lookup needs a window of at least 1")
        now = self._now()
        if req.wait > 0:
            return self._lookup_waiting(req, now + req.wait, cutoff)
        reply, _, _ = self._evaluate(req, now, None)
        self._count(reply.raw_states)
        return reply

    async def _lookup_waiting(
        self, req: Lookup, deadline: float, cutoff: asyncio.Future[None] | None
    ) -> LookupReply:
        """Re-evaluate whenever a key settles, until all settled or ``deadline``."""
        # Probes this lookup has already seen end: a key whose probe failed is
        # answered MISS rather than probed again in a loop (errors are not kept
        # as verdicts for long, possibly not at all).
        seen: dict[tuple[str, bytes], asyncio.Future[Verdict]] = {}
        while True:
            now = self._now()
            waits: list[asyncio.Future[Any]] = []
            reply, waits, bound_at = self._evaluate(req, now, waits, seen)
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

    def _closing_now(self) -> bool:
        return self._closing is not None and self._closing.done()

    def _evaluate(
        self,
        req: Lookup,
        now: float,
        waits: list[asyncio.Future[Any]] | None,
        seen: dict[tuple[str, bytes], asyncio.Future[Verdict]] | None = None,
    ) -> tuple[LookupReply, list[asyncio.Future[Any]], float | None]:
        keys = req.keys
        futures: list[asyncio.Future[Any] | None] = []
        disk = self.disk
        disk_only: list[int] = []  # indices of HITs that are on disk but not in RAM
        if not self.remotes and not self.reservations and (disk is None or not disk.scanning):
            # HIT is 1 and MISS is 0: membership tests map straight onto states.
            states = bytearray(map(self.ram.resident().__contains__, keys))
            if disk is not None and states.count(MISS):
                on_disk = disk.contains
                for i in range(len(states)):
                    if not states[i] and on_disk(keys[i]):
                        states[i] = HIT
                        disk_only.append(i)
        else:
            state_of = self._state
            states = bytearray(
                state_of(k, now, futures, seen, disk_only, i) for i, k in enumerate(keys)
            )
        bound_at: float | None = None
        if req.max_pending_wait > 0:
            result = self.deferrals.observe(
                req.request_tag, keys, states, req.max_pending_wait, now
            )
            if result.ends_deferral is not None:
                self.metrics.lookup_deferred_seconds.observe(result.ends_deferral)
            if result.expired_index is not None:
                # Past the reader's bound: a MISS for this request, never a hit.
                states[result.expired_index] = MISS
                if result.newly_expired:
                    self.metrics.lookup_pending_expired.inc()
            bound_at = result.expires_at
        window = req.window if req.mode == LookupMode.SLIDING_WINDOW else 0
        hits, defer = prefix_answer(states, window)
        if disk_only and self.disk_cfg.promote_on_lookup:
            limit = hits if req.mode != LookupMode.KEYS else len(keys)
            self._prefetch(keys, states, disk_only, limit, now)
        collected: list[asyncio.Future[Any]] = []
        if waits is not None and futures:
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

    def _prefetch(
        self,
        keys: Sequence[bytes],
        states: bytearray,
        disk_only: list[int],
        limit: int,
        now: float,
    ) -> None:
        """Start loading the disk-only HITs of the usable answer into RAM (read next)."""
        reservations = self.reservations
        for i in disk_only:
            if i >= limit:
                break
            if states[i] == HIT and keys[i] not in reservations:
                self._promote_from_disk(keys[i], now)

    def _count(self, raw: bytes) -> None:
        for state, counter in self._state_counters.items():
            n = raw.count(state)
            if n:
                counter.inc(n)

    def _state(
        self,
        key: bytes,
        now: float,
        futures: list[asyncio.Future[Any] | None],
        seen: dict[tuple[str, bytes], asyncio.Future[Verdict]] | None = None,
        disk_only: list[int] | None = None,
        index: int = 0,
    ) -> int:
        """One key's state; appends the future to wait on (or None)."""
        if self.ram.contains(key):
            futures.append(None)
            return HIT
        if self.disk is not None and self.disk.contains(key):
            if disk_only is not None:
                disk_only.append(index)
            futures.append(None)
            return HIT
        res = self.reservations.get(key)
        if res is not None:
            futures.append(res.done)
            return PENDING
        state = MISS
        waiting: asyncio.Future[Any] | None = None
        for slot in self.remotes:
            verdict = slot.probes.verdict(key, now)
            if verdict is None and seen is not None:
                earlier = seen.get((slot.name, key))
                if earlier is not None and earlier.done():
                    verdict = earlier.result()
            if verdict is Verdict.PRESENT:
                slot.cached.inc()
                if self.cfg.remote_hit == "hit":
                    futures.append(None)
                    return HIT
                res = self._promote(slot, key, now)
                futures.append(res.done)
                return PENDING
            if verdict is not None:
                slot.cached.inc()
                continue
            probe = slot.probes.inflight(key)
            if probe is None:
                if self._closing_now():
                    continue  # no new backend work once shutdown has begun
                probe = self._begin_probe(slot, key)
            else:
                slot.joined.inc()
            if seen is not None:
                seen[(slot.name, key)] = probe.future
            state = RETRY
            waiting = waiting or probe.future
        if state == MISS and self.disk is not None and self.disk.scanning:
            # Not indexed yet is not absent: the disk may still hold it.
            state = RETRY
            waiting = self.disk.scan_done
        futures.append(waiting)
        return state

    # ------------------------------------------------------------ probes

    def _begin_probe(self, slot: RemoteSlot, key: bytes) -> Probe:
        probe = slot.probes.begin(key, asyncio.get_running_loop())
        slot.started.inc()
        self.scheduler.enqueue_probe(slot.name, key)
        return probe

    def _dispatcher(self, slot: RemoteSlot) -> Any:
        def dispatch(keys: list[bytes]) -> None:
            probes = [p for p in (slot.probes.inflight(k) for k in keys) if p is not None]
            if not probes:
                return  # every key was invalidated before its batch left
            self.metrics.probe_batch_size.labels(slot.name).observe(len(probes))
            self._task(self._run_probe(slot, probes))

        return dispatch

    async def _run_probe(self, slot: RemoteSlot, probes: list[Probe]) -> None:
        """One ``batch_lookup`` for ``probes``; every probe is resolved, whatever happens."""
        keys = [p.key for p in probes]
        verdicts: list[Verdict] | None = None
        failure = "error"
        try:
            async with asyncio.timeout(self.cfg.probe_timeout):
                answers = await slot.tier.batch_lookup(keys)
                found = [bool(a) for a in answers]  # an iterable may fail mid-way
            if len(found) != len(keys):
                failure = "bad_result"
                raise TierError(
                    f"{slot.name}: batch_lookup returned {len(found)} results for {len(keys)} keys"
                )
            verdicts = [Verdict.PRESENT if f else Verdict.ABSENT for f in found]
        except TimeoutError:
            failure = "timeout"
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
                self.metrics.probe_failures.labels(slot.name, failure).inc(len(keys))
            for i, probe in enumerate(probes):
                verdict = verdicts[i] if verdicts is not None else Verdict.ERROR
                owned = slot.probes.complete(probe, verdict, now)
                self.metrics.probe_verdicts.labels(slot.name, verdict.value).inc()
                if not owned:
                    self.metrics.probe_superseded.labels(slot.name).inc()
                elif (
                    verdict is Verdict.PRESENT
                    and self.cfg.remote_hit == "promote"
                    and not self._closing_now()
                    and not self.ram.contains(probe.key)
                    and probe.key not in self.reservations
                ):
                    # Start loading now, so the next lookup finds it PENDING or HIT.
                    self._promote(slot, probe.key, now)

    def _invalidate(self, key: bytes) -> None:
        for slot in self.remotes:
            slot.probes.invalidate(key)

    # ------------------------------------------------------------ pending writes

    def _reserve(
        self, key: bytes, owner: str, owner_id: int, deadline: float, size: int, now: float
    ) -> Reservation:
        res = self.reservations.add(
            key, owner, owner_id, now + deadline, size, now, asyncio.get_running_loop()
        )
        res.timer = self.scheduler.call_at(res.deadline, lambda: self._expire(res))
        return res

    def _end(self, res: Reservation, how: End) -> bool:
        """End ``res`` (resolving its waiters); False if it had already ended."""
        if not self.reservations.end(res, how):
            return False
        self.scheduler.cancel(res.timer)
        if res.size:
            self.ram.release(res.size)
        if res.owner_id:
            self.metrics.reservations.labels(how.value).inc()
        return True

    def _expire(self, res: Reservation) -> None:
        if not self._end(res, End.EXPIRED):
            return
        self.metrics.pending_deadline_expired.inc()
        log.warning(
            "pending write of key %s by %s missed its deadline after %.3fs; aborted",
            res.key.hex(),
            res.owner,
            res.deadline - res.started,
        )
        if res.task is not None:
            res.task.cancel()

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

        return self._start_promotion(slot.name, key, now, load, failed)

    def _promote_from_disk(self, key: bytes, now: float) -> Reservation:
        assert self.disk is not None
        disk = self.disk
        return self._start_promotion(disk.name, key, now, lambda: disk.read(key), lambda: None)

    def _start_promotion(
        self,
        source: str,
        key: bytes,
        now: float,
        load: Callable[[], Awaitable[Buffer | None]],
        failed: Callable[[], None],
    ) -> Reservation:
        """Load ``key`` into RAM as a pending write: concurrent readers share it."""
        res = self._reserve(key, f"promotion:{source}", 0, self.cfg.pending_deadline, 0, now)
        self.metrics.promotions.labels(source, "started").inc()
        res.task = self._task(self._run_promotion(source, res, load, failed))
        return res

    async def _run_promotion(
        self,
        source: str,
        res: Reservation,
        load: Callable[[], Awaitable[Buffer | None]],
        failed: Callable[[], None],
    ) -> None:
        """The reservation ends whatever happens; a miss or failure calls ``failed``."""
        key = res.key
        outcome = "failed"
        try:
            async with asyncio.timeout(self.cfg.load_timeout):
                value = await load()
            if value is None:
                outcome = "absent"
            elif self.reservations.get(key) is res:
                self._store_local(key, value, promoted_from=source)  # completes res
                outcome = "completed"
            else:
                outcome = "superseded"
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except Exception as exc:
            log.warning("%s: loading key %s failed: %s", source, key.hex(), exc)
        finally:
            if outcome in ("failed", "absent"):
                failed()
            self.metrics.promotions.labels(source, outcome).inc()
            self._end(res, End.ABORTED)  # no-op when completed

    def reserve(self, req: Reserve, conn_id: int) -> list[ReserveStatus]:
        self.check_keys(req.keys)
        self._check_seconds("deadline", req.deadline)
        limit = self.limits.max_block_bytes
        for i, size in enumerate(req.sizes):
            if size > limit:
                raise ValueTooLargeError(
                    f"size {i} is {size} bytes; the maximum block size is {limit}"
                )
        deadline = req.deadline or self.cfg.pending_deadline
        now = self._now()
        statuses: list[ReserveStatus] = []
        for key, size in zip(req.keys, req.sizes, strict=True):
            if (
                self.ram.contains(key)
                or (self.disk is not None and self.disk.contains(key))
                or any(s.probes.verdict(key, now) is Verdict.PRESENT for s in self.remotes)
            ):
                statuses.append(ReserveStatus.PRESENT)
                continue
            if key in self.reservations:
                statuses.append(ReserveStatus.PENDING)
                continue
            if size:
                try:
                    evicted = self.ram.reserve(size)
                except (NoCapacityError, ValueTooLargeError):
                    statuses.append(ReserveStatus.REFUSED)
                    self.metrics.reservations.labels("refused").inc()
                    continue
                for victim, _ in evicted:
                    self._invalidate(victim)
            self._reserve(key, f"conn#{conn_id}", conn_id, deadline, size, now)
            self.metrics.reservations.labels("granted").inc()
            statuses.append(ReserveStatus.GRANTED)
        return statuses

    def abort(self, keys: Sequence[bytes], conn_id: int) -> list[bool]:
        """End ``conn_id``'s reservations of ``keys``; other writers' are untouched."""
        self.check_keys(keys)
        out = []
        for key in keys:
            res = self.reservations.get(key)
            out.append(res is not None and res.owner_id == conn_id and self._end(res, End.ABORTED))
        return out

    def release(self, tag: bytes) -> bool:
        """Forget a request tag's reader-side state."""
        existed = self.deferrals.get(tag) is not None
        deferred = self.deferrals.release(tag, self._now())
        if deferred is not None:
            self.metrics.lookup_deferred_seconds.observe(deferred)
        return existed

    def connection_closed(self, conn_id: int) -> None:
        """A writer went away: its reservations end at once."""
        owned = self.reservations.owned_by(conn_id)
        for res in owned:
            self._end(res, End.RELEASED)
        if owned:
            log.info("connection #%d closed; released %d reservation(s)", conn_id, len(owned))

    # ------------------------------------------------------------ GET

    def get_pinned(
        self, keys: Sequence[bytes]
    ) -> list[Buffer | None] | Coroutine[Any, Any, list[Buffer | None]]:
        """Values of ``keys``, each present one pinned until :meth:`unpin`."""
        self.check_keys(keys)
        pin = self.ram.pin
        values = [pin(k) for k in keys]
        if all(v is not None or not self._may_arrive(k) for k, v in zip(keys, values, strict=True)):
            return values
        return self._get_slow(keys, values)

    def _may_arrive(self, key: bytes) -> bool:
        """Whether a GET of a key missing from RAM should wait or load."""
        disk = self.disk
        return bool(
            self.remotes
            or key in self.reservations
            or (disk is not None and (disk.contains(key) or disk.scanning))
        )

    async def _get_slow(
        self, keys: Sequence[bytes], values: list[Buffer | None]
    ) -> list[Buffer | None]:
        missing = [i for i, v in enumerate(values) if v is None]
        try:
            found = await asyncio.gather(*(self._read_through(keys[i]) for i in missing))
        except BaseException:
            self.unpin(keys, values)
            raise
        for i, value in zip(missing, found, strict=True):
            values[i] = value
        return values

    async def _read_through(self, key: bytes) -> Buffer | None:
        """Wait for a pending write of ``key`` or promote it from a remote tier.

        Concurrent readers of one key share one reservation, hence one load.
        """
        for _ in range(_MAX_READ_ROUNDS):
            value = self.ram.pin(key)
            if value is not None:
                return value
            if self._closing_now():
                return None
            res = self.reservations.get(key)
            disk = self.disk
            if res is None and disk is not None:
                if disk.contains(key):
                    res = self._promote_from_disk(key, self._now())
                elif disk.scanning and disk.scan_done is not None:
                    await asyncio.wait([disk.scan_done])
                    continue
            if res is None:
                now = self._now()
                slot = next(
                    (
                        s
                        for s in self.remotes
                        if s.probes.verdict(key, now) not in (Verdict.ABSENT, Verdict.ERROR)
                    ),
                    None,
                )
                if slot is None:
                    return None
                res = self._promote(slot, key, now)
            waits: list[asyncio.Future[Any]] = [res.done]
            if self._closing is not None:
                waits.append(self._closing)
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        return None

    def unpin(self, keys: Sequence[bytes], values: Sequence[Buffer | None]) -> None:
        unpin = self.ram.unpin
        for key, value in zip(keys, values, strict=True):
            if value is not None:
                unpin(key)

    # ------------------------------------------------------------ PUT / DELETE

    def put(
        self, keys: Sequence[bytes], values: Sequence[Buffer], durable: bool = False
    ) -> list[PutStatus] | Coroutine[Any, Any, list[PutStatus]]:
        """Store into RAM; lower tiers follow their write policy.

        ``durable``: the reply waits until the blocks are on disk (per the
        disk's fsync policy). Without a disk tier there is nothing to wait for.
        """
        self.check_keys(keys)
        limit = self.limits.max_block_bytes
        for i, value in enumerate(values):
            if len(value) > limit:
                raise ValueTooLargeError(
                    f"value {i} is {len(value)} bytes; the maximum block size is {limit}"
                )
            if len(value) > self.ram.capacity:
                raise ValueTooLargeError(
                    f"value {i} is {len(value)} bytes, larger than the RAM tier "
                    f"({self.ram.capacity} bytes)"
                )
        statuses = [self._store_local(k, v) for k, v in zip(keys, values, strict=True)]
        if durable and self.disk is not None:
            return self._put_durable(keys, values, statuses)
        return statuses

    async def _put_durable(
        self, keys: Sequence[bytes], values: Sequence[Buffer], statuses: list[PutStatus]
    ) -> list[PutStatus]:
        assert self.disk is not None
        disk = self.disk
        await asyncio.gather(
            *(disk.write(k, v, durable=True) for k, v in zip(keys, values, strict=True))
        )
        return statuses

    def _store_local(self, key: bytes, value: Buffer, promoted_from: str = "") -> PutStatus:
        """Store into RAM and complete a pending write of ``key``, if any."""
        res = self.reservations.get(key)
        if res is not None and res.size:
            self.ram.release(res.size)
            res.size = 0
        try:
            stored, evicted = self.ram.put(key, value)
        except KvtierError:
            if res is not None:
                self._end(res, End.ABORTED)
            raise
        if res is not None:
            self._end(res, End.COMPLETED)
        self._invalidate(key)
        for victim, victim_value in evicted:
            self._invalidate(victim)
            for w in self.writers:
                if w.policy == "write-back" and not w.holds(victim):
                    self._write_behind(w, victim, victim_value, "demotion")
        if stored:
            from_remote = bool(promoted_from) and promoted_from not in self._local_names
            for w in self.writers:
                if promoted_from:
                    # A promoted block is in its source already; one that came
                    # from a remote tier is kept on the local disk as well.
                    wanted = from_remote and w.local and w.policy != "none"
                else:
                    wanted = w.policy == "write-through"
                if wanted and not w.holds(key):
                    self._write_behind(w, key, value, "write-through")
        return PutStatus.STORED if stored else PutStatus.EXISTS

    def _remote_writer(self, tier: Tier) -> Callable[[bytes, Buffer], Awaitable[None]]:
        async def write(key: bytes, value: Buffer) -> None:
            await tier.batch_store([key], [value])
            self._invalidate(key)

        return write

    def _write_behind(self, w: Writer, key: bytes, value: Buffer, why: str) -> None:
        """Write to a lower tier in the background, within its backlog."""
        size = len(value)
        if self._closing_now() or w.pending + size > w.max_pending:
            self.metrics.writes_dropped.labels(w.name, "backlog").inc()
            return
        w.pending += size
        self._task(self._run_write_behind(w, key, value, why, size))

    async def _run_write_behind(
        self, w: Writer, key: bytes, value: Buffer, why: str, size: int
    ) -> None:
        outcome = "failed"
        try:
            await w.write(key, value)
            outcome = "completed"
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except Exception as exc:
            self.metrics.writes_dropped.labels(w.name, "failed").inc()
            log.warning("%s: %s of key %s failed: %s", w.name, why, key.hex(), exc)
        finally:
            w.pending -= size
            if why == "demotion":
                self.metrics.demotions.labels(w.name, outcome).inc()

    def delete(self, keys: Sequence[bytes]) -> list[bool] | Coroutine[Any, Any, list[bool]]:
        self.check_keys(keys)
        disk = self.disk
        local = [self.ram.remove(k) | (disk is not None and disk.discard(k)) for k in keys]
        for key in keys:
            self._invalidate(key)
        if not self.remotes:
            return local
        return self._delete_remote(keys, local)

    async def _delete_remote(self, keys: Sequence[bytes], local: list[bool]) -> list[bool]:
        results = await asyncio.gather(
            *(slot.tier.delete(keys) for slot in self.remotes), return_exceptions=True
        )
        out = list(local)
        for slot, result in zip(self.remotes, results, strict=True):
            if isinstance(result, BaseException):
                if isinstance(result, asyncio.CancelledError):
                    raise result
                raise TierError(f"{slot.name}: delete failed: {result}") from result
            out = [a or bool(b) for a, b in zip(out, result, strict=True)]
        for key in keys:
            self._invalidate(key)
        return out

    # ------------------------------------------------------------ STATS

    def snapshot(self) -> StateSnapshot:
        return StateSnapshot(
            probes_inflight={s.name: s.probes.inflight_count for s in self.remotes},
            verdicts_cached={s.name: s.probes.verdict_count for s in self.remotes},
            pending_writes=len(self.reservations),
            request_states=len(self.deferrals),
        )

    def stats(self) -> dict[str, Any]:
        tiers: dict[str, Any] = {}
        local = [self.ram.stats()] + ([self.disk.stats()] if self.disk is not None else [])
        for st in [*local, *(s.tier.stats() for s in self.remotes)]:
            tiers[st.name] = {
                "capacity_bytes": st.capacity_bytes,
                "used_bytes": st.used_bytes,
                "blocks": st.blocks,
                "evictions": st.evictions,
                **st.extra,
            }
        return {
            "tiers": tiers,
            "maps": {
                "probes_inflight": sum(s.probes.inflight_count for s in self.remotes),
                "verdicts": sum(s.probes.verdict_count for s in self.remotes),
                "reservations": len(self.reservations),
                "request_states": len(self.deferrals),
            },
            "probes": {
                s.name: {"inflight": s.probes.inflight_count, "verdicts": s.probes.verdict_count}
                for s in self.remotes
            },
        }

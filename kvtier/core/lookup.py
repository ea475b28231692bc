"""Evaluating one lookup: each key's state from where it is, then the prefix answer.

For each key the :class:`~kvtier.core.locate.Locator` says where it is and
this module acts on it: a remote PRESENT verdict starts a promotion (the key
reads PENDING), a remote tier with neither verdict nor probe gets one
(RETRY), usable disk hits start loading into RAM ahead of the GET. The
reader-side PENDING bound (:mod:`~kvtier.core.deferral`) then truncates the
prefix. Keeps the bytearray fast path: with no remote tier, no pending
write and a complete disk index, states are membership tests at C speed.

Imports the core's pure modules, the tiers and the shared records.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from kvtier.core.counts import CoreCounters
from kvtier.core.deferral import DeferralTracker
from kvtier.core.locate import Location, Locator, Where
from kvtier.core.pending import Reservation, ReservationTable
from kvtier.core.prefix import prefix_answer
from kvtier.core.probes import Verdict
from kvtier.core.remotes import RemoteProbes, RemoteSlot
from kvtier.model import HIT, MISS, PENDING, RETRY, STATE_NAMES, Lookup, LookupMode, LookupReply
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.ram import RamTier

#: probes a waiting lookup has seen, by (remote tier index, key)
SeenProbes = dict[tuple[int, bytes], asyncio.Future[Verdict]]


class LookupEvaluator:
    def __init__(
        self,
        *,
        ram: RamTier,
        disk: DiskTier | None,
        pending: ReservationTable,
        locator: Locator,
        probing: RemoteProbes,
        deferrals: DeferralTracker,
        counters: CoreCounters,
        remote_hit_reads_hit: bool,
        promote_on_lookup: bool,
        promote_remote: Callable[[RemoteSlot, bytes, float], Reservation],
        promote_from_disk: Callable[[bytes, float], Reservation],
        closing: Callable[[], bool],
    ) -> None:
        self.ram = ram
        self.disk = disk
        self._pending = pending
        self.locator = locator
        self.probing = probing
        self.remotes = probing.slots
        self.deferrals = deferrals
        self.counters = counters
        self._remote_hit_reads_hit = remote_hit_reads_hit
        self._promote_on_lookup = promote_on_lookup
        self._promote_remote = promote_remote
        self._promote_from_disk = promote_from_disk
        self._closing_now = closing
        self._state_counters = {
            state: counters.lookup_keys.bind(name) for state, name in STATE_NAMES.items()
        }

    def __repr__(self) -> str:
        return f"<LookupEvaluator {self.locator!r}>"

    def evaluate(
        self,
        req: Lookup,
        now: float,
        seen: SeenProbes | None,
    ) -> tuple[LookupReply, list[asyncio.Future[Any]], float | None]:
        """States of ``req.keys`` now; with ``seen`` (a waiting lookup) also the
        futures whose settling can change the answer."""
        keys = req.keys
        disk = self.disk
        disk_only: list[int] = []  # indices of HITs that are on disk but not in RAM
        futures: list[asyncio.Future[Any] | None] = []
        if not self.remotes and not self._pending and (disk is None or not disk.scanning):
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
                states[i], fut = self._state(key, loc, now, seen)
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
        # A HIT is a read to come: the eviction policy hears of it (later,
        # before the next write, so the reply does not wait for it).
        self.ram.touch_later(keys, len(keys) if req.mode == LookupMode.KEYS else hits)
        if disk_only and self._promote_on_lookup:
            # Start loading the usable disk hits into RAM: the GET comes next.
            limit = hits if req.mode != LookupMode.KEYS else len(keys)
            pending = self._pending
            for i in disk_only:
                if i >= limit:
                    break
                # A key listed twice is loaded once: the first start is pending.
                if states[i] == HIT and keys[i] not in pending:
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

    def _state(
        self,
        key: bytes,
        loc: Location,
        now: float,
        seen: SeenProbes | None,
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
            if self._remote_hit_reads_hit:
                return HIT, None
            return PENDING, self._promote_remote(slot, key, now).done
        self._count_cached(loc)
        if where is Where.PROBING:
            settles = loc.settles
            for i, fut in loc.inflight:
                self.remotes[i].joined.value += 1
                if seen is not None:
                    seen[(i, key)] = fut
            if not self._closing_now():  # no new backend work once shutdown has begun
                for i in loc.unprobed:
                    probe = self.probing.begin(self.remotes[i], key)
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
        if not loc.unprobed and not loc.inflight:  # every tier answered (ABSENT, SCANNING)
            for slot in self.remotes:
                slot.cached.value += 1
            return
        busy = set(loc.unprobed).union(i for i, _ in loc.inflight)
        for slot in self.remotes:
            if slot.index not in busy:
                slot.cached.value += 1

    def count(self, raw: bytes) -> None:
        for state, cell in self._state_counters.items():
            n = raw.count(state)
            if n:
                cell.value += n

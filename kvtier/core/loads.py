"""Reads: GET, and the loads that bring a block up into RAM (from the disk,
or from a remote tier: a promotion).

:class:`Loads` owns the disk reads in flight and the promotion counters. A
GET pins what RAM holds and, for each other key, acts on where the locator
says it is: it joins the write or load in flight, starts a load from the
disk or from the remote tier that holds the key, or waits for the disk
index; a lookup starts the same loads ahead of the GET it foresees.

Invariants: one load of a key at a time, however many readers (a disk read
is shared through its future, a promotion is a pending write readers wait
on); a promotion's reservation ends in ``finally`` whatever the load did,
and a tier that claimed a block it could not deliver is told ABSENT for it
(no lookup-says-HIT / load-fails livelock), or ERROR when the load failed
rather than the store answering (an error is never remembered as absence:
the block is asked for again after ``error_ttl``); a GET's waits end at shutdown
and never cancel what they wait on; a GET that fails unpins what it pinned.
Imports the core's parts, the tiers and the shared records.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from kvtier.core.checks import check_keys
from kvtier.core.context import Context
from kvtier.core.costs import Occupancy
from kvtier.core.counts import Promoted
from kvtier.core.lookup import Location, Where
from kvtier.core.probes import Verdict
from kvtier.core.probing import Reach, RemoteSlot
from kvtier.core.stores import Stores
from kvtier.core.writes import End, Promotion, Reservation
from kvtier.errors import TierError
from kvtier.model import Buffer, PutStatus
from kvtier.tiers.hedger import present

log = logging.getLogger("kvtier.service")

#: a GET gives up on a key after this many rounds of waiting on writes that
#: ended without the block (each round is bounded by a write deadline)
MAX_READ_ROUNDS = 8


class Loads:
    """GET, disk reads into RAM, promotions from remote tiers."""

    def __init__(
        self,
        c: Context,
        stores: Stores,
        sources: Sequence[str],
    ) -> None:
        #: what every part of the service works with
        self.c = c
        self.stores = stores
        #: reads from the disk into RAM in flight, by key: every GET of the key joins one
        self._disk_loads: dict[bytes, asyncio.Future[None]] = {}
        #: loads in flight by source (disk reads, promotions: a new one
        #: queues behind them), and how many shared each one's time
        self.occupancy = Occupancy(time.perf_counter)
        #: promotions counted by source tier and outcome, bound once
        self._promoted = {
            name: {o: c.counters.promotions.bind(name, o.value) for o in Promoted}
            for name in sources
        }

    def __repr__(self) -> str:
        return f"<Loads disk_loads={len(self._disk_loads)}>"

    def close(self) -> None:
        """End every disk read (its readers find the key absent)."""
        loads, self._disk_loads = self._disk_loads, {}
        for done in loads.values():  # a read whose task never ran
            if not done.done():
                done.set_result(None)

    # ------------------------------------------------------------ GET

    def get(
        self, keys: Sequence[bytes], *, reach: Reach
    ) -> list[Buffer | None] | Awaitable[list[Buffer | None]]:
        """Values of ``keys``, each present one pinned until :meth:`unpin`: now,
        or (when some key must be loaded or waited for) the awaitable that
        returns them. Each key is checked, pinned and located once; the loads
        it needs start before this returns."""
        check_keys(self.c.limits, keys)
        values = self.c.ram.pin_many(keys)
        if None not in values:
            return values
        locate = reach.locator.locate
        now = self.c.now()
        below: list[tuple[int, asyncio.Future[Any]]] = []
        for i, value in enumerate(values):
            if value is None and (
                settles := self._read_step(keys[i], locate(keys[i], now), now, reach)
            ):
                below.append((i, settles))
        if not below:
            return values
        return self._get_below(keys, values, below, reach)

    def _read_step(
        self, key: bytes, loc: Location, now: float, reach: Reach
    ) -> asyncio.Future[Any] | None:
        """Act on where ``key`` is for a read: join the write, promotion or
        disk read in flight, or start one from the disk or the remote tier that holds the
        key (the first that may, while none has answered; a load of an absent
        block answers absent, which is kept), or wait for the disk index.
        Returns what to wait for; None when there is nothing to read."""
        where = loc.where
        if where is Where.ABSENT or self.c.life.closing:
            return None
        if loc.reservation is not None:  # a write or a promotion is under way
            return loc.reservation.done
        if where is Where.DISK:
            return self.load_from_disk(key)
        if where is Where.REMOTE:
            return self.promote(reach.remotes[loc.remote], key, now).done
        if where is Where.PROBING:
            first = min((*loc.unprobed, *(i for i, _ in loc.inflight)))
            return self.promote(reach.remotes[first], key, now).done
        return loc.settles  # SCANNING: the disk index may still name it

    async def _get_below(
        self,
        keys: Sequence[bytes],
        values: list[Buffer | None],
        below: list[tuple[int, asyncio.Future[Any]]],
        reach: Reach,
    ) -> list[Buffer | None]:
        try:
            found = await asyncio.gather(*(self._read(keys[i], f, reach) for i, f in below))
        except BaseException:
            self.unpin(keys, values)
            raise
        for (i, _), value in zip(below, found, strict=True):
            values[i] = value
        return values

    async def _read(self, key: bytes, settles: asyncio.Future[Any], reach: Reach) -> Buffer | None:
        """``key`` pinned in RAM once what it waits for settles; None if absent.
        A write that ended without the block sends the key round again, at
        most ``MAX_READ_ROUNDS`` times (each round bounded by a deadline)."""
        for _ in range(MAX_READ_ROUNDS):
            await self.c.life.until(settles)
            value = self.c.ram.pin(key)
            if value is not None or self.c.life.closing:
                return value
            now = self.c.now()
            step = self._read_step(key, reach.locator.locate(key, now), now, reach)
            if step is None:
                return None
            settles = step
        return None

    def unpin(self, keys: Sequence[bytes], values: Sequence[Buffer | None]) -> None:
        self.c.ram.unpin_many(keys, values)

    # ------------------------------------------------------------ loads into RAM

    def probed_present(self, slot: RemoteSlot, key: bytes, now: float) -> None:
        """A probe found ``key`` in ``slot``: start loading it, so the next lookup
        finds it PENDING or HIT."""
        if (
            self.c.cfg.remote_hit == "promote"
            and not self.c.life.closing
            and self.c.locator.locate(key, now).where is Where.REMOTE
        ):
            self.promote(slot, key, now)

    def promote(self, slot: RemoteSlot, key: bytes, now: float) -> Reservation:
        """Load ``key`` from a remote tier into RAM; a tier that claimed the
        block and could not deliver it is told ABSENT for the key (no
        lookup-says-HIT / load-fails livelock). A load the tier's hedger
        finds slow asks the next lower tier that may hold the block too."""
        hedger = slot.tier.hedger
        below = None
        if hedger is not None:  # (a tier that hedges: where its hedge may go)
            below = next(
                (s for s in slot.lower if s.probes.verdict(key, now) is not Verdict.ABSENT), None
            )

        async def load() -> Buffer | None:
            if hedger is None or below is None:
                return await _load_one(slot, key)

            def hedge() -> Awaitable[Buffer | None]:
                return _load_one(below, key)

            value, _ = await hedger.race(
                hedger.timed(slot.name, _load_one(slot, key)),
                hedge,
                hedger.delay(slot.name),
                delivers=present,
            )
            return value

        def failed(outcome: Promoted) -> None:
            # Only the store's answer is a verdict: an object it said it has
            # not (or one that did not admit) is absent for verdict_ttl; a
            # load that failed (an error, a timeout, a breaker that refused
            # to send it) is an error, kept for error_ttl.
            verdict = Verdict.ERROR if outcome is Promoted.FAILED else Verdict.ABSENT
            slot.probes.force(key, verdict, self.c.now())

        return self._start_promotion(slot.name, key, now, load, failed)

    def arriving(self, key: bytes) -> asyncio.Future[Any] | None:
        """What ends when ``key``'s load into RAM in flight ends, if one is:
        a disk read, or a pending write (a promotion, a client's
        reservation); it ends however the load did."""
        done = self._disk_loads.get(key)
        if done is not None:
            return done
        res = self.c.pending.table.get(key)
        return None if res is None else res.done

    def load_from_disk(self, key: bytes) -> asyncio.Future[None]:
        """Read ``key`` from the disk into RAM, once for every reader: a GET
        that finds a read of the key in flight joins it. A disk hit reads HIT
        meanwhile (the block is readable now), so this is no pending write."""
        done = self._disk_loads.get(key)
        if done is None:
            done = self._disk_loads[key] = asyncio.get_running_loop().create_future()
            self.c.life.task(self._disk_load(key, done))
        return done

    async def _disk_load(self, key: bytes, done: asyncio.Future[None]) -> None:
        disk = self.c.disk
        assert disk is not None
        promoted = self._promoted[disk.name]
        promoted[Promoted.STARTED].value += 1
        outcome = Promoted.FAILED
        mark, value = self.occupancy.begin(disk.name), None
        try:
            async with asyncio.timeout(self.c.cfg.load_timeout):
                value = await disk.read(key)
            if value is None:
                outcome = Promoted.ABSENT
            elif self.stores.store(key, value, disk.name) is PutStatus.STORED:
                outcome = Promoted.COMPLETED
            else:
                outcome = Promoted.SUPERSEDED  # a client stored it meanwhile
        except asyncio.CancelledError:
            outcome = Promoted.CANCELLED
            raise
        except Exception as exc:
            log.warning("%s: loading key %s failed: %s", disk.name, key.hex(), exc)
        finally:
            elapsed, sharing = self.occupancy.end(disk.name, mark)
            if value is not None:  # (what it cost teaches the lookups' budgets)
                self.c.costs.observe(disk.name, elapsed, len(value), sharing=sharing)
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
        failed: Callable[[Promoted], None] | None,
    ) -> Reservation:
        """A promotion is a pending write whose writer is a load from a lower
        tier: readers of the key wait on it like on any write, so concurrent
        GETs of one key share one load, and its deadline bounds it."""
        res = self.c.pending.reserve(key, Promotion(source), self.c.cfg.pending_deadline, 0, now)
        self._promoted[source][Promoted.STARTED].value += 1
        res.task = self.c.life.task(self._promotion(source, res, load, failed))
        return res

    async def _promotion(
        self,
        source: str,
        res: Reservation,
        load: Callable[[], Awaitable[Buffer | None]],
        failed: Callable[[Promoted], None] | None,
    ) -> None:
        """Load, then store into RAM if the reservation still holds the key (a
        client's PUT may have completed it first). The reservation ends in
        ``finally`` whatever the load did."""
        key = res.key
        outcome = Promoted.FAILED
        mark, value = self.occupancy.begin(source), None
        try:
            async with asyncio.timeout(self.c.cfg.load_timeout):
                value = await load()
            if value is None:
                outcome = Promoted.ABSENT
            elif self.c.pending.table.get(key) is res:
                self.stores.store(key, value, source)  # completes res
                outcome = Promoted.COMPLETED
            else:
                outcome = Promoted.SUPERSEDED
        except asyncio.CancelledError:
            outcome = Promoted.CANCELLED
            raise
        except Exception as exc:
            log.warning("%s: loading key %s failed: %s", source, key.hex(), exc)
        finally:
            elapsed, sharing = self.occupancy.end(source, mark)
            if value is not None:
                self.c.costs.observe(source, elapsed, len(value), sharing=sharing)
            if failed is not None and outcome in (Promoted.FAILED, Promoted.ABSENT):
                failed(outcome)
            self._promoted[source][outcome].value += 1
            if outcome is not Promoted.COMPLETED:  # a completed one ended with its store
                self.c.pending.end(res, End.ABORTED)


async def _load_one(slot: RemoteSlot, key: bytes) -> Buffer | None:
    values = await slot.tier.batch_load([key])
    if len(values) != 1:
        raise TierError(f"{slot.name}: batch_load returned {len(values)} values for 1 key")
    return values[0]

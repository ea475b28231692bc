"""Write propagation: which lower tiers a stored or evicted block flows to.

Each lower tier is a :class:`Writer` with a write policy:

* ``write-through`` - every block stored by a client is written down in
  the background;
* ``write-back`` - a block is written down when RAM evicts it (a demotion);
* ``none`` - nothing flows down (durable PUTs still reach the disk).

A block promoted from a remote tier is also kept on the local disk unless
its policy is ``none``; a block promoted from a tier is never written back
to that tier. Background writes are bounded per tier by ``max_pending``
bytes in flight; each write counts its block's bytes plus
``WRITE_OVERHEAD``, what it costs the daemon besides, so the bound holds
for memory with blocks of any size. Past the bound:

* a local tier's (the disk's) write is still queued, and :meth:`Propagation.room`
  hands out a future that resolves once its writes are back under the
  bound: the server stops reading the connections whose stores found the
  tier full until then, so writers slow to the disk's pace and no block
  is lost. Only past ``HARD_LIMIT`` times the bound (writes that no
  client store paces: promotions kept locally) is one dropped;
* a remote tier's (S3, peers) write is dropped, counted and logged: a slow
  network tier never slows the engines' stores.

A value is held (its RAM bytes unchanged) while its write runs. Imports the
tiers' interface and the core's counters.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.core.counts import CoreCounters, Dropped, Written
from kvtier.model import Buffer
from kvtier.tiers.base import Tier

log = logging.getLogger("kvtier.service")


class WritePolicy(enum.Enum):
    WRITE_THROUGH = "write-through"
    WRITE_BACK = "write-back"
    NONE = "none"


class WriteReason(enum.Enum):
    WRITE_THROUGH = "write-through"  # a client stored it
    DEMOTION = "demotion"  # RAM evicted it
    KEEP_LOCAL = "keep-local"  # promoted from a remote tier, kept on disk too


#: daemon memory one background write in flight costs besides its block
#: (its task, coroutines, the executor's work item), measured at ~8 KB; every
#: write counts it against its tier's ``max_pending`` bytes
WRITE_OVERHEAD = 8 * 1024

#: a local tier's writes in flight may reach this many times its bound
#: (writers are paced at the bound) before one is dropped
HARD_LIMIT = 4

#: seconds between two warnings of dropped writes of one tier
DROP_LOG_INTERVAL = 10.0


@dataclass(slots=True, frozen=True)
class RemoteSpec:
    """A remote tier and how stores flow to it."""

    tier: Tier
    policy: WritePolicy = WritePolicy.NONE
    max_pending: int = 0

    def writer(self, written: Callable[[bytes], None]) -> Writer:
        """The tier as a :class:`Writer`; ``written(key)`` runs after each store."""
        tier = self.tier

        async def write(key: bytes, value: Buffer) -> None:
            await tier.batch_store([key], [value])
            written(key)

        return Writer(tier.name, self.policy, self.max_pending, write, _never, local=False)


def _never(_key: bytes) -> bool:
    return False


@dataclass(slots=True)
class Writer:
    """A lower tier that blocks flow to."""

    name: str
    policy: WritePolicy
    #: bytes of background writes allowed in flight to this tier
    max_pending: int
    write: Callable[[bytes, Buffer], Awaitable[None]]
    holds: Callable[[bytes], bool]  # already there: nothing to write
    local: bool
    #: bytes of background writes in flight now; bounded by max_pending
    pending: int = 0


class Propagation:
    def __init__(
        self,
        writers: Sequence[Writer],
        counters: CoreCounters,
        task: Callable[[Coroutine[Any, Any, None]], object],
        closing: Callable[[], bool],
        hold: Callable[[bytes, Buffer], None] = lambda key, value: None,
        let_go: Callable[[bytes, Buffer], None] = lambda key, value: None,
    ) -> None:
        self.writers = list(writers)
        #: a background write keeps its value unchanged (RAM may evict it meanwhile)
        self._hold = hold
        self._let_go = let_go
        #: the local tiers: a block promoted from one of them flows nowhere
        self.local = frozenset(w.name for w in self.writers if w.local)
        self._local = [w for w in self.writers if w.local]
        self._counters = counters
        self._task = task
        self._closing = closing
        #: resolves once every local tier's writes are back under its bound
        #: (:meth:`room`); None while they are
        self._room: asyncio.Future[None] | None = None
        #: when each tier's dropped writes were last logged
        self._logged: dict[str, float] = {}

    def __repr__(self) -> str:
        busy = {w.name: w.pending for w in self.writers if w.pending}
        full = " full" if self._room is not None else ""
        return f"<Propagation writers={[w.name for w in self.writers]} in_flight={busy}{full}>"

    def room(self) -> asyncio.Future[None] | None:
        """None while every local tier can queue more writes; else the future
        that resolves once they can (a store's writer waits for it before
        sending more)."""
        return self._room

    def stats(self) -> dict[str, dict[str, int]]:
        """Each lower tier's background writes: bytes in flight, the bound,
        and the writes given up, by cause."""
        dropped = self._counters.writes_dropped
        return {
            w.name: {
                "in_flight_bytes": w.pending,
                "max_in_flight_bytes": w.max_pending,
                "dropped_backlog": int(dropped.value(w.name, Dropped.BACKLOG.value)),
                "dropped_failed": int(dropped.value(w.name, Dropped.FAILED.value)),
            }
            for w in self.writers
        }

    def stored(self, key: bytes, value: Buffer, promoted_from: str | None) -> None:
        """``key`` was newly stored in RAM (by a client, or promoted from a tier)."""
        for w in self.writers:
            if promoted_from is None:
                reason = WriteReason.WRITE_THROUGH
                wanted = w.policy is WritePolicy.WRITE_THROUGH
            else:
                # A promoted block is in its source already; one that came from
                # a remote tier is kept on the local disk as well.
                reason = WriteReason.KEEP_LOCAL
                wanted = (
                    w.local and w.policy is not WritePolicy.NONE and promoted_from not in self.local
                )
            if wanted and not w.holds(key):
                self._write_behind(w, key, value, reason)

    def evicted(self, victims: Sequence[tuple[bytes, Buffer]]) -> None:
        """RAM evicted ``victims``: write-back tiers take them."""
        for key, value in victims:
            for w in self.writers:
                if w.policy is WritePolicy.WRITE_BACK and not w.holds(key):
                    self._write_behind(w, key, value, WriteReason.DEMOTION)

    def _write_behind(self, w: Writer, key: bytes, value: Buffer, why: WriteReason) -> None:
        # What a write in flight really costs the daemon: its bytes and the
        # memory of the write itself, so small blocks cannot pile up unbounded.
        size = len(value) + WRITE_OVERHEAD
        over = w.pending + size > w.max_pending
        if over and w.local and w.pending + size <= w.max_pending * HARD_LIMIT:
            if self._room is None:  # queued all the same: its writers are slowed
                self._room = asyncio.get_running_loop().create_future()
        elif over or self._closing():
            self._dropped(w, key, why)
            return
        w.pending += size
        self._hold(key, value)
        try:
            self._task(self._run(w, key, value, why, size))
        except BaseException:
            w.pending -= size
            self._let_go(key, value)
            raise

    async def _run(self, w: Writer, key: bytes, value: Buffer, why: WriteReason, size: int) -> None:
        outcome = Written.FAILED
        try:
            await w.write(key, value)
            outcome = Written.COMPLETED
        except asyncio.CancelledError:
            outcome = Written.CANCELLED
            raise
        except Exception as exc:
            self._counters.writes_dropped.inc(w.name, Dropped.FAILED.value)
            log.warning("%s: %s of key %s failed: %s", w.name, why.value, key.hex(), exc)
        finally:
            w.pending -= size
            self._let_go(key, value)
            if why is WriteReason.DEMOTION:
                self._counters.demotions.inc(w.name, outcome.value)
            room = self._room
            if room is not None and all(x.pending <= x.max_pending for x in self._local):
                self._room = None
                room.set_result(None)

    def _dropped(self, w: Writer, key: bytes, why: WriteReason) -> None:
        """A write given up for want of room: counted, and logged (at most
        every ``DROP_LOG_INTERVAL`` seconds a tier)."""
        self._counters.writes_dropped.inc(w.name, Dropped.BACKLOG.value)
        if self._closing():
            return
        now = time.monotonic()
        if now - self._logged.get(w.name, -DROP_LOG_INTERVAL) >= DROP_LOG_INTERVAL:
            self._logged[w.name] = now
            total = self._counters.writes_dropped.value(w.name, Dropped.BACKLOG.value)
            log.warning(
                "%s: %s of key %s dropped: %d bytes of writes already in flight "
                "(max_pending_write_bytes %d); %d dropped so far",
                w.name,
                why.value,
                key.hex(),
                w.pending,
                w.max_pending,
                total,
            )

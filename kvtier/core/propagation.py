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
* a remote tier's (S3, peers) write never slows the engines' stores. A
  tier with a backlog (an object store's ``max_backlog_bytes``) is owed
  each block from the moment it is written (:mod:`kvtier.core.outbox`)
  until it has it: the owed blocks are sent oldest first, ``SEND_AT_ONCE``
  in flight, and one the tier fails stays owed and is sent again once it
  answers. The owed keys are kept on the disk where there is one
  (:class:`~kvtier.tiers.disk.owedfile.OwedFile`, read again at start: a
  crash loses no write in flight), their bytes held in memory only where
  no disk copy outlives the daemon. Past the backlog's bound the oldest
  waiting are given up; a tier without one (the peers) drops a write past
  its ``max_pending`` bytes in flight, or one it fails; each is counted and
  logged.

A durable PUT with no disk rests on the first remote tier that outlives
the daemon (:meth:`Propagation.durably`): it waits for that tier's write,
or fails saying why.

A value is held (its RAM bytes unchanged) while its write runs. Imports the
tiers' interface and the core's counters.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.backoff import Backoff
from kvtier.core.counts import CoreCounters, Dropped, Written
from kvtier.core.outbox import Outbox, Owed
from kvtier.errors import NotDurableError
from kvtier.model import Buffer
from kvtier.tiers.base import Tier
from kvtier.tiers.disk.owedfile import OwedFile

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

#: owed blocks sent at once to a tier: as many as a tier's writes in
#: flight when it keeps up (the S3 tier's ``max_concurrency``), so that
#: new writes, queued behind the owed ones, flow as fast as without them
SEND_AT_ONCE = 64
#: seconds between two tries of a tier whose owed writes all failed: from
#: the first, doubling up to the most (a tier whose breaker is open refuses
#: at once, without a request, until its own trial succeeds)
RETRY_FIRST = 0.05
RETRY_MOST = 1.0


@dataclass(slots=True, frozen=True)
class RemoteSpec:
    """A remote tier and how stores flow to it."""

    tier: Tier
    policy: WritePolicy = WritePolicy.NONE
    max_pending: int = 0
    #: bytes of blocks the tier may be owed while it does not take them
    #: (0: a failed write is dropped)
    max_backlog: int = 0

    def writer(self, written: Callable[[bytes], None]) -> Writer:
        """The tier as a :class:`Writer`; ``written(key)`` runs after each store."""
        tier = self.tier

        async def write(key: bytes, value: Buffer) -> None:
            await tier.batch_store([key], [value])
            written(key)

        async def erase(key: bytes) -> None:
            await tier.delete([key])
            written(key)

        return Writer(
            tier.name,
            self.policy,
            self.max_pending,
            write,
            _never,
            local=False,
            outlives=tier.outlives_daemon,
            outbox=Outbox(self.max_backlog) if self.max_backlog else None,
            erase=erase,
        )


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
    #: a block written here outlives the daemon (a durable PUT may rest on it)
    outlives: bool = False
    #: the blocks the tier is owed (None: its failed writes are dropped)
    outbox: Outbox | None = None
    #: the owed keys on the disk (None: in memory only)
    owed_file: OwedFile | None = None
    #: removes a block from the tier: one deleted while its write was in flight
    erase: Callable[[bytes], Awaitable[None]] | None = None
    #: bytes of background writes in flight now; bounded by max_pending
    pending: int = 0
    #: keys of the writes in flight, and what waits on each (a durable PUT)
    flying: dict[bytes, list[asyncio.Future[bool]] | None] = field(default_factory=dict)
    #: when to send owed blocks again after the tier failed them (None: at once)
    retry: asyncio.TimerHandle | None = None
    backoff: Backoff = field(default_factory=lambda: Backoff(RETRY_FIRST, RETRY_MOST))
    #: the owed keys' file is written at the end of this loop step
    flush_due: bool = False
    #: owed blocks that reached the tier
    drained: int = 0


class Propagation:
    def __init__(
        self,
        writers: Sequence[Writer],
        counters: CoreCounters,
        task: Callable[[Coroutine[Any, Any, None]], object],
        closing: Callable[[], bool],
        hold: Callable[[bytes, Buffer], None] = lambda key, value: None,
        let_go: Callable[[bytes, Buffer], None] = lambda key, value: None,
        copy_of: Callable[[bytes], Awaitable[Buffer | None]] | None = None,
        kept_locally: Callable[[bytes], bool] = _never,
    ) -> None:
        self.writers = list(writers)
        #: an owed block's bytes from the local tiers (RAM, then the disk)
        self._copy_of = copy_of
        #: whether a local tier that outlives the daemon holds the key (an
        #: owed block's bytes are then read again when it is sent)
        self._kept_locally = kept_locally
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
        owed = {w.name: len(w.outbox) for w in self.writers if w.outbox}
        full = " full" if self._room is not None else ""
        return (
            f"<Propagation writers={[w.name for w in self.writers]} in_flight={busy} "
            f"owed={owed}{full}>"
        )

    # ------------------------------------------------------------ start, stop

    def open(self) -> None:
        """Read back what the tiers were owed when the last run stopped (the
        keys kept on the disk; their bytes are the disk's) and start sending
        them."""
        for w in self.writers:
            box, file = w.outbox, w.owed_file
            if box is None or file is None:
                continue
            owed = file.load()
            given_up = [gone.key for key, size in owed.items() for gone in box.owe(key, size, None)]
            if given_up:
                file.settled(given_up)
                self._counters.writes_dropped.inc(w.name, Dropped.BACKLOG.value, n=len(given_up))
            if owed:
                log.info("%s: %d blocks owed since the last run", w.name, len(box))
                self._send_owed(w)

    def close(self) -> None:
        """Write what the owed files hold; the blocks owed in memory only are
        lost with the daemon (counted and logged)."""
        for w in self.writers:
            box, file = w.outbox, w.owed_file
            if box is None:
                continue
            if w.retry is not None:
                w.retry.cancel()
                w.retry = None
            if file is not None:
                file.close()
                continue
            gone = box.clear()
            for owed in gone:
                if owed.value is not None:
                    self._let_go(owed.key, owed.value)
            if gone:
                self._counters.writes_dropped.inc(w.name, Dropped.BACKLOG.value, n=len(gone))
                log.warning(
                    "%s: %d blocks owed were never sent (the store did not take them "
                    "before the daemon stopped)",
                    w.name,
                    len(gone),
                )

    def room(self) -> asyncio.Future[None] | None:
        """None while every local tier can queue more writes; else the future
        that resolves once they can (a store's writer waits for it before
        sending more)."""
        return self._room

    def stats(self) -> dict[str, dict[str, int]]:
        """Each lower tier's background writes: bytes in flight, the bound,
        and the writes given up, by cause."""
        dropped = self._counters.writes_dropped
        out: dict[str, dict[str, int]] = {}
        for w in self.writers:
            out[w.name] = entry = {
                "in_flight_bytes": w.pending,
                "max_in_flight_bytes": w.max_pending,
                "dropped_backlog": int(dropped.value(w.name, Dropped.BACKLOG.value)),
                "dropped_failed": int(dropped.value(w.name, Dropped.FAILED.value)),
                "dropped_gone": int(dropped.value(w.name, Dropped.GONE.value)),
            }
            if w.outbox is not None:
                entry["owed_blocks"] = len(w.outbox)
                entry["owed_bytes"] = w.outbox.bytes
                entry["max_owed_bytes"] = w.outbox.max_bytes
                entry["owed_sent"] = w.drained
        return out

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

    def evicted(
        self, victims: Sequence[tuple[bytes, Buffer]], leased: Collection[bytes] = ()
    ) -> int:
        """RAM evicted ``victims``: write-back tiers take them, and every local
        tier takes the ``leased`` ones (a retention lease keeps a block below
        RAM when RAM cannot keep it). Returns how many leased ones no tier
        holds and no local tier takes (their lease is broken)."""
        broken = 0
        for key, value in victims:
            kept = False
            for w in self.writers:
                if w.holds(key):
                    kept = True
                elif w.policy is WritePolicy.WRITE_BACK or (w.local and key in leased):
                    self._write_behind(w, key, value, WriteReason.DEMOTION)
                    kept = kept or w.local
            broken += not kept and key in leased
        return broken

    def forget(self, keys: Sequence[bytes]) -> None:
        """``keys`` were deleted: no tier is owed them any more."""
        for w in self.writers:
            if w.outbox:
                self._settle(w, w.outbox.forget(keys))

    def _write_behind(self, w: Writer, key: bytes, value: Buffer, why: WriteReason) -> None:
        # What a write in flight really costs the daemon: its bytes and the
        # memory of the write itself, so small blocks cannot pile up unbounded.
        if w.outbox is not None and not self._closing():
            self._owe(w, key, value, why)  # (each write is owed until the tier has it)
            return
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
        w.flying[key] = None

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
            waiting = w.flying.pop(key, None)
            for fut in waiting or ():
                if not fut.done():
                    fut.set_result(outcome is Written.COMPLETED)
            if why is WriteReason.DEMOTION:
                self._counters.demotions.inc(w.name, outcome.value)
            room = self._room
            if room is not None and all(x.pending <= x.max_pending for x in self._local):
                self._room = None
                room.set_result(None)

    # ------------------------------------------------------------ owed blocks

    def _owe(self, w: Writer, key: bytes, value: Buffer, why: WriteReason) -> None:
        """``key``'s block is owed to ``w`` (the module): its bytes kept where
        no local tier that outlives the daemon has them."""
        box = w.outbox
        assert box is not None
        if key in box:
            return
        kept = None if self._kept_locally(key) else value
        demoted = why is WriteReason.DEMOTION
        given_up = box.owe(key, len(value), kept, demoted=demoted)
        if key in box:
            if kept is not None:
                self._hold(key, kept)
            if w.owed_file is not None:
                w.owed_file.owed(key, len(value))
                self._flush_soon(w)
        for gone in given_up:
            if gone.key != key or key in box:
                self._settle(w, [gone])
            self._dropped(w, gone.key, why)
        self._send_owed(w)

    def _send_owed(self, w: Writer) -> None:
        """Send ``w``'s oldest owed blocks, up to ``SEND_AT_ONCE`` in flight:
        each send that ends starts the next, so the tier is kept as busy as
        by the writes themselves. After a failure nothing more is sent until
        a delay has passed (:class:`~kvtier.backoff.Backoff`: 0.05 s doubling
        to 1 s while the tier keeps failing; at once again after a success)."""
        box = w.outbox
        if box is None or w.retry is not None or self._closing():
            return
        for owed in box.take(SEND_AT_ONCE - box.sending):
            try:
                self._task(self._send(w, owed))
            except BaseException:
                box.failed(owed)
                raise

    def _send_later(self, w: Writer) -> None:
        if w.retry is None and not self._closing():
            delay = w.backoff.failed(time.monotonic())
            w.retry = asyncio.get_running_loop().call_later(delay, self._retry, w)

    def _retry(self, w: Writer) -> None:
        w.retry = None
        self._send_owed(w)

    async def _send(self, w: Writer, owed: Owed) -> None:
        """Send one owed block; one the tier fails stays owed, at its place."""
        box = w.outbox
        assert box is not None
        try:
            value = owed.value
            if value is None and self._copy_of is not None:
                value = await self._copy_of(owed.key)
        except asyncio.CancelledError:
            box.failed(owed)
            raise
        except Exception as exc:  # (a local tier that cannot read it back)
            log.warning("%s: owed block %s unreadable: %s", w.name, owed.key.hex(), exc)
            value = None
        if value is None:  # no tier of this daemon holds it any more
            if box.sent(owed) is not None:
                self._settle(w, [owed])
                self._counters.writes_dropped.inc(w.name, Dropped.GONE.value)
            self._send_owed(w)
            return
        key = owed.key
        outcome = Written.FAILED
        w.flying.setdefault(key, None)
        try:
            await w.write(key, value)
            outcome = Written.COMPLETED
        except asyncio.CancelledError:
            outcome = Written.CANCELLED
            box.failed(owed)
            raise
        except Exception as exc:
            box.failed(owed)
            if owed.key in box:  # (still owed: not deleted meanwhile)
                self._counters.writes_owed.inc(w.name)
                if not w.retry:
                    log.warning("%s: write of key %s failed, kept owed: %s", w.name, key.hex(), exc)
            self._send_later(w)
            return
        finally:
            for fut in w.flying.pop(key, None) or ():
                if not fut.done():
                    fut.set_result(outcome is Written.COMPLETED)
            if owed.demoted and outcome is not Written.FAILED:
                self._counters.demotions.inc(w.name, outcome.value)
        if box.sent(owed) is not None:
            self._settle(w, [owed])
            w.drained += 1
        elif w.erase is not None and not self._closing():
            await self._erase(w, key)  # deleted while it was on its way: the delete wins
        w.backoff.succeeded()
        self._send_owed(w)

    async def _erase(self, w: Writer, key: bytes) -> None:
        assert w.erase is not None
        try:
            await w.erase(key)
        except Exception as exc:
            log.warning(
                "%s: key %s, deleted while written, is still there: %s", w.name, key.hex(), exc
            )

    def _settle(self, w: Writer, gone: Sequence[Owed]) -> None:
        """Entries that left ``w``'s outbox: their bytes let go, their keys off its file."""
        for owed in gone:
            if owed.value is not None:
                self._let_go(owed.key, owed.value)
        if w.owed_file is not None and gone:
            w.owed_file.settled([o.key for o in gone])
            self._flush_soon(w)

    def _flush_soon(self, w: Writer) -> None:
        """Write ``w``'s owed keys at the end of this loop step (one frame for
        the blocks owed in it): a crash loses none owed in an earlier step."""
        if not w.flush_due:
            w.flush_due = True
            asyncio.get_running_loop().call_soon(self._flush, w)

    def _flush(self, w: Writer) -> None:
        w.flush_due = False
        file = w.owed_file
        if file is not None and file.held:
            try:
                file.flush()
            except OSError as exc:
                log.warning("%s: cannot write the owed blocks' file: %s", w.name, exc)

    # ------------------------------------------------------------ durable PUTs

    def durable_writer(self) -> Writer | None:
        """The remote tier a durable PUT rests on without a disk: the first
        that outlives the daemon (None: none does)."""
        return next((w for w in self.writers if w.outlives and not w.local), None)

    async def durably(self, w: Writer, key: bytes, value: Buffer) -> None:
        """Return once ``key``'s block is on ``w`` (its write-through in flight,
        or a write of its own); raise :class:`NotDurableError` saying why not."""
        if key in w.flying:
            fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            waiting = w.flying[key]
            if waiting is None:
                waiting = w.flying[key] = []
            waiting.append(fut)
            if await fut:
                return
            raise NotDurableError(
                f"not durable: the write of {key.hex()} to {w.name} failed "
                "(it is written through once the tier takes writes again)"
            )
        try:
            await w.write(key, value)
        except Exception as exc:
            raise NotDurableError(f"not durable: {exc}") from exc
        if w.outbox and key in w.outbox:
            self._settle(w, w.outbox.forget([key]))

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
            if w.outbox is not None:
                held, bound = w.outbox.bytes, w.outbox.max_bytes
                setting = "owed (max_backlog_bytes"
            else:
                held, bound = w.pending, w.max_pending
                setting = "already in flight (max_pending_write_bytes"
            log.warning(
                "%s: %s of key %s dropped: %d bytes of writes %s %d); %d dropped so far",
                w.name,
                why.value,
                key.hex(),
                held,
                setting,
                bound,
                total,
            )

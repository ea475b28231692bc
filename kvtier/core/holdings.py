"""What the daemon holds: the one place where it changes, and who hears of it.

The truth of what this node holds is its local tiers' indexes: a key is
held by RAM or the disk exactly while its tier's budget has it admitted
(:class:`~kvtier.tiers.budget.Budget`), and it is pending exactly while the
table of pending writes has it (:class:`~kvtier.core.writes.ReservationTable`).
Both tell :class:`Holdings` of every change, in the step the change is
made, whoever made it: a store, a promotion, an eviction, a delete, a block
found corrupt or missing on disk, a failed disk write, the disk index
growing while it is rebuilt, a reservation granted, ended or expired. No
tier can change its index without it, so no path can skip what follows.

In that same step, before any reply that depends on the change, it tells:

* the remote tiers' kept probe verdicts of the key: dropped (the truth
  changed here);
* the lookup process's feed (docs/lookup-process.md): ``HELD`` when the
  first local tier takes a key, ``GONE`` when the last lets it go,
  ``PENDING`` / ``SETTLED`` as writes begin and end;
* block events for routers (SUBSCRIBE, :mod:`~kvtier.core.events`):
  ``STORED`` naming each tier that takes a key, ``EVICTED`` or ``DELETED``
  once no local tier holds it (a block lost to corruption reads as evicted).

Invariants: a key is ``HELD`` in the feed exactly while some local tier
holds it, and ``PENDING`` exactly while a write of it is pending; the feed
starts with a snapshot taken in one step, so it never misses a change; with
no subscriber no event is made. Imports the core's events and writes, the
tiers' index watch and the shared records only.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterable, Sequence

from kvtier import collector
from kvtier.core.events import EventLog
from kvtier.core.writes import ReservationTable
from kvtier.model import EventKind, EventTier, FeedOp, FeedRecords
from kvtier.tiers.base import LocalTier
from kvtier.tiers.budget import Gone

#: the event a key's going makes, once no local tier holds it
_GONE_EVENTS = {Gone.EVICTED: EventKind.EVICTED, Gone.DELETED: EventKind.DELETED}


class TierWatch:
    """One local tier's index watch: the changes :class:`Holdings` hears of."""

    __slots__ = ("holdings", "others", "tier")

    def __init__(self, holdings: Holdings, tier: EventTier, others: list[LocalTier]) -> None:
        self.holdings = holdings
        self.tier = tier
        #: the other local tiers: a key one of them holds is still held here
        self.others = others

    def __repr__(self) -> str:
        return f"<TierWatch {self.tier.name}>"

    def held(self, keys: Sequence[bytes]) -> None:
        self.holdings.held(self, keys)

    def gone(self, keys: Sequence[bytes], why: Gone) -> None:
        self.holdings.gone(self, keys, why)


class Holdings:
    """Hears of every change of what the local tiers hold and of every
    pending write, and tells the probe verdicts, the feed and the events."""

    def __init__(
        self,
        tiers: Sequence[tuple[EventTier, LocalTier]],
        pending: ReservationTable,
        events: EventLog,
        invalidate: Callable[[Sequence[bytes]], None],
    ) -> None:
        self.events = events
        self.pending = pending
        self._invalidate = invalidate
        self._tiers = [tier for _, tier in tiers]
        self.watches: list[TierWatch] = []
        for name, tier in tiers:
            watch = TierWatch(self, name, [t for t in self._tiers if t is not tier])
            tier.budget.watch = watch
            self.watches.append(watch)
        #: the lookup process's feed, while it runs
        self._write: Callable[[FeedRecords], None] | None = None

    def __repr__(self) -> str:
        feed = " feeding" if self._write is not None else ""
        return f"<Holdings tiers={len(self._tiers)}{feed} {self.events!r}>"

    def holds(self, key: bytes) -> bool:
        """Whether a local tier (RAM, the disk) holds ``key`` now."""
        return any(tier.contains(key) for tier in self._tiers)

    # -- changes (from the tiers' indexes and the pending table)

    def held(self, watch: TierWatch, keys: Sequence[bytes]) -> None:
        self._invalidate(keys)
        write = self._write
        if write is not None:
            others = watch.others
            new = [k for k in keys if not any(t.contains(k) for t in others)]
            if new:
                write([(FeedOp.HELD, k) for k in new])
        if self.events.subscriptions:
            self.events.emit_many(EventKind.STORED, keys, watch.tier)

    def gone(self, watch: TierWatch, keys: Sequence[bytes], why: Gone) -> None:
        self._invalidate(keys)
        others = watch.others
        last = [k for k in keys if not any(t.contains(k) for t in others)]
        if not last:
            return
        if self._write is not None:
            self._write([(FeedOp.GONE, k) for k in last])
        if self.events.subscriptions:
            self.events.emit_many(_GONE_EVENTS.get(why, EventKind.EVICTED), last)

    def _pending(self, changes: Sequence[tuple[bytes, bool]]) -> None:
        if self._write is not None:
            self._write([(FeedOp.PENDING if now else FeedOp.SETTLED, k) for k, now in changes])

    # -- the lookup process's feed

    def feed(self, write: Callable[[FeedRecords], None], scan: asyncio.Future[None] | None) -> None:
        """Start the feed: a reset and a snapshot of what is held and pending
        now (``scan``: the disk index rebuild, while it runs), then every
        change, through ``write``, in the step it is made."""
        assert self._write is None, "one lookup process per daemon"
        with collector.held_off():  # (a record per key held: millions, at once)
            holding = [tier for tier in self._tiers if len(tier.budget)]
            held: Iterable[bytes] = holding[0].budget if len(holding) == 1 else {}
            if len(holding) > 1:  # (a key held by two tiers is named once)
                held = dict.fromkeys(itertools.chain.from_iterable(t.budget for t in holding))
            records: FeedRecords = [(FeedOp.RESET, b"")]
            records += zip(itertools.repeat(FeedOp.HELD), held)
            records += [(FeedOp.PENDING, r.key) for r in self.pending.all()]
            scanning = scan is not None and not scan.done()
            if scanning:
                records.append((FeedOp.SCANNING, b""))
            write(records)
        self._write = write
        self.pending.watch(self._pending)
        if scan is not None and scanning:

            def scanned(_: object) -> None:
                if self._write is write:  # (the same feed, still running)
                    write([(FeedOp.SCANNED, b"")])

            scan.add_done_callback(scanned)

    def stop_feed(self) -> None:
        """The lookup process is gone: write no more."""
        if self._write is not None:
            self.pending.unwatch()
            self._write = None

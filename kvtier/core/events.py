"""Block events: what a router needs to know of where blocks are. Pure.

The service reports each change of what this node holds: a block STORED in
a local tier (RAM, then the disk), EVICTED from the last local tier that
held it, or DELETED. The :class:`EventLog` numbers every event with a
per-daemon sequence number and hands it to each :class:`Subscription`,
whose queue is bounded.

Invariants: sequence numbers grow by one per event, with no holes; a
subscription's queue never holds more than its ``limit`` events: the event
that would overflow it drops what it holds and marks a *gap*, which the
subscriber sees (with the first sequence number it missed) before any later
event, and after which it must resync from a snapshot. The service emits
only while someone subscribes: with no subscriber no event exists, costs
nothing, and takes no sequence number. Imports the shared records only.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.model import BlockEvent, EventKind, EventTier


@dataclass(slots=True, frozen=True)
class EventStats:
    """What the event log did; metrics reads the fields by name."""

    #: the last sequence number given out
    seq: int
    #: events published, by kind's name
    published: dict[str, int]
    subscribers: int
    #: overflows that cost a subscriber events (it resyncs from a snapshot)
    gaps: int


class Subscription:
    """One subscriber's bounded queue of events."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._queue: deque[BlockEvent] = deque()
        #: the first sequence number lost to an overflow, until it is taken
        self._gap_from: int | None = None
        #: set whenever there is something to take, or the log closed
        self.ready = asyncio.Event()
        #: the daemon is shutting down: the subscriber's stream ends
        self.closed = False
        self.gaps = 0

    def __repr__(self) -> str:
        gap = f" gap_from={self._gap_from}" if self._gap_from is not None else ""
        return f"<Subscription queued={len(self._queue)}/{self.limit} gaps={self.gaps}{gap}>"

    def __len__(self) -> int:
        return len(self._queue)

    def offer(self, event: BlockEvent) -> bool:
        """Queue ``event``; True if it started a gap."""
        if self._gap_from is not None:
            return False  # lost until the subscriber has seen the gap
        started = False
        if len(self._queue) >= self.limit:
            self._gap_from = self._queue[0].seq if self._queue else event.seq
            self._queue.clear()
            self.gaps += 1
            started = True
        else:
            self._queue.append(event)
        self.ready.set()
        return started

    def offer_many(self, events: list[BlockEvent]) -> bool:
        """Queue ``events`` (in order); True if they started a gap."""
        if self._gap_from is not None:
            return False
        if len(self._queue) + len(events) > self.limit:
            self._gap_from = self._queue[0].seq if self._queue else events[0].seq
            self._queue.clear()
            self.gaps += 1
            self.ready.set()
            return True
        self._queue.extend(events)
        self.ready.set()
        return False

    def take(self, most: int) -> list[BlockEvent]:
        """Up to ``most`` events, oldest first; a gap comes alone."""
        if self._gap_from is not None:
            gap = BlockEvent(self._gap_from, EventKind.GAP)
            self._gap_from = None
            self._sync_ready()
            return [gap]
        out = [self._queue.popleft() for _ in range(min(most, len(self._queue)))]
        self._sync_ready()
        return out

    def _sync_ready(self) -> None:
        if self._queue or self._gap_from is not None:
            self.ready.set()
        else:
            self.ready.clear()


class EventLog:
    def __init__(self) -> None:
        #: the last sequence number given out
        self.seq = 0
        self.subscriptions: set[Subscription] = set()
        #: events published, by kind, and gaps started in any subscription
        self.published: dict[EventKind, int] = {k: 0 for k in EventKind}
        self.gaps = 0

    def __repr__(self) -> str:
        return f"<EventLog seq={self.seq} subscriptions={len(self.subscriptions)}>"

    def emit(self, kind: EventKind, key: bytes, tier: EventTier = EventTier.NONE) -> None:
        self.seq += 1
        self.published[kind] += 1
        event = BlockEvent(self.seq, kind, key, tier)
        for sub in self.subscriptions:
            self.gaps += sub.offer(event)

    def emit_many(
        self, kind: EventKind, keys: Sequence[bytes], tier: EventTier = EventTier.NONE
    ) -> None:
        """One event per key, in order, as :meth:`emit` makes them one by one."""
        if not keys:
            return
        first = self.seq + 1
        self.seq += len(keys)
        self.published[kind] += len(keys)
        events = [BlockEvent(seq, kind, key, tier) for seq, key in enumerate(keys, first)]
        for sub in self.subscriptions:
            self.gaps += sub.offer_many(events)

    def subscribe(self, limit: int) -> Subscription:
        sub = Subscription(limit)
        self.subscriptions.add(sub)
        return sub

    def unsubscribe(self, sub: object) -> None:
        """Forget ``sub`` (any object: one that is not a subscription here is ignored)."""
        if isinstance(sub, Subscription):
            self.subscriptions.discard(sub)

    def stats(self) -> EventStats:
        return EventStats(
            seq=self.seq,
            published={
                k.name.lower(): n for k, n in self.published.items() if k <= EventKind.DELETED
            },
            subscribers=len(self.subscriptions),
            gaps=self.gaps,
        )

    def close(self) -> None:
        """Shutdown: every subscription's stream ends."""
        for sub in self.subscriptions:
            sub.closed = True
            sub.ready.set()

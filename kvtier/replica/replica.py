"""A lookup's answer from a copy of what the daemon holds. Pure.

The lookup process (docs/lookup-process.md) answers lookups away from the
daemon's event loop, so that a lookup does not queue behind the bookkeeping
of blocks streaming in. It answers from a :class:`Replica`: the keys a local
tier holds (RAM or the disk: a lookup reads them HIT) and the keys with a
write pending (PENDING), both kept in step by the daemon's feed
(:class:`~kvtier.model.FeedOp`), plus two facts about the daemon: whether it
has remote tiers, and whether its disk index is still being rebuilt.

:meth:`Replica.answer` gives the answer the daemon's own lookup would give
(:mod:`kvtier.core.lookup`), or None where only the daemon can answer
(the lookup is *referred*, and the client asks the daemon).

Invariants: a key held is HIT, else a key pending is PENDING, else MISS,
exactly as the daemon's locator orders them; a key that is neither held nor
pending is answered only where no remote tier could hold it and the disk
index is complete (else the lookup is referred: the daemon probes, or
answers RETRY); a lookup that would wait on a PENDING key (``wait``) or be
bounded on one (``max_pending_wait``) is referred, as the daemon keeps the
waits and the deferrals, and so is one with a budget (the daemon knows
what each load costs); the prefix answer is :func:`prefix_answer` of the
same states; records apply in order, and ``RESET``
forgets everything before it. Imports the core's lookup rules and the
shared records only.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvtier.core.lookup import HIT_BYTE, prefix_answer
from kvtier.model import (
    MISS,
    PENDING,
    FeedOp,
    Lookup,
    LookupMode,
    LookupReply,
)


class Replica:
    """What the daemon holds and has pending, as its feed says."""

    __slots__ = ("held", "pending", "remotes", "scanning")

    def __init__(self, *, remotes: bool) -> None:
        #: keys a local tier holds
        self.held: set[bytes] = set()
        #: keys with a write in flight
        self.pending: set[bytes] = set()
        #: the daemon has remote tiers: a key not held here may be held there
        self.remotes = remotes
        #: the daemon's disk index is being rebuilt: a key not indexed yet may be on disk
        self.scanning = False

    def __repr__(self) -> str:
        return (
            f"<Replica held={len(self.held)} pending={len(self.pending)} "
            f"remotes={self.remotes} scanning={self.scanning}>"
        )

    def apply(self, records: Iterable[tuple[FeedOp, bytes]]) -> None:
        held, pending = self.held, self.pending
        for op, key in records:
            if op is FeedOp.HELD:
                held.add(key)
            elif op is FeedOp.GONE:
                held.discard(key)
            elif op is FeedOp.PENDING:
                pending.add(key)
            elif op is FeedOp.SETTLED:
                pending.discard(key)
            elif op is FeedOp.SCANNING:
                self.scanning = True
            elif op is FeedOp.SCANNED:
                self.scanning = False
            else:  # RESET: a snapshot follows (and SCANNING, if still so)
                held.clear()
                pending.clear()
                self.scanning = False

    def answer(self, req: Lookup) -> LookupReply | None:
        """The daemon's answer to ``req``, or None: refer it to the daemon."""
        if req.budget > 0:
            return None  # (the daemon knows what each load costs)
        keys = req.keys
        held, pending = self.held, self.pending
        window = req.window if req.mode == LookupMode.SLIDING_WINDOW else 0
        if held.issuperset(keys):  # all HIT, the usual answer: one pass in C
            every = HIT_BYTE * len(keys)
            return LookupReply(every, *prefix_answer(every, window))
        # HIT is 1 and MISS is 0: membership maps straight onto states.
        states = bytearray(map(held.__contains__, keys))
        if states.count(MISS):
            # A key nothing holds here may be on a remote tier, or on a disk
            # not indexed yet: the daemon answers RETRY and starts the probe.
            complete = not self.remotes and not self.scanning
            for i in range(len(states)):
                if states[i] != MISS:
                    continue
                if keys[i] in pending:
                    if req.wait > 0 or req.max_pending_wait > 0:
                        return None
                    states[i] = PENDING
                elif not complete:
                    return None
        hits, defer = prefix_answer(states, window)
        return LookupReply(bytes(states), hits, defer)

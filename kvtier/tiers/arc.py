"""ARC, and kvtier's default: ARC with a long frequency history. Pure.

ARC (Megiddo & Modha, FAST'03) keeps resident keys in two LRU lists, T1
(seen once lately) and T2 (seen again), and remembers recently evicted
keys in two ghost lists, B1 and B2, of at most ``c`` keys each (``c``: the
most keys ever resident). A miss that hits B1 says T1 was too small: its
target size ``p`` grows; a hit in B2 shrinks it. The victim comes from T1
while T1 is larger than ``p``, else from T2.

:class:`HistoryARCPolicy` (``harc``, the default) adds one thing: a key
admitted that the :class:`~kvtier.tiers.seen.SeenFilter` has seen within
the last ``HISTORY`` x ``c`` admissions and touches goes straight to T2.
On KV-cache traffic reuse comes after gaps far longer than ARC's ghost
lists reach (the median gap of the Mooncake trace is ~7,000 blocks): the
filter remembers, in ~12 bits a key, that a block is worth keeping when it
comes back, while ARC's adaptation still protects recency-heavy traffic
(docs/eviction.md has the measurements).

Invariants: T1 and T2 hold exactly the resident keys, disjointly; B1 and B2
hold only non-resident keys, at most ``c`` each after every admission;
``0 <= p <= c``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from kvtier.tiers.seen import SeenFilter

#: the history reaches back this many times the cache's key count
HISTORY = 10


class ARCPolicy:
    def __init__(self) -> None:
        self._t1: OrderedDict[bytes, None] = OrderedDict()
        self._t2: OrderedDict[bytes, None] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        #: target size of T1, adapted by ghost hits
        self.p = 0
        #: the most keys ever resident: ARC's cache size
        self.c = 1

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} t1={len(self._t1)} t2={len(self._t2)} "
            f"b1={len(self._b1)} b2={len(self._b2)} p={self.p}>"
        )

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def _frequent(self, key: bytes) -> bool:
        """Whether a key admitted without a ghost hit starts in T2."""
        return False

    def admit(self, key: bytes) -> None:
        b1, b2 = self._b1, self._b2
        if key in b1:
            self.p = min(self.c, self.p + max(1, len(b2) // len(b1)))
            del b1[key]
            self._t2[key] = None
        elif key in b2:
            self.p = max(0, self.p - max(1, len(b1) // len(b2)))
            del b2[key]
            self._t2[key] = None
        elif self._frequent(key):
            self._t2[key] = None
        else:
            self._t1[key] = None
        self.c = max(self.c, len(self))
        # Ghosts are trimmed here, after the check: the tier evicts (making
        # ghosts) before it admits the key that needed the room.
        for ghost in (b1, b2):
            while len(ghost) > self.c:
                ghost.popitem(last=False)

    def touch(self, key: bytes) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def remove(self, key: bytes) -> None:
        """Deleted: forgotten, not remembered as a ghost."""
        self._t1.pop(key, None)
        self._t2.pop(key, None)

    def evict(self, key: bytes) -> None:
        """Evicted to make room: remembered in its ghost list."""
        for live, ghost in ((self._t1, self._b1), (self._t2, self._b2)):
            if key in live:
                del live[key]
                ghost[key] = None
                return

    def candidates(self) -> Iterator[bytes]:
        t1, t2 = self._t1, self._t2
        first, second = (t1, t2) if len(t1) > self.p or not t2 else (t2, t1)
        yield from first
        yield from second


class HistoryARCPolicy(ARCPolicy):
    def __init__(self) -> None:
        super().__init__()
        self.seen = SeenFilter(lambda: HISTORY * self.c)

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]} {self.seen!r}>"

    def _frequent(self, key: bytes) -> bool:
        return self._seen_before

    def admit(self, key: bytes) -> None:
        self._seen_before = self.seen.add(key)
        super().admit(key)

    # A touch needs no history: the key is resident, and was recorded when
    # it was admitted.

    _seen_before = False

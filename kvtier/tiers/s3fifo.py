"""S3-FIFO (Yang et al., SOSP'23): three FIFO queues, a baseline policy. Pure.

New keys enter a small queue S (a tenth of the resident keys); a key that
leaves S unread is evicted and remembered in a ghost queue G; one read
while in S moves it to the main queue M on its way out. A key admitted
while in G goes straight to M. M is a FIFO with reinsertion: a key with a
read since it was last examined goes back to M's tail (its count lowered)
instead of out. Reads only bump a 2-bit counter: no list moves on a hit.

Choosing a victim moves keys between queues (reinsertions), so
:meth:`S3FIFOPolicy.candidates` does that work as it goes. A key it
offers is set aside until the tier evicts it; one the tier skips (pinned)
goes back to the head of its queue on the next call.

Invariants: S and M hold exactly the resident keys, disjointly, plus the
keys set aside; G holds only non-resident keys, at most as many as M can.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping


class S3FIFOPolicy:
    def __init__(self, small_fraction: float = 0.1) -> None:
        self._small: OrderedDict[bytes, None] = OrderedDict()
        self._main: OrderedDict[bytes, None] = OrderedDict()
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._freq: dict[bytes, int] = {}
        #: keys offered as victims and not yet evicted, with the queue they came from
        self._aside: dict[bytes, OrderedDict[bytes, None]] = {}
        self._fraction = small_fraction
        #: the most keys ever resident
        self.c = 1

    def __repr__(self) -> str:
        return (
            f"<S3FIFOPolicy small={len(self._small)} main={len(self._main)} "
            f"ghost={len(self._ghost)}>"
        )

    def __len__(self) -> int:
        return len(self._small) + len(self._main) + len(self._aside)

    def admit_many(self, keys: Mapping[bytes, object]) -> None:
        if len(self) or self._ghost:
            for key in keys:
                self.admit(key)
            return
        # (a fresh policy: each key into S, as admit would put it, built at once)
        self._small = OrderedDict.fromkeys(keys)
        self._freq = dict.fromkeys(keys, 0)
        self.c = max(self.c, len(self))

    def admit(self, key: bytes, cold: bool = False) -> None:
        self._restore()
        self._freq[key] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None
            if cold:  # first out of the small queue
                self._small.move_to_end(key, last=False)
        self.c = max(self.c, len(self))

    def touch(self, key: bytes) -> None:
        freq = self._freq.get(key)
        if freq is not None and freq < 3:
            self._freq[key] = freq + 1

    def touch_many(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self.touch(key)

    def remove(self, key: bytes) -> None:
        self._forget(key)

    def evict(self, key: bytes) -> None:
        came_from = self._aside.get(key)
        if self._forget(key) and came_from is self._small:
            self._ghost[key] = None
            while len(self._ghost) > self.c:
                self._ghost.popitem(last=False)

    def _forget(self, key: bytes) -> bool:
        found = self._freq.pop(key, None) is not None
        self._aside.pop(key, None)
        self._small.pop(key, None)
        self._main.pop(key, None)
        return found

    def _restore(self) -> None:
        """Keys offered but not evicted (pinned) go back to their queue's head."""
        for key, queue in self._aside.items():
            queue[key] = None
            queue.move_to_end(key, last=False)
        self._aside.clear()

    def candidates(self) -> Iterator[bytes]:
        self._restore()
        small, main, freq = self._small, self._main, self._freq
        target = max(1, int(self.c * self._fraction))
        while small or main:
            if small and (len(small) >= target or not main):
                key = next(iter(small))
                del small[key]
                if freq[key] > 0:
                    freq[key] = 0
                    main[key] = None
                    continue
                self._aside[key] = small
                yield key
                continue
            key = next(iter(main))
            del main[key]
            if freq[key] > 0:
                freq[key] -= 1
                main[key] = None
                continue
            self._aside[key] = main
            yield key

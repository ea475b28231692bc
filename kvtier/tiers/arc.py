"""ARC, and kvtier's default: ARC with a long frequency history. Pure.

ARC (Megiddo & Modha, FAST'03) keeps resident keys in two LRU lists, T1
(seen once lately) and T2 (seen again), and remembers recently evicted
keys in two ghost lists, B1 and B2, of at most ``c`` keys each (``c``: the
most keys ever resident). A miss that hits B1 says T1 was too small: its
target size ``p`` grows; a hit in B2 shrinks it. The victim comes from T1
while T1 is larger than ``p``, else from T2.

:class:`HistoryARCPolicy` (``harc``, the default) adds a long memory. A
key admitted that the :class:`SeenFilter` has seen
within the last ``HISTORY`` x ``c`` admissions may go straight to T2. On
KV-cache traffic reuse comes after gaps far longer than ARC's ghost lists
reach (the median gap of the Mooncake trace is ~7,000 blocks): the filter
remembers, in ~10 bits a key, that a returning block was worth keeping.

Whether that helps depends on the traffic (when most returning blocks are
not worth it, it costs), so the policy decides online by set dueling: two
shadow caches, ``c / SAMPLE`` keys each, replay the accesses of one key in
``SAMPLE`` (chosen by hash), one with the history and one without; the
history is used while its shadow hits at least as often. Old wins count
for less (halved every 4 shadow capacities of sampled accesses).

Invariants: T1 and T2 hold exactly the resident keys, disjointly; B1 and B2
hold only non-resident keys, at most ``c`` each after every admission;
``0 <= p <= c``.

The history, :class:`SeenFilter`: a two-generation Bloom filter. Each
generation is a Bloom filter of ``m`` bits (a power of two, 10 bits a key or
more) probed at 4 places, sized for ``period`` keys: about 1% false
positives when full. Keys go into the current generation; once it holds
``period`` keys it becomes the previous one and a new, empty current one
starts, sized for the period then asked for. A key is *seen* if either
generation has it, so the history reaches back between one and two
periods; it costs about 10-20 bits per key of history instead of a
dictionary entry. Probes come from the key's XXH3-64 hash, split by double
hashing (deterministic: a replay gives the same figures every run).
Invariants: a key added is seen until two rotations have passed; a key
never added is seen only at the filter's false-positive rate.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

import xxhash

_hash = xxhash.xxh3_64_intdigest  # deterministic: replays give the same figures

_BITS_PER_KEY = 10
#: probe arithmetic in 30-bit halves stays in CPython's one-digit ints (fast)
_LOW = (1 << 30) - 1


class _Bloom:
    __slots__ = ("bits", "count", "mask")

    def __init__(self, keys: int) -> None:
        m = 1 << min(30, max(10, (keys * _BITS_PER_KEY - 1).bit_length()))
        self.mask = m - 1
        self.bits = bytearray(m >> 3)
        self.count = 0

    def has(self, a: int, b: int) -> bool:
        m, bits = self.mask, self.bits
        for _ in range(4):
            p = a & m
            if not bits[p >> 3] >> (p & 7) & 1:
                return False
            a += b
        return True


class SeenFilter:
    def __init__(self, period: Callable[[], int]) -> None:
        #: how many keys a generation holds before it rotates (asked at each rotation)
        self._period = period
        self._limit = max(1, period())
        self._current = _Bloom(self._limit)
        self._previous: _Bloom | None = None

    def __repr__(self) -> str:
        return f"<SeenFilter keys={self._current.count}/{self._limit} bytes={self.nbytes}>"

    @property
    def nbytes(self) -> int:
        prev = len(self._previous.bits) if self._previous is not None else 0
        return len(self._current.bits) + prev

    def add(self, key: bytes) -> bool:
        """Record ``key``; returns whether it had been seen before."""
        h = _hash(key)
        a, b = h & _LOW, ((h >> 30) & _LOW) | 1
        cur = self._current
        m, bits = cur.mask, cur.bits
        p0 = a & m
        p1 = (a + b) & m
        p2 = (a + 2 * b) & m
        p3 = (a + 3 * b) & m
        if (
            bits[p0 >> 3] >> (p0 & 7) & 1
            and bits[p1 >> 3] >> (p1 & 7) & 1
            and bits[p2 >> 3] >> (p2 & 7) & 1
            and bits[p3 >> 3] >> (p3 & 7) & 1
        ):
            return True
        bits[p0 >> 3] |= 1 << (p0 & 7)
        bits[p1 >> 3] |= 1 << (p1 & 7)
        bits[p2 >> 3] |= 1 << (p2 & 7)
        bits[p3 >> 3] |= 1 << (p3 & 7)
        cur.count += 1
        prev = self._previous
        seen = prev is not None and prev.has(a, b)
        if cur.count >= self._limit:
            self._limit = max(1, self._period())
            self._previous, self._current = cur, _Bloom(self._limit)
        return seen

    def __contains__(self, key: bytes) -> bool:
        h = _hash(key)
        a, b = h & _LOW, ((h >> 30) & _LOW) | 1
        prev = self._previous
        return self._current.has(a, b) or (prev is not None and prev.has(a, b))


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


class _Shadow:
    """A small cache over a sample of the keys, to score a policy online."""

    def __init__(self, policy: ARCPolicy) -> None:
        self.policy = policy
        self.hits = 0.0

    def access(self, key: bytes, capacity: int) -> None:
        policy = self.policy
        if key in policy._t1 or key in policy._t2:
            self.hits += 1
            policy.touch(key)
            return
        while len(policy) >= capacity:
            policy.evict(next(policy.candidates()))
        policy.admit(key)


class HistoryARCPolicy(ARCPolicy):
    def __init__(self) -> None:
        super().__init__()
        self.seen = SeenFilter(lambda: HISTORY * self.c)
        # Two shadow caches over 1 key in SAMPLE replay the traffic with and
        # without the history; the one that hits more decides (set dueling).
        self._with = _Shadow(_HistoryShadow())
        self._without = _Shadow(ARCPolicy())
        self._sampled = 0

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]} history={self.uses_history} {self.seen!r}>"

    @property
    def uses_history(self) -> bool:
        return self._with.hits >= self._without.hits

    def _frequent(self, key: bytes) -> bool:
        return self._seen_before and self.uses_history

    def _sample(self, key: bytes) -> None:
        if _hash(key) % SAMPLE:
            return
        capacity = max(4, self.c // SAMPLE)
        self._with.access(key, capacity)
        self._without.access(key, capacity)
        self._sampled += 1
        if self._sampled >= capacity * 4:  # old wins count less
            self._sampled = 0
            self._with.hits /= 2
            self._without.hits /= 2

    def admit(self, key: bytes) -> None:
        self._seen_before = self.seen.add(key)
        self._sample(key)
        super().admit(key)

    def touch(self, key: bytes) -> None:
        self._sample(key)
        super().touch(key)

    _seen_before = False


class _HistoryShadow(ARCPolicy):
    def __init__(self) -> None:
        super().__init__()
        self.seen = SeenFilter(lambda: HISTORY * self.c)

    def _frequent(self, key: bytes) -> bool:
        return self._seen_before

    def admit(self, key: bytes) -> None:
        self._seen_before = self.seen.add(key)
        super().admit(key)

    _seen_before = False


#: one key in SAMPLE feeds the shadow caches
SAMPLE = 8

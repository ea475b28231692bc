"""ARC, and kvtier's default: ARC with a long frequency history, never below LRU. Pure.

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
not worth it, it costs; on recency-friendly traffic ARC itself loses to
plain LRU), so the policy decides online by set dueling among three
candidates: ARC with the history, plain ARC, and LRU. Three shadow caches
replay the accesses of one key in ``rate`` (chosen by hash; ``rate`` is
``SAMPLE``, or less so that a shadow holds at least ``MIN_SHADOW`` keys),
each ``c / rate`` keys; a cache that has never held ``MIN_SHADOW`` keys is
plain LRU.
LRU orders the evictions unless the better ARC candidate's shadow out-hits
LRU's by more than chance would: ``MARGIN`` standard deviations of the
difference of the two counts. The mode is decided ``DECIDE`` times per
shadow capacity of sampled accesses (flapping between two orders costs
more than either loses), and old wins count for less (halved every
``DECAY`` shadow capacities of sampled accesses). In LRU mode the victim is
the least recently used key of T1 and T2 together (each is in order of
last access; their merge by the access count each key records is the LRU
order), so switching modes moves no key. Cost: each key records its last
access (an int, ~30 bytes; plain ARC records it too) and the shadows hold
``3c / rate`` keys more.

Invariants: T1 and T2 hold exactly the resident keys, disjointly, each in
order of last access; B1 and B2 hold only non-resident keys, at most ``c``
each after every admission; ``0 <= p <= c``; the mode is LRU whenever no
candidate's shadow leads LRU's by more than the margin.

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

import enum
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping

import xxhash

from kvtier.tiers.backlog import Backlog

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
        return self.add_hash(_hash(key))

    def add_hash(self, h: int) -> bool:
        """:meth:`add` of a key whose hash (``_hash``) the caller has."""
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
        #: resident keys, least recently used first, each with its last access
        #: (a count of accesses: the older of the two heads is the LRU key)
        self._t1: OrderedDict[bytes, int] = OrderedDict()
        self._t2: OrderedDict[bytes, int] = OrderedDict()
        #: the keys a start loaded, part of T1: after its cold keys (ticks
        #: below 0), before the rest (ticks above every loaded key's);
        #: their ticks are 0 (a Backlog, built at once where T1 builds a
        #: node per key; None: nothing loaded)
        self._loaded: Backlog[bytes] | None = None
        self._tick = 0
        #: cold keys (TAIL hints) enter T1 at its LRU end with ticks below 0,
        #: each older than the last, so T1 stays in order of its ticks
        self._cold_tick = 0
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        #: target size of T1, adapted by ghost hits
        self.p = 0
        #: the most keys ever resident: ARC's cache size
        self.c = 1

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} t1={len(self._t1) + len(self._loaded or ())} "
            f"t2={len(self._t2)} "
            f"b1={len(self._b1)} b2={len(self._b2)} p={self.p}>"
        )

    def __len__(self) -> int:
        loaded = self._loaded
        return len(self._t1) + len(self._t2) + (0 if loaded is None else len(loaded))

    def _t1_items(self) -> Iterator[tuple[bytes, int]]:
        """T1's keys and ticks, least recently used first: the cold ones,
        the loaded ones, then the rest."""
        items = iter(self._t1.items())
        loaded = self._loaded
        if not loaded:
            return items
        return _with_loaded(items, loaded)

    def _frequent(self, key: bytes) -> bool:
        """Whether a key admitted without a ghost hit starts in T2."""
        return False

    def admit(self, key: bytes, cold: bool = False, h: int | None = None) -> None:
        """``key`` is resident now (``cold``: a TAIL hint; ``h``: its hash,
        when the caller has it, for a subclass that hashes keys)."""
        b1, b2 = self._b1, self._b2
        self._tick = now = self._tick + 1
        if key in b1:
            self.p = min(self.c, self.p + max(1, len(b2) // len(b1)))
            del b1[key]
            self._t2[key] = now
        elif key in b2:
            self.p = max(0, self.p - max(1, len(b1) // len(b2)))
            del b2[key]
            self._t2[key] = now
        elif self._frequent(key):
            self._t2[key] = now
        elif cold:
            self._cold_tick -= 1
            self._t1[key] = self._cold_tick
            self._t1.move_to_end(key, last=False)
        else:
            self._t1[key] = now
        loaded = self._loaded
        c = len(self._t1) + len(self._t2) + (0 if loaded is None else len(loaded))
        if c > self.c:
            self.c = c
        c = self.c
        # Ghosts are trimmed here, after the check: the tier evicts (making
        # ghosts) before it admits the key that needed the room.
        if len(b1) > c:
            while len(b1) > c:
                b1.popitem(last=False)
        if len(b2) > c:
            while len(b2) > c:
                b2.popitem(last=False)

    def admit_many(self, keys: Mapping[bytes, object]) -> None:
        """Keys resident at start (a loaded index), oldest first: each in T1
        as recent once, no ghost or history looked up (none knows them)."""
        if len(self) == 0:
            self._loaded = Backlog(keys)
            self._tick = max(self._tick, 0) + 1  # (later ticks above the loaded keys' 0)
        else:
            start = self._tick
            self._t1.update(zip(keys, range(start + 1, start + 1 + len(keys)), strict=True))
            self._tick = start + len(keys)
        self.c = max(self.c, len(self))

    def touch(self, key: bytes) -> None:
        self._tick = now = self._tick + 1
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = now
        elif key in self._t2:
            self._t2.move_to_end(key)
            self._t2[key] = now
        elif self._loaded is not None and self._loaded.discard(key):
            self._t2[key] = now

    def touch_many(self, keys: Iterable[bytes]) -> None:
        """:meth:`touch` of each key in turn, in one call."""
        t1, t2, loaded = self._t1, self._t2, self._loaded
        now = self._tick
        for key in keys:
            now += 1
            if key in t2:
                t2.move_to_end(key)
                t2[key] = now
            elif key in t1:
                del t1[key]
                t2[key] = now
            elif loaded is not None and loaded.discard(key):
                t2[key] = now
        self._tick = now

    def remove(self, key: bytes) -> None:
        """Deleted: forgotten, not remembered as a ghost."""
        if (
            self._t1.pop(key, _ABSENT) is _ABSENT
            and self._t2.pop(key, _ABSENT) is _ABSENT
            and self._loaded is not None
        ):
            self._loaded.discard(key)

    def evict(self, key: bytes) -> None:
        """Evicted to make room: remembered in its ghost list."""
        for live, ghost in ((self._t1, self._b1), (self._t2, self._b2)):
            if key in live:
                del live[key]
                ghost[key] = None
                return
        if self._loaded is not None and self._loaded.discard(key):
            self._b1[key] = None

    def candidates(self) -> Iterator[bytes]:
        t1 = (key for key, _ in self._t1_items())
        if len(self._t1) + len(self._loaded or ()) > self.p or not self._t2:
            yield from t1
            yield from self._t2
        else:
            yield from self._t2
            yield from t1

    def evict_first(self) -> None:
        """Evict the first of :meth:`candidates` (there is one)."""
        if self._loaded:  # (the first may be a loaded key)
            self.evict(next(self.candidates()))
            return
        t1, t2 = self._t1, self._t2
        if len(t1) > self.p or not t2:
            key, _ = t1.popitem(last=False)
            self._b1[key] = None
        else:
            key, _ = t2.popitem(last=False)
            self._b2[key] = None


class _Shadow:
    """A small cache over a sample of the keys, to score a policy online."""

    def __init__(self, policy: ARCPolicy) -> None:
        self.policy = policy
        self.hits = 0.0

    def access(self, key: bytes, capacity: int, cold: bool = False, h: int | None = None) -> None:
        policy = self.policy
        if key in policy._t1 or key in policy._t2:
            self.hits += 1
            policy.touch(key)
            return
        while len(policy._t1) + len(policy._t2) >= capacity:
            policy.evict_first()
        policy.admit(key, cold, h)


class _LRUShadow:
    """The plain LRU candidate's shadow cache."""

    def __init__(self) -> None:
        self.order: OrderedDict[bytes, None] = OrderedDict()
        self.hits = 0.0

    def access(self, key: bytes, capacity: int, cold: bool = False) -> None:
        order = self.order
        if key in order:
            self.hits += 1
            order.move_to_end(key)
            return
        while len(order) >= capacity:
            order.popitem(last=False)
        order[key] = None
        if cold:
            order.move_to_end(key, last=False)


class Mode(enum.Enum):
    """Which candidate orders the evictions: the one whose shadow hits most."""

    HISTORY = "history"  # ARC, keys seen within the history entering T2
    ARC = "arc"  # plain ARC
    LRU = "lru"  # least recently used first, over T1 and T2 alike


class HistoryARCPolicy(ARCPolicy):
    def __init__(self) -> None:
        super().__init__()
        self.seen = SeenFilter(lambda: HISTORY * self.c)
        # Three shadow caches over 1 key in SAMPLE replay the traffic as each
        # candidate would; the one that hits most decides (set dueling).
        self._with = _Shadow(_HistoryShadow())
        self._without = _Shadow(ARCPolicy())
        self._lru = _LRUShadow()
        self._sampled = 0
        self.mode = Mode.LRU

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]} mode={self.mode.value} {self.seen!r}>"

    @property
    def uses_history(self) -> bool:
        return self.mode is Mode.HISTORY

    def _frequent(self, key: bytes) -> bool:
        return self._seen_before and self.mode is Mode.HISTORY

    def _rate(self) -> int:
        """One key in this many feeds the shadows, so that each holds at
        least MIN_SHADOW keys (a cache under twice that is replayed whole);
        0: a cache smaller than that is LRU and samples nothing."""
        c = self.c
        return 0 if c < MIN_SHADOW else min(SAMPLE, c // MIN_SHADOW)

    def _sample(self, key: bytes, cold: bool = False, h: int | None = None) -> None:
        """``key``'s access replayed in the shadows if it is sampled (``h``:
        its hash, when the caller has it)."""
        c = self.c  # _rate(), inlined: this runs on every admit and touch
        if c < MIN_SHADOW:
            return
        rate = min(SAMPLE, c // MIN_SHADOW)
        if h is None:
            h = _hash(key)
        if not h % rate:
            self._replay(key, rate, cold, h)

    def _replay(self, key: bytes, rate: int, cold: bool = False, h: int | None = None) -> None:
        """A sampled access, replayed in each shadow; now and then the duel
        is decided (``h``: the key's hash, when the caller has it)."""
        capacity = self.c // rate
        self._with.access(key, capacity, cold, h)
        self._without.access(key, capacity, cold)
        self._lru.access(key, capacity, cold)
        self._count_sampled(capacity)

    def _count_sampled(self, capacity: int) -> None:
        """One more sampled access replayed; now and then the duel is decided."""
        self._sampled += 1
        with_, without, lru = self._with, self._without, self._lru
        if self._sampled % (capacity // DECIDE) == 0:
            # Decided every 1/DECIDE shadow capacity of sampled accesses, not
            # at each (flapping between orders costs more than either loses).
            # LRU wins ties and near-ties: a candidate orders the evictions
            # only while it beats LRU by more than chance would (MARGIN
            # standard deviations of the difference of two counts).
            best = max(with_.hits, without.hits)
            lead = best - lru.hits
            if self.mode is Mode.LRU and lead <= MARGIN * math.sqrt(best + lru.hits):
                pass  # LRU keeps ties and near-ties
            elif lead <= 0:  # a candidate orders until LRU's shadow is level again
                self.mode = Mode.LRU
            else:
                self.mode = Mode.HISTORY if with_.hits >= without.hits else Mode.ARC
        if self._sampled >= capacity * DECAY:  # old wins count less
            self._sampled = 0
            with_.hits /= 2
            without.hits /= 2
            lru.hits /= 2

    def admit(self, key: bytes, cold: bool = False, h: int | None = None) -> None:
        if h is None:
            h = _hash(key)  # once, for the history and the sampling
        self._seen_before = self.seen.add_hash(h)
        self._sample(key, cold, h)
        super().admit(key, cold)

    def touch(self, key: bytes) -> None:
        self._sample(key)
        super().touch(key)

    def touch_many(self, keys: Iterable[bytes]) -> None:
        """:meth:`touch` of each key in turn, in one call: the same order,
        shadows and mode as one call per key (the shadows see only the
        sampled keys, in order, and never the lists of this policy, so they
        are replayed first)."""
        keys = list(keys)
        rate = self._rate()
        if rate:
            sampled = [(k, h) for k, h in zip(keys, map(_hash, keys), strict=True) if not h % rate]
            if sampled:
                self._replay_touches(sampled, rate)
        super().touch_many(keys)

    def _replay_touches(self, sampled: list[tuple[bytes, int]], rate: int) -> None:
        """:meth:`_replay` of each sampled touch in turn, with the common case
        (a key each shadow holds: a hit that moves it) done here: a long
        prefix looked up between two writes is touched whole at the next."""
        capacity = self.c // rate
        shadows = (self._with, self._without)
        lru = self._lru
        order = lru.order
        # _count_sampled's work is only at these counts: other keys just count
        step, decay = capacity // DECIDE, capacity * DECAY
        for key, h in sampled:
            for shadow in shadows:
                policy = shadow.policy
                t1, t2 = policy._t1, policy._t2
                if key in t2:  # ARCPolicy.touch, inlined
                    policy._tick = now = policy._tick + 1
                    shadow.hits += 1
                    t2.move_to_end(key)
                    t2[key] = now
                elif key in t1:
                    policy._tick = now = policy._tick + 1
                    shadow.hits += 1
                    del t1[key]
                    t2[key] = now
                else:
                    shadow.access(key, capacity, False, h)
            if key in order:
                lru.hits += 1
                order.move_to_end(key)
            else:
                lru.access(key, capacity)
            n = self._sampled + 1
            if n % step and n < decay:
                self._sampled = n
            else:
                self._count_sampled(capacity)

    def candidates(self) -> Iterator[bytes]:
        if self.mode is not Mode.LRU:
            return super().candidates()
        # T1 and T2 are each in order of last access: merged by it, they
        # give every resident key least recently used first.
        t1, t2 = self._t1_items(), self._t2
        if not t2:
            return (key for key, _ in t1)
        if not self._t1 and not self._loaded:
            return iter(t2)
        return _merge_by_access(t1, iter(t2.items()))

    _seen_before = False


def _with_loaded(
    items: Iterator[tuple[bytes, int]], loaded: Backlog[bytes]
) -> Iterator[tuple[bytes, int]]:
    """T1's ``items`` with the loaded keys (tick 0) between its cold ones
    (ticks below 0) and the rest."""
    for key, tick in items:
        if tick >= 0:
            yield from ((k, 0) for k in loaded)
            yield key, tick
            yield from items
            return
        yield key, tick
    yield from ((k, 0) for k in loaded)


def _merge_by_access(
    first: Iterator[tuple[bytes, int]], second: Iterator[tuple[bytes, int]]
) -> Iterator[bytes]:
    """The keys of two lists (non-empty), each in order of last access,
    merged by it (T1's first on a tie): what ``heapq.merge`` gives, with less
    set-up for the one or two keys an eviction usually takes."""
    one: tuple[bytes, int] | None = next(first)
    two: tuple[bytes, int] | None = next(second)
    while one is not None and two is not None:
        if one[1] <= two[1]:
            yield one[0]
            one = next(first, None)
        else:
            yield two[0]
            two = next(second, None)
    # one list ran out: the rest of the other, in its order
    head, rest = (one, first) if one is not None else (two, second)
    assert head is not None
    yield head[0]
    yield from (key for key, _ in rest)


class _HistoryShadow(ARCPolicy):
    def __init__(self) -> None:
        super().__init__()
        self.seen = SeenFilter(lambda: HISTORY * self.c)

    def _frequent(self, key: bytes) -> bool:
        return self._seen_before

    def admit(self, key: bytes, cold: bool = False, h: int | None = None) -> None:
        self._seen_before = self.seen.add_hash(_hash(key) if h is None else h)
        super().admit(key, cold)

    _seen_before = False


#: what a pop of an absent key returns
_ABSENT = object()

#: one key in SAMPLE feeds the shadow caches
SAMPLE = 8
#: shadow wins are halved every DECAY shadow capacities of sampled accesses
DECAY = 16
#: a shadow cache holds at least this many keys; a cache that has never held
#: this many is LRU (too few keys for the duel to tell candidates apart)
MIN_SHADOW = 256
#: the mode is decided DECIDE times per shadow capacity of sampled accesses
DECIDE = 4
#: by how many standard deviations another candidate's shadow must out-hit
#: LRU's to be used
MARGIN = 2.0

"""Has this key been seen recently? A two-generation Bloom filter. Pure.

The frequency history of :class:`~kvtier.tiers.arc.HistoryARCPolicy`: it
remembers keys long after they were evicted, in about 10-20 bits per key
of history instead of a dictionary entry.

Each generation is a Bloom filter of ``m`` bits (a power of two, 10 bits a
key or more) probed at 4 places, sized for ``period`` keys: about 1% false
positives when full. Keys go into the current generation; once it holds
``period`` keys it becomes the previous one and a new, empty current one
starts, sized for the period then asked for. A key is *seen* if either
generation has it, so the history reaches back between one and two
periods. Probes come from the key's XXH3-64 hash, split by double hashing
(deterministic: a replay gives the same figures every run).

Invariants: a key added is seen until two rotations have passed; a key
never added is seen only at the filter's false-positive rate.
"""

from __future__ import annotations

from collections.abc import Callable

import xxhash

_BITS_PER_KEY = 10
_hash = xxhash.xxh3_64_intdigest
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

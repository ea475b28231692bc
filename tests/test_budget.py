"""The byte budget RAM and disk share, alone: accounting, pins, eviction order."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from kvtier.tiers.budget import Budget, Gone
from kvtier.tiers.policy import NoRoom


def test_evicts_least_recently_used_first_and_skips_pins() -> None:
    b = Budget(100)
    for key in (b"a", b"b", b"c"):
        b.admit(key, 30)
    b.touch(b"a")  # order now b, c, a
    b.pin(b"b")
    assert b.evict_for(50) == [b"c", b"a"]  # b is pinned; 10 free + 30 + 30 >= 50
    assert (b.used, len(b), b.evictions) == (30, 1, 2)
    assert repr(b) == "<Budget used=30/100 held=0 keys=1 pinned=1 evictions=2>"


def test_no_room_removes_nothing() -> None:
    b = Budget(100)
    b.admit(b"a", 60)
    b.pin(b"a")
    with pytest.raises(NoRoom):
        b.evict_for(50)
    assert b"a" in b and b.used == 60 and b.evictions == 0


def test_held_bytes_count_against_capacity() -> None:
    b = Budget(100)
    b.admit(b"a", 50)
    b.hold(40)
    assert b.free == 10
    assert b.evict_for(20) == [b"a"]
    b.release(40)
    b.release(40)  # releasing more than held never goes negative
    assert (b.held, b.free) == (0, 100)


def test_pins_nest_and_drop() -> None:
    b = Budget(100)
    b.admit(b"a", 10)
    b.pin(b"a")
    b.pin(b"a")
    b.unpin(b"a")
    assert b.pinned_count == 1
    b.unpin(b"a")
    assert b.pinned_count == 0
    b.pin(b"a")
    b.drop_pins(b"a")
    assert b.pinned_count == 0


def test_capacity_holds_under_random_load() -> None:
    rng = random.Random(7)
    b = Budget(10_000)
    for _ in range(20_000):
        key = rng.randrange(300).to_bytes(2, "big")
        if key in b:
            if rng.random() < 0.3:
                b.remove(key)
            else:
                b.touch(key)
            continue
        size = rng.randrange(1, 3000)
        try:
            b.evict_for(size)
        except NoRoom:
            continue
        b.admit(key, size)
        assert b.used + b.held <= b.capacity
    assert b.used == sum(b.size_of(k) for k in b)


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        Budget(0)


class Recorder:
    """An index watch that writes down what it is told, and checks it is
    told of each change once, after it happened."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        #: the keys it was told are held
        self.keys: set[bytes] = set()
        self.told: set[tuple[str, Gone | None]] = set()

    def held(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            assert key not in self.keys and key in self.budget  # once, and after
            self.keys.add(key)
        self.told.add(("held", None))

    def gone(self, keys: Sequence[bytes], why: Gone) -> None:
        for key in keys:
            assert key in self.keys and key not in self.budget  # once, and after
            self.keys.discard(key)
        self.told.add(("gone", why))


def test_the_watch_hears_of_every_change_of_the_index_once() -> None:
    """Whatever changes the index (admit, remove, evict), its watch is told,
    once per key, after the change: the watch's copy equals the index."""
    rng = random.Random(5)
    b = Budget(300)
    rec = b.watch = Recorder(b)
    for step in range(2000):
        key = bytes([rng.randrange(40)])
        roll = rng.random()
        if key not in b and roll < 0.5:
            try:
                b.evict_for(50, key)
            except NoRoom:
                continue
            b.admit(key, rng.randrange(1, 50))
        elif key in b and roll < 0.7:
            b.remove(key, Gone.LOST if step % 2 else Gone.DELETED)
        elif key in b and roll < 0.8:
            b.pin(key)
        else:
            b.unpin(key)
        assert rec.keys == set(b)
    assert rec.told == {("held", None), *(("gone", why) for why in Gone)}  # every kind seen

"""Namespaces' shares of a tier (kvtier.tiers.shares), alone and under a budget."""

from __future__ import annotations

import random

import pytest

from kvtier.model import namespace_of, namespace_prefix
from kvtier.tiers.budget import Budget
from kvtier.tiers.policy import LRUPolicy, NoRoom
from kvtier.tiers.shares import Quota, Shares

A, B, C = b"a", b"b", b"c"


def key(ns: bytes, n: int) -> bytes:
    return namespace_prefix(ns) + b"k%d" % n


def budget(capacity: int, **quotas: Quota) -> Budget:
    q = {k.encode() if k != "default" else b"": v for k, v in quotas.items()}
    return Budget(capacity, Shares(capacity, q, LRUPolicy))


def fill(b: Budget, ns: bytes, count: int, size: int = 10, start: int = 0) -> list[bytes]:
    """Admit ``count`` blocks of ``ns`` the way a tier does: room first."""
    evicted = []
    for n in range(start, start + count):
        k = key(ns, n)
        evicted += b.evict_for(size, k)
        b.admit(k, size)
    return evicted


def test_a_namespace_at_its_minimum_keeps_its_blocks_under_anothers_flood() -> None:
    b = budget(100, a=Quota(min=40))
    fill(b, A, 4)  # 40 bytes: its guarantee
    evicted = fill(b, B, 100)  # ten times the tier
    assert not [k for k in evicted if namespace_of(k) == A]
    assert b.shares is not None and b.shares.used == {A: 40, B: 60}
    assert b.used <= b.capacity


def test_without_a_minimum_a_namespace_keeps_its_fair_share_only() -> None:
    b = budget(100)
    fill(b, A, 8)  # 80 bytes, above its half of the tier
    evicted = fill(b, B, 100)
    assert sum(1 for k in evicted if namespace_of(k) == A) == 3  # down to its share
    assert b.shares is not None and b.shares.used == {A: 50, B: 50}


def test_a_namespace_at_its_max_makes_room_from_its_own_blocks() -> None:
    b = budget(100, a=Quota(max=30))
    fill(b, B, 5)
    evicted = fill(b, A, 6)
    assert b.shares is not None and b.shares.used[A] == 30
    assert [namespace_of(k) for k in evicted] == [A, A, A]
    assert evicted == [key(A, 0), key(A, 1), key(A, 2)]  # its own LRU order
    assert b.shares.used[B] == 50  # room was there: B lost nothing


def test_one_over_its_max_gives_up_room_before_anyone_else() -> None:
    b = budget(100, a=Quota(max=80))
    fill(b, A, 8)
    fill(b, B, 2)
    assert b.shares is not None
    b.shares.quotas = {A: Quota(max=20)}  # lowered live: A is now over it
    evicted = fill(b, C, 3)
    assert [namespace_of(k) for k in evicted] == [A, A, A]


def test_weights_split_the_room_above_the_minimums() -> None:
    b = budget(120, a=Quota(weight=2.0), b=Quota(weight=1.0))
    for n in range(200):  # both keep writing, alternately
        fill(b, A, 1, start=n)
        fill(b, B, 1, start=n)
    assert b.shares is not None
    assert b.shares.used == {A: 80, B: 40}
    assert b.shares.shares(b.shares.used, None) == {A: 80.0, B: 40.0}


def test_pinned_blocks_are_passed_over_and_a_plan_changes_nothing() -> None:
    b = budget(30, a=Quota(max=20))
    fill(b, A, 2)
    b.pin(key(A, 0))
    assert b.shares is not None
    plan = b.shares.plan(key(A, 9), 10, b.free, lambda k: k == key(A, 0))
    assert plan == [key(A, 1)] and b.shares.used[A] == 20 and len(b) == 2
    b.pin(key(A, 1))
    with pytest.raises(NoRoom, match="at its max"):
        b.evict_for(10, key(A, 9))
    with pytest.raises(NoRoom, match="larger than"):
        b.evict_for(21, key(A, 9))


def test_every_namespace_at_its_minimum_refuses_rather_than_breaking_one() -> None:
    b = budget(40, a=Quota(min=20), b=Quota(min=20))
    fill(b, A, 2)
    fill(b, B, 2)
    with pytest.raises(NoRoom, match="guaranteed minimum"):
        b.evict_for(10, key(C, 0))
    assert fill(b, A, 1, start=5) == [key(A, 0)]  # its own blocks, though, it may replace


def test_accounting_holds_under_random_traffic() -> None:
    rng = random.Random(7)
    b = budget(1000, a=Quota(min=200, max=600), b=Quota(weight=3.0), c=Quota(min=100))
    resident: dict[bytes, int] = {}
    for step in range(5000):
        ns = rng.choice([A, B, C, b""])
        k = key(ns, rng.randrange(300))
        if k in b:
            if rng.random() < 0.2:
                resident.pop(k)
                b.remove(k)
            else:
                b.touch(k)
            continue
        size = rng.randrange(5, 60)
        try:
            for victim in b.evict_for(size, k):
                resident.pop(victim)
        except NoRoom:
            continue
        b.admit(k, size)
        resident[k] = size
        shares = b.shares
        assert shares is not None
        assert b.used == sum(resident.values()) <= b.capacity, step
        for n in (A, B, C, b""):
            held = sum(s for r, s in resident.items() if namespace_of(r) == n)
            assert shares.used.get(n, 0) == held
        assert shares.used.get(A, 0) <= 600
    assert repr(b.shares).startswith("<Shares ")

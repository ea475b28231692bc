"""Eviction policies alone and under a Budget: LRU and its backlog of loaded keys,
ARC, history ARC, S3-FIFO, the seen filter."""

from __future__ import annotations

import gc
from collections.abc import Mapping

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.collector import held_off
from kvtier.tiers.arc import ARCPolicy, HistoryARCPolicy, Mode, SeenFilter
from kvtier.tiers.backlog import Backlog
from kvtier.tiers.budget import Budget
from kvtier.tiers.policy import POLICIES, EvictionPolicy, LRUPolicy, make_policy
from kvtier.tiers.ram import RamTier
from kvtier.tiers.s3fifo import S3FIFOPolicy


def k(i: int) -> bytes:
    return f"key-{i}".encode()


def fill(budget: Budget, keys: list[bytes]) -> list[bytes]:
    """Admit each key (size 1), evicting as needed; returns the keys evicted."""
    evicted: list[bytes] = []
    for key in keys:
        if key in budget:
            budget.touch(key)
            continue
        evicted += budget.evict_for(1)
        budget.admit(key, 1)
    return evicted


@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_keeps_the_budget_and_skips_pinned_keys(name: str) -> None:
    budget = Budget(10, make_policy(name))
    fill(budget, [k(i) for i in range(10)])
    for i in range(10):
        budget.pin(k(i)) if i % 2 == 0 else None
    evicted = fill(budget, [k(i) for i in range(100, 105)])
    assert len(evicted) == 5 and all(int(e.split(b"-")[1]) % 2 == 1 for e in evicted)
    assert budget.used == 10 and len(budget) == 10
    for i in range(0, 10, 2):
        budget.unpin(k(i))
    # Deleting is not evicting: the policy forgets the key.
    budget.remove(k(0))
    assert budget.used == 9
    fill(budget, [k(i) for i in range(200, 230)])
    assert budget.used == 10
    assert budget.evictions == 5 + 29


def test_unknown_policy_names_the_choices() -> None:
    with pytest.raises(ValueError, match="harc, lru, arc, s3fifo"):
        make_policy("lfu")


def test_arc_ghost_hits_move_its_target() -> None:
    arc = ARCPolicy()
    budget = Budget(4, arc)
    fill(budget, [k(i) for i in range(4)])  # all in T1
    fill(budget, [k(i) for i in range(4, 8)])  # 0..3 evicted to B1
    assert arc.p == 0
    fill(budget, [k(0)])  # a B1 ghost comes back: T1 deserved more room
    assert arc.p >= 1
    assert "t2=1" in repr(arc)  # and the key returns as frequent
    assert len(arc) == 4


def test_history_arc_orders_by_recency_until_a_candidate_beats_lru() -> None:
    harc = HistoryARCPolicy()
    budget = Budget(3, harc)
    fill(budget, [k(0), k(1), k(2)])  # all in T1
    budget.touch(k(0))  # k(0) to T2, now the most recently used
    assert harc.mode is Mode.LRU  # no candidate has beaten LRU yet
    # LRU order over T1 and T2 alike (ARC would offer T1's k(1), k(2) first).
    assert list(harc.candidates()) == [k(1), k(2), k(0)]
    assert "mode=lru" in repr(harc)


def test_history_arc_takes_over_where_lru_fails_and_remembers_keys_seen_long_ago() -> None:
    harc, lru = HistoryARCPolicy(), LRUPolicy[bytes]()
    budgets = Budget(300, harc), Budget(300, lru)
    hits = [0, 0]
    # 150 hot keys come back every round after 900 one-time keys: further
    # back than LRU's 300 slots or ARC's ghost lists reach, within the history.
    fresh = iter(range(1000, 1_000_000))
    for _ in range(30):
        for i, budget in enumerate(budgets):
            hits[i] += sum(k(h) in budget for h in range(150))
        round_keys = [k(h) for h in range(150)] + [k(next(fresh)) for _ in range(900)]
        for budget in budgets:
            fill(budget, round_keys)
    assert harc.mode is Mode.HISTORY and harc.uses_history
    assert "mode=history" in repr(harc)
    assert hits[1] == 0 and hits[0] >= 150 * 20  # the hot keys stay, in T2
    assert all(k(h) in budgets[0] for h in range(150))


def test_a_cache_too_small_to_duel_is_lru() -> None:
    harc = HistoryARCPolicy()
    budget = Budget(100, harc)  # fewer keys than the duel needs
    for _ in range(30):
        fill(budget, [k(h) for h in range(50)] + [k(1000 + h) for h in range(300)])
    assert harc.mode is Mode.LRU


def test_s3fifo_one_read_in_the_small_queue_earns_the_main_queue() -> None:
    s3 = S3FIFOPolicy()
    budget = Budget(10, s3)
    fill(budget, [k(i) for i in range(10)])
    budget.touch(k(0))
    evicted = fill(budget, [k(i) for i in range(10, 15)])
    assert k(0) not in evicted and k(0) in budget
    # A key evicted from the small queue unread is a ghost: back, it goes to main.
    assert k(1) in evicted
    fill(budget, [k(1)])
    assert "main=2" in repr(s3)


def test_s3fifo_offers_a_pinned_key_again_later() -> None:
    s3 = S3FIFOPolicy()
    budget = Budget(3, s3)
    fill(budget, [k(0), k(1), k(2)])
    budget.pin(k(0))
    assert fill(budget, [k(3)]) == [k(1)]  # k(0) was offered, skipped, kept
    assert k(0) in budget and len(s3) == 3
    budget.unpin(k(0))
    assert fill(budget, [k(4)]) == [k(0)]


def test_seen_filter_remembers_for_one_to_two_periods() -> None:
    seen = SeenFilter(lambda: 1000)
    assert seen.add(b"a") is False
    assert seen.add(b"a") is True
    for i in range(999):
        seen.add(k(i))
    assert b"a" in seen  # rotated once: still in the previous generation
    for i in range(1000, 2100):  # a few read as seen already (false positives)
        seen.add(k(i))
    assert b"a" not in seen  # two rotations: forgotten
    false_positives = sum(k(i) in seen for i in range(10_000, 20_000))
    assert false_positives < 200  # ~1% when full
    assert seen.nbytes <= 2 * 2048


def test_lru_is_unchanged() -> None:
    lru: LRUPolicy[bytes] = LRUPolicy()
    budget = Budget(3, lru)
    assert fill(budget, [k(0), k(1), k(2), k(0), k(3)]) == [k(1)]


def test_lookup_hits_reach_the_policy_before_the_next_write() -> None:
    ram = RamTier(3, LRUPolicy())
    for i in range(3):
        ram.put(k(i), b"x")
    ram.touch_later([k(0), k(9)], 2)  # a lookup hit k(0); k(9) is not resident
    stored, evicted = ram.put(k(3), b"x")
    assert stored and [key for key, _ in evicted] == [k(1)]  # k(0) was refreshed first


@pytest.mark.parametrize("name", POLICIES)
def test_a_cold_key_goes_first_unless_it_is_read_again(name: str) -> None:
    budget = Budget(4, make_policy(name))
    fill(budget, [k(0), k(1), k(2)])
    budget.admit(k(3), 1, cold=True)  # a TAIL hint: the newest, yet first to go
    assert budget.evict_for(1) == [k(3)]
    budget.admit(k(4), 1, cold=True)
    budget.touch(k(4))  # read again: an ordinary key now
    assert budget.evict_for(1) != [k(4)]


def test_cold_keys_keep_the_lru_order_of_a_history_arc() -> None:
    policy = HistoryARCPolicy()
    assert policy.mode is Mode.LRU
    for i in range(3):
        policy.admit(k(i))
    policy.admit(k(10), cold=True)
    policy.admit(k(11), cold=True)
    policy.touch(k(0))
    assert list(policy.candidates()) == [k(11), k(10), k(1), k(2), k(0)]


@pytest.mark.parametrize("name", POLICIES)
def test_touching_many_keys_at_once_is_touching_each_in_turn(name: str) -> None:
    """The batch touch (a window of lookups' hits) leaves every policy, its
    shadows and its mode as one touch per key would, and so the same victims."""
    import random

    rng = random.Random(7)
    apart, batched = Budget(3000, make_policy(name)), Budget(3000, make_policy(name))
    for step in range(60):
        admitted = [k(step * 1000 + i) for i in range(rng.randrange(50, 400))]
        fill(apart, admitted)
        fill(batched, admitted)
        # Hits on keys old and new, some repeated, some no longer resident.
        hits = [k(rng.randrange(0, (step + 1) * 1000)) for _ in range(300)]
        hits = [h for h in hits if h in apart]
        for h in hits:
            apart.touch(h)
        batched.touch_many(hits)
        assert repr(apart._policy) == repr(batched._policy)
    assert list(apart._policy.candidates()) == list(batched._policy.candidates())
    assert fill(apart, [k(10**6 + i) for i in range(500)]) == fill(
        batched, [k(10**6 + i) for i in range(500)]
    )
    if isinstance(apart._policy, HistoryARCPolicy):
        assert isinstance(batched._policy, HistoryARCPolicy)
        assert apart._policy._sampled == batched._policy._sampled > 0
        assert apart._policy._lru.hits == batched._policy._lru.hits > 0
        for one, other in (
            (apart._policy._with, batched._policy._with),
            (apart._policy._without, batched._policy._without),
        ):
            assert one.hits == other.hits > 0
            assert repr(one.policy) == repr(other.policy)
            assert list(one.policy.candidates()) == list(other.policy.candidates())


def test_the_lru_order_of_a_history_arc_is_its_two_lists_merged_by_last_access() -> None:
    """In LRU mode the victims are T1 and T2 merged by each key's last
    access, as heapq.merge gives them, whichever list runs out first."""
    import heapq
    import random
    from operator import itemgetter

    rng = random.Random(3)
    policy = HistoryARCPolicy()
    for i in range(400):
        policy.admit(k(i))
        if rng.random() < 0.4:
            policy.touch(k(rng.randrange(i + 1)))
    assert policy.mode is Mode.LRU and policy._t1 and policy._t2
    merged = heapq.merge(policy._t1.items(), policy._t2.items(), key=itemgetter(1))
    assert list(policy.candidates()) == [key for key, _ in merged]
    for key in list(policy._t2)[:-1]:  # T2 down to one key, then T1 empty
        policy.remove(key)
    assert list(policy.candidates())[-1] in policy._t2 or not policy._t1
    for key in list(policy._t1):
        policy.remove(key)
    assert list(policy.candidates()) == list(policy._t2)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_loaded_index_evicts_oldest_first_like_keys_admitted_in_turn(name: str) -> None:
    """Keys admitted at once at start (a loaded index) leave in the order
    keys admitted one by one would, and are counted alike."""
    keys = [b"key-%03d" % i for i in range(50)]
    loaded, admitted = Budget(500, make_policy(name)), Budget(500, make_policy(name))
    loaded.admit_many(dict.fromkeys(keys, 10))
    for key in keys:
        admitted.admit(key, 10)
    assert (loaded.used, len(loaded)) == (admitted.used, len(admitted)) == (500, 50)
    assert loaded.evict_for(100) == admitted.evict_for(100) == keys[:10]
    with pytest.raises(AssertionError):
        loaded.admit_many({keys[20]: 10})  # a key is admitted once


def test_the_collector_is_held_off_inside_the_block_and_restored_after() -> None:
    assert gc.isenabled()
    with held_off():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with pytest.raises(KeyError), held_off():
            raise KeyError("in the block")
        assert not gc.isenabled()  # as it was
    finally:
        gc.enable()


ops_st = st.lists(
    st.tuples(st.sampled_from(["take", "discard", "put_back"]), st.integers(0, 2999)),
    max_size=300,
)


@given(st.integers(0, 3000), ops_st)
def test_a_backlog_keeps_its_members_in_order_whatever_leaves(
    n: int, ops: list[tuple[str, int]]
) -> None:
    """A Backlog against a plain list of its members, under takes from the
    front, removals from anywhere and keys put back at the front; past its
    slack the list is compacted and the order holds."""
    keys = [k(i) for i in range(n)]
    backlog = Backlog(dict.fromkeys(keys, 1) if n % 2 else keys, slack=n % 7)
    model = list(keys)
    taken: list[bytes] = []
    for op, i in ops:
        if op == "take" and model:
            taken.append(backlog.pop_first())
            assert taken[-1] == model.pop(0)
        elif op == "discard":
            assert backlog.discard(k(i)) == (k(i) in model)
            if k(i) in model:
                model.remove(k(i))
        elif op == "put_back" and taken:
            key = taken.pop()
            if key not in model:
                backlog.push_first(key)
                model.insert(0, key)
        assert len(backlog) == len(model)
    assert list(backlog) == model
    assert len(backlog._order) <= 3 * (len(model) + n % 7) + 1
    assert all(key in backlog for key in model)
    assert (backlog.first() if model else None) == (model[0] if model else None)


class _ARCLoadedInT1(ARCPolicy):
    """ARC placing loaded keys in T1 itself, as each admitted in turn."""

    def admit_many(self, keys: Mapping[bytes, object]) -> None:
        for key in keys:
            self.admit(key)


class _HARCLoadedInT1(HistoryARCPolicy):
    """History ARC placing loaded keys straight in T1 (no history, no shadows)."""

    def admit_many(self, keys: Mapping[bytes, object]) -> None:
        start = self._tick
        self._t1.update(zip(keys, range(start + 1, start + 1 + len(keys)), strict=True))
        self._tick = start + len(keys)
        self.c = max(self.c, len(self))


#: a policy keeping loaded keys in a backlog, and one without, ordering alike
BACKLOG_PAIRS: dict[str, tuple[type[EvictionPolicy[bytes]], type[EvictionPolicy[bytes]] | None]] = {
    "lru": (LRUPolicy, None),
    "arc": (ARCPolicy, _ARCLoadedInT1),
    "harc": (HistoryARCPolicy, _HARCLoadedInT1),
}


@pytest.mark.parametrize("name", sorted(BACKLOG_PAIRS))
@given(
    n=st.integers(1, 400),
    ops=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 599)), max_size=300),
)
def test_loaded_keys_in_a_backlog_order_evictions_as_keys_in_the_queue_itself(
    name: str, n: int, ops: list[tuple[int, int]]
) -> None:
    """A policy's loaded keys wait in a backlog: under admits (cold ones
    too), touches, removals and evictions, its order is that of the same
    policy whose loaded keys went into its queue itself (for LRU: admitted
    one by one)."""
    make, reference = BACKLOG_PAIRS[name]
    keys = [k(i) for i in range(n)]
    loaded = make()
    plain = make() if reference is None else reference()
    loaded.admit_many(dict.fromkeys(keys, 1))
    if reference is None:
        for key in keys:
            plain.admit(key)
    else:
        plain.admit_many(dict.fromkeys(keys, 1))
    resident = set(keys)
    for op, i in ops:
        key = k(i)
        if op in (0, 1) and key not in resident:
            loaded.admit(key, cold=op == 1)
            plain.admit(key, cold=op == 1)
            resident.add(key)
        elif op == 2:
            loaded.touch(key)
            plain.touch(key)
        elif op == 3:
            loaded.touch_many([key, k(i // 2)])
            plain.touch_many([key, k(i // 2)])
        elif op == 4 and key in resident:
            loaded.remove(key)
            plain.remove(key)
            resident.discard(key)
        elif op in (5, 6) and resident:
            victim = next(iter(plain.candidates()))
            assert next(iter(loaded.candidates())) == victim
            loaded.evict(victim)
            plain.evict(victim)
            resident.discard(victim)
        assert len(loaded) == len(plain) == len(resident)
    assert list(loaded.candidates()) == list(plain.candidates())

"""Retention leases in the eviction order (kvtier.tiers.retention), alone and
in a RAM tier: who goes first, when leases end, the cap, and a model
compared with the book under random operations."""

from __future__ import annotations

import random

import pytest

from kvtier.model import Retention, namespace_prefix
from kvtier.tiers.budget import Budget
from kvtier.tiers.policy import LRUPolicy, make_policy
from kvtier.tiers.ram import RamTier
from kvtier.tiers.retention import Arrivals, Retaining, RetentionBook
from kvtier.tiers.shares import Quota, Shares

SIZE = 10


def k(n: int, ns: bytes = b"") -> bytes:
    return namespace_prefix(ns) + b"k%03d" % n


def tier(blocks: int, policy: str = "lru", share: float = 1.0) -> RamTier:
    return RamTier(blocks * SIZE, make_policy(policy), retained_share=share)


def put(ram: RamTier, keys: list[bytes]) -> list[bytes]:
    """A batch PUT as the daemon makes one (room first, tail first); the evicted keys."""
    evicted = [key for key, _ in ram.make_room(keys, [b"x" * SIZE] * len(keys))]
    for key in reversed(keys):
        evicted += [e for e, _ in ram.put(key, b"x" * SIZE)[1]]
    return evicted


def lease(session: bytes, ttl: float = 60.0, priority: int = 50) -> Retention:
    return Retention(session, ttl, priority)


@pytest.mark.parametrize("policy", ["lru", "harc", "arc", "s3fifo"])
def test_a_leased_chain_outlasts_newer_ordinary_blocks(policy: str) -> None:
    ram = tier(8, policy)
    chain = [k(i) for i in range(4)]
    put(ram, chain)
    assert ram.retain(chain, lease(b"s"), now=0.0) == 4
    evicted = put(ram, [k(10 + i) for i in range(4)]) + put(ram, [k(20 + i) for i in range(4)])
    assert all(ram.contains(key) for key in chain)
    assert set(evicted) == {k(10 + i) for i in range(4)}
    assert ram.retention.counts.evicted == 0


def test_leased_blocks_go_lowest_priority_first_then_least_recent_then_tail_first() -> None:
    ram = tier(12)
    low, old, new = (
        [k(i) for i in range(4)],
        [k(10 + i) for i in range(4)],
        [k(20 + i) for i in range(4)],
    )
    for n, (chain, priority) in enumerate(((old, 80), (low, 20), (new, 80))):
        put(ram, chain)
        ram.retain(chain, lease(b"s%d" % n, priority=priority), now=float(n))
    order = list(ram.budget._policy.candidates())
    assert order == low[::-1] + old[::-1] + new[::-1]
    # RAM full of leased blocks: a new one takes the low-priority chain's tail
    assert put(ram, [k(30)]) == [low[-1]]
    assert ram.retention.counts.evicted == 1


def test_a_lease_ends_at_its_time_and_its_blocks_go_first() -> None:
    ram = tier(8)
    chain = [k(i) for i in range(4)]
    put(ram, chain)
    ram.retain(chain, lease(b"s", ttl=10.0), now=0.0)
    put(ram, [k(10)])
    book = ram.retention
    assert book.expire(9.999) == 0 and len(book) == 4
    assert book.expire(10.0) == 4 and len(book) == 0 and book.sessions() == 0
    assert book.counts.expired == 4
    # ordinary again, at the cold end: before the newer block, oldest (tail) first
    assert list(ram.budget._policy.candidates())[:4] == chain[::-1]


def test_a_session_that_comes_back_keeps_its_lease_and_its_latest_word_stands() -> None:
    ram = tier(8)
    chain = [k(i) for i in range(3)]
    put(ram, chain)
    book = ram.retention
    ram.retain(chain, lease(b"s", ttl=10.0, priority=90), now=0.0)
    ram.retain(chain[:2], lease(b"s", ttl=10.0, priority=10), now=8.0)  # renewed, lower
    assert book.expire(15.0) == 0  # 8 + 10
    assert {book.lease_of(key).priority for key in chain[:2]} == {10}  # type: ignore[union-attr]
    assert book.lease_of(chain[2]).priority == 90  # type: ignore[union-attr]
    ram.retain(chain[:1], lease(b"other", ttl=1.0, priority=70), now=9.0)  # a shared head
    assert book.lease_of(chain[0]).priority == 70  # type: ignore[union-attr]
    assert book.holds(b"s", chain) == 2 and book.holds(b"other", chain) == 1
    assert book.counts.renewed == 3


def test_a_release_ends_one_sessions_leases_in_its_namespace_only() -> None:
    ram = tier(16)
    a, b = [k(i, b"a") for i in range(3)], [k(i, b"b") for i in range(3)]
    put(ram, a)
    put(ram, b)
    ram.retain(a, lease(b"s"), now=0.0)
    ram.retain(b, lease(b"s"), now=0.0)
    book = ram.retention
    assert book.release(b"s", b"x") == 0
    assert book.release(b"s", b"a") == 3
    assert book.holds(b"s", a) == 0 and book.holds(b"s", b) == 3
    assert book.leased_bytes == {b"b": 3 * SIZE} and book.counts.released == 3


def test_leased_bytes_never_pass_the_cap_the_oldest_lowest_go_first() -> None:
    ram = tier(20, share=0.5)  # 100 of 200 bytes
    chains = [[k(10 * c + i) for i in range(4)] for c in range(4)]
    for n, chain in enumerate(chains):
        put(ram, chain)
        ram.retain(chain, lease(b"s%d" % n, priority=50 if n != 1 else 90), now=float(n))
        assert ram.retention.leased_bytes.get(b"", 0) <= 100
    book = ram.retention
    # 16 blocks leased, room for 10: chain 0 (oldest of priority 50) and the
    # tail of chain 2 ended, ordinary blocks at the warm end
    assert book.counts.capped == 6
    assert all(book.lease_of(key) is None for key in chains[0])
    assert [book.lease_of(key) is None for key in chains[2]] == [False, False, True, True]
    assert all(book.lease_of(key) is not None for key in chains[1] + chains[3])


def test_leases_under_namespace_quotas_keep_each_namespaces_share() -> None:
    capacity = 20 * SIZE
    quotas = {b"a": Quota(max=10 * SIZE), b"b": Quota()}
    ram = RamTier(capacity, Shares(capacity, quotas, LRUPolicy), retained_share=0.5)
    a = [k(i, b"a") for i in range(8)]
    put(ram, a)
    ram.retain(a, lease(b"s"), now=0.0)
    assert ram.retention.leased_bytes[b"a"] == 5 * SIZE  # half of a's max
    # b's pressure cannot reach a's leased blocks while a's own ordinary ones remain
    put(ram, [k(i, b"b") for i in range(14)])
    assert all(ram.contains(key) for key in a[:5])


def test_a_deleted_leased_block_leaves_the_book() -> None:
    ram = tier(8)
    chain = [k(i) for i in range(3)]
    put(ram, chain)
    ram.retain(chain, lease(b"s"), now=0.0)
    assert ram.remove(chain[1])
    assert ram.retention.lease_of(chain[1]) is None
    assert ram.retention.holds(b"s", chain) == 2
    assert ram.retention.counts.evicted == 0 and ram.retention.leased_bytes[b""] == 2 * SIZE


def test_the_book_and_a_model_agree_under_random_operations() -> None:
    """Random puts, deletes, leases, renewals, whole prompts, releases and expiries: after
    each, the book's leases, sessions and bytes, and every key's place (the
    leased order or the wrapped policy, never both, every resident key in
    one), against what the module's docstring promises."""
    for seed in range(20):
        rng = random.Random(seed)
        ram = tier(24, rng.choice(["lru", "harc"]), share=rng.choice([0.3, 0.6, 1.0]))
        book = ram.retention
        now = 0.0
        for _ in range(400):
            now += rng.random()
            op = rng.random()
            ns = rng.choice([b"", b"a"])  # (two namespaces, one cap each)
            if op < 0.4:
                start = rng.randrange(40)
                put(ram, [k(start + i, ns) for i in range(rng.randint(1, 6))])
            elif op < 0.5:
                ram.remove(k(rng.randrange(46), ns))
            elif op < 0.8:
                session = b"s%d" % rng.randrange(4)
                keys = [k(rng.randrange(46), ns) for _ in range(rng.randint(1, 5))]
                ram.retain(keys, lease(session, rng.choice([2.0, 5.0]), rng.randrange(101)), now)
            elif op < 0.85:
                keys = [k(rng.randrange(46), ns) for _ in range(rng.randint(1, 8))]
                ram.supersede(b"s%d" % rng.randrange(4), keys)
            elif op < 0.9:
                ram.release_session(b"s%d" % rng.randrange(4), ns)
            else:
                ram.expire_leases(now)
            _check(ram, book)
        ram.expire_leases(now + 10)
        assert len(book) == 0 and book.leased_bytes == {} and book.sessions() == 0
        _check(ram, book)


def _check(ram: RamTier, book: RetentionBook) -> None:
    policy = ram.budget._policy
    assert isinstance(policy, Retaining)
    leased = [key for order in policy._leased.values() for key in order]
    ordinary = list(policy.inner.candidates())
    assert sorted(leased) == sorted(book._held)
    assert not set(leased) & set(ordinary)
    assert sorted(leased + ordinary) == sorted(ram.resident())
    assert len(policy) == len(ram)
    for ns in (b"", b"a"):
        total = sum(h.size for h in book._held.values() if h.namespace == ns)
        assert book.leased_bytes.get(ns, 0) == total <= book.cap_of(ns)
    for slot, sess in book._sessions.items():
        assert sess.keys and all(book._held[key].session == slot for key in sess.keys)
    assert sum(len(s.keys) for s in book._sessions.values()) == len(book)


def test_a_tier_without_leases_is_its_policy_itself() -> None:
    """The wrapper costs nothing while it holds no lease: its methods are
    the wrapped policy's own, until the first lease and after the last."""
    inner = LRUPolicy[bytes]()
    wrapper = Retaining(inner, RetentionBook())
    budget = Budget(100, wrapper)
    assert wrapper.touch == inner.touch and wrapper.candidates == inner.candidates
    budget.admit(b"a", 10)
    wrapper.book.grant([b"a"], [10], [wrapper], lease(b"s"), 0.0)
    assert wrapper.touch != inner.touch
    wrapper.book.release(b"s")
    assert wrapper.touch == inner.touch
    assert list(wrapper.candidates()) == [b"a"]


def test_a_retention_out_of_range_is_refused() -> None:
    for bad in (
        dict(session=b"x" * 65, ttl=1.0),
        dict(session=b"s", ttl=0.0),
        dict(session=b"s", ttl=float("nan")),
        dict(session=b"s", ttl=8 * 24 * 3600.0),
        dict(session=b"s", ttl=1.0, priority=101),
        dict(session=b"s", ttl=1.0, priority=-1),
    ):
        with pytest.raises(ValueError):
            Retention(**bad)  # type: ignore[arg-type]


def test_touches_put_a_chains_head_last_in_the_order() -> None:
    ram = tier(8)
    chain = [k(i) for i in range(4)]
    put(ram, chain)
    put(ram, [k(9)])
    ram.touch_later(chain, 4)
    ram.put(k(10), b"x" * SIZE)  # applies the touches
    assert list(ram.budget._policy.candidates()) == [k(9), *chain[::-1], k(10)]


def test_a_lease_heard_late_moves_its_session_end_later_only() -> None:
    book = RetentionBook()
    wrapper = Retaining(LRUPolicy(), book)
    for key in (b"a", b"b"):
        wrapper.admit(key)
    book.grant([b"a"], [1], [wrapper], Retention(b"s", 100.0, 50), now=10.0)  # ends at 110
    # a word said at 0 (ends at 100), heard once b landed: b joins, the end stays
    book.grant([b"b"], [1], [wrapper], Retention(b"s", 100.0, 50), now=0.0, later_only=True)
    assert book.expire(105.0) == 0
    assert book.expire(110.0) == 2


def test_leases_for_blocks_on_their_way_are_kept_bounded_and_end_with_their_time() -> None:
    arrivals = Arrivals(most=2)
    lease = Retention(b"s", 60.0, 70)
    arrivals.add([b"a", b"b", b"c"], lease, now=0.0)
    assert len(arrivals) == 2 and arrivals.take(b"a") is None  # (the oldest went)
    assert arrivals.take(b"b") == (lease, 0.0)
    assert arrivals.take(b"b") is None  # (taken once)
    arrivals.add([b"d"], Retention(b"s", 10.0, 70), now=5.0)
    arrivals.expire(15.0)  # d's time has passed, c's not
    assert arrivals.take(b"d") is None and arrivals.take(b"c") == (lease, 0.0)


def test_a_sessions_whole_prompt_ends_its_leases_on_a_prompt_it_left() -> None:
    ram = tier(8)
    left, kept = [k(0), k(1), k(2)], [k(0), k(5)]  # (it compacted: one block stays)
    put(ram, left)
    ram.retain(left, lease(b"s"), now=0.0)
    put(ram, [k(9)])
    ram.retain([k(9)], lease(b"other"), now=0.0)  # another session's lease stays
    put(ram, [k(5)])
    assert ram.supersede(b"s", kept) == 2  # k1 and k2: no longer its prompt
    assert ram.retention.counts.superseded == 2
    assert set(ram.retention.lease_of(key) is not None for key in (k(0), k(9))) == {True}
    # they are ordinary blocks, first to go (a chain's tail first)
    assert [key for key, _ in ram.make_room([k(20)], [b"x" * SIZE * 5])] == [k(2), k(1)]
    assert ram.supersede(b"nobody", kept) == 0 and ram.supersede(b"s", []) == 0

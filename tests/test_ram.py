from __future__ import annotations

import contextlib
import random

import pytest

from kvtier.errors import NoCapacityError, ValueTooLargeError
from kvtier.model import Buffer
from kvtier.tiers.policy import LRUPolicy, make_policy
from kvtier.tiers.ram import _MAX_DEFERRED_KEYS, Arena, RamTier
from kvtier.tiers.shares import Quota, Shares


def test_lru_policy_orders_by_recency() -> None:
    lru: LRUPolicy[str] = LRUPolicy()
    for key in "abc":
        lru.admit(key)
    lru.touch("a")
    assert list(lru.candidates()) == ["b", "c", "a"]
    lru.remove("c")
    assert list(lru.candidates()) == ["b", "a"]
    assert len(lru) == 2


def test_put_is_idempotent() -> None:
    ram = RamTier(100)
    assert ram.put(b"k", b"12345") == (True, [])
    assert ram.put(b"k", b"other") == (False, [])
    assert ram.get(b"k") == b"12345"
    assert ram.used_bytes == 5


def test_evicts_least_recently_used() -> None:
    ram = RamTier(30)
    for key in (b"a", b"b", b"c"):
        ram.put(key, b"x" * 10)
    ram.get(b"a")
    stored, evicted = ram.put(b"d", b"y" * 10)
    assert stored
    assert [k for k, _ in evicted] == [b"b"]
    assert ram.evictions == 1
    assert not ram.contains(b"b") and ram.contains(b"a")


@pytest.mark.parametrize("write", ["put", "stage", "reserve"])
def test_a_batch_read_counts_as_recent_at_the_next_eviction(write: str) -> None:
    """A read of many blocks shows its touches to the policy at the next
    write or eviction, not on the read's path; in the order read."""
    page = 64 * 1024
    ram = RamTier(3 * page, LRUPolicy(), arena=Arena(4 * page), min_slot=page)
    for key in (b"a", b"b", b"c"):
        ram.put(key, b"x" * page)
    values = ram.pin_many([b"b", b"a", b"nope"])
    ram.unpin_many([b"b", b"a", b"nope"], values)
    if write == "put":
        _, evicted = ram.put(b"d", b"y" * page)
    elif write == "stage":
        _, evicted = ram.stage(page, b"d")
    else:
        evicted = ram.reserve(page, b"d")
    assert [k for k, _ in evicted] == [b"c"]  # b and a were read after it
    assert ram.contains(b"a") and ram.contains(b"b")


@pytest.mark.parametrize("policy", ["lru", "harc", "shares"])
def test_a_prompts_head_stays_more_recent_than_the_blocks_stored_after_its_lookup(
    policy: str,
) -> None:
    """A lookup's hits are shown to the policy after the writes of the blocks
    it missed: under pressure a chain loses its new tail first, then its
    hits tail first, and never keeps a block behind a missing one. The
    hits wait unevicted meanwhile, even at the cold end. (``shares``:
    namespaces with quotas, whose eviction plans its own way.)"""
    if policy == "shares":
        ram = RamTier(8 * 10, Shares(8 * 10, {b"": Quota()}, LRUPolicy))
    else:
        ram = RamTier(8 * 10, make_policy(policy))
    turn1 = [b"h0", b"h1", b"h2"]
    for key in reversed(turn1):  # (a batch is admitted tail first)
        ram.put(key, b"x" * 10)
    for key in (b"o0", b"o1", b"o2", b"o3", b"o4"):  # another session's, later
        ram.put(key, b"x" * 10)
    turn2 = [*turn1, b"n0", b"n1", b"n2"]
    ram.touch_later(turn2, 3)  # the session returns: its head is the coldest now
    evicted = ram.make_room(turn2[3:], [b"x" * 10] * 3)
    assert [k for k, _ in evicted] == [b"o0", b"o1", b"o2"]  # not the hits
    for key in reversed(turn2[3:]):
        ram.put(key, b"x" * 10)
    ram.touch_later([b"o3", b"o4", b"m"], 2)  # the other session's next turn
    # ... whose write shows the first one's hits, and evicts its last block
    gone = [k for k, _ in ram.put(b"m", b"x" * 10)[1]]
    for i in range(6):
        gone += [k for k, _ in ram.put(b"z%d" % i, b"x" * 10)[1]]
    assert gone[:6] == [b"n2", b"n1", b"n0", b"h2", b"h1", b"h0"]


def test_waiting_hits_go_when_nothing_else_is_left_to_evict() -> None:
    """A lookup's hits are spared while they wait, unless the room its own
    store needs can come from nowhere else: then they are shown and the
    eviction takes the coldest of them, the last hit."""
    ram = RamTier(3 * 10, LRUPolicy())
    chain = [b"h0", b"h1", b"h2", b"n0"]
    for key in reversed(chain[:3]):
        ram.put(key, b"x" * 10)
    ram.touch_later(chain, 3)
    stored, evicted = ram.put(b"n0", b"x" * 10)
    assert stored and [k for k, _ in evicted] == [b"h2"]
    assert "deferred_touches=0" in repr(ram)


def test_reads_without_a_write_keep_their_deferred_touches_bounded() -> None:
    """A stream of reads with no write between defers at most
    ``_MAX_DEFERRED_KEYS`` touches: past it, each read shows the oldest to
    the policy (no read pays for a long backlog), and the next write the
    rest."""
    page = 64 * 1024
    n = 64
    ram = RamTier(n * page, LRUPolicy(), arena=Arena(n * page * 2), min_slot=page)
    keys = [b"k%03d" % i for i in range(n)]
    for key in keys:
        ram.put(key, b"x" * page)
    for r in range(_MAX_DEFERRED_KEYS // 8):
        batch = [keys[(r * 8 + j) % (n - 1)] for j in range(16)]  # never the last key
        ram.unpin_many(batch, ram.pin_many(batch))
        deferred = int(repr(ram).split("deferred_touches=")[1].split()[0].rstrip(">"))
        assert deferred <= _MAX_DEFERRED_KEYS
    assert deferred > _MAX_DEFERRED_KEYS - 16  # (the bound was reached)
    _, evicted = ram.put(b"new", b"y" * page)
    assert [k for k, _ in evicted] == [keys[-1]]  # the one block never read
    assert "deferred_touches=0" in repr(ram)


def test_pinned_blocks_are_never_evicted() -> None:
    ram = RamTier(30)
    for key in (b"a", b"b", b"c"):
        ram.put(key, b"x" * 10)
    a = ram.pin(b"a")
    assert a == b"x" * 10
    _, evicted = ram.put(b"d", b"y" * 10)
    assert [k for k, _ in evicted] == [b"b"]  # a was older but pinned
    ram.pin(b"c")
    ram.pin(b"d")
    with pytest.raises(NoCapacityError):
        ram.put(b"e", b"z" * 10)
    assert ram.used_bytes == 30
    assert a is not None
    ram.unpin(b"a", a)
    _, evicted = ram.put(b"e", b"z" * 10)
    assert [k for k, _ in evicted] == [b"a"]


def test_value_larger_than_tier_is_a_clear_error() -> None:
    ram = RamTier(10)
    with pytest.raises(ValueTooLargeError, match="larger than the RAM tier"):
        ram.put(b"k", b"x" * 11)
    assert ram.used_bytes == 0


@pytest.mark.parametrize("shared", [False, True], ids=["heap", "arena"])
def test_capacity_is_never_exceeded_under_random_load(shared: bool) -> None:
    """Random puts, pins, unpins, deletes: the budget holds, and a value a
    reader pinned keeps its bytes even once deleted or overwritten."""
    rng = random.Random(1234)
    page = 4096
    arena = Arena(64 * page) if shared else None
    ram = RamTier(64 * page, arena=arena, min_slot=page)
    readers: list[tuple[bytes, Buffer, bytes]] = []  # key, value held, its bytes then
    for step in range(5000):
        key = rng.randrange(200).to_bytes(2, "big")
        action = rng.random()
        if action < 0.6:
            value = bytes([step % 251]) * rng.randrange(1, 5 * page)
            with contextlib.suppress(NoCapacityError):
                ram.put(key, value)
        elif action < 0.7 and len(ram):
            key = rng.choice(list(ram.resident()))
            held = ram.pin(key)
            assert held is not None
            readers.append((key, held, bytes(held)))
        elif action < 0.75 and readers:
            k, held, _ = readers.pop(rng.randrange(len(readers)))
            ram.unpin(k, held)
        elif action < 0.9:
            if readers and rng.random() < 0.5:
                key = rng.choice(readers)[0]  # deleted while read
            ram.remove(key)
        else:
            ram.get(key)
        b = ram.budget
        assert b.used + b.held <= ram.capacity
        if step % 20 == 0:
            for _, held, seen in readers:
                assert held == seen
    for k, held, _ in readers:
        ram.unpin(k, held)
    for key in list(ram.resident()):
        ram.remove(key)
    assert ram.budget.used == 0 and ram.budget.held == 0
    if ram.slots is not None:
        assert ram.slots.is_pristine(), ram.slots
        assert ram.stats().arena_allocated_bytes == 0


def test_repr_shows_state() -> None:
    ram = RamTier(100)
    ram.put(b"k", b"123")
    ram.pin(b"k")
    assert repr(ram) == (
        "<RamTier used=3/100 reserved=0 blocks=1 pinned=1 evictions=0 deferred_touches=0>"
    )


def test_reserved_bytes_count_against_capacity() -> None:
    ram = RamTier(30)
    ram.put(b"a", b"x" * 10)
    ram.put(b"b", b"x" * 10)
    evicted = ram.reserve(15)
    assert [k for k, _ in evicted] == [b"a"]
    assert ram.used_bytes + ram.reserved_bytes <= 30
    with pytest.raises(NoCapacityError):
        ram.pin(b"b")
        ram.put(b"c", b"y" * 10)
    ram.release(15)
    assert ram.reserved_bytes == 0
    ram.put(b"c", b"y" * 10)


def test_a_batch_makes_its_room_in_one_pass_and_no_block_of_it_evicts_another() -> None:
    ram = RamTier(1000, LRUPolicy())
    for i in range(10):
        ram.put(b"old%d" % i, b"x" * 100)
    batch = [b"new%d" % i for i in range(4)]
    values = [b"y" * 100] * 4
    ram.put(batch[0], b"y" * 100)  # resident (old0 made room): needs none
    evicted = ram.make_room(batch, values)
    assert [k for k, _ in evicted] == [b"old1", b"old2", b"old3"]  # the LRU end, once
    for k, v in zip(batch, values, strict=True):
        _, more = ram.put(k, v)
        assert more == []  # its room was made
    assert all(ram.contains(k) for k in batch) and ram.budget.used == 1000
    # A batch larger than the tier makes no room here: each block makes its own.
    assert ram.make_room([b"big%d" % i for i in range(20)], [b"z" * 100] * 20) == []
    assert ram.budget.used == 1000


def test_a_staged_batch_evicts_only_the_room_its_blocks_still_need() -> None:
    """Blocks received in place hold their room from stage() on: storing the
    batch evicts nothing more, and a full tier stays full."""
    page = 4096
    ram = RamTier(8 * page, LRUPolicy(), arena=Arena(10 * page), min_slot=page)
    for i in range(8):
        ram.put(b"old%d" % i, b"x" * page)
    batch = [b"new%d" % i for i in range(3)]
    views = []
    for key in batch:
        view, evicted = ram.stage(page, key)
        assert view is not None and len(evicted) == 1  # each makes its own room
        view[:] = b"y" * page
        views.append(view)
    assert ram.make_room(batch, views) == []  # held already
    for key, view in zip(batch, views, strict=True):
        assert ram.put(key, view) == (True, [])
    assert len(ram) == 8 and ram.budget.used == 8 * page and ram.reserved_bytes == 0
    assert not any(ram.contains(b"old%d" % i) for i in range(3))
    assert all(ram.contains(b"old%d" % i) for i in range(3, 8))

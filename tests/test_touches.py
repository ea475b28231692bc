"""DeferredTouches: a lookup's hits shown after the writes of what it missed."""

from __future__ import annotations

import random
from collections.abc import Iterable

from kvtier.tiers.touches import DeferredTouches


def keys(*names: str) -> list[bytes]:
    return [n.encode() for n in names]


def shown(out: Iterable[bytes] | None) -> list[str]:
    return [] if out is None else [k.decode() for k in out]


class Held:
    """The blocks a tier holds: in these tests, those named in lower case
    (the blocks lookups miss are named in upper case)."""

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and key.islower()


HELD = Held()


def test_a_lookups_hits_are_shown_after_the_writes_of_what_it_missed() -> None:
    t = DeferredTouches()
    assert t.add(keys("a", "b", "c", "D", "E"), 3) is None
    assert sorted(t.protected()) == keys("a", "b", "c")
    assert shown(t.before_write(b"E", HELD)) == []  # its own writes, tail first
    assert shown(t.before_write(b"D", HELD)) == []
    assert t.add(keys("a", "b", "c", "d", "e", "F"), 5) is None  # the next turn
    # a write of the next turn's: the first turn's writes are over
    assert shown(t.before_write(b"F", HELD)) == ["c", "b", "a"]
    assert sorted(t.protected()) == keys("a", "b", "c", "d", "e")
    assert shown(t.take_all()) == ["e", "d", "c", "b", "a"]
    assert not t.queue and t.pending == 0 and not t.protected()


def test_a_lookup_of_each_key_waits_for_the_writes_of_those_it_missed() -> None:
    """A lookup that reads every key it names (KEYS mode: hits past a miss
    too) misses the blocks the tier does not hold; once they are written,
    all its keys are shown, the stored ones among them, tail first."""
    t = DeferredTouches()
    t.add(keys("a", "B", "c", "D"), 4)
    assert shown(t.before_write(b"D", HELD)) == []
    assert shown(t.before_write(b"B", HELD)) == []
    t.add(keys("x", "Y"), 1)
    assert shown(t.before_write(b"Y", HELD)) == ["D", "c", "B", "a"]


def test_interleaved_requests_each_wait_for_their_own_writes() -> None:
    t = DeferredTouches()
    t.add(keys("a1", "a2", "A"), 2)
    t.add(keys("b1", "B"), 1)
    # B's writes come first: A still awaits its own, and B's are under way
    assert shown(t.before_write(b"B", HELD)) == []
    assert shown(t.before_write(b"A", HELD)) == []
    # then a third request writes: A and B are both done, shown in order
    t.add(keys("c1", "C"), 1)
    assert shown(t.before_write(b"C", HELD)) == ["a2", "a1", "b1"]
    assert repr(t) == "<DeferredTouches lookups=1 hits=1 missed=1>"


def test_a_read_that_missed_nothing_is_shown_at_a_write_it_does_not_serve() -> None:
    t = DeferredTouches()
    t.add(keys("a", "b"), 2)  # a read of two blocks (or a lookup all hits)
    assert shown(t.before_write(b"x", HELD)) == ["b", "a"]
    assert not t.queue


def test_a_lookup_heard_of_after_its_writes_awaits_none() -> None:
    t = DeferredTouches()
    t.add(keys("a", "b"), 1)  # reported late: b is held already
    assert shown(t.before_write(b"x", HELD)) == ["a"]


def test_a_lookup_whose_misses_are_never_written_waits_only_until_the_bounds() -> None:
    t = DeferredTouches(max_lookups=3, max_keys=100)
    t.add(keys("a", "A"), 1)  # A is never written
    t.add(keys("b"), 1)
    assert shown(t.before_write(b"x", HELD)) == []  # b waits behind a, in order
    t.add(keys("c"), 1)
    assert shown(t.add(keys("d"), 1)) == ["a"]  # four lookups: the oldest goes
    assert shown(t.before_write(b"x", HELD)) == ["b", "c", "d"]


def test_the_bound_on_keys_shows_the_oldest_whatever_their_state() -> None:
    t = DeferredTouches(max_lookups=100, max_keys=4)
    t.add(keys("a", "b", "c", "X"), 3)
    assert shown(t.add(keys("d", "e"), 2)) == ["c", "b", "a"]
    assert t.pending == 2
    assert shown(t.before_write(b"X", HELD)) == ["e", "d"]  # (a's miss: nobody waits for it)


def test_the_same_lookup_again_adds_nothing() -> None:
    t = DeferredTouches()
    k = keys("a", "b", "C")
    t.add(k, 2)
    t.add(k, 2)
    assert t.pending == 2


def test_shown_together_each_key_once_at_its_latest_lookup() -> None:
    t = DeferredTouches()
    t.add(keys("s", "a"), 2)
    t.add(keys("s", "b"), 2)
    assert shown(t.take_all()) == ["a", "b", "s"]


def test_random_lookups_and_writes_keep_the_invariants() -> None:
    """Each lookup's hits are shown once, whole, tail first, in the order the
    lookups came; never at a write that serves it (unless the bounds show
    it); and protected() is every waiting hit."""
    rng = random.Random(7)
    for _ in range(200):
        t = DeferredTouches(max_lookups=rng.randint(1, 6), max_keys=rng.randint(2, 20))
        looked: list[tuple[list[bytes], list[bytes]]] = []  # (hits, misses) by lookup
        out: list[bytes] = []
        waiting: list[int] = []
        for _ in range(60):
            op = rng.random()
            if op < 0.4:
                n = len(looked)
                hits = [b"h%d.%d" % (n, i) for i in range(rng.randint(1, 4))]
                misses = [b"M%d.%d" % (n, i) for i in range(rng.randint(0, 3))]
                looked.append((hits, misses))
                waiting.append(n)
                got = list(t.add(hits + misses, len(hits)) or ())
                out += got
                _drop_shown(waiting, looked, got)  # whole lookups, oldest first
            elif op < 0.9 and looked:
                n = rng.randrange(len(looked))
                missed = looked[n][1]
                key = rng.choice(missed) if missed else b"other"
                got = list(t.before_write(key, HELD) or ())
                out += got
                _drop_shown(waiting, looked, got)
                if missed:  # never shown at a write that serves it
                    assert not set(looked[n][0]) & set(got)
            else:
                got = list(t.take_all() or ())
                out += got
                _drop_shown(waiting, looked, got)
                assert not waiting
            expect = {k for n in waiting for k in looked[n][0]}
            assert set(t.protected()) == expect
            assert t.pending == sum(len(looked[n][0]) for n in waiting)
            if not t.queue:  # nothing of a lookup shown stays
                assert "missed=0" in repr(t)
        out += list(t.take_all() or ())
        assert out == [k for hits, _ in looked for k in reversed(hits)]
        assert "missed=0" in repr(t)


def _drop_shown(
    waiting: list[int], looked: list[tuple[list[bytes], list[bytes]]], got: list[bytes]
) -> None:
    """Take the lookups ``got`` shows off the head of ``waiting``: each is
    shown whole, tail first, in the order the lookups came."""
    at = 0
    while at < len(got):
        n = waiting.pop(0)
        hits = list(reversed(looked[n][0]))
        assert got[at : at + len(hits)] == hits
        at += len(hits)

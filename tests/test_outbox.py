"""The blocks a remote tier is owed (kvtier/core/outbox.py), alone: its
bound, its order, and that every entry leaves exactly once."""

from __future__ import annotations

import random

import pytest

from kvtier.core.outbox import Outbox, Owed


def keys(*names: str) -> list[bytes]:
    return [n.encode() for n in names]


def test_owed_blocks_leave_oldest_first_and_one_failed_keeps_its_place() -> None:
    box = Outbox(100)
    for key in keys("a", "b", "c"):
        assert box.owe(key, 10, None) == []
    first = box.take(2)
    assert [o.key for o in first] == keys("a", "b") and box.waiting == 1
    box.failed(first[0])  # a: still owed, first in line
    assert box.sent(first[1]) is first[1]  # b: gone
    assert [o.key for o in box.take(5)] == keys("a", "c")
    assert (len(box), box.bytes, box.sending) == (2, 20, 2)


def test_past_its_bound_the_oldest_waiting_are_given_up() -> None:
    box = Outbox(30)
    for key in keys("a", "b", "c"):
        box.owe(key, 10, None)
    (sending,) = box.take(1)  # a is being sent: it ends by sent() or failed()
    dropped = box.owe(b"d", 20, None)
    assert [o.key for o in dropped] == keys("b", "c")
    assert (b"a" in box, b"d" in box, box.bytes) == (True, True, 30)
    # Too large for the bound: the new entry itself is given up, nothing else.
    assert [o.key for o in box.owe(b"e", 31, None)] == [b"e"]
    assert box.bytes == 30 and b"e" not in box
    # Only the one being sent is left to drop: the new one does not fit.
    box.sent(sending)
    box.take(1)  # d now
    assert [o.key for o in box.owe(b"f", 15, None)] == [b"f"]


def test_a_key_owed_already_stays_as_it_is() -> None:
    box = Outbox(100)
    box.owe(b"a", 10, b"first")
    assert box.owe(b"a", 10, b"again") == []
    (owed,) = box.take(1)
    assert owed.value == b"first" and len(box) == 1


def test_forget_removes_even_one_being_sent_and_its_end_is_then_nothing() -> None:
    box = Outbox(100)
    box.owe(b"a", 10, None)
    box.owe(b"b", 10, None)
    (a,) = box.take(1)
    assert [o.key for o in box.forget(keys("a", "zz"))] == [b"a"]
    assert (box.sending, box.bytes) == (0, 10)
    assert box.sent(a) is None  # (it had left)
    box.failed(a)
    assert (box.sending, len(box)) == (0, 1)


def test_a_negative_bound_is_refused() -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        Outbox(-1)


def test_random_operations_keep_every_invariant_and_let_each_entry_go_once() -> None:
    """Random owes, takes, ends, forgets and clears against a plain model:
    the bytes are the sum, within the bound, the order is the order owed,
    and every entry handed back (dropped, sent, forgotten, cleared) is one
    that was accepted, handed back once."""
    rng = random.Random(64)
    box = Outbox(200)
    model: dict[bytes, int] = {}  # accepted and not handed back, in order
    out: list[Owed] = []  # taken, not ended
    handed: dict[int, Owed] = {}  # (kept alive: ids stay unique)

    def hand_back(gone: list[Owed]) -> None:
        for o in gone:
            assert id(o) not in handed and o.key in model
            handed[id(o)] = o
            del model[o.key]

    for _ in range(5000):
        op = rng.random()
        if op < 0.4:
            key = b"k%d" % rng.randrange(40)
            size = rng.randrange(1, 60)
            fresh = key not in model
            gone = box.owe(key, size, None)
            if fresh and key not in box:  # refused: the last one handed back
                assert gone[-1].key == key
                gone = gone[:-1]
            hand_back(gone)
            if fresh and key in box:
                model[key] = size
            assert fresh or gone == []
        elif op < 0.6:
            out += box.take(rng.randrange(4))
        elif op < 0.75 and out:
            o = out.pop(rng.randrange(len(out)))
            left = box.sent(o)
            if left is not None:
                hand_back([left])
        elif op < 0.85 and out:
            box.failed(out.pop(rng.randrange(len(out))))
        elif op < 0.97:
            hand_back(box.forget([b"k%d" % rng.randrange(40)]))
        else:
            hand_back(box.clear())
            out.clear()
        assert box.bytes == sum(model.values()) <= box.max_bytes
        assert len(box) == len(model) and all(k in box for k in model)
        assert box.sending == sum(1 for o in out if o.key in box and o.sending)
    assert [o.key for o in box.take(len(box))] == [
        k for k in model if k not in {o.key for o in out}
    ]

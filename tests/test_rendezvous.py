"""Rendezvous hashing: few keys move when the node set changes."""

from __future__ import annotations

import random

import pytest

from kvtier.tiers.rendezvous import owner, ranked, score

KEYS = [i.to_bytes(8, "little") + b"/block" for i in range(100_000)]


def nodes(n: int) -> list[bytes]:
    return [f"10.0.0.{i}:7070".encode() for i in range(1, n + 1)]


def owners(ns: list[bytes]) -> list[bytes | None]:
    return [owner(k, ns) for k in KEYS]


@pytest.mark.parametrize("n", [3, 8])
def test_removing_a_node_moves_only_its_keys(n: int) -> None:
    before = owners(nodes(n))
    gone = nodes(n)[1]
    after = owners([x for x in nodes(n) if x != gone])
    for key, b, a in zip(KEYS, before, after, strict=True):
        if b != gone:
            assert a == b
        else:  # its keys go to their next-ranked node
            assert a == ranked(key, nodes(n))[1]
    moved = sum(b != a for b, a in zip(before, after, strict=True))
    assert moved == before.count(gone)


@pytest.mark.parametrize("n", [3, 8])
def test_adding_a_node_moves_about_one_in_n_plus_one(n: int) -> None:
    before = owners(nodes(n))
    after = owners(nodes(n + 1))
    new = nodes(n + 1)[-1]
    moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    assert all(a == new for _, a in moved)  # keys move only to the newcomer
    share = len(moved) / len(KEYS)
    assert abs(share - 1 / (n + 1)) < 0.01, share


def test_keys_spread_evenly() -> None:
    ns = nodes(5)
    counts = {n: 0 for n in ns}
    for o in owners(ns):
        assert o is not None
        counts[o] += 1
    for c in counts.values():
        assert abs(c / len(KEYS) - 0.2) < 0.01


def test_the_answer_ignores_node_order() -> None:
    ns = nodes(6)
    shuffled = ns[:]
    random.Random(7).shuffle(shuffled)
    sample = KEYS[:2000]
    assert [owner(k, ns) for k in sample] == [owner(k, shuffled) for k in sample]
    assert all(ranked(k, ns) == ranked(k, shuffled) for k in sample[:200])


def test_no_nodes_no_owner() -> None:
    assert owner(b"k", []) is None
    assert ranked(b"k", []) == []


def test_scores_differ_per_node_and_key() -> None:
    assert score(b"a:1", b"k") != score(b"b:1", b"k")
    assert score(b"a:1", b"k") != score(b"a:1", b"j")
    assert ranked(b"k", nodes(4))[0] == owner(b"k", nodes(4))

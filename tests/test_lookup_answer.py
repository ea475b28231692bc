from __future__ import annotations

import pytest

from kvtier.core.lookup import leading_hits, prefix_answer, sliding_window_hits
from kvtier.model import HIT, MISS, PENDING, RETRY


@pytest.mark.parametrize(
    ("states", "expected"),
    [
        ([], (0, False)),
        ([HIT, HIT, HIT], (3, False)),
        ([HIT, MISS, HIT], (1, False)),
        ([HIT, PENDING, HIT], (1, True)),
        ([HIT, RETRY], (1, True)),
        ([MISS, PENDING], (0, False)),
    ],
)
def test_prefix_answer(states: list[int], expected: tuple[int, bool]) -> None:
    assert prefix_answer(states) == expected


def test_leading_hits() -> None:
    assert leading_hits([HIT, HIT, MISS, HIT]) == 2


@pytest.mark.parametrize(
    ("states", "window", "expected"),
    [
        ([HIT] * 6, 2, 6),
        ([MISS, HIT, HIT, MISS, HIT, HIT, HIT, MISS], 2, 7),
        ([MISS, HIT, HIT, MISS, HIT, MISS], 2, 3),
        ([HIT, MISS, HIT, MISS], 2, 1),  # no full window: the leading run
        ([MISS, HIT, MISS], 2, 0),
        ([HIT, HIT, MISS], 0, 2),
    ],
)
def test_sliding_window(states: list[int], window: int, expected: int) -> None:
    assert sliding_window_hits(states, window) == expected


def test_sliding_window_defers_only_when_pending_could_extend() -> None:
    assert prefix_answer([HIT, HIT, PENDING, HIT], window=2) == (2, True)
    assert prefix_answer([HIT, HIT, MISS, PENDING], window=2) == (2, False)

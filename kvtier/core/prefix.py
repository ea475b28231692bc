"""How long a prefix of a key chain can be loaded. Pure; imports only the shared records.

States are the plain ints of :mod:`kvtier.model`: 0 MISS, 1 HIT, 2 PENDING, 3 RETRY.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.model import HIT, PENDING, RETRY

_HIT_BYTE = bytes([HIT])


def leading_hits(states: Sequence[int]) -> int:
    """Length of the leading run of HIT."""
    if isinstance(states, bytes | bytearray):
        return len(states) - len(states.lstrip(_HIT_BYTE))  # at C speed
    for i, state in enumerate(states):
        if state != HIT:
            return i
    return len(states)


def sliding_window_hits(states: Sequence[int], window: int) -> int:
    """Longest prefix whose last ``window`` blocks all hit.

    Scans from the end for the rightmost run of ``window`` consecutive hits;
    without one, falls back to the leading run of hits (shorter than the
    window), as vLLM's sliding-window lookup does. ``window <= 0`` means the
    whole prefix must hit (plain prefix mode).
    """
    if window <= 0:
        return leading_hits(states)
    run = 0
    for idx in range(len(states) - 1, -1, -1):
        if states[idx] == HIT:
            run += 1
            if run == window:
                return idx + window
        else:
            run = 0
    return run


def _optimistic(states: Sequence[int]) -> list[int]:
    return [HIT if s in (PENDING, RETRY) else s for s in states]


def prefix_answer(states: Sequence[int], window: int = 0) -> tuple[int, bool]:
    """(usable prefix length, defer).

    ``defer`` is True when PENDING or RETRY keys could lengthen the answer
    once they settle: the engine should ask again next step rather than
    recompute what is about to become loadable.
    """
    if window > 0:
        hits = sliding_window_hits(states, window)
        return hits, sliding_window_hits(_optimistic(states), window) > hits
    hits = leading_hits(states)
    return hits, hits < len(states) and states[hits] in (PENDING, RETRY)

"""Hedged reads: when to ask a block's next holder too, and how often. Pure.

A read from a peer or S3 that has not answered after its source's usual
time (its p95 over its recent reads, or ``hedge_after`` when set) asks
another holder too; the first to deliver wins and the other is cancelled
(:class:`~kvtier.tiers.hedger.Hedger`, the acting half, races them).
Hedges cost load on the fleet, so they are rationed: :class:`HedgeBudget`
is a token bucket that earns ``ratio`` of a token per read and spends one
per hedge, so hedges stay at most ``ratio`` of reads plus a small burst.
:class:`LatencyWindow` keeps a peer's recent load times for its p95.

Invariants: a budget never holds more than its burst, nor spends a token
it does not have; hedges taken over any run of reads are at most
``ratio`` times the reads plus the burst; a window holds at most its size
of the most recent observations, and its p95 is None until it has a few.
Imports nothing of kvtier.
"""

from __future__ import annotations

import enum
from collections import deque

#: observations a window keeps, and the fewest it needs to estimate a p95
WINDOW = 64
MIN_SAMPLES = 8


class HedgeOutcome(enum.Enum):
    """How a hedged read ended (the metrics label)."""

    WON = "won"  # the hedge delivered first
    LOST = "lost"  # the first request delivered first; the hedge was cancelled
    SKIPPED = "skipped"  # a hedge was due but the budget had no token (or no other holder)


class HedgeBudget:
    """Tokens for hedges: ``ratio`` earned per read, one spent per hedge."""

    def __init__(self, ratio: float, burst: float = 10.0) -> None:
        if not 0 <= ratio <= 1:
            raise ValueError(f"a hedge ratio is between 0 and 1, not {ratio}")
        self.ratio = ratio
        self.burst = burst
        self.tokens = min(burst, 1.0) if ratio > 0 else 0.0

    def __repr__(self) -> str:
        return f"<HedgeBudget ratio={self.ratio} tokens={self.tokens:.2f}/{self.burst}>"

    def earn(self, reads: int = 1) -> None:
        """``reads`` remote reads were made."""
        self.tokens = min(self.burst, self.tokens + self.ratio * reads)

    def spend(self) -> bool:
        """Take one token for a hedge; False (nothing taken) without one."""
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


class LatencyWindow:
    """A source's most recent read times, for its p95."""

    def __init__(self, size: int = WINDOW) -> None:
        self._seconds: deque[float] = deque(maxlen=size)

    def __repr__(self) -> str:
        p95 = self.p95()
        return f"<LatencyWindow n={len(self._seconds)} p95={p95 if p95 is None else f'{p95:.4f}'}>"

    def observe(self, seconds: float) -> None:
        if seconds >= 0:
            self._seconds.append(seconds)

    def p95(self) -> float | None:
        if len(self._seconds) < MIN_SAMPLES:
            return None
        ordered = sorted(self._seconds)
        return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


def hedge_delay(configured: float | None, p95: float | None, floor: float) -> float | None:
    """Seconds to wait before hedging: ``configured`` when set, else the
    source's p95, never under ``floor``; None (no hedge) while neither is known."""
    if configured is not None:
        return max(configured, 0.0)
    return None if p95 is None else max(floor, p95)

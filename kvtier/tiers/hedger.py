"""Hedged reads, the acting half: race a slow read against a second one
(:mod:`kvtier.tiers.hedging` is the pure half: when, and how often).

A :class:`Hedger` belongs to one tier whose reads it may hedge. It keeps
that tier's recent read times by source (a peer's address, the tier
itself) for their p95, the hedge budget, and the hedges' counts by
outcome. :meth:`Hedger.race` waits for a read up to the hedge delay; past
it, when a second holder exists and the budget has a token, it starts the
second read and returns the first answer that delivers, cancelling the
other. Three readers use it: the peer tier (the next owner), the S3 tier
(the same object asked again: a second request usually reaches another
server) and the core's promotions (a lower remote tier that may hold the
block too, :meth:`~kvtier.core.loads.Loads.promote`).

Invariants: at most one hedge per race; an answer that does not deliver
(a miss, an error) never wins while the other read may still deliver; the
loser is cancelled, and both reads are when the race itself is; a race in
which neither read delivers returns the first read's answer or raises its
error; every hedge that was due is counted once, by outcome.
Imports the tiers' pure hedging module and the counters.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from kvtier.counters import Counts
from kvtier.tiers.hedging import HedgeBudget, HedgeOutcome, LatencyWindow, hedge_delay

T = TypeVar("T")

#: a hedge is never sent sooner than this after its read
HEDGE_FLOOR = 0.001


def present(value: object) -> bool:
    """A block read delivers when it found the block (None: a miss)."""
    return value is not None


class Hedger:
    """One tier's hedged reads: its read times by source, budget and counts."""

    def __init__(self, after: float | None, max_ratio: float) -> None:
        #: seconds before a read not answered yet is hedged (None: the
        #: source's p95 over its recent reads)
        self.after = after
        #: hedges are at most this share of reads (plus a small burst)
        self.budget = HedgeBudget(max_ratio)
        #: hedges that were due, by outcome (won, lost, skipped)
        self.counts = Counts("outcome")
        self._windows: dict[str, LatencyWindow] = {}

    def __repr__(self) -> str:
        return (
            f"<Hedger after={self.after} {self.budget!r} sources={len(self._windows)} "
            f"hedges={self.counts.total():g}>"
        )

    def delay(self, source: str) -> float | None:
        """Seconds a read from ``source`` may take before it is hedged (None:
        it is not, while its p95 is unknown and no ``after`` is set)."""
        window = self._windows.get(source)
        p95 = window.p95() if window is not None else None
        return hedge_delay(self.after, p95, HEDGE_FLOOR)

    async def timed(self, source: str, read: Awaitable[T]) -> T:
        """``read``'s answer, its time kept for ``source``'s p95 (a read that
        fails or is cancelled teaches nothing)."""
        started = time.perf_counter()
        answer = await read
        window = self._windows.get(source)
        if window is None:
            window = self._windows[source] = LatencyWindow()
        window.observe(time.perf_counter() - started)
        return answer

    def outcomes(self) -> dict[str, int]:
        return {o.value: int(self.counts.value(o.value)) for o in HedgeOutcome}

    async def race(
        self,
        first: Awaitable[T],
        second: Callable[[], Awaitable[T]] | None,
        delay: float | None,
        delivers: Callable[[T], bool],
    ) -> tuple[T, bool]:
        """The answer of ``first``, or of ``second()`` (started after
        ``delay`` if ``first`` has not answered, when ``second`` and ``delay``
        are given and the budget allows), whichever delivers first; and
        whether the hedge won."""
        if second is None or delay is None:
            return await first, False
        primary: asyncio.Future[T] = asyncio.ensure_future(first)
        hedge: asyncio.Future[T] | None = None
        try:
            done, _ = await asyncio.wait({primary}, timeout=delay)
            if done:
                return await primary, False
            if not self.budget.spend():
                self.counts.inc(HedgeOutcome.SKIPPED.value)
                return await primary, False
            hedge = asyncio.ensure_future(second())
            racing: set[asyncio.Future[T]] = {primary, hedge}
            while racing:
                done, racing = await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
                for read in (primary, hedge):
                    if (
                        read in done
                        and not read.cancelled()
                        and read.exception() is None
                        and delivers(read.result())
                    ):
                        won = read is hedge
                        self.counts.inc((HedgeOutcome.WON if won else HedgeOutcome.LOST).value)
                        return read.result(), won
            self.counts.inc(HedgeOutcome.LOST.value)  # neither delivered
            return await primary, False
        finally:
            for left in (primary, hedge):
                if left is not None and not left.done():
                    left.cancel()

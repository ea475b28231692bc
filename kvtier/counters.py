"""Plain counters and histograms that their owners bump and metrics reads.

The core, the tiers and the server count into these (an attribute add, no
lock, no Prometheus); ``kvtier.metrics`` turns them into series at scrape
time. Pure: imports nothing of kvtier.

Invariants: a count only grows; a histogram's bucket counts add up to its
``count``; label values are bound once per child (:meth:`Counts.bind`) so
the hot path does one attribute add.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator


class Cell:
    """One labelled child of :class:`Counts`."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def __repr__(self) -> str:
        return f"<Cell {self.value:g}>"

    def inc(self, n: float = 1) -> None:
        self.value += n


class Counts:
    """Monotonic counts by label values (no labels: one child, ``()``)."""

    __slots__ = ("_cells", "labels")

    def __init__(self, *labels: str) -> None:
        self.labels = labels
        self._cells: dict[tuple[str, ...], Cell] = {}

    def __repr__(self) -> str:
        return f"<Counts {self.labels} children={len(self._cells)} total={self.total():g}>"

    def bind(self, *values: str) -> Cell:
        if len(values) != len(self.labels):
            raise ValueError(f"expected labels {self.labels}, got {values}")
        cell = self._cells.get(values)
        if cell is None:
            cell = self._cells[values] = Cell()
        return cell

    def inc(self, *values: str, n: float = 1) -> None:
        self.bind(*values).value += n

    def value(self, *values: str) -> float:
        cell = self._cells.get(values)
        return cell.value if cell is not None else 0.0

    def total(self) -> float:
        return sum(c.value for c in self._cells.values())

    def samples(self) -> Iterator[tuple[tuple[str, ...], float]]:
        for values, cell in self._cells.items():
            yield values, cell.value


class HistogramCell:
    """Observations bucketed by upper bound (``le``); the last bucket is +Inf."""

    __slots__ = ("bounds", "buckets", "count", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.buckets = [0] * (len(bounds) + 1)
        self.count = 0
        self.sum = 0.0

    def __repr__(self) -> str:
        return f"<HistogramCell count={self.count} sum={self.sum:g}>"

    def observe(self, value: float) -> None:
        self.buckets[bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value

    def cumulative(self) -> list[tuple[float, int]]:
        """``(le, cumulative count)`` pairs, ending with ``inf``."""
        out: list[tuple[float, int]] = []
        running = 0
        for bound, n in zip((*self.bounds, float("inf")), self.buckets, strict=True):
            running += n
            out.append((float(bound), running))
        return out


class Histograms:
    """Histograms by label values, all with the same bucket bounds."""

    __slots__ = ("_cells", "bounds", "labels")

    def __init__(self, bounds: tuple[float, ...], *labels: str) -> None:
        if list(bounds) != sorted(bounds):
            raise ValueError("bucket bounds must be sorted")
        self.bounds = bounds
        self.labels = labels
        self._cells: dict[tuple[str, ...], HistogramCell] = {}

    def __repr__(self) -> str:
        return f"<Histograms {self.labels} children={len(self._cells)}>"

    def bind(self, *values: str) -> HistogramCell:
        if len(values) != len(self.labels):
            raise ValueError(f"expected labels {self.labels}, got {values}")
        cell = self._cells.get(values)
        if cell is None:
            cell = self._cells[values] = HistogramCell(self.bounds)
        return cell

    def observe(self, value: float, *values: str) -> None:
        self.bind(*values).observe(value)

    def samples(self) -> Iterator[tuple[tuple[str, ...], HistogramCell]]:
        yield from self._cells.items()


#: request and backend latencies, seconds
LATENCY_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)

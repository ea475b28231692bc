"""What a load costs from each source, and how much of a lookup a budget buys. Pure.

A cache hit is worth taking only if loading it beats computing it again.
:class:`Costs` keeps, per source (``ram``, ``disk``, each remote tier by
name), a moving estimate of its time to first byte and its throughput,
learnt from the loads the daemon does (:meth:`Costs.observe`) and from
priors before the first; the loads in flight on a source (a new load
queues behind them) are the caller's count. :func:`budget_cut` reads them
to decide, without any I/O, how long a prefix of a lookup's hits the
engine should load given its budget (the seconds it would spend
recomputing those blocks): the keys past the cut answer MISS, so the
engine loads the head and recomputes the tail.

The model: each source's blocks up to a key cost its time to first byte
once (not where the lookup's own keys are loading already: their first
byte is on its way), plus their bytes and the blocks in flight on it
ahead of them (each of the source's mean size; a lookup's own keys
loading are not ahead of themselves) at its throughput; the sources' costs add up (a
conservative bound: loads from two sources may overlap). Loading the
first ``p`` keys saves the engine their share of the budget (``p`` times
budget over keys) less that load time; the cut is the ``p`` that saves
the most (0 when none saves anything). A load's time splits into the two
estimates by size: a small load (at most ``SMALL_LOAD`` bytes) is mostly
its time to first byte; a larger one's bytes over the time past its time
to first byte, times the loads that shared the source meanwhile, is its
throughput: what the source moves a second in all, so that loads queued
on it drain at that rate. Estimates are exponentially weighted (``ALPHA``
per load).

Invariants: estimates stay positive and finite whatever is observed; a
lookup without a budget is never cut; the cut is monotone (a larger budget
never cuts earlier); keys that would not load cost nothing. Imports
nothing of kvtier.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

#: weight of each new observation in the moving estimates
ALPHA = 0.2
#: a load this small measures mostly its time to first byte
SMALL_LOAD = 64 * 1024
#: bounds on what an estimate may become (a clock's glitch is not a cost)
_MIN_SECONDS, _MAX_SECONDS = 1e-7, 60.0
_MIN_RATE, _MAX_RATE = 1e5, 1e12


@dataclass(slots=True)
class Estimate:
    """One source's cost: seconds to its first byte, then bytes a second."""

    ttfb: float
    throughput: float
    #: loads observed (0: the prior still stands)
    loads: int = 0
    #: mean bytes of a block loaded from it (for blocks whose size is unknown)
    block_bytes: float = 1 << 20

    def seconds(self, nbytes: float, queued: int = 0, *, first_byte: bool = True) -> float:
        """A load of ``nbytes`` started now, behind ``queued`` loads in flight
        (``first_byte``: it waits its first byte; not one under way)."""
        wait = self.ttfb if first_byte else 0.0
        return wait + (nbytes + queued * self.block_bytes) / self.throughput


#: priors before any load is observed: local memory, a local disk (NVMe's
#: order), a peer on the same network, an object store
PRIORS: Mapping[str, Estimate] = {
    "ram": Estimate(ttfb=20e-6, throughput=5e9),
    "disk": Estimate(ttfb=150e-6, throughput=1.5e9),
    "peers": Estimate(ttfb=1e-3, throughput=1e9),
}
#: the prior of any other remote tier (an object store)
REMOTE_PRIOR = Estimate(ttfb=30e-3, throughput=200e6)


@dataclass
class Costs:
    """Every source's estimate (a source unseen so far starts from its prior)."""

    sources: dict[str, Estimate] = field(default_factory=dict)

    def __repr__(self) -> str:
        shown = ", ".join(
            f"{n}={e.ttfb * 1e3:.2f}ms/{e.throughput / 1e9:.2f}GB/s"
            for n, e in self.sources.items()
        )
        return f"<Costs {shown}>"

    def of(self, source: str) -> Estimate:
        est = self.sources.get(source)
        if est is None:
            prior = PRIORS.get(source, REMOTE_PRIOR)
            est = self.sources[source] = Estimate(prior.ttfb, prior.throughput)
        return est

    def observe(
        self, source: str, seconds: float, nbytes: int, blocks: int = 1, sharing: float = 1.0
    ) -> None:
        """A load of ``blocks`` blocks, ``nbytes`` in all, took ``seconds``,
        ``sharing`` the source with that many loads in flight on average
        (itself included, :class:`Occupancy`): the source moved about
        ``sharing`` times its bytes meanwhile."""
        if not math.isfinite(seconds) or seconds <= 0 or nbytes <= 0:
            return  # (a load that failed or found nothing teaches nothing)
        est = self.sources.get(source) or self.of(source)
        est.loads += 1
        if blocks > 0 and nbytes > 0:
            est.block_bytes += ALPHA * (nbytes / blocks - est.block_bytes)
        if nbytes <= SMALL_LOAD:
            ttfb = min(max(seconds, _MIN_SECONDS), _MAX_SECONDS)
            est.ttfb += ALPHA * (ttfb - est.ttfb)
            return
        transfer = max(seconds - est.ttfb, seconds / 10)  # (a time to first byte overestimated)
        rate = min(max(nbytes * max(sharing, 1.0) / transfer, _MIN_RATE), _MAX_RATE)
        est.throughput += ALPHA * (rate - est.throughput)

    def round_trip(self, source: str, seconds: float) -> None:
        """A request to ``source`` that moved no block (an existence probe)
        answered in ``seconds``: its time to first byte, at most."""
        if not math.isfinite(seconds) or seconds <= 0:
            return
        est = self.sources.get(source) or self.of(source)
        ttfb = min(max(seconds, _MIN_SECONDS), _MAX_SECONDS)
        est.ttfb += ALPHA * (ttfb - est.ttfb)


class Occupancy:
    """Loads in flight per source, and how many shared each load's time on
    average (what :meth:`Costs.observe` calls ``sharing``): the count's
    integral over time, read at a load's start and end.

    Invariants: ``inflight[s]`` is the loads begun and not ended on ``s``;
    a load's sharing is at least 1 (itself) and the mean of the count while
    it ran."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        #: loads in flight per source (a new load queues behind them)
        self.inflight: dict[str, int] = {}
        self._area: dict[str, float] = {}
        self._since: dict[str, float] = {}

    def __repr__(self) -> str:
        return f"<Occupancy {self.inflight}>"

    def begin(self, source: str) -> tuple[float, float]:
        """A load on ``source`` begins: its mark, for :meth:`end`."""
        now, n = self.clock(), self.inflight.get(source, 0)
        area = self._area.get(source, 0.0) + n * (now - self._since.get(source, now))
        self._area[source], self._since[source], self.inflight[source] = area, now, n + 1
        return now, area

    def end(self, source: str, mark: tuple[float, float]) -> tuple[float, float]:
        """The load of ``mark`` ended: its seconds, and the mean loads in
        flight on ``source`` while it ran (itself included)."""
        now, n = self.clock(), self.inflight[source]
        area = self._area[source] + n * (now - self._since[source])
        self._area[source], self._since[source], self.inflight[source] = area, now, n - 1
        began, before = mark
        seconds = now - began
        return seconds, (area - before) / seconds if seconds > 0 else 1.0


def budget_cut(
    sources: Sequence[str | None],
    sizes: Sequence[int],
    costs: Costs,
    budget: float,
    inflight: Mapping[str, int] | None = None,
    loading: Mapping[str, int] | None = None,
) -> int:
    """How many of a lookup's keys, in order, the engine should load: the
    prefix that saves it the most time, where recomputing costs ``budget``
    over all the keys (each key its share) and loading costs what
    :class:`Costs` expects. ``sources[i]`` is where key ``i`` would load from
    (None: it would not load: it costs nothing to load, and recomputing it
    is the engine's either way), ``sizes[i]`` its bytes (0: unknown, the
    source's mean block); ``inflight``: loads in flight per source, which a
    new one waits behind; ``loading``: how many of those are the keys' own
    (not ahead of themselves, and past their first byte's wait). Returns
    ``len(sources)`` when ``budget`` is 0 (none set), 0 when no prefix
    beats recomputing."""
    n = len(sources)
    if budget <= 0 or n == 0:
        return n
    per_key = budget / n
    best, best_saved = 0, 0.0
    for i, load in enumerate(load_seconds(sources, sizes, costs, inflight, loading)):
        saved = (i + 1) * per_key - load
        if saved > best_saved:
            best, best_saved = i + 1, saved
    return best


def load_seconds(
    sources: Sequence[str | None],
    sizes: Sequence[int],
    costs: Costs,
    inflight: Mapping[str, int] | None = None,
    loading: Mapping[str, int] | None = None,
) -> list[float]:
    """Per key, the seconds to load it and every key before it (the model
    above; a key with no source adds nothing)."""
    spent: dict[str, float] = {}  # per source: bytes so far
    load = 0.0
    out: list[float] = []
    for i, source in enumerate(sources):
        if source is not None:
            est = costs.of(source)
            size = sizes[i] or est.block_bytes
            before = spent.get(source)
            if before is None:
                spent[source] = size
                own = loading.get(source, 0) if loading else 0
                queued = max(0, (inflight.get(source, 0) if inflight else 0) - own)
                # its first byte (unless its loads are under way), the queue, its bytes
                load += est.seconds(size, queued, first_byte=not own)
            else:
                spent[source] = before + size
                load += size / est.throughput
        out.append(load)
    return out

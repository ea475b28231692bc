"""The remote tiers' existence probes in motion: the acting half of
:mod:`kvtier.core.probes`.

:mod:`kvtier.core.probes` decides (a probe in flight per key and tier, the
verdicts kept); :class:`RemoteProbes` acts: it queues each probe on the
scheduler, sends each tick's keys of a tier in one ``batch_lookup`` and
resolves every probe by its deadline. Imports the pure map, the scheduler,
the tiers' interface and the counters; the service owns one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.core.costs import Costs
from kvtier.core.counts import CoreCounters, ProbeFailure, ProbeUse
from kvtier.core.lookup import Locator
from kvtier.core.probes import Probe, ProbeMap, Verdict
from kvtier.core.timers import Scheduler
from kvtier.errors import TierError
from kvtier.tiers.base import Tier

log = logging.getLogger("kvtier.service")


class RemoteSlot:
    """A remote tier, its probe map and its probe counters (bound once)."""

    def __init__(self, index: int, tier: Tier, probes: ProbeMap, counters: CoreCounters) -> None:
        self.index = index
        self.tier = tier
        self.probes = probes
        self.name = tier.name
        self.started = counters.probes.bind(tier.name, ProbeUse.STARTED.value)
        self.joined = counters.probes.bind(tier.name, ProbeUse.JOINED.value)
        self.cached = counters.probes.bind(tier.name, ProbeUse.CACHED.value)
        self.verdicts = {v: counters.probe_verdicts.bind(tier.name, v.value) for v in Verdict}
        self.batch_size = counters.probe_batch_size.bind(tier.name)
        #: the remote tiers after this one, in order: where a slow load from
        #: this one may be hedged (a block can be in several)
        self.lower: Sequence[RemoteSlot] = ()

    def __repr__(self) -> str:
        return f"<RemoteSlot {self.name} {self.probes!r}>"


@dataclass(frozen=True, slots=True)
class Reach:
    """What a request may look at and start work on: a locator, and the
    remote tiers it may probe and load from. A peer's request reaches the
    local tiers only (no remote tier, a locator without probe maps), so
    nothing a peer asks is forwarded."""

    locator: Locator
    remotes: Sequence[RemoteSlot]


class RemoteProbes:
    """The remote tiers' existence probes in motion: begin, batch, run, resolve;
    the acting half of :class:`~kvtier.core.probes.ProbeMap`.

    A probe begins as a future in its tier's map plus a key queued on the
    scheduler, which flushes each tick's keys into one ``batch_lookup`` task
    per tier. Invariants (the first seed lesson):

    * callers wait on a probe's future, never on its task, so a caller going
      away cannot cancel it;
    * the task resolves every probe it covered in ``finally``, whatever the
      backend did (raised, hung past ``probe_timeout``, answered short);
    * a result for a probe superseded meanwhile is dropped and counted;
    * the deadline resolves a probe even when the backend call ignores
      cancellation; at most ``len(keys) + 1`` answers are read, and only
      booleans count as answers (anything else fails the batch as bad_result).

    A PRESENT verdict is handed to ``on_present`` (the service decides
    whether to promote).
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        verdict_ttl: float,
        error_ttl: float,
        max_verdicts: int,
        probe_timeout: float,
        scheduler: Scheduler,
        counters: CoreCounters,
        task: Callable[[Coroutine[Any, Any, None]], object],
        on_present: Callable[[RemoteSlot, bytes, float], None],
        costs: Costs,
    ) -> None:
        self.slots = [
            RemoteSlot(
                i,
                tier,
                ProbeMap(
                    tier.name,
                    verdict_ttl=verdict_ttl,
                    error_ttl=error_ttl,
                    max_verdicts=max_verdicts,
                ),
                counters,
            )
            for i, tier in enumerate(tiers)
        ]
        for i, slot in enumerate(self.slots):
            slot.lower = self.slots[i + 1 :]
        self._timeout = probe_timeout
        self._scheduler = scheduler
        self._counters = counters
        self._task = task
        #: a probe's round trip teaches its tier's time to first byte
        self._costs = costs
        self._on_present = on_present
        for slot in self.slots:
            scheduler.add_prober(slot.name, self._dispatcher(slot))

    def __repr__(self) -> str:
        return f"<RemoteProbes {self.slots!r}>"

    def begin(self, slot: RemoteSlot, key: bytes) -> Probe:
        probe = slot.probes.begin(key, asyncio.get_running_loop())
        slot.started.value += 1
        self._scheduler.enqueue_probe(slot.name, probe)
        return probe

    def invalidate(self, key: bytes) -> None:
        """``key`` changed here: no remote tier's kept verdict answers for it now."""
        for slot in self.slots:
            slot.probes.invalidate(key)

    def invalidate_many(self, keys: Sequence[bytes]) -> None:
        """:meth:`invalidate` of each key (a tier's index changed by many)."""
        for slot in self.slots:
            invalidate = slot.probes.invalidate
            for key in keys:
                invalidate(key)

    def expire(self, now: float) -> None:
        for slot in self.slots:
            slot.probes.expire(now)

    def abandon_all(self) -> None:
        for slot in self.slots:
            slot.probes.abandon_all()

    def _dispatcher(self, slot: RemoteSlot) -> Callable[[list[Probe]], None]:
        def dispatch(probes: list[Probe]) -> None:
            # Every probe queued runs, superseded ones too (their key changed
            # here meanwhile): lookups wait on each, and a superseded probe
            # resolves its own future, caching nothing (ProbeMap).
            slot.batch_size.observe(len(probes))
            self._task(self._run(slot, probes))

        return dispatch

    async def _run(self, slot: RemoteSlot, probes: list[Probe]) -> None:
        """One ``batch_lookup`` for ``probes``; every probe is resolved by its deadline.

        ``asyncio.timeout`` ends a backend call that honours cancellation; a
        scheduler timer at the same deadline resolves the probes of one that
        does not (its answer, if it ever comes, is dropped and counted late).
        """
        keys = [p.key for p in probes]
        batch = _ProbeBatch(slot, probes)
        deadline = self._scheduler.now() + self._timeout
        backstop = self._scheduler.call_at(deadline, lambda: self._expire(batch))
        verdicts: list[Verdict] | None = None
        failure = ProbeFailure.ERROR
        began = time.perf_counter()
        try:
            async with asyncio.timeout(self._timeout):
                answers = await slot.tier.batch_lookup(keys)
                # At most one answer too many is read: an endless iterable ends here.
                found = list(itertools.islice(answers, len(keys) + 1))
            if len(found) != len(keys) or not all(type(a) is bool for a in found):
                failure = ProbeFailure.BAD_RESULT
                raise TierError(
                    f"{slot.name}: batch_lookup answered {len(found)} result(s) for "
                    f"{len(keys)} key(s), or not all of them booleans"
                )
            verdicts = [Verdict.PRESENT if f else Verdict.ABSENT for f in found]
            self._costs.round_trip(slot.name, time.perf_counter() - began)
        except TimeoutError:
            failure = ProbeFailure.TIMEOUT
            log.warning(
                "%s: probe of %d key(s) timed out after %.3fs", slot.name, len(keys), self._timeout
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("%s: probe of %d key(s) failed: %s", slot.name, len(keys), exc)
        finally:
            self._scheduler.cancel(backstop)
            if batch.resolved and verdicts is not None:
                self._counters.probe_late.inc(slot.name, n=len(keys))
            self._resolve(batch, verdicts, failure)

    def _expire(self, batch: _ProbeBatch) -> None:
        if not batch.resolved:
            log.warning(
                "%s: probe of %d key(s) still unanswered after %.3fs; resolved as timed out",
                batch.slot.name,
                len(batch.probes),
                self._timeout,
            )
            self._resolve(batch, None, ProbeFailure.TIMEOUT)

    def _resolve(
        self, batch: _ProbeBatch, verdicts: list[Verdict] | None, failure: ProbeFailure
    ) -> None:
        """Resolve every probe of ``batch`` once: with ``verdicts``, or as errors."""
        if batch.resolved:
            return
        batch.resolved = True
        slot, counters = batch.slot, self._counters
        now = self._scheduler.now()
        if verdicts is None:
            counters.probe_failures.inc(slot.name, failure.value, n=len(batch.probes))
        for i, probe in enumerate(batch.probes):
            verdict = verdicts[i] if verdicts is not None else Verdict.ERROR
            owned = slot.probes.complete(probe, verdict, now)
            slot.verdicts[verdict].value += 1
            if not owned:
                counters.probe_superseded.inc(slot.name)
            elif verdict is Verdict.PRESENT:
                self._on_present(slot, probe.key, now)


class _ProbeBatch:
    """One batch_lookup call's probes; resolved once, by the answer or the deadline."""

    __slots__ = ("probes", "resolved", "slot")

    def __init__(self, slot: RemoteSlot, probes: list[Probe]) -> None:
        self.slot = slot
        self.probes = probes
        self.resolved = False

"""The remote tiers' existence probes: begin, batch, run, resolve.

One :class:`RemoteSlot` per remote tier holds its probe map. A probe begins
as a future in the map plus a key queued on the scheduler, which flushes
each tick's keys into one ``batch_lookup`` task per tier. Invariants (the
first seed lesson):

* callers wait on a probe's future, never on its task, so a caller going
  away cannot cancel it;
* the task resolves every probe it covered in ``finally``, whatever the
  backend did (raised, hung past ``probe_timeout``, answered short);
* a result for a probe superseded meanwhile is dropped and counted.

A PRESENT verdict is handed to ``on_present`` (the service decides whether
to promote). Imports the core's pure maps, the tiers' interface and the
counters.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from kvtier.core.counts import CoreCounters, ProbeFailure, ProbeUse
from kvtier.core.probes import Probe, ProbeMap, Verdict
from kvtier.core.scheduler import Scheduler
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

    def __repr__(self) -> str:
        return f"<RemoteSlot {self.name} {self.probes!r}>"


class RemoteProbes:
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
        self._timeout = probe_timeout
        self._scheduler = scheduler
        self._counters = counters
        self._task = task
        self._on_present = on_present
        for slot in self.slots:
            scheduler.add_prober(slot.name, self._dispatcher(slot))

    def __repr__(self) -> str:
        return f"<RemoteProbes {self.slots!r}>"

    def begin(self, slot: RemoteSlot, key: bytes) -> Probe:
        probe = slot.probes.begin(key, asyncio.get_running_loop())
        slot.started.value += 1
        self._scheduler.enqueue_probe(slot.name, key)
        return probe

    def invalidate(self, key: bytes) -> None:
        for slot in self.slots:
            slot.probes.invalidate(key)

    def expire(self, now: float) -> None:
        for slot in self.slots:
            slot.probes.expire(now)

    def abandon_all(self) -> None:
        for slot in self.slots:
            slot.probes.abandon_all()

    def _dispatcher(self, slot: RemoteSlot) -> Callable[[list[bytes]], None]:
        def dispatch(keys: list[bytes]) -> None:
            probes = [p for p in (slot.probes.inflight(k) for k in keys) if p is not None]
            if not probes:
                return  # every key was invalidated before its batch left
            self._counters.probe_batch_size.observe(len(probes), slot.name)
            self._task(self._run(slot, probes))

        return dispatch

    async def _run(self, slot: RemoteSlot, probes: list[Probe]) -> None:
        """One ``batch_lookup`` for ``probes``; every probe is resolved, whatever happens."""
        keys = [p.key for p in probes]
        verdicts: list[Verdict] | None = None
        failure = ProbeFailure.ERROR
        try:
            async with asyncio.timeout(self._timeout):
                answers = await slot.tier.batch_lookup(keys)
                found = [bool(a) for a in answers]  # an iterable may fail mid-way
            if len(found) != len(keys):
                failure = ProbeFailure.BAD_RESULT
                raise TierError(
                    f"{slot.name}: batch_lookup returned {len(found)} results for {len(keys)} keys"
                )
            verdicts = [Verdict.PRESENT if f else Verdict.ABSENT for f in found]
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
            now = self._scheduler.now()
            counters = self._counters
            if verdicts is None:
                counters.probe_failures.inc(slot.name, failure.value, n=len(keys))
            for i, probe in enumerate(probes):
                verdict = verdicts[i] if verdicts is not None else Verdict.ERROR
                owned = slot.probes.complete(probe, verdict, now)
                counters.probe_verdicts.inc(slot.name, verdict.value)
                if not owned:
                    counters.probe_superseded.inc(slot.name)
                elif verdict is Verdict.PRESENT:
                    self._on_present(slot, probe.key, now)

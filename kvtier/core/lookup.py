"""A lookup's decision: each key's state from where it is, what to start, and
the prefix answer. Pure.

:func:`plan_lookup` turns the :class:`~kvtier.core.locate.Location` of every
key into its state (HIT, PENDING, RETRY, MISS) and a :class:`LookupPlan`
that names the work the answer needs, without doing any of it: the remote
tiers to probe for a key no tier has answered for (RETRY), the remote hits
to promote into RAM (PENDING until they land), the disk hits a GET will
want next (prefetch). The service starts that work, then reads the prefix
answer. The same locations always give the same plan.

Invariants: a key whose tiers are all still unknown reads RETRY while some
probe of it is (or is about to be) in flight, and MISS only once every tier
has answered; once shutdown has begun no work is planned, so a key that
would need a probe reads MISS (or RETRY while the disk index is scanned);
``settles[i]`` is set for every PENDING or RETRY key whose settling is
already known (a write, a probe in flight, the index scan) and left None
where the planned work will supply it; :func:`prefix_answer` reads only the
states (a prefix counts HITs alone, and defers only while a PENDING or RETRY
key could lengthen it). Imports the core's pure maps and the shared records.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.core.locate import Location, Where
from kvtier.core.probes.table import Verdict
from kvtier.model import HIT, MISS, PENDING, RETRY, LookupMode

_HIT_BYTE = bytes([HIT])

#: probes a waiting lookup has seen, by (remote tier index, key)
SeenProbes = dict[tuple[int, bytes], asyncio.Future[Verdict]]


@dataclass(slots=True)
class LookupPlan:
    """The states of a lookup's keys, and the work they need started."""

    states: bytearray
    #: per key, what settles it (a write's ``done``, a probe's future, the index scan)
    settles: list[asyncio.Future[Any] | None]
    #: (key index, remote tier index): probes to start
    probe: list[tuple[int, int]] = field(default_factory=list)
    #: (key index, remote tier index): remote hits to load into RAM
    promote: list[tuple[int, int]] = field(default_factory=list)
    #: key indices of disk hits with no load into RAM under way
    on_disk: list[int] = field(default_factory=list)
    #: (key index, remote tier index, its future): probes in flight the keys join
    joins: list[tuple[int, int, asyncio.Future[Verdict]]] = field(default_factory=list)
    #: per remote tier: keys a kept verdict answered
    cached: list[int] = field(default_factory=list)


def plan_lookup(
    locations: Sequence[Location],
    *,
    remotes: int,
    remote_hit_reads_hit: bool,
    closing: bool,
    scan: asyncio.Future[None] | None,
) -> LookupPlan:
    """The plan for keys at ``locations`` (``remotes``: how many remote tiers;
    ``scan``: the disk index scan while it runs)."""
    n = len(locations)
    plan = LookupPlan(bytearray(n), [None] * n, cached=[0] * remotes)
    states, settles = plan.states, plan.settles
    for i, loc in enumerate(locations):
        where = loc.where
        if where is Where.RAM:
            states[i] = HIT
            continue
        if where is Where.DISK:
            states[i] = HIT
            if loc.reservation is None:
                plan.on_disk.append(i)
            continue
        if where is Where.PENDING:
            states[i], settles[i] = PENDING, loc.settles
            continue
        if where is Where.REMOTE:
            plan.cached[loc.remote] += 1
            if remote_hit_reads_hit:
                states[i] = HIT
            else:
                states[i] = PENDING
                plan.promote.append((i, loc.remote))
            continue
        # Every tier with neither a probe in flight nor one to start has a
        # kept verdict that answered for this key.
        unprobed, inflight = loc.unprobed, loc.inflight
        for t in range(remotes):
            if t not in unprobed and not any(t == busy for busy, _ in inflight):
                plan.cached[t] += 1
        if where is Where.PROBING:
            for t, fut in inflight:
                plan.joins.append((i, t, fut))
            settles[i] = loc.settles
            if not closing:  # no new backend work once shutdown has begun
                for t in unprobed:
                    plan.probe.append((i, t))
            if settles[i] is not None or (loc.unprobed and not closing):
                states[i] = RETRY
            elif scan is not None:
                states[i], settles[i] = RETRY, scan
            else:
                states[i] = MISS
        elif where is Where.SCANNING:
            # Not indexed yet is not absent: the disk may still hold it.
            states[i], settles[i] = RETRY, loc.settles
        else:
            states[i] = MISS
    return plan


def waits_for(
    states: bytearray, settles: Sequence[asyncio.Future[Any] | None], mode: LookupMode
) -> list[asyncio.Future[Any]]:
    """What a waiting lookup waits on: the settling of the keys that can still
    change the answer (in prefix mode, those before the first MISS)."""
    stop = len(states)
    if mode == LookupMode.PREFIX:
        first_miss = states.find(MISS)
        stop = first_miss if first_miss >= 0 else stop
    return [
        fut
        for i, fut in enumerate(settles[:stop])
        if fut is not None and states[i] in (PENDING, RETRY)
    ]


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

"""A read's decision: where each key is, and what a lookup answers. Pure.

:meth:`Locator.locate` is the one read-only answer that lookup, GET,
RESERVE, promotion and prefetch all act on. It looks, in this order
(docs/lookup.md states the same order): RAM, the disk index, the pending
writes, then each remote tier's kept verdict or probe in flight, then
whether the disk index is still being rebuilt. It decides only: it starts
no probe, no promotion, no I/O and counts nothing; the service acts on the
:class:`Location` it returns (the shape of httpcore's pool: decide
synchronously, then do the I/O).

:func:`plan_lookup` turns the locations of a lookup's keys into their
states (HIT, PENDING, RETRY, MISS) and a :class:`LookupPlan` that names the
work the answer needs, without doing any of it: the remote tiers to probe
for a key no tier has answered for (RETRY), the remote hits to promote into
RAM (PENDING until they land), the disk hits a GET will want next
(prefetch). The service starts that work, then reads the prefix answer.

Invariants: the same state gives the same location and the same locations
the same plan; a remote PRESENT verdict wins over tiers still unknown (a
load can start now); a key that no tier has answered for is PROBING, never
ABSENT, and reads RETRY while some probe of it is (or is about to be) in
flight, MISS only once every tier has answered; a key that is not indexed
while the disk index is still being rebuilt is SCANNING, never ABSENT; once
shutdown has begun no work is planned, so a key that would need a probe
reads MISS (or RETRY while the disk index is scanned); ``settles[i]`` is
set for every PENDING or RETRY key whose settling is already known (a
write, a probe in flight, the index scan) and left None where the planned
work will supply it; :func:`prefix_answer` reads only the states (a prefix
counts HITs alone, and defers only while a PENDING or RETRY key could
lengthen it). Imports only the core's pure maps, the errors and the
shared records.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvtier.core.probes import ProbeMap, Verdict
from kvtier.core.writes import Reservation, ReservationTable
from kvtier.model import HIT, MISS, PENDING, RETRY, LookupMode


class Where(enum.Enum):
    RAM = "ram"  # resident in RAM: readable now
    DISK = "disk"  # indexed on the local disk: readable now (a GET promotes it)
    PENDING = "pending"  # a reservation or a promotion is writing it
    REMOTE = "remote"  # a remote tier's kept verdict says it holds the key
    PROBING = "probing"  # some remote tier has not answered yet
    SCANNING = "scanning"  # not indexed, but the disk index is still being rebuilt
    ABSENT = "absent"  # no tier has it


class DiskIndex(Protocol):
    def contains(self, key: bytes) -> bool: ...

    @property
    def scanning(self) -> bool: ...

    @property
    def scan_done(self) -> asyncio.Future[None] | None: ...


@dataclass(slots=True, frozen=True)
class Location:
    where: Where
    #: what settles the answer: a write's ``done``, a probe's future, the index scan
    settles: asyncio.Future[Any] | None = None
    #: PENDING: the write in flight; DISK: a promotion into RAM under way, if any
    reservation: Reservation | None = None
    #: REMOTE: index of the remote tier whose verdict is PRESENT
    remote: int = -1
    #: PROBING: remote tiers with neither a verdict nor a probe in flight
    unprobed: tuple[int, ...] = ()
    #: PROBING: remote tiers with a probe in flight, and its future
    inflight: tuple[tuple[int, asyncio.Future[Verdict]], ...] = ()


AT_RAM = Location(Where.RAM)
AT_DISK = Location(Where.DISK)
ABSENT = Location(Where.ABSENT)


class Locator:
    """Reads the tiers' indexes, the pending writes and the probe maps; writes nothing."""

    __slots__ = ("_disk", "_pending", "_probes", "_ram")

    def __init__(
        self,
        ram: Container[bytes],
        disk: DiskIndex | None,
        pending: ReservationTable,
        probes: Sequence[ProbeMap],
    ) -> None:
        self._ram = ram
        self._disk = disk
        self._pending = pending
        self._probes = probes

    def __repr__(self) -> str:
        return (
            f"<Locator disk={self._disk is not None} pending={len(self._pending)} "
            f"remotes={len(self._probes)}>"
        )

    def locate(
        self,
        key: bytes,
        now: float,
        seen: Mapping[tuple[int, bytes], asyncio.Future[Verdict]] | None = None,
    ) -> Location:
        if key in self._ram:
            return AT_RAM
        disk = self._disk
        res = self._pending.get(key)
        if disk is not None and disk.contains(key):
            # Readable now; a promotion of it into RAM may be under way.
            return AT_DISK if res is None else Location(Where.DISK, res.done, res)
        if res is not None:
            return Location(Where.PENDING, res.done, res)
        unprobed: list[int] = []
        inflight: list[tuple[int, asyncio.Future[Verdict]]] = []
        for i, probes in enumerate(self._probes):
            verdict = probes.verdict(key, now)
            if verdict is None and seen is not None:
                earlier = seen.get((i, key))
                if earlier is not None and earlier.done():
                    verdict = earlier.result()
            if verdict is Verdict.PRESENT:
                return Location(Where.REMOTE, remote=i)
            if verdict is not None:
                continue  # ABSENT or ERROR: this tier answered
            probe = probes.inflight(key)
            if probe is None:
                unprobed.append(i)
            else:
                inflight.append((i, probe.future))
        if unprobed or inflight:
            settles = inflight[0][1] if inflight else None
            return Location(
                Where.PROBING, settles, unprobed=tuple(unprobed), inflight=tuple(inflight)
            )
        if disk is not None and disk.scanning:
            return Location(Where.SCANNING, disk.scan_done)
        return ABSENT


#: one HIT state as a byte (a lookup's states are a byte each)
HIT_BYTE = bytes([HIT])

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
        return len(states) - len(states.lstrip(HIT_BYTE))  # at C speed
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
    if isinstance(states, bytes | bytearray):  # every lookup's: leading_hits, inline
        hits = len(states) - len(states.lstrip(HIT_BYTE))
    else:
        hits = leading_hits(states)
    return hits, hits < len(states) and states[hits] in (PENDING, RETRY)

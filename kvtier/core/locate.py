"""Where a key is: the one read-only answer that lookup, GET, RESERVE,
promotion and prefetch all act on.

:meth:`Locator.locate` looks, in this order (docs/lookup.md states the same
order): RAM, the disk index, the pending writes, then each remote tier's
kept verdict or probe in flight, then whether the disk index is still being
rebuilt. It decides only: it starts no probe, no promotion, no I/O and
counts nothing; the service acts on the :class:`Location` it returns (the
shape of httpcore's pool: decide synchronously, then do the I/O).

Invariants: the answer depends only on the state passed in; a remote
PRESENT verdict wins over tiers still unknown (a load can start now); a key
that no tier has answered for is PROBING, never ABSENT; a key that is not
indexed while the disk index is still being rebuilt is SCANNING, never
ABSENT. Imports only the core's pure maps and the shared records.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvtier.core.probes.table import ProbeMap, Verdict
from kvtier.core.writes.table import Reservation, ReservationTable


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


#: probes a waiting lookup has already seen end, by (remote tier index, key)
Seen = Mapping[tuple[int, bytes], "asyncio.Future[Verdict]"]


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

    def locate(self, key: bytes, now: float, seen: Seen | None = None) -> Location:
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

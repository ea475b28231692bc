"""Promotions: loading a block from a lower tier into RAM, once, for every reader.

A promotion is a pending write (:mod:`kvtier.core.writes`) whose writer is
a load from the disk or a remote tier: readers of the key wait on it like
on any write, so concurrent GETs of one key share one load. A remote tier
that claimed a block and could not deliver it gets an ABSENT verdict for
the key, so the next lookup answers MISS instead of HIT again (no
HIT / failed-load livelock).

:meth:`Promoter.read_through` is the GET path below RAM: where the key is
decides whether to wait on a write, start a promotion, wait for the disk
index, or give up. Imports the core's maps and the tiers' interface.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.config import LookupConfig
from kvtier.core.locate import Locator, Where
from kvtier.core.pending import Reservation
from kvtier.core.probes import Verdict
from kvtier.core.remotes import RemoteSlot
from kvtier.core.writes import PendingWrites
from kvtier.errors import TierError
from kvtier.model import Buffer
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.ram import RamTier

#: a GET gives up on a key after this many rounds of waiting on writes that
#: ended without the block (each round is bounded by a write deadline)
MAX_READ_ROUNDS = 8


class Promoter:
    def __init__(
        self,
        ram: RamTier,
        disk: DiskTier | None,
        pending: PendingWrites,
        remotes: Sequence[RemoteSlot],
        cfg: LookupConfig,
        now: Callable[[], float],
        closing: Callable[[], asyncio.Future[None] | None],
    ) -> None:
        self.ram = ram
        self.disk = disk
        self.pending = pending
        self.remotes = remotes
        self.cfg = cfg
        self._now = now
        #: the service's shutdown future (None before start): waits end with it
        self._closing = closing

    def __repr__(self) -> str:
        return f"<Promoter remotes={len(self.remotes)} {self.pending!r}>"

    def remote(self, slot: RemoteSlot, key: bytes, now: float) -> Reservation:
        async def load() -> Buffer | None:
            values = await slot.tier.batch_load([key])
            if len(values) != 1:
                raise TierError(f"{slot.name}: batch_load returned {len(values)} values for 1 key")
            return values[0]

        def failed() -> None:
            slot.probes.force(key, Verdict.ABSENT, self._now())

        return self.pending.promote(slot.name, key, self.cfg.pending_deadline, now, load, failed)

    def from_disk(self, key: bytes, now: float) -> Reservation:
        assert self.disk is not None
        disk = self.disk
        return self.pending.promote(
            disk.name, key, self.cfg.pending_deadline, now, lambda: disk.read(key), lambda: None
        )

    def _closing_now(self) -> bool:
        closing = self._closing()
        return closing is not None and closing.done()

    async def read_through(self, key: bytes, locator: Locator) -> Buffer | None:
        """``key``'s value pinned in RAM, loading it from below if it must; None if absent."""
        for _ in range(MAX_READ_ROUNDS):
            value = self.ram.pin(key)
            if value is not None:
                return value
            if self._closing_now():
                return None
            now = self._now()
            loc = locator.locate(key, now)
            where = loc.where
            res: Reservation | None
            if where is Where.PENDING or (where is Where.DISK and loc.reservation is not None):
                res = loc.reservation
            elif where is Where.DISK:
                res = self.from_disk(key, now)
            elif where is Where.REMOTE:
                res = self.remote(self.remotes[loc.remote], key, now)
            elif where is Where.PROBING:
                # No answer yet: load from the first tier that may hold it (a
                # load of an absent block answers absent, which is kept).
                first = min((*loc.unprobed, *(i for i, _ in loc.inflight)))
                res = self.remote(self.remotes[first], key, now)
            elif where is Where.SCANNING:
                assert loc.settles is not None
                await self._wait_or_closing(loc.settles)
                continue
            else:
                return None
            assert res is not None
            await self._wait_or_closing(res.done)
        return None

    async def _wait_or_closing(self, fut: asyncio.Future[Any]) -> None:
        waits: list[asyncio.Future[Any]] = [fut]
        closing = self._closing()
        if closing is not None:
            waits.append(closing)
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)

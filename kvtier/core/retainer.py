"""Retention leases, acting half: the verbs' leases to RAM's book, their
expiry on the daemon's clock, and what they are worth.

The pure half is :mod:`kvtier.tiers.retention` (the book and the eviction
order). Here a LOOKUP, PUT or commit that carries a lease grants or renews
it on the blocks it names in RAM and on the disk (each local tier keeps
its own book, and the disk leases a block whose write is on its way as
it lands), a release ends a session's leases, and the daemon's sweep ends
the leases whose time has passed (so a lease may outlive its ttl by at
most one ``sweep_interval``). A lookup of a session
that still holds a lease on its chain's head is a *return within the
lease*: the blocks it asked and the leading run of them the local tiers
held are counted, which is the hit ratio leases are for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.core.counts import CoreCounters
from kvtier.model import Retention, namespace_name, namespace_of
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.ram import RamTier


class Retainer:
    def __init__(
        self,
        ram: RamTier,
        now: Callable[[], float],
        counters: CoreCounters,
        held_locally: Callable[[bytes], bool],
        disk: DiskTier | None = None,
        forward: Callable[[Sequence[bytes], Retention], None] | None = None,
    ) -> None:
        self.ram = ram
        self.disk = disk
        #: hands a local session's lease on to the remote tiers that keep
        #: leases (peers: their copies of its blocks), in the background
        self._forward = forward
        self.book = ram.retention
        self.now = now
        self.counters = counters
        self._held_locally = held_locally

    def __repr__(self) -> str:
        return f"<Retainer {self.book!r}>"

    def looked_up(self, keys: Sequence[bytes], retention: Retention, whole: bool = False) -> None:
        """A lookup of ``keys`` (a chain) with ``retention``: a return within
        the lease is counted, then the lease renewed on the resident keys.
        ``whole``: they are the session's whole prompt, so its leases on
        blocks outside them (a prompt it left) end, in RAM and on the disk."""
        if keys and self.book.holds(retention.session, keys[:1]):
            held = 0
            for key in keys:
                if not self._held_locally(key):
                    break
                held += 1
            self.counters.retention_return_asked.value += len(keys)
            self.counters.retention_return_held.value += held
        self.retain(keys, retention)
        if whole:
            self.ram.supersede(retention.session, keys)
            if self.disk is not None:
                self.disk.supersede(retention.session, keys)

    def retain(self, keys: Sequence[bytes], retention: Retention, *, peer: bool = False) -> None:
        """Lease ``keys`` to ``retention`` (or renew it): those in RAM, and
        those on the disk or on their way to it; a local session's lease
        goes on to the peers too. ``peer``: a peer's lease on the blocks
        its pushes bring here (leased in RAM as they land; never sent on)."""
        if keys:
            now = self.now()
            self.ram.retain(keys, retention, now, arrive=peer)
            if self.disk is not None:
                self.disk.retain(keys, retention, now)
            if self._forward is not None and not peer:
                self._forward(keys, retention)

    def holds(self, key: bytes, retention: Retention) -> bool:
        """Whether resident ``key`` is under ``retention``'s session's lease."""
        held = self.book.lease_of(key)
        return held is not None and held.session == (namespace_of(key), retention.session)

    def on_arrival(
        self, loads: Sequence[tuple[bytes, asyncio.Future[Any]]], retention: Retention
    ) -> None:
        """Lease ``loads``' keys (a chain's, in order) to ``retention`` once
        every one of their loads into RAM has ended: the ones that landed."""
        keys = [k for k, _ in loads]
        left = len(loads)

        def ended(_: asyncio.Future[Any]) -> None:
            nonlocal left
            left -= 1
            if not left:
                self.retain(keys, retention)

        for _, load in loads:
            load.add_done_callback(ended)

    def release(self, session: bytes, namespace: bytes) -> int:
        """End ``namespace``'s ``session``'s leases; how many blocks RAM held."""
        if self.disk is not None:
            self.disk.release_session(session, namespace)
        return self.ram.release_session(session, namespace)

    def expire(self) -> None:
        now = self.now()
        self.ram.expire_leases(now)
        if self.disk is not None:
            self.disk.expire_leases(now)

    def stats(self) -> dict[str, Any]:
        c = self.book.counts
        by: dict[str, dict[str, int]] = {}
        for (ns, priority), n in sorted(self.book.by_priority().items()):
            by.setdefault(namespace_name(ns), {})[str(priority)] = n
        return {
            "leased_blocks": len(self.book),
            "sessions": self.book.sessions(),
            "leased_bytes": {namespace_name(ns): n for ns, n in self.book.leased_bytes.items()},
            "leased_bytes_by_priority": by,
            "granted": c.granted,
            "renewed": c.renewed,
            "released": c.released,
            "expired": c.expired,
            "capped": c.capped,
            "superseded": c.superseded,
            "evicted_from_ram": c.evicted,
            "broken": int(self.counters.retention_broken.value),
            "returns_asked": int(self.counters.retention_return_asked.value),
            "returns_held": int(self.counters.retention_return_held.value),
            "disk": None if self.disk is None else _disk_stats(self.disk),
        }


def _disk_stats(disk: DiskTier) -> dict[str, Any]:
    """The disk's leases: what it holds under them, and what it let go."""
    book = disk.retention
    return {
        "leased_blocks": len(book),
        "leased_bytes": {namespace_name(ns): n for ns, n in book.leased_bytes.items()},
        "awaiting_writes": len(disk.arriving_leases),
        "evicted": book.counts.evicted,
        "capped": book.counts.capped,
    }

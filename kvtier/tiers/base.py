"""The interface every tier implements, and the block checksum they share.

Local tiers (RAM, disk) also answer ``contains`` synchronously from an
in-memory index, so a lookup of a local block never awaits. Remote tiers
(S3, peers) are probed through ``batch_lookup``. A tier keeps its own
counters (read by metrics at scrape time through ``stats``); tiers never
import the core or metrics.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import xxhash

from kvtier.model import Buffer, Retention
from kvtier.tiers.budget import Budget
from kvtier.tiers.hedger import Hedger


def block_checksum(key: bytes, value: Buffer) -> int:
    """XXH3-64 of key then value: stored with every block on disk and in S3."""
    h = xxhash.xxh3_64()
    h.update(key)
    h.update(value)
    return h.intdigest()


@dataclass(slots=True)
class TierStats:
    """What every tier reports; a tier with more to say returns a subclass
    whose fields metrics read by name (never through string keys)."""

    name: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    evictions: int = 0
    #: a tier that seals blocks (:mod:`kvtier.tiers.sealing`; None: it does
    #: not): plain bytes encrypted and decrypted, bytes given to its codec
    #: and the bytes it made of them, blocks that did not open by reason
    sealed_bytes: int | None = None
    opened_bytes: int | None = None
    packed_in_bytes: int | None = None
    packed_out_bytes: int | None = None
    seal_failures: dict[str, int] | None = None
    #: a tier whose reads are hedged (None: they are not): the hedges that
    #: were due, by outcome (won, lost, skipped)
    hedges: dict[str, int] | None = None

    def as_dict(self) -> dict[str, object]:
        """The STATS reply's entry for this tier: every field but the name
        (fields a tier does not have, None, are left out)."""
        out: dict[str, object] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "name" and value is not None:
                out[f.name] = value
        return out


@dataclass(slots=True)
class RamStats(TierStats):
    pinned: int = 0
    reserved_bytes: int = 0
    #: ``reserved_bytes`` by what it holds room for (reservations, rooms,
    #: ready, quarantined, bodies), and rooms given back under pressure
    held_bytes: dict[str, int] = field(default_factory=dict)
    reclaimed_bytes: int = 0
    #: the shared arena (None without one)
    arena_bytes: int | None = None
    arena_allocated_bytes: int | None = None
    arena_held_blocks: int | None = None


@dataclass(slots=True)
class DiskStats(TierStats):
    reads: int = 0
    read_bytes: int = 0
    writes: int = 0
    written_bytes: int = 0
    corrupt_discarded: int = 0
    enospc: int = 0
    write_errors: int = 0
    writes_in_flight: int = 0
    index_buckets_scanned: int = 0
    index_buckets_total: int = 0
    #: how the index was loaded at start: "snapshot" (its files) or "scan"
    index_loaded_from: str = ""
    index_load_seconds: float = 0.0
    #: bytes journalled since the index's last snapshot, and snapshots written
    index_journal_bytes: int = 0
    index_compactions: int = 0
    filesystem_free_bytes: int = 0
    filesystem_size_bytes: int = 0


@dataclass(slots=True)
class S3Stats(TierStats):
    corrupt: int = 0
    breaker_state: int = 0


@dataclass(slots=True)
class PeerStats(TierStats):
    peers: int = 0
    peers_up: int = 0


class Tier(abc.ABC):
    """A place blocks live. All batch methods keep the order of ``keys``."""

    name: str
    #: hedges this tier's slow reads (to another holder of the block), if it may
    hedger: Hedger | None = None
    #: a block stored here outlives this daemon (a restart, a crash): a
    #: durable PUT may rest on it (the disk, an object store; not RAM, not
    #: another daemon's RAM)
    outlives_daemon: bool = False

    @abc.abstractmethod
    async def batch_lookup(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is present."""

    @abc.abstractmethod
    async def batch_load(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        """Each key's value, or None where absent."""

    @abc.abstractmethod
    async def batch_store(self, keys: Sequence[bytes], values: Sequence[Buffer]) -> None:
        """Store every pair (idempotent for keys already present)."""

    @abc.abstractmethod
    async def delete(self, keys: Sequence[bytes]) -> list[bool]:
        """Remove each key; True where it was present."""

    @abc.abstractmethod
    def stats(self) -> TierStats:
        """A snapshot of the tier's occupancy."""

    #: whether :meth:`retain_copies` carries a lease anywhere (a tier of other
    #: daemons: they order their copies of a session's blocks by it)
    keeps_leases: bool = False

    async def retain_copies(  # noqa: B027 - a tier that orders no leases
        self, keys: Sequence[bytes], retention: Retention
    ) -> None:
        """Lease this tier's copies of ``keys`` to ``retention``'s session
        (best effort; a tier that orders no leases does nothing)."""

    async def open(self) -> None:  # noqa: B027 - optional hook
        """Acquire resources (clients, pools); called once at startup."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources; called once at shutdown."""


class LocalTier(Tier):
    """A tier whose index lives in memory and answers without I/O, under a byte budget."""

    budget: Budget

    @abc.abstractmethod
    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is resident, answered from the index."""

    async def batch_lookup(self, keys: Sequence[bytes]) -> list[bool]:
        return [self.contains(k) for k in keys]

    def indexed(self) -> list[bytes]:
        """The keys held now (the budget is the index)."""
        return list(self.budget)

    @property
    def capacity(self) -> int:
        return self.budget.capacity

    @property
    def used_bytes(self) -> int:
        return self.budget.used

    @property
    def evictions(self) -> int:
        return self.budget.evictions

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
from dataclasses import dataclass, field

import xxhash

from kvtier.model import Buffer
from kvtier.tiers.budget import Budget


def block_checksum(key: bytes, value: Buffer) -> int:
    """XXH3-64 of key then value: stored with every block on disk and in S3."""
    h = xxhash.xxh3_64()
    h.update(key)
    h.update(value)
    return h.intdigest()


@dataclass(slots=True)
class TierStats:
    name: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    evictions: int = 0
    extra: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, int]:
        """The STATS reply's entry for this tier."""
        return {
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": self.used_bytes,
            "blocks": self.blocks,
            "evictions": self.evictions,
            **self.extra,
        }


class Tier(abc.ABC):
    """A place blocks live. All batch methods keep the order of ``keys``."""

    name: str

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

    @property
    def capacity(self) -> int:
        return self.budget.capacity

    @property
    def used_bytes(self) -> int:
        return self.budget.used

    @property
    def evictions(self) -> int:
        return self.budget.evictions

"""RAM tier: a byte-capacity block pool with pluggable eviction and pinning."""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass

from kvtier.errors import NoCapacityError, ValueTooLargeError
from kvtier.tiers.base import Buffer, LocalTier, TierStats
from kvtier.tiers.policy import EvictionPolicy, LRUPolicy, NoRoom, plan_eviction


@dataclass(slots=True)
class _Block:
    value: Buffer
    size: int
    pins: int = 0


class RamTier(LocalTier):
    """Blocks in process memory.

    Invariants: ``used_bytes + reserved_bytes <= capacity`` at all times; a
    pinned block is never evicted; storing a key that is resident is a no-op
    (idempotent). Reserved bytes hold room for blocks announced by RESERVE.
    """

    name = "ram"

    def __init__(self, capacity: int, policy: EvictionPolicy[bytes] | None = None) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self.used_bytes = 0
        self.reserved_bytes = 0
        self.evictions = 0
        self._blocks: dict[bytes, _Block] = {}
        self._policy: EvictionPolicy[bytes] = policy if policy is not None else LRUPolicy()

    def __repr__(self) -> str:
        pinned = sum(1 for b in self._blocks.values() if b.pins)
        return (
            f"<RamTier used={self.used_bytes}/{self.capacity} reserved={self.reserved_bytes} "
            f"blocks={len(self._blocks)} pinned={pinned} evictions={self.evictions}>"
        )

    def __len__(self) -> int:
        return len(self._blocks)

    # -- index

    def contains(self, key: bytes) -> bool:
        return key in self._blocks

    def resident(self) -> Container[bytes]:
        """A live view for bulk membership tests (read-only use)."""
        return self._blocks.keys()

    # -- reads

    def get(self, key: bytes) -> Buffer | None:
        block = self._blocks.get(key)
        if block is None:
            return None
        self._policy.touch(key)
        return block.value

    def pin(self, key: bytes) -> Buffer | None:
        """Read ``key`` and keep it resident until :meth:`unpin`."""
        block = self._blocks.get(key)
        if block is None:
            return None
        block.pins += 1
        self._policy.touch(key)
        return block.value

    def unpin(self, key: bytes) -> None:
        block = self._blocks.get(key)
        if block is not None and block.pins:
            block.pins -= 1

    def is_pinned(self, key: bytes) -> bool:
        block = self._blocks.get(key)
        return block is not None and block.pins > 0

    # -- writes

    def put(self, key: bytes, value: Buffer) -> tuple[bool, list[tuple[bytes, Buffer]]]:
        """Store ``key``. Returns (stored, evicted pairs); stored is False if resident."""
        if key in self._blocks:
            self._policy.touch(key)
            return False, []
        size = len(value)
        if size > self.capacity:
            raise ValueTooLargeError(
                f"value of {size} bytes is larger than the RAM tier ({self.capacity} bytes)"
            )
        evicted = self._make_room(size)
        self._blocks[key] = _Block(value, size)
        self.used_bytes += size
        self._policy.admit(key)
        return True, evicted

    def _make_room(self, size: int) -> list[tuple[bytes, Buffer]]:
        free = self.capacity - self.used_bytes - self.reserved_bytes
        blocks = self._blocks
        try:
            victims = plan_eviction(
                size,
                free,
                self._policy.candidates(),
                size_of=lambda k: blocks[k].size,
                pinned=lambda k: blocks[k].pins > 0,
            )
        except NoRoom as exc:
            raise NoCapacityError(f"RAM tier: {exc} (every other block is pinned)") from None
        evicted = [(victim, self._remove(victim).value) for victim in victims]
        self.evictions += len(evicted)
        return evicted

    def reserve(self, size: int) -> list[tuple[bytes, Buffer]]:
        """Hold ``size`` bytes for a block about to arrive; returns evicted pairs."""
        if size > self.capacity:
            raise ValueTooLargeError(
                f"cannot reserve {size} bytes in a RAM tier of {self.capacity} bytes"
            )
        evicted = self._make_room(size)
        self.reserved_bytes += size
        return evicted

    def release(self, size: int) -> None:
        """Give back bytes held by :meth:`reserve`."""
        self.reserved_bytes = max(0, self.reserved_bytes - size)

    def remove(self, key: bytes) -> bool:
        if key not in self._blocks:
            return False
        self._remove(key)
        return True

    def _remove(self, key: bytes) -> _Block:
        block = self._blocks.pop(key)
        self.used_bytes -= block.size
        self._policy.remove(key)
        return block

    # -- Tier interface

    async def batch_load(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        return [self.get(k) for k in keys]

    async def batch_store(self, keys: Sequence[bytes], values: Sequence[Buffer]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.put(key, value)

    async def delete(self, keys: Sequence[bytes]) -> list[bool]:
        return [self.remove(k) for k in keys]

    def stats(self) -> TierStats:
        return TierStats(
            name=self.name,
            capacity_bytes=self.capacity,
            used_bytes=self.used_bytes,
            blocks=len(self._blocks),
            evictions=self.evictions,
            extra={
                "pinned": sum(1 for b in self._blocks.values() if b.pins),
                "reserved_bytes": self.reserved_bytes,
            },
        )

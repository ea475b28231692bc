"""RAM tier: blocks in process memory under a byte budget, pinned while read.

Invariants (kept by its :class:`~kvtier.tiers.budget.Budget`): resident plus
reserved bytes never exceed the capacity; a pinned block is never evicted;
storing a key that is resident is a no-op (idempotent). Reserved bytes hold
room for blocks announced by RESERVE. Imports the tiers' base, budget and
policy; never the core or metrics.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvtier.errors import NoCapacityError, ValueTooLargeError
from kvtier.model import Buffer
from kvtier.tiers.base import LocalTier, TierStats
from kvtier.tiers.budget import Budget
from kvtier.tiers.policy import EvictionPolicy, NoRoom

#: lookups whose hits may wait to be shown to the policy (then they are applied)
_MAX_DEFERRED_TOUCHES = 256


class RamTier(LocalTier):
    name = "ram"

    def __init__(self, capacity: int, policy: EvictionPolicy[bytes] | None = None) -> None:
        self.budget = Budget(capacity, policy)
        self._values: dict[bytes, Buffer] = {}
        #: lookups' hits not yet shown to the eviction policy (see touch_later)
        self._touches: list[tuple[Sequence[bytes], int]] = []

    def __repr__(self) -> str:
        b = self.budget
        return (
            f"<RamTier used={b.used}/{b.capacity} reserved={b.held} blocks={len(b)} "
            f"pinned={b.pinned_count} evictions={b.evictions}>"
        )

    def __len__(self) -> int:
        return len(self._values)

    @property
    def reserved_bytes(self) -> int:
        return self.budget.held

    # -- index

    def contains(self, key: bytes) -> bool:
        return key in self._values

    def resident(self) -> Collection[bytes]:
        """A live view for bulk membership tests (read-only use)."""
        return self._values.keys()

    # -- reads

    def touch_later(self, keys: Sequence[bytes], count: int) -> None:
        """A lookup answered HIT for ``keys[:count]``: refresh the resident ones in
        the eviction order before the next write, off the lookup's reply path."""
        self._touches.append((keys, count))
        if len(self._touches) >= _MAX_DEFERRED_TOUCHES:
            self._apply_touches()

    def _apply_touches(self) -> None:
        touches, self._touches = self._touches, []
        values, touch = self._values, self.budget.touch
        for keys, count in touches:
            for key in keys[:count]:
                if key in values:
                    touch(key)

    def get(self, key: bytes) -> Buffer | None:
        value = self._values.get(key)
        if value is not None:
            self.budget.touch(key)
        return value

    def pin(self, key: bytes) -> Buffer | None:
        """Read ``key`` and keep it resident until :meth:`unpin`."""
        value = self._values.get(key)
        if value is not None:
            self.budget.pin(key)
            self.budget.touch(key)
        return value

    def unpin(self, key: bytes) -> None:
        if key in self._values:
            self.budget.unpin(key)

    # -- writes

    def put(self, key: bytes, value: Buffer) -> tuple[bool, list[tuple[bytes, Buffer]]]:
        """Store ``key``. Returns (stored, evicted pairs); stored is False if resident."""
        if self._touches:
            self._apply_touches()
        if key in self._values:
            self.budget.touch(key)
            return False, []
        size = len(value)
        if size > self.capacity:
            raise ValueTooLargeError(
                f"value of {size} bytes is larger than the RAM tier ({self.capacity} bytes)"
            )
        evicted = self._make_room(size)
        self._values[key] = value
        self.budget.admit(key, size)
        return True, evicted

    def _make_room(self, size: int) -> list[tuple[bytes, Buffer]]:
        try:
            victims = self.budget.evict_for(size)
        except NoRoom as exc:
            raise NoCapacityError(f"RAM tier: {exc} (every other block is pinned)") from None
        return [(victim, self._values.pop(victim)) for victim in victims]

    def reserve(self, size: int) -> list[tuple[bytes, Buffer]]:
        """Hold ``size`` bytes for a block about to arrive; returns evicted pairs."""
        if size > self.capacity:
            raise ValueTooLargeError(
                f"cannot reserve {size} bytes in a RAM tier of {self.capacity} bytes"
            )
        if self._touches:
            self._apply_touches()
        evicted = self._make_room(size)
        self.budget.hold(size)
        return evicted

    def release(self, size: int) -> None:
        """Give back bytes held by :meth:`reserve`."""
        self.budget.release(size)

    def remove(self, key: bytes) -> bool:
        if self._values.pop(key, None) is None:
            return False
        self.budget.remove(key)
        self.budget.drop_pins(key)
        return True

    # -- Tier interface

    async def batch_load(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        return [self.get(k) for k in keys]

    async def batch_store(self, keys: Sequence[bytes], values: Sequence[Buffer]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.put(key, value)

    async def delete(self, keys: Sequence[bytes]) -> list[bool]:
        return [self.remove(k) for k in keys]

    def stats(self) -> TierStats:
        b = self.budget
        return TierStats(
            name=self.name,
            capacity_bytes=b.capacity,
            used_bytes=b.used,
            blocks=len(b),
            evictions=b.evictions,
            extra={"pinned": b.pinned_count, "reserved_bytes": b.held},
        )

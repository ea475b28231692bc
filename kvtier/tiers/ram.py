"""RAM tier: blocks in process memory under a byte budget, pinned while read.

With an :class:`~kvtier.tiers.arena.Arena`, blocks of at least ``min_slot``
bytes live in the shared arena (same-host clients read them in place) and
are counted at their slot size; smaller ones, and any block when the arena
is fragmented, stay ordinary Python objects. A value in the arena is freed
only when no holder is left (:class:`~kvtier.tiers.arena.Slots`): a deleted or
evicted block that a reader still holds is freed when it lets go. Such
blocks are outside the budget, as an evicted block a background write
still holds always was; the arena is sized with room for them, and a
block that finds no room in it lives in the heap.

Invariants (kept by its :class:`~kvtier.tiers.budget.Budget`): resident plus
reserved bytes never exceed the capacity; a pinned block is never evicted;
storing a key that is resident is a no-op (idempotent). Reserved bytes hold
room for blocks announced by RESERVE. Imports the tiers' base, budget and
policy; never the core or metrics.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from itertools import chain, islice

from kvtier.errors import NoCapacityError, ValueTooLargeError
from kvtier.model import Buffer
from kvtier.tiers.arena import Arena, OutOfArena, Slots
from kvtier.tiers.base import LocalTier, RamStats
from kvtier.tiers.budget import Budget
from kvtier.tiers.policy import EvictionPolicy, NoRoom

#: lookups whose hits may wait to be shown to the policy (then they are applied)
_MAX_DEFERRED_TOUCHES = 256


class RamTier(LocalTier):
    name = "ram"

    def __init__(
        self,
        capacity: int,
        policy: EvictionPolicy[bytes] | None = None,
        *,
        arena: Arena | None = None,
        min_slot: int = 64 * 1024,
    ) -> None:
        self.budget = Budget(capacity, policy)
        self._values: dict[bytes, Buffer] = {}
        #: lookups' hits not yet shown to the eviction policy (see touch_later)
        self._touches: list[tuple[Sequence[bytes], int]] = []
        #: the shared arena's views and their holders; None: every block in the heap
        self.slots = Slots(arena) if arena is not None else None
        #: values below this size stay in the heap even with an arena
        self.min_slot = min_slot
        #: evicted arena blocks are copied out (someone demotes them) when set
        self.keep_evicted = False

    def __repr__(self) -> str:
        b = self.budget
        shared = f" {self.slots!r}" if self.slots is not None else ""
        return (
            f"<RamTier used={b.used}/{b.capacity} reserved={b.held} blocks={len(b)} "
            f"pinned={b.pinned_count} evictions={b.evictions}{shared}>"
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
        the eviction order before the next write, off the lookup's reply path.
        The same lookup again (a reader polling) adds nothing to do."""
        touches = self._touches
        if touches and touches[-1][1] == count and touches[-1][0] == keys:
            return
        touches.append((keys, count))
        if len(touches) >= _MAX_DEFERRED_TOUCHES:
            self._apply_touches()

    def _apply_touches(self) -> None:
        """Each key touched once, in the order of its latest lookup: lookups of
        the same prefixes (a shared system prompt, a polling reader) cost the
        policy one touch per key per window, not one per lookup."""
        touches, self._touches = self._touches, []
        if len(touches) == 1:
            keys, count = touches[0]
            latest: Iterable[bytes] = keys[:count]
        else:  # dict.fromkeys dedupes at C speed; built newest first, then reversed
            newest = chain.from_iterable(islice(k, c) for k, c in reversed(touches))
            latest = reversed(dict.fromkeys(newest))
        values, touch = self._values, self.budget.touch
        for key in latest:
            if key in values:
                touch(key)

    def get(self, key: bytes) -> Buffer | None:
        value = self._values.get(key)
        if value is not None:
            self.budget.touch(key)
        return value

    def pin(self, key: bytes) -> Buffer | None:
        """Read ``key`` and keep it resident, its bytes unchanged, until :meth:`unpin`."""
        value = self._values.get(key)
        if value is not None:
            self.budget.pin(key)
            self.budget.touch(key)
            if self.slots is not None:
                self.slots.hold(value)
        return value

    def hold(self, value: Buffer) -> None:
        """Keep ``value``'s bytes as they are until :meth:`let_go`, without keeping
        the key resident: for a background write of a value it already has."""
        if self.slots is not None:
            self.slots.hold(value)

    def let_go(self, value: Buffer) -> None:
        if self.slots is not None:
            self.slots.let_go(value)

    def unpin(self, key: bytes, value: Buffer) -> None:
        if self._values.get(key) is value:
            self.budget.unpin(key)
        if self.slots is not None:
            self.slots.let_go(value)

    def in_arena_memory(self, value: Buffer) -> bool:
        """Whether ``value`` is a view of the arena (stored, staged or freed)."""
        return (
            self.slots is not None
            and isinstance(value, memoryview)
            and value.obj is self.slots.arena.mapping
        )

    def peek(self, key: bytes) -> Buffer | None:
        """``key``'s value as stored, without touching the eviction order."""
        return self._values.get(key)

    # -- writes

    def put(
        self, key: bytes, value: Buffer, *, copy: bool = False
    ) -> tuple[bool, list[tuple[bytes, Buffer]]]:
        """Store ``key``. Returns (stored, evicted pairs); stored is False if resident.

        A value :meth:`stage` handed out becomes the block itself; ``copy``:
        the value's memory is not the caller's to give (a view of a buffer
        about to be reused), so the tier keeps a copy.
        """
        if self._touches:
            self._apply_touches()
        if key in self._values:
            self.budget.touch(key)
            self.drop_staged(value)
            return False, []
        length = len(value)
        if length > self.budget.capacity:
            raise ValueTooLargeError(
                f"value of {length} bytes is larger than the RAM tier ({self.capacity} bytes)"
            )
        slots = self.slots
        if slots is not None and length >= self.min_slot:
            if slots.is_staged(value):
                slot = slots.slot_of(value)
                assert slot is not None
                slots.adopt(value)  # type: ignore[arg-type]
                self.budget.release(slot.size)  # held since stage(): now used
                self._values[key] = value
                self.budget.admit(key, slot.size)
                return True, []
            size = slots.block_size(length)
            evicted = self._make_room(size)
            try:
                view = slots.new(length)
            except OutOfArena:  # fragmented: this block lives in the heap
                view = None
            if view is not None:
                view[:] = value
                self._values[key] = view
                self.budget.admit(key, size)
                return True, evicted
            return True, evicted + self._admit_heap(key, value, copy=True)
        return True, self._admit_heap(key, value, copy=copy)

    def _admit_heap(self, key: bytes, value: Buffer, *, copy: bool) -> list[tuple[bytes, Buffer]]:
        size = len(value)
        evicted = self._make_room(size)
        # A view into a larger buffer (one block of a batched PUT's frame)
        # would keep the whole frame alive for as long as the block stays:
        # the block gets bytes of its own, so RAM holds what it counts.
        if copy or (isinstance(value, memoryview) and _is_slice(value)):
            value = bytes(value)
        self._values[key] = value
        self.budget.admit(key, size)
        return evicted

    def _make_room(self, size: int) -> list[tuple[bytes, Buffer]]:
        try:
            victims = self.budget.evict_for(size)
        except NoRoom as exc:
            raise NoCapacityError(f"RAM tier: {exc} (every other block is pinned)") from None
        values = self._values
        if self.slots is None:
            return [(victim, values.pop(victim)) for victim in victims]
        out: list[tuple[bytes, Buffer]] = []
        for victim in victims:
            value = values.pop(victim)
            if self.slots.slot_of(value) is not None:
                kept = bytes(value) if self.keep_evicted else value
                self._retire(value)
                value = kept
            out.append((victim, value))
        return out

    def _retire(self, value: Buffer) -> None:
        assert self.slots is not None
        self.slots.retire(value)  # freed now, or by the last holder

    def stage(self, length: int) -> tuple[memoryview | None, list[tuple[bytes, Buffer]]]:
        """Arena room for a PUT body about to arrive (it is received in place);
        None when there is no arena or no contiguous room. Returns evicted pairs."""
        slots = self.slots
        if slots is None or length < self.min_slot or length > self.capacity:
            return None, []
        if self._touches:
            self._apply_touches()
        size = slots.block_size(length)
        try:
            evicted = self._make_room(size)
        except NoCapacityError:
            return None, []
        try:
            view = slots.stage(length)
        except OutOfArena:
            return None, evicted
        self.budget.hold(size)
        return view, evicted

    def drop_staged(self, value: Buffer) -> None:
        """A staged value that was not stored (the PUT failed, or the key was resident)."""
        if self.slots is not None:
            self.budget.release(self.slots.drop_staged(value))  # type: ignore[arg-type]

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
        value = self._values.pop(key, None)
        if value is None:
            return False
        self.budget.remove(key)
        self.budget.drop_pins(key)
        if self.slots is not None:
            self._retire(value)
        return True

    # -- Tier interface

    async def batch_load(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        return [self.get(k) for k in keys]

    async def batch_store(self, keys: Sequence[bytes], values: Sequence[Buffer]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.put(key, value)

    async def delete(self, keys: Sequence[bytes]) -> list[bool]:
        return [self.remove(k) for k in keys]

    def stats(self) -> RamStats:
        b = self.budget
        st = RamStats(
            name=self.name,
            capacity_bytes=b.capacity,
            used_bytes=b.used,
            blocks=len(b),
            evictions=b.evictions,
            pinned=b.pinned_count,
            reserved_bytes=b.held,
        )
        if self.slots is not None:
            alloc = self.slots.arena.allocator
            st.arena_bytes = alloc.size
            st.arena_allocated_bytes = alloc.allocated_bytes
            st.arena_held_blocks = self.slots.held_count
        return st


def _is_slice(view: memoryview) -> bool:
    """Whether ``view`` shows only part of the buffer it comes from."""
    base = view.obj
    return base is not None and memoryview(base).nbytes != view.nbytes

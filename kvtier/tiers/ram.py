"""The RAM tier, and the shared arena its blocks live in.

RAM keeps blocks under a byte budget, pinned while read. With an
:class:`Arena`, blocks of at least ``min_slot`` bytes live in the shared
arena (same-host clients read them in place) and are counted at their slot
size; smaller ones, and any block when the arena is fragmented, stay
ordinary Python objects. A value in the arena is freed only when no holder
is left (:class:`Slots`): a deleted or evicted block that a reader still
holds is freed when it lets go. Such blocks are outside the budget, as an
evicted block a background write still holds always was; the arena is sized
with room for them, and a block that finds no room in it lives in the heap.

Invariants (kept by its :class:`~kvtier.tiers.budget.Budget`): resident plus
reserved bytes never exceed the capacity; a pinned block is never evicted;
storing a key that is resident is a no-op (idempotent). Reserved bytes hold
room for blocks about to arrive: announced by RESERVE, bodies being
received in place, rooms handed to writers, rooms made ahead of a
writer's next block. The parts that hold room are its keepers (:class:`Keeper`):
when evicting every unpinned block would not make the room a store, a
RESERVE or a promotion needs, the keepers first give back what they hold
but nobody uses (rooms made ahead, never handed out), then, for a block
that is here (not for another RESERVE), reservations' room (they stay
pending), and only then is the store refused, with an error that names
what holds the room (pinned blocks, reservations, rooms, bodies).
Imports the tiers' base, budget and policy; never the core or metrics.

The shared arena is one anonymous memory file (``memfd_create``) of a fixed
size, mapped read-write by the daemon; its descriptor can be handed to a
client over the Unix socket (SCM_RIGHTS), which maps it read-only and reads
blocks in place. Space is handed out by an :class:`ExtentAllocator`, the
arena's pure bookkeeping; a :class:`Slot` names a block's bytes. The arena
never decides what to evict: the tier's budget and eviction policy do, and
free slots only when no lease holds them (:mod:`kvtier.core.shared.leases`).
Its memory is allocated and mapped into the daemon from the start up,
a step at a time in a worker thread, once the daemon serves
(:func:`prepare_memory`, ``shared.preallocate``): a page the kernel must
allocate when a block first lands in it costs far more than the block's
copy. ``Arena.prepared`` only grows, and never past the arena.

A block stored in the arena is one :class:`Slot` and one writable
``memoryview`` of it; that view object *is* the block's value everywhere in
the daemon, so its ``id`` names the slot. :class:`Slots` keeps the RAM
tier's views and their holders: anything that keeps a value past the
synchronous step (a reply still in the transport's buffer, a client's lease,
a background write) *holds* it; the tier *retires* a value when the key is
deleted or evicted. A view is *staged* between :meth:`Slots.stage` and
:meth:`Slots.adopt` (a PUT body being received straight into the arena) or
:meth:`Slots.drop_staged`.

Invariants: a slot is freed exactly once, when it has been retired (or its
staging dropped) and no holder is left; a held slot is never handed out
again, so a reader's bytes never change under it; ``freed`` reports the
bytes each free gives back so the budget can follow the arena.

The allocator is pure (arithmetic over one byte range). A request is rounded
up to whole pages (a 300,000-byte block takes 74 pages of 4 KiB, 1% more,
not the 512 KiB a power-of-two scheme would). Free space is a set of
extents, merged with their neighbours when freed. A request takes a free
extent of exactly its size when there is one (KV blocks mostly share one
size, so after warm-up nearly every request is an exact fit, O(1));
otherwise the smallest larger extent, split at its start.

Its invariants (tested with random sequences): allocated extents never
overlap and stay inside the range; ``free_bytes + allocated_bytes == size``;
no two free extents touch (they would have been merged); after every extent
is freed one free extent covers the range.

Linux only (``memfd_create``); where it is missing the RAM tier keeps its
blocks in process memory and clients use the socket path.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import mmap
import os
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvtier import blockcopy
from kvtier.errors import NoCapacityError, ValueTooLargeError
from kvtier.model import Buffer, Retention
from kvtier.tiers.base import LocalTier, RamStats
from kvtier.tiers.budget import Budget
from kvtier.tiers.policy import EvictionPolicy, NoRoom
from kvtier.tiers.retention import Arrivals, RetentionBook, grant_held, leased_cap, retaining
from kvtier.tiers.touches import DeferredTouches

log = logging.getLogger("kvtier.ram")

#: lookups and reads whose hits may wait to be shown to the policy, and the
#: keys they may name in all: past either bound the oldest are shown at once,
#: so a stream of reads with no write between pays for its own touches, and
#: never for a long backlog at one read (measured: 256 reads of 256 blocks
#: applied at once cost one read 3.9 ms, against 63 us for the others)
_MAX_DEFERRED_TOUCHES = 256
_MAX_DEFERRED_KEYS = 4096


class HeldKind(enum.Enum):
    """What reserved RAM holds room for (STATS ``ram.held_bytes``)."""

    RESERVATIONS = "reservations"  # blocks announced by RESERVE
    ROOMS = "rooms"  # rooms handed to writers writing in place
    READY = "ready"  # rooms made ahead of writers' next blocks, not handed out
    QUARANTINED = "quarantined"  # rooms of closed connections, freed soon
    BODIES = "bodies"  # bodies being received or copied into their slots


#: what yields room to a store, a promotion or a disk read, in this order:
#: rooms made ahead that nobody uses, then reservations' room (they stay
#: pending: their PUT makes its room when it arrives)
YIELD_ORDER = (HeldKind.READY, HeldKind.RESERVATIONS)


class Keeper(Protocol):
    """A part that holds room in RAM (slots staged with :meth:`RamTier.stage`,
    or bytes held with :meth:`RamTier.reserve`): it says what it holds, by
    kind, and gives back what it holds but no block needs now."""

    #: the kind of room it gives back (READY rooms made ahead, never handed
    #: out; or RESERVATIONS' room, the reservations staying pending)
    yields: HeldKind

    def held(self) -> Mapping[HeldKind, int]:
        """Bytes of RAM it holds now, by kind."""

    def reclaim(self, need: int) -> int:
        """Give back room it holds of its ``yields`` kind, ``need`` bytes or
        more where it can; returns the bytes given back."""


class RamTier(LocalTier):
    name = "ram"

    def __init__(
        self,
        capacity: int,
        policy: EvictionPolicy[bytes] | None = None,
        *,
        arena: Arena | None = None,
        min_slot: int = 64 * 1024,
        retained_share: float = 0.8,
    ) -> None:
        #: retention leases on resident blocks (docs/retention.md)
        self.retention = RetentionBook(self._retention_cap)
        #: the share of the tier (or of a namespace's max) leases may hold
        self.retained_share = retained_share
        #: leases given for blocks on their way here (retain's ``arrive``)
        self.arriving_leases = Arrivals()
        self.budget = Budget(capacity, retaining(policy, self.retention))
        self._values: dict[bytes, Buffer] = {}
        #: reads' and lookups' hits not yet shown to the eviction policy (see
        #: touch_later)
        self._reads = DeferredTouches(_MAX_DEFERRED_TOUCHES, _MAX_DEFERRED_KEYS)
        #: the shared arena's views and their holders; None: every block in the heap
        self.slots = Slots(arena) if arena is not None else None
        #: values below this size stay in the heap even with an arena
        self.min_slot = min_slot
        #: evicted arena blocks are copied out (someone demotes them) when set
        self.keep_evicted = False
        #: bytes held for reservations (the rest of ``budget.held`` is the
        #: keepers' rooms and bodies being received)
        self._reserved = 0
        #: the parts holding room that give it back before a store is refused
        self.keepers: list[Keeper] = []
        #: rooms the keepers gave back under pressure, in bytes
        self.reclaimed_bytes = 0

    def __repr__(self) -> str:
        b = self.budget
        shared = f" {self.slots!r}" if self.slots is not None else ""
        return (
            f"<RamTier used={b.used}/{b.capacity} reserved={b.held} blocks={len(b)} "
            f"pinned={b.pinned_count} evictions={b.evictions} "
            f"deferred_touches={self._reads.pending}{shared}>"
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
        """A lookup answered HIT for ``keys[:count]`` (the rest it missed), or
        a read pinned them (``count == len(keys)``): refresh the resident ones
        in the eviction order later, off the reply's path, and after the
        writes of the blocks the lookup missed, so that the prompt's head
        stays more recent than the blocks stored after it
        (:class:`~kvtier.tiers.touches.DeferredTouches`). Until then no
        eviction takes them. The same lookup again (a reader polling) adds
        nothing to do."""
        shown = self._reads.add(keys, count)
        if shown is not None:
            self._touch_resident(shown)

    def _apply_touches(self) -> None:
        """Show the policy every read still waiting."""
        shown = self._reads.take_all()
        if shown is not None:
            self._touch_resident(shown)

    def _touch_resident(self, keys: Iterable[bytes]) -> None:
        """Show the policy a touch of each of ``keys`` still held, in order."""
        values = self._values
        self.budget.touch_many([key for key in keys if key in values])

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

    def pin_many(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        """:meth:`pin` of each key, in one call: the touches shown to the
        eviction policy in one pass, in the keys' order (a read of many
        blocks)."""
        if len(keys) == 1:  # (a lone GET: the batch's lists cost more than they save)
            return [self.pin(keys[0])]
        values = list(map(self._values.get, keys))
        present = [k for k, v in zip(keys, values, strict=True) if v is not None]
        if present:
            self.budget.pin_many(present)
            self.touch_later(present, len(present))
            if self.slots is not None:
                hold = self.slots.hold
                for value in values:
                    if value is not None:
                        hold(value)
        return values

    def unpin_many(self, keys: Sequence[bytes], values: Sequence[Buffer | None]) -> None:
        """:meth:`unpin` of each pinned key (``None`` values are skipped)."""
        if len(keys) == 1:
            if values[0] is not None:
                self.unpin(keys[0], values[0])
            return
        get, unpin = self._values.get, self.budget.unpin
        let_go = self.slots.let_go if self.slots is not None else None
        for key, value in zip(keys, values, strict=True):
            if value is None:
                continue
            if get(key) is value:
                unpin(key)
            if let_go is not None:
                let_go(value)

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

    # -- retention

    def retain(
        self, keys: Sequence[bytes], retention: Retention, now: float, *, arrive: bool = False
    ) -> int:
        """Lease the resident ones of ``keys`` (a chain, head first) to
        ``retention``, or renew their lease; returns how many were resident.
        ``arrive``: the others are leased as they land (a peer's lease on
        blocks its push is bringing here)."""
        values = self._values
        held = [k for k in keys if k in values]
        if arrive and len(held) < len(keys):
            self.arriving_leases.add((k for k in keys if k not in values), retention, now)
        grant_held(self.retention, self.budget, held, retention, now)
        return len(held)

    def release_session(self, session: bytes, namespace: bytes) -> int:
        """End ``namespace``'s ``session``'s lease (after the reads it made
        are in the order: its blocks then go first)."""
        if self._reads.queue:
            self._apply_touches()
        return self.retention.release(session, namespace)

    def supersede(self, session: bytes, keys: Sequence[bytes]) -> int:
        """``keys`` are ``session``'s whole prompt: its other leases here end
        (after the reads made before it are in the order: its blocks then
        go first)."""
        if self._reads.queue:
            self._apply_touches()
        return self.retention.supersede(session, keys)

    def expire_leases(self, now: float) -> int:
        """End the leases whose time passed, as :meth:`release_session` does."""
        if self._reads.queue and self.retention.due(now):
            self._apply_touches()
        self.arriving_leases.expire(now)
        return self.retention.expire(now)

    def lease_landed(self, key: bytes) -> None:
        """``key`` was just stored: the lease given for it on its way, if any."""
        self.arriving_leases.land(key, self.retention, self.budget)

    def _retention_cap(self, ns: bytes) -> int:
        return leased_cap(self.budget, self.retained_share, ns)

    # -- writes

    def put(
        self, key: bytes, value: Buffer, *, copy: bool = False, cold: bool = False
    ) -> tuple[bool, list[tuple[bytes, Buffer]]]:
        """Store ``key``. Returns (stored, evicted pairs); stored is False if resident.

        A value :meth:`stage` handed out becomes the block itself; ``copy``:
        the value's memory is not the caller's to give (a view of a buffer
        about to be reused), so the tier keeps a copy. ``cold``: the writer
        expects no reuse (a TAIL hint): admitted first in the eviction order.
        """
        if self._reads.queue:  # (the reads whose writes are over are shown first)
            shown = self._reads.before_write(key, self._values)
            if shown is not None:
                self._touch_resident(shown)
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
                self.budget.admit(key, slot.size, cold)
                return True, self._within_max(key)
            size = slots.block_size(length)
            evicted = self._make_room(size, key)
            try:
                view = slots.new(length)
            except OutOfArena:  # fragmented: this block lives in the heap
                view = None
            if view is not None:
                view[:] = value
                self._values[key] = view
                self.budget.admit(key, size, cold)
                return True, evicted
            return True, evicted + self._admit_heap(key, value, copy=True, cold=cold)
        return True, self._admit_heap(key, value, copy=copy, cold=cold)

    def _admit_heap(
        self, key: bytes, value: Buffer, *, copy: bool, cold: bool
    ) -> list[tuple[bytes, Buffer]]:
        size = len(value)
        evicted = self._make_room(size, key)
        # A view into a larger buffer (one block of a batched PUT's frame)
        # would keep the whole frame alive for as long as the block stays:
        # the block gets bytes of its own, so RAM holds what it counts.
        if copy or (isinstance(value, memoryview) and _is_slice(value)):
            value = bytes(value)
        self._values[key] = value
        self.budget.admit(key, size, cold)
        return evicted

    def make_room(
        self, keys: Sequence[bytes], values: Sequence[Buffer]
    ) -> list[tuple[bytes, Buffer]]:
        """Room for a batch of blocks in one eviction pass (each :meth:`put`
        then finds its room free, and no block of the batch evicts another);
        returns the evicted pairs. A batch that does not fit makes no room
        here: each block then makes its own, or fails on its own."""
        slots = self.slots
        # a staged block holds its room already
        lengths = [
            0 if slots is not None and slots.is_staged(value) else len(value) for value in values
        ]
        return self.make_room_for(keys, lengths)

    def make_room_for(
        self, keys: Sequence[bytes], lengths: Sequence[int]
    ) -> list[tuple[bytes, Buffer]]:
        """:meth:`make_room` for blocks of ``lengths`` about to be staged: the
        victims' slots are all freed (and merge with their free neighbours)
        before any block of the batch takes one, so a block larger than the
        victims finds contiguous room more often than when each block evicts
        for itself as it is staged."""
        values_held, slots, min_slot = self._values, self.slots, self.min_slot
        need = 0
        for key, n in zip(keys, lengths, strict=True):
            if key in values_held or not n:
                continue
            need += slots.block_size(n) if slots is not None and n >= min_slot else n
        try:
            return self._make_room(need, keys[0]) if need else []
        except (NoCapacityError, ValueTooLargeError):
            return []

    def _within_max(self, key: bytes) -> list[tuple[bytes, Buffer]]:
        """After a block whose room was made before it arrived (a staged PUT
        body) lands: its namespace's own blocks past its max go now."""
        if self.budget.shares is None:
            return []
        try:
            return self._make_room(0, key)
        except NoCapacityError:
            return []  # every other block of it is being read: it stays over

    def _make_room(
        self, size: int, key: bytes | None, yielding: Collection[HeldKind] = YIELD_ORDER
    ) -> list[tuple[bytes, Buffer]]:
        reads = self._reads
        if reads.queue:  # (the reads whose writes are over are in the order it sees)
            shown = reads.before_write(key, self._values)
            if shown is not None:
                self._touch_resident(shown)
        leased = self.retention.evicted_leased
        leased.clear()
        try:
            # A read still waiting to be shown counts as just made: none of
            # its keys goes, unless there is no room without them.
            victims = self.budget.evict_for(size, key, reads.protected() if reads.queue else ())
        except NoRoom as exc:
            if reads.queue:
                self._apply_touches()
                return self._make_room(size, key, yielding)
            victims = self._reclaim_for(size, key, yielding, exc)
        values = self._values
        if self.slots is None:
            return [(victim, values.pop(victim)) for victim in victims]
        out: list[tuple[bytes, Buffer]] = []
        for victim in victims:
            value = values.pop(victim)
            if self.slots.slot_of(value) is not None:
                # (a leased block is kept below: its bytes outlive the slot)
                kept = bytes(value) if self.keep_evicted or victim in leased else value
                self._retire(value)
                value = kept
            out.append((victim, value))
        return out

    def _retire(self, value: Buffer) -> None:
        assert self.slots is not None
        self.slots.retire(value)  # freed now, or by the last holder

    def stage(
        self, length: int, key: bytes | None = None
    ) -> tuple[memoryview | None, list[tuple[bytes, Buffer]]]:
        """Arena room for a PUT body about to arrive (it is received in place)
        for ``key`` when known; None when there is no arena or no contiguous
        room. Returns evicted pairs."""
        slots = self.slots
        if slots is None or not self.stages(length):
            return None, []
        size = slots.block_size(length)
        try:
            evicted = self._make_room(size, key)
        except NoCapacityError:
            return None, []
        try:
            view = slots.stage(length)
        except OutOfArena:
            return None, evicted
        self.budget.hold(size)
        return view, evicted

    def _reclaim_for(
        self, size: int, key: bytes | None, yielding: Collection[HeldKind], exc: NoRoom
    ) -> list[bytes]:
        """Victims for ``size`` bytes once the keepers gave back room of the
        ``yielding`` kinds, in order (rooms nobody uses, then reservations'
        room); else NoCapacityError saying what holds the room."""
        for kind in YIELD_ORDER:
            if kind not in yielding:
                continue
            freed = sum(k.reclaim(size) for k in self.keepers if k.yields is kind)
            if not freed:
                continue
            self.reclaimed_bytes += freed
            try:
                return self.budget.evict_for(size, key)
            except NoRoom as again:
                exc = again
        raise NoCapacityError(f"RAM tier: {exc}; {self.holders()}") from None

    def held_bytes(self) -> dict[HeldKind, int]:
        """The reserved bytes by what they hold room for (every kind listed)."""
        out = dict.fromkeys(HeldKind, 0)
        out[HeldKind.RESERVATIONS] = self._reserved
        for keeper in self.keepers:
            for kind, n in keeper.held().items():
                out[kind] += n
        out[HeldKind.BODIES] = max(0, self.budget.held - sum(out.values()))
        return out

    def holders(self) -> str:
        """What holds RAM's room now, for an error that refuses a store."""
        b = self.budget
        pinned = sum(map(b.size_of, b.pinned_keys()))
        parts = [f"{pinned} bytes in {b.pinned_count} blocks being read or written"]
        parts += [f"{n} bytes of {kind.value}" for kind, n in self.held_bytes().items() if n]
        return "held: " + ", ".join(parts) + f" (of {b.capacity})"

    def stages(self, length: int) -> bool:
        """Whether a body of ``length`` bytes may get arena room (:meth:`stage`)."""
        return self.slots is not None and self.min_slot <= length <= self.capacity

    def hold_room(self, size: int) -> None:
        """Hold ``size`` bytes for a block about to arrive, without evicting
        (room just given back by the same writer)."""
        self.budget.hold(size)
        self._reserved += size

    def drop_staged(self, value: Buffer) -> None:
        """A staged value that was not stored (the PUT failed, or the key was resident)."""
        if self.slots is not None:
            self.budget.release(self.slots.drop_staged(value))  # type: ignore[arg-type]

    def reserve(self, size: int, key: bytes | None = None) -> list[tuple[bytes, Buffer]]:
        """Hold ``size`` bytes for a block (``key``, when known) about to
        arrive; returns evicted pairs."""
        if size > self.capacity:
            raise ValueTooLargeError(
                f"cannot reserve {size} bytes in a RAM tier of {self.capacity} bytes"
            )
        # (a reservation takes no room from others: only rooms nobody uses yield)
        evicted = self._make_room(size, key, (HeldKind.READY,))
        self.budget.hold(size)
        self._reserved += size
        return evicted

    def release(self, size: int) -> None:
        """Give back bytes held by :meth:`reserve`."""
        self.budget.release(size)
        self._reserved = max(0, self._reserved - size)

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
            held_bytes={kind.value: n for kind, n in self.held_bytes().items()},
            reclaimed_bytes=self.reclaimed_bytes,
        )
        if self.slots is not None:
            alloc = self.slots.arena.allocator
            st.arena_bytes = alloc.size
            st.arena_allocated_bytes = alloc.allocated_bytes
            st.arena_held_blocks = self.slots.held_count
        return st


async def prepare_memory(arenas: Sequence[tuple[Arena, int]]) -> None:
    """Each arena's memory up to its bound allocated and mapped into the
    daemon (:meth:`Arena.prepare`), a step at a time in a worker thread,
    while the daemon serves; each arena's ``preparing`` is true meanwhile,
    and false once this ends, however it ends. A step in flight when this is
    cancelled is waited for (its thread reads the mapping, which outlives
    it). Memory that cannot be had ends it, logged: the rest is allocated
    as blocks land in it."""
    loop = asyncio.get_running_loop()
    started = time.perf_counter()
    for arena, _ in arenas:
        arena.preparing = True
    try:
        for arena, end in arenas:
            try:
                while arena.prepared < min(end, arena.size):
                    step = loop.run_in_executor(None, arena.prepare, end)
                    try:
                        await asyncio.shield(step)
                    except asyncio.CancelledError:
                        await asyncio.wait([step])
                        raise
            except OSError as exc:
                log.warning(
                    "the shared memory could not be allocated up front past %d of %d bytes"
                    " (%s); the rest is allocated as blocks land in it",
                    arena.prepared,
                    min(end, arena.size),
                    exc,
                )
                return
    finally:
        for arena, _ in arenas:
            arena.preparing = False
    log.info(
        "shared memory allocated up front: %d MiB in %.2fs",
        sum(arena.prepared for arena, _ in arenas) >> 20,
        time.perf_counter() - started,
    )


def _is_slice(view: memoryview) -> bool:
    """Whether ``view`` shows only part of the buffer it comes from."""
    base = view.obj
    return base is not None and memoryview(base).nbytes != view.nbytes


class OutOfArena(Exception):
    """No free extent is large enough (the range is full or fragmented)."""


class ExtentAllocator:
    def __init__(self, size: int, page: int = 4096) -> None:
        if page <= 0 or page & (page - 1):
            raise ValueError("page must be a power of two")
        pages = size // page
        if pages < 1:
            raise ValueError(f"a range of {size} bytes holds no {page}-byte page")
        self.page = page
        self.size = pages * page
        #: free extents: offset -> length, end -> offset, and offsets by length
        self._free: dict[int, int] = {0: self.size}
        self._ends: dict[int, int] = {self.size: 0}
        self._by_length: dict[int, set[int]] = {self.size: {0}}
        #: length of each allocated extent, by offset
        self._allocated: dict[int, int] = {}
        self.allocated_bytes = 0

    def __repr__(self) -> str:
        return (
            f"<ExtentAllocator {self.allocated_bytes}/{self.size} bytes "
            f"blocks={len(self._allocated)} free_extents={len(self._free)}>"
        )

    @property
    def free_bytes(self) -> int:
        return self.size - self.allocated_bytes

    @property
    def largest_free(self) -> int:
        return max(self._by_length, default=0)

    def block_size(self, size: int) -> int:
        """The bytes a request of ``size`` occupies (whole pages, at least one)."""
        page = self.page
        return max(1, -(-size // page)) * page

    def alloc(self, size: int) -> int:
        """The offset of an extent of at least ``size`` bytes; raises :class:`OutOfArena`."""
        need = self.block_size(size)
        exact = self._by_length.get(need)
        if exact:
            offset = next(iter(exact))
        else:
            fits = [n for n in self._by_length if n >= need]
            if not fits:
                raise OutOfArena(
                    f"no free extent of {need} bytes "
                    f"({self.free_bytes} bytes free, largest {self.largest_free})"
                )
            offset = next(iter(self._by_length[min(fits)]))
        length = self._take(offset)
        if length > need:
            self._put(offset + need, length - need)
        self._allocated[offset] = need
        self.allocated_bytes += need
        return offset

    def free(self, offset: int) -> None:
        """Give back the extent at ``offset``, merging it with free neighbours."""
        length = self._allocated.pop(offset, None)
        if length is None:
            raise ValueError(f"offset {offset} is not an allocated block")
        self.allocated_bytes -= length
        end = offset + length
        if end in self._free:  # the next extent is free
            length += self._take(end)
        before = self._ends.get(offset)
        if before is not None:  # the previous extent is free
            length += self._take(before)
            offset = before
        self._put(offset, length)

    def _put(self, offset: int, length: int) -> None:
        self._free[offset] = length
        self._ends[offset + length] = offset
        self._by_length.setdefault(length, set()).add(offset)

    def _take(self, offset: int) -> int:
        length = self._free.pop(offset)
        del self._ends[offset + length]
        same = self._by_length[length]
        same.discard(offset)
        if not same:
            del self._by_length[length]
        return length

    def is_pristine(self) -> bool:
        """Whether nothing is allocated and one free extent covers the range."""
        return not self._allocated and self._free == {0: self.size}


@dataclass(slots=True, frozen=True)
class Slot:
    offset: int
    length: int
    #: the arena bytes it occupies (``length`` rounded up by the allocator)
    size: int


#: bytes of an arena prepared at a time (:meth:`Arena.prepare`: one worker
#: thread's step, a few milliseconds; a shutdown waits for one at most)
PREPARE_STEP = 16 * 1024 * 1024


class Arena:
    def __init__(self, size: int, *, page: int = 4096, name: str = "kvtier-arena") -> None:
        self.allocator = ExtentAllocator(size, page)
        self.size = self.allocator.size
        #: the memory file; dup it to hand it to a client
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.size)
            self.mapping = mmap.mmap(self.fd, self.size)
        except BaseException:
            os.close(self.fd)
            raise
        self._view = memoryview(self.mapping)
        #: bytes from the start whose memory is allocated and mapped here
        #: (:meth:`prepare`); written by a worker thread
        self.prepared = 0
        #: :func:`prepare_memory` is at work on it (requests meanwhile are
        #: slower: the kernel zeroes the pages it allocates)
        self.preparing = False

    def __repr__(self) -> str:
        return f"<Arena fd={self.fd} prepared={self.prepared} {self.allocator!r}>"

    def prepare(self, end: int) -> int:
        """Allocate the memory of the next ``PREPARE_STEP`` bytes at most
        before ``end`` and map it into this process, changing no byte (blocks
        may already be there); returns how far from the start the arena is
        prepared. A block written there then costs what a block written over
        an older one does: measured on a 2-vCPU virtual machine, 512 MiB
        written in 1 MiB blocks took 544 ms into pages never touched (each
        allocated by a fault), 176 ms into pages only reserved
        (``posix_fallocate``, 130 ms), 17 ms once allocated and mapped
        (:func:`kvtier.blockcopy.populate`, 137 ms); a client then maps
        them 16 pages a fault. Blocking, without the GIL: a worker thread's
        work. Raises OSError when the memory cannot be had."""
        start = self.prepared
        stop = min(end, self.size, start + PREPARE_STEP)
        if stop > start:
            os.posix_fallocate(self.fd, start, stop - start)
            with self._view[start:stop] as span:
                blockcopy.populate(span)  # (where it cannot, pages are zeroed as first written)
            self.prepared = stop
        return self.prepared

    def allocate(self, length: int) -> Slot:
        """Room for ``length`` bytes; raises :class:`OutOfArena`."""
        return Slot(self.allocator.alloc(length), length, self.allocator.block_size(length))

    def view(self, slot: Slot) -> memoryview:
        """The slot's bytes, writable (the daemon's side)."""
        return self._view[slot.offset : slot.offset + slot.length]

    def readonly_fd(self) -> int:
        """A new descriptor of the memory file that can only be mapped read-only:
        the one handed to clients (a writable one would let them map it writable)."""
        return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)

    def free(self, slot: Slot) -> None:
        self.allocator.free(slot.offset)

    def close(self) -> None:
        """Close the memory file; the mapping goes with the last view of it."""
        self._view.release()
        with contextlib.suppress(BufferError):  # views still alive keep it mapped
            self.mapping.close()
        os.close(self.fd)


class Slots:
    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        #: every view handed out and not yet freed, by id: its slot and the view
        self._live: dict[int, tuple[Slot, memoryview]] = {}
        #: holders of each view beyond the tier itself, by id
        self._refs: dict[int, int] = {}
        #: retired views still held: freed when the last holder lets go
        self._retired: set[int] = set()
        #: views being filled by a PUT body, not yet a block
        self._staged: set[int] = set()

    def __repr__(self) -> str:
        return (
            f"<Slots live={len(self._live)} held={len(self._refs)} "
            f"retired={len(self._retired)} staged={len(self._staged)} {self.arena.allocator!r}>"
        )

    def block_size(self, length: int) -> int:
        """The arena bytes a value of ``length`` occupies."""
        return self.arena.allocator.block_size(length)

    @property
    def held_count(self) -> int:
        return len(self._refs)

    @property
    def retired_bytes(self) -> int:
        return sum(self._live[i][0].size for i in self._retired)

    def new(self, length: int) -> memoryview:
        """A fresh view of ``length`` bytes; raises :class:`OutOfArena`."""
        slot = self.arena.allocate(length)
        view = self.arena.view(slot)
        self._live[id(view)] = (slot, view)
        return view

    def slot_of(self, value: object) -> Slot | None:
        entry = self._live.get(id(value))
        return entry[0] if entry is not None and entry[1] is value else None

    # -- staging

    def stage(self, length: int) -> memoryview:
        view = self.new(length)
        self._staged.add(id(view))
        return view

    def is_staged(self, value: object) -> bool:
        return id(value) in self._staged and self.slot_of(value) is not None

    def adopt(self, view: memoryview) -> None:
        """A staged view becomes a stored block."""
        self._staged.discard(id(view))

    def drop_staged(self, view: memoryview) -> int:
        """The PUT that staged ``view`` did not store it; returns the bytes freed."""
        if id(view) not in self._staged:
            return 0
        self._staged.discard(id(view))
        return self._free(id(view))

    # -- holders

    def hold(self, value: object) -> None:
        """Keep ``value``'s slot from being reused (no-op for values not in the arena)."""
        if self.slot_of(value) is not None:
            vid = id(value)
            self._refs[vid] = self._refs.get(vid, 0) + 1

    def let_go(self, value: object) -> int:
        """One holder is done; returns the bytes freed (the slot was retired and unheld)."""
        vid = id(value)
        n = self._refs.get(vid)
        if n is None or self.slot_of(value) is None:
            return 0
        if n > 1:
            self._refs[vid] = n - 1
            return 0
        del self._refs[vid]
        return self._free(vid) if vid in self._retired else 0

    def retire(self, value: object) -> int:
        """The tier no longer stores ``value``: freed now unless held. Returns bytes freed."""
        if self.slot_of(value) is None:
            return 0
        vid = id(value)
        if vid in self._refs:
            self._retired.add(vid)
            return 0
        return self._free(vid)

    def _free(self, vid: int) -> int:
        slot, _view = self._live.pop(vid)
        self._retired.discard(vid)
        self._refs.pop(vid, None)
        self.arena.free(slot)
        return slot.size

    def is_pristine(self) -> bool:
        """Nothing handed out at all: the arena's allocator is back to its start."""
        return not self._live and self.arena.allocator.is_pristine()


def map_readonly(fd: int, size: int) -> mmap.mmap:
    """A client's read-only mapping of an arena handed to it."""
    return mmap.mmap(fd, size, prot=mmap.PROT_READ)

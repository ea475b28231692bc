"""Shared memory for same-host clients: leases on arena blocks, and staging room.

A client that opted in reads a RAM block in place: GET_SHARED pins the
block (the GET path's own pin) and hands the pin to a lease, which ends
when the client releases it, when its connection closes, or at the lease
deadline (revoked and counted). A client writes a block by asking for room
in the staging region, writing there, and committing it under a key: the
daemon checks length and checksum, copies the bytes into RAM (a writer
never touches a block a reader may hold) and the room stays the client's
for its next block until it gives it back, goes idle past the staging
deadline, or disconnects.

Invariants: a block under a lease keeps its bytes (its slot is never
reused before the lease ends); every lease and every staging room of a
connection ends when the connection closes; ``stats`` shows what is live.
Imports the core's service and lease table and the tiers' arena; no sockets.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import xxhash

from kvtier.core.service import check_sizes
from kvtier.core.shared.leases import Lease, LeaseEnd, LeaseTable
from kvtier.errors import BadArgumentError, NoCapacityError
from kvtier.model import Buffer, ConnId, Leased, Limits, PutStatus
from kvtier.tiers.ram import Arena, OutOfArena, RamTier, Slot

log = logging.getLogger("kvtier.shared")


@dataclass(slots=True)
class Room:
    """Staging room one connection asked for."""

    owner: ConnId
    slot: Slot
    #: reclaimed when not committed to before this time
    deadline: float


@dataclass(slots=True, frozen=True)
class SharedStats:
    """What shared memory is doing now; metrics reads the fields by name."""

    leases: int
    #: leases ended, by how (released, closed, revoked)
    leases_ended: dict[str, int]
    staging_rooms: int
    staging_allocated_bytes: int
    staging_bytes: int
    staging_expired: int
    commits_refused: int
    leased_bytes: int
    arena_bytes: int
    arena_allocated_bytes: int

    def as_dict(self) -> dict[str, Any]:
        """The STATS reply's ``shared`` section."""
        return asdict(self)


class SharedBlocks:
    def __init__(
        self,
        ram: RamTier,
        staging: Arena,
        *,
        put: Callable[[Sequence[bytes], Sequence[Buffer]], list[PutStatus]],
        unpin: Callable[[Sequence[bytes], Sequence[Buffer | None]], None],
        now: Callable[[], float],
        lease_timeout: float,
        staging_timeout: float,
        limits: Limits,
    ) -> None:
        assert ram.slots is not None, "shared memory needs RAM in the arena"
        self.ram = ram
        self.slots = ram.slots
        self.staging = staging
        self._put = put
        self._unpin = unpin
        self._now = now
        self._limits = limits
        self.lease_timeout = lease_timeout
        self.staging_timeout = staging_timeout
        self.leases = LeaseTable(on_end=self._lease_ended)
        #: the value each live lease pins (its pin is given back when it ends)
        self._leased: dict[int, Buffer] = {}
        #: staging room handed out, by offset in the staging region
        self._rooms: dict[int, Room] = {}
        #: staging rooms reclaimed at their deadline
        self.rooms_expired = 0
        #: commits refused: wrong length, wrong checksum, or not the caller's room
        self.commits_refused = 0
        #: bytes of the blocks leased (read by clients without crossing the socket)
        self.leased_bytes = 0

    def __repr__(self) -> str:
        return (
            f"<SharedBlocks {self.leases!r} rooms={len(self._rooms)} "
            f"staging={self.staging.allocator.allocated_bytes}/{self.staging.size}>"
        )

    # -- reads

    def grant(
        self, owner: ConnId, keys: Sequence[bytes], values: Sequence[Buffer | None]
    ) -> list[Leased | Buffer | None]:
        """Answers for pinned ``values``: a lease for each block in the arena (the
        pin is now the lease's); the bytes for the others, still pinned (the
        caller unpins them once sent)."""
        deadline = self._now() + self.lease_timeout
        out: list[Leased | Buffer | None] = []
        for key, value in zip(keys, values, strict=True):
            slot = self.slots.slot_of(value) if value is not None else None
            if slot is None:
                out.append(value)
                continue
            assert value is not None
            lease = self.leases.grant(owner, key, deadline)
            self._leased[lease.lease_id] = value
            out.append(Leased(lease.lease_id, slot.offset, slot.length))
            self.leased_bytes += slot.length
        return out

    def unlease(self, owner: ConnId, ids: Sequence[int]) -> int:
        """End ``owner``'s leases among ``ids``; returns how many ended."""
        release = self.leases.release
        return sum(release(owner, i) for i in ids)

    def _lease_ended(self, lease: Lease, end: LeaseEnd) -> None:
        value = self._leased.pop(lease.lease_id)
        self._unpin([lease.key], [value])
        if end is LeaseEnd.REVOKED:
            log.warning(
                "lease %d on key %s held by %s past %.1fs; revoked",
                lease.lease_id,
                lease.key.hex(),
                lease.owner,
                self.lease_timeout,
            )

    # -- writes

    def stage(self, owner: ConnId, length: int) -> int:
        """Room for a block of ``length`` bytes; returns its offset in the staging region."""
        if length <= 0:
            raise BadArgumentError("STAGE needs a positive length")
        check_sizes(self._limits, [length], "value")
        try:
            slot = self.staging.allocate(length)
        except OutOfArena as exc:
            raise NoCapacityError(f"staging region: {exc}") from None
        self._rooms[slot.offset] = Room(owner, slot, self._now() + self.staging_timeout)
        return slot.offset

    def commit(
        self, owner: ConnId, key: bytes, offset: int, length: int, checksum: int, keep: bool
    ) -> PutStatus:
        """Store the block written at ``offset`` under ``key``."""
        room = self._rooms.get(offset)
        if room is None or room.owner != owner:
            self.commits_refused += 1
            raise BadArgumentError(f"no staging room at offset {offset} belongs to this connection")
        try:
            if length > room.slot.length:
                self.commits_refused += 1
                raise BadArgumentError(
                    f"a block of {length} bytes does not fit its room of {room.slot.length}"
                )
            if self.ram.get(key) is not None:  # (a touch, as a PUT of it would)
                # Nothing will be stored: the staged bytes need not be read.
                return PutStatus.EXISTS
            value = self.staging.view(room.slot)[:length]
            try:
                if xxhash.xxh3_64_intdigest(value) != checksum:
                    self.commits_refused += 1
                    raise BadArgumentError(
                        f"checksum mismatch for key {key.hex()}: the staged bytes changed "
                        "or were not all written; nothing stored"
                    )
                (status,) = self._put([key], [value])
            finally:
                value.release()
        finally:
            if keep:
                room.deadline = self._now() + self.staging_timeout
            else:
                self._free_room(offset)
        return status

    def unstage(self, owner: ConnId, offset: int) -> bool:
        room = self._rooms.get(offset)
        if room is None or room.owner != owner:
            return False
        self._free_room(offset)
        return True

    def _free_room(self, offset: int) -> None:
        room = self._rooms.pop(offset)
        self.staging.free(room.slot)

    # -- lifecycle

    def connection_closed(self, owner: ConnId) -> None:
        self.leases.close(owner)
        for offset in [o for o, r in self._rooms.items() if r.owner == owner]:
            self._free_room(offset)

    def expire(self, now: float) -> None:
        """Revoke leases and reclaim staging room past their deadlines."""
        self.leases.expire(now)
        late = [o for o, r in self._rooms.items() if r.deadline <= now]
        for offset in late:
            log.warning(
                "staging room at %d unused past %.1fs; reclaimed", offset, self.staging_timeout
            )
            self._free_room(offset)
        self.rooms_expired += len(late)

    def close(self) -> None:
        """End every lease and room (shutdown)."""
        for owner in {lease.owner for lease in self.leases.live()}:
            self.leases.close(owner)
        for offset in list(self._rooms):
            self._free_room(offset)

    def stats(self) -> SharedStats:
        return SharedStats(
            leases=len(self.leases),
            leases_ended={end.value: n for end, n in self.leases.ended.items()},
            staging_rooms=len(self._rooms),
            staging_allocated_bytes=self.staging.allocator.allocated_bytes,
            staging_bytes=self.staging.size,
            staging_expired=self.rooms_expired,
            commits_refused=self.commits_refused,
            leased_bytes=self.leased_bytes,
            arena_bytes=self.slots.arena.size,
            arena_allocated_bytes=self.slots.arena.allocator.allocated_bytes,
        )

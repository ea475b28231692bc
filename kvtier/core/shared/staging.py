"""Staging rooms: where a client that may not write RAM in place writes a block.

A client that opted in, but is not of the daemon's own user, writes a
block into a room of the staging region (a second shared file, writable by
every such client), then commits it under a key: the daemon copies the
bytes into the block's own RAM slot and checks the copy's checksum there
(a writer never touches a block a reader may hold, and the bytes checked
are the bytes stored). The room stays the client's for its next block
until it gives it back, goes idle past the staging timeout, or
disconnects.

Invariants: a room is its owner's alone (a commit or UNSTAGE of another
connection's room is refused and counted); a commit stores nothing unless
the copied bytes match the checksum; every room of a connection is freed
when it closes; a room unused past ``timeout`` is reclaimed, counted and
logged. Imports the core's checks and stores, the RAM arena and the shared
records.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from kvtier import blockcopy
from kvtier.core.checks import check_checksum
from kvtier.core.stores import Stores
from kvtier.errors import BadArgumentError, NoCapacityError
from kvtier.model import ConnId, PutStatus
from kvtier.tiers.ram import Arena, OutOfArena, RamTier, Slot

log = logging.getLogger("kvtier.shared")


@dataclass(slots=True)
class Room:
    """A room of the staging region one connection holds."""

    owner: ConnId
    slot: Slot
    #: reclaimed when not committed to before this time
    deadline: float


class StagingRooms:
    """Rooms of the staging region, and their commits into RAM."""

    def __init__(
        self,
        ram: RamTier,
        staging: Arena,
        stores: Stores,
        now: Callable[[], float],
        timeout: float,
    ) -> None:
        self.ram = ram
        self.staging = staging
        self.stores = stores
        self._now = now
        #: how long a room may stay unused (reloadable; also an in-place
        #: room's quarantine once its connection closed)
        self.timeout = timeout
        #: rooms handed out, by offset in the staging region
        self._rooms: dict[int, Room] = {}
        #: rooms reclaimed at their deadline
        self.expired = 0
        #: commits refused: wrong length, wrong checksum, or not the caller's room
        self.refused = 0

    def __repr__(self) -> str:
        return (
            f"<StagingRooms rooms={len(self._rooms)} "
            f"staging={self.staging.allocator.allocated_bytes}/{self.staging.size}>"
        )

    def __len__(self) -> int:
        return len(self._rooms)

    def stage(self, owner: ConnId, length: int) -> int:
        """A room of ``length`` bytes (the facade checked it); returns
        its offset in the staging region."""
        try:
            slot = self.staging.allocate(length)
        except OutOfArena as exc:
            raise NoCapacityError(f"staging region: {exc}") from None
        self._rooms[slot.offset] = Room(owner, slot, self._now() + self.timeout)
        return slot.offset

    def commit(
        self, owner: ConnId, key: bytes, offset: int, length: int, checksum: int, keep: bool
    ) -> PutStatus:
        """Store the block written at ``offset`` under ``key``."""
        room = self._rooms.get(offset)
        if room is None or room.owner != owner:
            self.refused += 1
            raise BadArgumentError(f"no staging room at offset {offset} belongs to this connection")
        try:
            if length > room.slot.length:
                self.refused += 1
                raise BadArgumentError(
                    f"a block of {length} bytes does not fit its room of {room.slot.length}"
                )
            if self.ram.get(key) is not None:  # (a touch, as a PUT of it would)
                # Nothing will be stored: the staged bytes need not be read.
                return PutStatus.EXISTS
            # Copied first, then checked: the staging region is writable by
            # every client that opted in, the block's own slot by none, so
            # the bytes checked are the bytes stored (a check of the staged
            # bytes could pass and another process change them before the
            # copy).
            value = self.staging.view(room.slot)[:length]
            stores = self.stores
            stored_view = stores.stage(length, key)
            block = stored_view if stored_view is not None else memoryview(bytearray(length))
            try:
                if stored_view is not None:
                    blockcopy.fault_in(stored_view)
                block[:] = value  # (not streamed: the check reads it at once)
                try:
                    check_checksum(block, checksum, key, "the staged block")
                except BadArgumentError:
                    self.refused += 1
                    raise
                (status,) = stores.put([key], [block], copy=True)
            finally:
                value.release()
                stores.drop_staged(block)  # unless stored
        finally:
            if keep:
                room.deadline = self._now() + self.timeout
            else:
                self._free(offset)
        return status

    def unstage(self, owner: ConnId, offset: int) -> bool:
        room = self._rooms.get(offset)
        if room is None or room.owner != owner:
            return False
        self._free(offset)
        return True

    def _free(self, offset: int) -> None:
        room = self._rooms.pop(offset)
        self.staging.free(room.slot)

    def connection_closed(self, owner: ConnId) -> None:
        for offset in [o for o, r in self._rooms.items() if r.owner == owner]:
            self._free(offset)

    def expire(self, now: float) -> None:
        """Reclaim rooms unused past their deadlines."""
        late = [o for o, r in self._rooms.items() if r.deadline <= now]
        for offset in late:
            log.warning("staging room at %d unused past %.1fs; reclaimed", offset, self.timeout)
            self._free(offset)
        self.expired += len(late)

    def close(self) -> None:
        """Free every room (shutdown)."""
        for offset in list(self._rooms):
            self._free(offset)

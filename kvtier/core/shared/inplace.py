"""In-place rooms: RAM slots a client of the daemon's own user writes blocks into.

A client of the daemon's own user (:func:`may_write_in_place`) asks for a
room that is a staged RAM slot, writes a block there through its writable
mapping of the arena, and commits it under a key: the slot becomes the
block (no copy), and the reply carries the next room, made after the
answer to the connection's last commit (one for each block it stored) so
that the answer waits for no eviction.

Invariants: an in-place room is freed only by its commit (it becomes the
block, or a refused one is freed), an UNSTAGE, or once its connection
closed: at once when the writer's process is gone, else after a short
quarantine (a writer thread may still be finishing a copy into it); a
connection holds at most ``MAX_IN_PLACE_ROOMS``, and at most as many rooms
made ahead, all of one length, which were never handed out, are freed at
once when the connection goes, and are given back whenever RAM needs their
room (it is a :class:`~kvtier.tiers.ram.Keeper`). A commit hands its writer the next
room only while the rooms handed out and made ahead hold at most
1/``ROOMS_SHARE`` of RAM: past it, the writer asks for a room when it
has a block for it. Imports the core's checks and stores, the RAM tier and
the shared records.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtier.core.checks import check_checksum
from kvtier.core.stores import Stores
from kvtier.errors import BadArgumentError, ForbiddenError, NoCapacityError
from kvtier.model import MAX_IN_PLACE_ROOMS, ConnId, Copied, PutStatus
from kvtier.tiers.ram import HeldKind, RamTier, Slot, Slots

#: rooms handed out by commits and made ahead hold at most this share of
#: RAM (1/8) together: past it, a commit hands out no next room
ROOMS_SHARE = 8
#: seconds a closed connection's rooms wait before they are freed, when its
#: process lives on (a thread of it may be finishing a copy: a block's copy
#: takes milliseconds); at once when the process is gone
QUARANTINE_SECONDS = 2.0


def may_write_in_place(uid: int | None, enabled: bool = True) -> bool:
    """Whether a client of ``uid`` may write blocks into RAM's arena in place
    (and gets the arena writable at the handoff): only a process of the
    daemon's own user, which could already open the daemon's arena through
    ``/proc/<pid>/fd``, stop the daemon or rewrite its files; every other
    user writes through staging, whose bytes the daemon copies and checks."""
    return enabled and uid is not None and uid == os.geteuid()


def nothing() -> None:
    """The store of a :class:`Copied` whose blocks are stored already."""


@dataclass(slots=True)
class Place:
    """A RAM slot one connection writes a block into in place."""

    owner: ConnId
    slot: Slot
    #: its view of the slot (it becomes the block)
    view: memoryview = field(repr=False)
    #: its namespace, as a key prefix: the room is made in its share of RAM
    namespace: bytes
    #: once its connection has closed: freed at this time, never before
    deadline: float = math.inf


class InPlaceRooms:
    """RAM slots handed out to be written in place, and their commits."""

    def __init__(
        self,
        ram: RamTier,
        slots: Slots,
        stores: Stores,
        now: Callable[[], float],
        quarantine: Callable[[], float],
        enabled: bool = True,
    ) -> None:
        self.ram = ram
        self.slots = slots
        self.stores = stores
        self._now = now
        #: how long a closed connection's rooms wait before they are freed
        self._quarantine_for = quarantine
        #: whether clients of the daemon's own user may write in place
        self.enabled = enabled
        #: rooms handed out, by offset in the arena, and how many each connection holds
        self._places: dict[int, Place] = {}
        self._places_of: dict[ConnId, int] = {}
        #: the slot bytes of the rooms handed out
        self._room_bytes = 0
        #: the rooms each connection's next COMMITs hand out, made once the
        #: answer to its last one had left (at most MAX_IN_PLACE_ROOMS a
        #: connection, of one length, never handed out yet, so freed at once
        #: when the connection goes)
        self._prepared: dict[ConnId, list[memoryview]] = {}
        #: rooms of closed connections: a writer process may still be in the
        #: middle of a copy into one, so each is freed at its deadline
        self._quarantine: list[Place] = []
        #: blocks committed where their writer wrote them (no copy)
        self.commits = 0
        #: commits refused: wrong length, wrong checksum, or not the caller's room
        self.refused = 0

    def __repr__(self) -> str:
        return (
            f"<InPlaceRooms rooms={len(self._places)} prepared={len(self._prepared)} "
            f"quarantined={len(self._quarantine)} commits={self.commits}>"
        )

    def __len__(self) -> int:
        return len(self._places)

    @property
    def prepared(self) -> int:
        """Rooms made ahead for connections' next commits, held now."""
        return sum(map(len, self._prepared.values()))

    @property
    def quarantined(self) -> int:
        return len(self._quarantine)

    def may_write(self, uid: int | None) -> bool:
        """Whether a client of ``uid`` may write in place here (:func:`may_write_in_place`)."""
        return may_write_in_place(uid, self.enabled)

    # -- the room it holds (a Keeper of the RAM tier)

    def held(self) -> dict[HeldKind, int]:
        return {
            HeldKind.ROOMS: self._room_bytes,
            HeldKind.READY: self._ready_bytes(),
            HeldKind.QUARANTINED: sum(r.slot.size for r in self._quarantine),
        }

    yields = HeldKind.READY

    def reclaim(self, need: int) -> int:
        """Give back the rooms made ahead (never handed out)."""
        freed = self._ready_bytes()
        for owner in list(self._prepared):
            self._drop_prepared(owner)
        return freed

    def _ready_bytes(self) -> int:
        size = self.slots.block_size
        return sum(len(views) * size(len(views[0])) for views in self._prepared.values())

    def _drop_prepared(self, owner: ConnId) -> None:
        """``owner``'s rooms made ahead, never handed out: freed at once."""
        for view in self._prepared.pop(owner, ()):
            self.stores.drop_staged(view)

    def _may_renew(self, length: int) -> bool:
        """Whether a commit may hand out (or make ahead) another room of
        ``length`` bytes: rooms out and ahead stay within their share of RAM."""
        size = self.slots.block_size
        total = self._room_bytes + self._ready_bytes() + size(length)
        return total <= self.ram.capacity // ROOMS_SHARE

    def place(self, owner: ConnId, length: int, namespace: bytes) -> int:
        """A RAM slot of ``length`` bytes for ``owner`` to write in place, made
        in ``namespace``'s share; returns its offset in the arena."""
        if not self.enabled:
            raise ForbiddenError("writing in place is off (shared.write_in_place)")
        held = self._places_of.get(owner, 0)
        if held >= MAX_IN_PLACE_ROOMS:
            raise NoCapacityError(
                f"a connection holds at most {MAX_IN_PLACE_ROOMS} in-place rooms at once"
            )
        if length < self.ram.min_slot:
            raise NoCapacityError(
                f"a block of {length} bytes is under shared.min_block ({self.ram.min_slot}): "
                "it is kept outside the arena, so it cannot be written in place"
            )
        view = self.stores.stage_room(length, namespace)
        if view is None:
            raise NoCapacityError(f"no room in RAM's arena for a block of {length} bytes")
        return self._hand_out(owner, view, namespace)

    def _hand_out(self, owner: ConnId, view: memoryview, namespace: bytes) -> int:
        """``view``, a RAM slot staged as a room, becomes ``owner``'s room."""
        slot = self.slots.slot_of(view)
        assert slot is not None
        self._places[slot.offset] = Place(owner, slot, view, namespace)
        self._places_of[owner] = self._places_of.get(owner, 0) + 1
        self._room_bytes += slot.size
        return slot.offset

    def _prepare(self, owner: ConnId, length: int, namespace: bytes) -> None:
        """Make a room one of ``owner``'s next COMMITs of ``length`` bytes
        hands out, after the answer to this one has left: that answer did
        not wait for the eviction that makes it. None to be had: none prepared."""
        ready = self._prepared.get(owner)
        if ready is not None and (len(ready) >= MAX_IN_PLACE_ROOMS or len(ready[0]) != length):
            return  # (as many as a connection may hold, of one length)
        if not self._may_renew(length):
            return  # (within the share)
        view = self.stores.stage_room(length, namespace)
        if view is not None:
            self._prepared.setdefault(owner, []).append(view)

    def _take_prepared(self, owner: ConnId, length: int) -> memoryview | None:
        """One of ``owner``'s rooms made ahead, if they hold ``length`` bytes
        (else they are freed: the writer's blocks changed length)."""
        ready = self._prepared.get(owner)
        if ready is None:
            return None
        if len(ready[0]) != length or not self.enabled:
            self._drop_prepared(owner)
            return None
        view = ready.pop()
        if not ready:
            del self._prepared[owner]
        return view

    def commit(
        self,
        owner: ConnId,
        key: bytes,
        offset: int,
        length: int,
        checksum: int | None,
        renew: bool,
    ) -> tuple[Copied, int | None]:
        """Store the block ``owner`` wrote into its room at ``offset`` under
        ``key``: its slot becomes the block, nothing is copied. Returns the
        status to answer with and the store to call right after the answer
        (:class:`Copied`: the slot's room is made, so the store cannot
        fail), and, with ``renew``, the offset of a new room of the same
        length (None: none to be had now). That room was made after the
        answer to the connection's last COMMIT, which makes the next one
        after its block is stored (:meth:`_prepare`); when there is none of
        this length it is made now, before the block is stored. Where
        namespaces have shares, the block is stored first and the room made
        after it, both before the answer.

        A ``checksum`` is checked over the slot after the writer is done: a
        block that does not match (torn, or a lying checksum) stores nothing
        and its slot is freed. Without one the slot is stored as written, as
        a PUT over the socket stores what arrived (a writer in place is of
        the daemon's own user: see :func:`may_write_in_place`). A key already
        held answers EXISTS; the room stays the writer's (it is the next
        room) or, without ``renew``, is freed."""
        room = self._room_of(owner, offset, length)
        view, stores = room.view, self.stores
        if self.ram.get(key) is not None:  # (a touch, as a PUT of it would)
            if renew:
                return Copied([PutStatus.EXISTS], nothing), offset
            self._free(offset)
            return Copied([PutStatus.EXISTS], nothing), None
        self._unplace(offset)
        if checksum is not None:
            try:
                check_checksum(view, checksum, key, "the block written in place")
            except BaseException:
                self.refused += 1
                stores.drop_staged(view)
                raise

        def store() -> None:
            try:
                (status,) = stores.put([key], [view], copy=True)
            finally:
                stores.drop_staged(view)  # unless stored
            self.commits += status is PutStatus.STORED

        def next_room() -> int | None:
            if not self._may_renew(length):
                return None  # (the writer asks for one when it has a block)
            try:
                return self.place(owner, length, room.namespace)
            except NoCapacityError:
                return None

        if not renew:
            return Copied([PutStatus.STORED], store, [key]), None
        if self.ram.budget.shares is not None:
            # A namespace's share counts its blocks, not its rooms: the next
            # room is made once this block is in, so that the two fit its max
            # (docs/tenancy.md), and the block is stored before the answer.
            store()
            return Copied([PutStatus.STORED], nothing), next_room()
        # The next room was made after the last answer (a writer commits
        # blocks of one length, one after the other); else it is made now,
        # before the block is stored, and evicts as it would after (the
        # block's slot counts against RAM already).
        ready = self._take_prepared(owner, length)
        if ready is not None:
            renewed: int | None = self._hand_out(owner, ready, room.namespace)
        else:
            renewed = next_room()
        if renewed is None:
            return Copied([PutStatus.STORED], store, [key]), None

        def store_and_prepare() -> None:
            store()
            self._prepare(owner, length, room.namespace)

        return Copied([PutStatus.STORED], store_and_prepare, [key]), renewed

    def commit_many(
        self, owner: ConnId, commits: Sequence[tuple[bytes, int, int, bool]]
    ) -> list[tuple[Copied, int | None]]:
        """:meth:`commit` of each (key, offset, length, renew), unchecked,
        once every one is known good: a room that is not ``owner``'s, a
        length that is not its room's, or a room or key named twice refuses
        the whole batch, and no room is used."""
        offsets = {offset for _, offset, _, _ in commits}
        keys = {key for key, _, _, _ in commits}
        if len(offsets) != len(commits) or len(keys) != len(commits):
            self.refused += 1
            raise BadArgumentError("a COMMIT of many names each room, and each key, once")
        for _, offset, length, _ in commits:
            self._room_of(owner, offset, length)
        return [
            self.commit(owner, key, offset, length, None, renew)
            for key, offset, length, renew in commits
        ]

    def _room_of(self, owner: ConnId, offset: int, length: int) -> Place:
        """``owner``'s room at ``offset``, which holds ``length`` bytes; else
        BadArgumentError (counted refused)."""
        room = self._places.get(offset)
        if room is None or room.owner != owner:
            self.refused += 1
            raise BadArgumentError(
                f"no in-place room at offset {offset} belongs to this connection"
            )
        if length != len(room.view):
            self.refused += 1
            raise BadArgumentError(
                f"a block of {length} bytes committed to an in-place room of {len(room.view)} "
                "(a room holds one block of the length it was asked for)"
            )
        return room

    def unstage(self, owner: ConnId, offset: int) -> bool:
        room = self._places.get(offset)
        if room is None or room.owner != owner:
            return False
        self._free(offset)
        return True

    def _free(self, offset: int) -> None:
        self.stores.drop_staged(self._unplace(offset).view)

    def _unplace(self, offset: int) -> Place:
        room = self._places.pop(offset)
        self._room_bytes -= room.slot.size
        left = self._places_of[room.owner] - 1
        if left:
            self._places_of[room.owner] = left
        else:
            del self._places_of[room.owner]
        return room

    def connection_closed(self, owner: ConnId, writer_gone: bool = False) -> None:
        """``owner`` closed: the room made ahead goes at once, and so do the
        rooms it had when its process is gone (``writer_gone``: nothing can
        write them any more); else they wait out the quarantine."""
        self._drop_prepared(owner)  # never handed out: no writer can be in them
        if writer_gone and self._quarantine:  # (quarantined at its EOF, say)
            gone = [r for r in self._quarantine if r.owner == owner]
            self._quarantine = [r for r in self._quarantine if r.owner != owner]
            for room in gone:
                self.stores.drop_staged(room.view)
        if owner in self._places_of:
            deadline = self._now() + self._quarantine_for()
            for offset in [o for o, r in self._places.items() if r.owner == owner]:
                if writer_gone:
                    self._free(offset)
                    continue
                room = self._unplace(offset)
                room.deadline = deadline
                self._quarantine.append(room)

    def expire(self, now: float) -> None:
        """Free the quarantined rooms past their deadlines."""
        if self._quarantine and self._quarantine[0].deadline <= now:
            done = [r for r in self._quarantine if r.deadline <= now]
            self._quarantine = [r for r in self._quarantine if r.deadline > now]
            for room in done:
                self.stores.drop_staged(room.view)

    def close(self) -> None:
        """Free every room (shutdown)."""
        for offset in list(self._places):
            self._quarantine.append(self._unplace(offset))
        for owner in list(self._prepared):
            self._drop_prepared(owner)
        for room in self._quarantine:
            self.stores.drop_staged(room.view)
        self._quarantine = []

"""Shared memory for same-host clients: leases on arena blocks, and staging room.

A client that opted in reads a RAM block in place: GET_SHARED pins the
block (the GET path's own pin) and hands the pin to a lease, which ends
when the client releases it, when its connection closes, or at the lease
deadline (revoked and counted). A client of the daemon's own user
(:func:`may_write_in_place`) writes a large block *in place*: it asks for
a room that is a staged RAM slot, writes the block there through its
writable mapping of the arena, and commits it under a key; the slot
becomes the block (no copy) and the reply carries the next room. Any
other client writes through the staging region: the daemon checks length
and checksum, copies the bytes into RAM (a writer never touches a block a
reader may hold) and the room stays the client's for its next block until
it gives it back, goes idle past the staging deadline, or disconnects.

A client whose blocks already sit in a memory file of its own (an engine's
host pool in a memfd) registers that file as a *region*: the daemon then
copies blocks itself, from the region into their RAM slots (PUT_REGION)
and from RAM into the region (GET_REGION), so the bytes cross no
socket: on the event loop, :data:`~kvtier.model.LOOP_STEP` bytes a loop step, or each
copy whole in a worker thread (:class:`Copier`), with memcpy
from its own mapping of a file that no process it does not already trust
can shrink (:func:`may_map`: a mapped file shrunk under a copy faults the
daemon), else with ``pread``/``pwrite`` (a read past the end is a clear
error). It uses the descriptor with the access the client opened it with.

Invariants: a block under a lease keeps its bytes (its slot is never
reused before the lease ends); every lease, staging room and region of a
connection ends when the connection closes; an in-place room is freed
only by its commit (it becomes the block, or a refused one is freed), an
UNSTAGE, or ``staging_timeout`` after its connection closed (never while
its writer may still be copying into it); a connection holds at most
``MAX_IN_PLACE_ROOMS``; a staged slot or a pinned
block a copy works on outlives the copy, even when its request is
cancelled (a copy on the loop takes no step after that, one in a thread
ends first), and a region's descriptor is closed (and its mapping
unmapped) only once no copy uses it; a copy on the loop holds it for one
step of at most :data:`~kvtier.model.LOOP_STEP` bytes at a time;
``stats`` shows what is live. Imports the core's argument checks and lease table
and the tiers' arena; no sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import itertools
import logging
import math
import mmap
import os
import secrets
import stat
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import anyio.lowlevel
import xxhash

from kvtier import addresses, blockcopy
from kvtier.core.checks import check_keys, check_sizes
from kvtier.core.shared.leases import Lease, LeaseEnd, LeaseTable
from kvtier.errors import BadArgumentError, ForbiddenError, NoCapacityError, TierError
from kvtier.model import (
    LOOP_STEP,
    MAX_IN_PLACE_ROOMS,
    Buffer,
    ConnId,
    Copied,
    Leased,
    Limits,
    PutStatus,
)
from kvtier.tiers.ram import Arena, OutOfArena, RamTier, Slot

log = logging.getLogger("kvtier.shared")

T = TypeVar("T")

#: a copy's steps: each moves at most LOOP_STEP bytes; its return value is the copy's
Steps = Generator[None, None, T]


@dataclass(slots=True)
class Room:
    """Staging room one connection asked for, or a RAM slot it writes in place."""

    owner: ConnId
    slot: Slot
    #: reclaimed when not committed to before this time (an in-place room:
    #: freed at this time once its connection has closed; never before)
    deadline: float
    #: an in-place room's view of its RAM slot (it becomes the block); None
    #: for a room of the staging region
    view: memoryview | None = field(default=None, repr=False)
    #: an in-place room's namespace, as a key prefix: the room is its RAM
    namespace: bytes = b""


#: regions one connection may hold (attached or waiting for their descriptor)
MAX_REGIONS = 8
#: rooms made ahead for connections' next PUT_REGIONs hold at most this
#: share of RAM (1/8) together: past it, a store makes its rooms when it arrives
REGION_ROOMS_SHARE = 8


@dataclass(slots=True, eq=False)
class Region:
    """A memory file of a client's that the daemon copies blocks to and from."""

    region_id: int
    owner: ConnId
    token: bytes = field(repr=False)
    #: the client's descriptor, once handed over the handoff socket; -1 before
    fd: int = -1
    #: the file's size when it was handed over: every block must lie inside it
    size: int = 0
    #: the daemon's own mapping of the file, when it may map it (see
    #: :func:`may_map`): blocks are copied with memcpy, else read and written
    #: with ``pread``/``pwrite``; unmapped when the descriptor closes
    mapping: mmap.mmap | None = field(default=None, repr=False)
    #: the mapping's address (0: not mapped)
    base: int = 0
    #: the mapping may be written (the client handed a read-write descriptor)
    writable: bool = False
    #: copies of it running now: the descriptor is closed only at 0
    busy: int = 0
    #: the connection is gone: the descriptor closes when the last copy ends
    closed: bool = False


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
    #: RAM slots clients write blocks into in place now, and those of closed
    #: connections waiting out the staging timeout before they are freed
    in_place_rooms: int
    in_place_quarantined: int
    #: rooms made ahead for connections writing in place (the next one each
    #: will ask for)
    in_place_prepared: int
    #: blocks committed where their writer wrote them (no copy)
    in_place_commits: int
    #: client regions held now (attached or waiting for their descriptor)
    regions: int
    #: of those, the files the daemon maps and copies with memcpy (may_map)
    regions_mapped: int
    #: bytes the daemon copied out of clients' regions into RAM, and into them
    region_bytes_in: int
    region_bytes_out: int
    #: RAM slots made ahead for connections' next PUT_REGION, held now, and
    #: the blocks that have landed in one since the start
    region_rooms: int
    region_rooms_used: int
    #: worker threads the regions' copies run in (0: on the event loop), and
    #: the loop steps those on the loop have taken since the start
    copy_threads: int
    copy_steps: int

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
        stage: Callable[[int, bytes], memoryview | None],
        stage_many: Callable[
            [Sequence[int], Sequence[bytes], Sequence[memoryview]], list[memoryview | None]
        ],
        stage_room: Callable[[int, bytes], memoryview | None],
        stage_rooms: Callable[[int, int, bytes], list[memoryview]],
        drop_staged: Callable[[Buffer], None],
        reserve_arriving: Callable[[Sequence[bytes], ConnId], None],
        abort: Callable[[Sequence[bytes], ConnId], object],
        now: Callable[[], float],
        lease_timeout: float,
        staging_timeout: float,
        limits: Limits,
        write_in_place: bool = True,
        copier: Copier | None = None,
    ) -> None:
        assert ram.slots is not None, "shared memory needs RAM in the arena"
        self.ram = ram
        self.slots = ram.slots
        self.staging = staging
        self._put = put
        self._unpin = unpin
        #: a RAM slot to receive a block in place (the service's), and its undo
        self._stage = stage
        self._stage_many = stage_many
        #: a RAM slot for a block whose key comes later, in a namespace's share
        self._stage_room = stage_room
        self._stage_rooms = stage_rooms
        self._drop_staged = drop_staged
        #: a PUT_REGION's keys read PENDING while their copy runs (the
        #: service's reservations without room), and their end if it fails
        self._reserve_arriving = reserve_arriving
        self._abort = abort
        self._now = now
        self._limits = limits
        self.lease_timeout = lease_timeout
        self.staging_timeout = staging_timeout
        self.leases = LeaseTable(on_end=self._lease_ended)
        #: the value each live lease pins (its pin is given back when it ends)
        self._leased: dict[int, Buffer] = {}
        #: staging room handed out, by offset in the staging region
        self._rooms: dict[int, Room] = {}
        #: whether clients of the daemon's own user may write RAM slots in place
        #: (see :func:`may_write_in_place`)
        self.write_in_place = write_in_place
        #: in-place rooms handed out, by offset in the arena, and how many each
        #: connection holds
        self._places: dict[int, Room] = {}
        self._places_of: dict[ConnId, int] = {}
        #: the room each connection's next in-place COMMIT hands out, made
        #: once the answer to its last one had left (at most one a connection,
        #: never handed out yet, so freed at once when the connection goes)
        self._prepared: dict[ConnId, memoryview] = {}
        #: the rooms each connection's next PUT_REGION takes first, made once
        #: the answer to its last one had left: as many as it stored, of their
        #: one length (never handed out, so freed at once when it goes)
        self._region_rooms: dict[ConnId, list[memoryview]] = {}
        self.region_rooms_used = 0
        #: in-place rooms of closed connections: a writer process may still be
        #: in the middle of a copy into one, so each is freed at its deadline
        self._quarantine: list[Room] = []
        self.in_place_commits = 0
        #: staging rooms reclaimed at their deadline
        self.rooms_expired = 0
        #: commits refused: wrong length, wrong checksum, or not the caller's room
        self.commits_refused = 0
        #: bytes of the blocks leased (read by clients without crossing the socket)
        self.leased_bytes = 0
        #: clients' regions by id, and those still waiting for their descriptor by token
        self._regions: dict[int, Region] = {}
        self._tokens: dict[bytes, Region] = {}
        self._region_ids = itertools.count(1)
        self.region_bytes_in = 0
        self.region_bytes_out = 0
        #: where the regions' copies run (on the loop unless given threads)
        self.copier = copier or Copier(0)

    def __repr__(self) -> str:
        return (
            f"<SharedBlocks {self.leases!r} rooms={len(self._rooms)} "
            f"staging={self.staging.allocator.allocated_bytes}/{self.staging.size} "
            f"in_place={len(self._places)} prepared={len(self._prepared)} "
            f"region_rooms={sum(map(len, self._region_rooms.values()))} "
            f"quarantined={len(self._quarantine)} "
            f"regions={len(self._regions)} {self.copier!r}>"
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

    def stage(
        self, owner: ConnId, length: int, in_place: bool = False, namespace: bytes = b""
    ) -> int:
        """Room for a block of ``length`` bytes; returns its offset in the
        staging region, or with ``in_place`` in RAM's arena: a slot of RAM
        the client writes itself (the caller checked it may,
        :func:`may_write_in_place`), which becomes the block at COMMIT. Its
        room is made in ``namespace``'s share (the connection's key prefix:
        docs/tenancy.md), as a PUT of the block would make it."""
        if length <= 0:
            raise BadArgumentError("STAGE needs a positive length")
        check_sizes(self._limits, [length], "value")
        if in_place:
            return self._place(owner, length, namespace)
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
            # Copied first, then checked: the staging region is writable by
            # every client that opted in, the block's own slot by none, so
            # the bytes checked are the bytes stored (a check of the staged
            # bytes could pass and another process change them before the
            # copy).
            value = self.staging.view(room.slot)[:length]
            stored_view = self._stage(length, key)
            block = stored_view if stored_view is not None else memoryview(bytearray(length))
            try:
                if stored_view is not None:
                    blockcopy.fault_in(stored_view)
                block[:] = value  # (not streamed: the check reads it at once)
                self._verify(block, checksum, key, "the staged block")
                (status,) = self._put([key], [block])
            finally:
                value.release()
                self._drop_staged(block)  # unless stored
        finally:
            if keep:
                room.deadline = self._now() + self.staging_timeout
            else:
                self._free_room(offset)
        return status

    def may_write_in_place(self, uid: int | None) -> bool:
        """Whether a client of ``uid`` may write in place here (:func:`may_write_in_place`)."""
        return may_write_in_place(uid, self.write_in_place)

    def _place(self, owner: ConnId, length: int, namespace: bytes) -> int:
        """A RAM slot of ``length`` bytes for ``owner`` to write in place."""
        if not self.write_in_place:
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
        view = self._stage_room(length, namespace)
        if view is None:
            raise NoCapacityError(f"no room in RAM's arena for a block of {length} bytes")
        return self._hand_out(owner, view, namespace)

    def _hand_out(self, owner: ConnId, view: memoryview, namespace: bytes) -> int:
        """``view``, a RAM slot staged as a room, becomes ``owner``'s in-place room."""
        slot = self.slots.slot_of(view)
        assert slot is not None
        self._places[slot.offset] = Room(owner, slot, math.inf, view, namespace)
        self._places_of[owner] = self._places_of.get(owner, 0) + 1
        return slot.offset

    def _prepare(self, owner: ConnId, length: int, namespace: bytes) -> None:
        """Make the room ``owner``'s next in-place COMMIT of ``length`` bytes
        hands out, after the answer to this one has left: that answer did not
        wait for the eviction that makes it. None to be had: none prepared."""
        if owner in self._prepared:
            return  # (one a connection)
        view = self._stage_room(length, namespace)
        if view is not None:
            self._prepared[owner] = view

    def commit_in_place(
        self,
        owner: ConnId,
        key: bytes,
        offset: int,
        length: int,
        checksum: int | None,
        renew: bool,
    ) -> tuple[Copied, int | None]:
        """Store the block ``owner`` wrote into its in-place room at ``offset``
        under ``key``: its slot becomes the block, nothing is copied. Returns
        the status to answer with and the store to call right after the
        answer (:class:`Copied`: the slot's room is made, so the store cannot
        fail), and, with ``renew``, the offset of a new room of the same
        length (None: none to be had now). That room was made after the
        answer to the connection's last COMMIT in place, which makes the
        next one after its block is stored (:meth:`_prepare`); when there
        is none of this length it is made now, before the block is stored.
        Where namespaces have shares, the block is stored first and the room
        made after it, both before the answer.

        A ``checksum`` is checked over the slot after the writer is done: a
        block that does not match (torn, or a lying checksum) stores nothing
        and its slot is freed. Without one the slot is stored as written, as
        a PUT over the socket stores what arrived (a writer in place is of
        the daemon's own user: see :func:`may_write_in_place`). A key already
        held answers EXISTS; the room stays the writer's (it is the next
        room) or, without ``renew``, is freed."""
        room = self._places.get(offset)
        if room is None or room.owner != owner or room.view is None:
            self.commits_refused += 1
            raise BadArgumentError(
                f"no in-place room at offset {offset} belongs to this connection"
            )
        view = room.view
        if length != len(view):
            self.commits_refused += 1
            raise BadArgumentError(
                f"a block of {length} bytes committed to an in-place room of {len(view)} "
                "(a room holds one block of the length it was asked for)"
            )
        if self.ram.get(key) is not None:  # (a touch, as a PUT of it would)
            if renew:
                return Copied([PutStatus.EXISTS], _nothing), offset
            self._free_place(offset)
            return Copied([PutStatus.EXISTS], _nothing), None
        self._unplace(offset)
        if checksum is not None:
            try:
                self._verify(view, checksum, key, "the block written in place")
            except BaseException:
                self._drop_staged(view)
                raise

        def store() -> None:
            try:
                (status,) = self._put([key], [view])
            finally:
                self._drop_staged(view)  # unless stored
            self.in_place_commits += status is PutStatus.STORED

        def next_room() -> int | None:
            try:
                return self._place(owner, length, room.namespace)
            except NoCapacityError:
                return None

        if not renew:
            return Copied([PutStatus.STORED], store, [key]), None
        if self.ram.budget.shares is not None:
            # A namespace's share counts its blocks, not its rooms: the next
            # room is made once this block is in, so that the two fit its max
            # (docs/tenancy.md), and the block is stored before the answer.
            store()
            return Copied([PutStatus.STORED], _nothing), next_room()
        # The next room was made after the last answer (a writer commits
        # blocks of one length, one after the other); else it is made now,
        # before the block is stored, and evicts as it would after (the
        # block's slot counts against RAM already).
        ready = self._prepared.pop(owner, None)
        if ready is not None and len(ready) == length and self.write_in_place:
            renewed: int | None = self._hand_out(owner, ready, room.namespace)
        else:
            if ready is not None:
                self._drop_staged(ready)
            renewed = next_room()
        if renewed is None:
            return Copied([PutStatus.STORED], store, [key]), None

        def store_and_prepare() -> None:
            store()
            self._prepare(owner, length, room.namespace)

        return Copied([PutStatus.STORED], store_and_prepare, [key]), renewed

    def _verify(self, block: memoryview, checksum: int, key: bytes, what: str) -> None:
        """Refuse (and count) a block whose bytes do not match its checksum."""
        if xxhash.xxh3_64_intdigest(block) != checksum:
            self.commits_refused += 1
            raise BadArgumentError(
                f"checksum mismatch for key {key.hex()}: {what} changed or was not "
                "all written; nothing stored"
            )

    def _free_place(self, offset: int) -> None:
        room = self._unplace(offset)
        assert room.view is not None
        self._drop_staged(room.view)

    def _unplace(self, offset: int) -> Room:
        room = self._places.pop(offset)
        left = self._places_of[room.owner] - 1
        if left:
            self._places_of[room.owner] = left
        else:
            del self._places_of[room.owner]
        return room

    def unstage(self, owner: ConnId, offset: int, in_place: bool = False) -> bool:
        rooms = self._places if in_place else self._rooms
        room = rooms.get(offset)
        if room is None or room.owner != owner:
            return False
        if in_place:
            self._free_place(offset)
        else:
            self._free_room(offset)
        return True

    def _free_room(self, offset: int) -> None:
        room = self._rooms.pop(offset)
        self.staging.free(room.slot)

    # -- regions

    def open_region(self, owner: ConnId) -> tuple[int, bytes]:
        """A new region of ``owner``'s: its id, and the token that hands its
        descriptor over the handoff socket (:meth:`attach_region`)."""
        if sum(r.owner == owner for r in self._regions.values()) >= MAX_REGIONS:
            raise NoCapacityError(f"a connection holds at most {MAX_REGIONS} regions")
        region = Region(next(self._region_ids), owner, secrets.token_bytes(16))
        self._regions[region.region_id] = region
        self._tokens[region.token] = region
        return region.region_id, region.token

    def attach_region(self, token: bytes, fd: int, uid: int | None = None) -> int:
        """The descriptor of the region ``token`` names, handed over by a
        client of ``uid``; returns the file's size. The region owns ``fd``
        once this returns (and closes it), not before."""
        region = self._tokens.get(token)
        if region is None:
            raise ForbiddenError("no region waits for this token")
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadArgumentError("a region is a regular file (a memfd), not a pipe or socket")
        if st.st_size <= 0:
            raise BadArgumentError("a region's file is empty")
        del self._tokens[token]
        region.fd, region.size = fd, st.st_size
        if may_map(fd, st, uid):
            writable = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            try:
                region.mapping = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, prot)
            except OSError as exc:  # (no address space, a file system without mmap)
                log.info("region %d: not mapped (%s); copied with pread", region.region_id, exc)
            else:
                with memoryview(region.mapping) as whole:  # (released: it may close)
                    region.base = addresses.address_of(whole)[0]
                region.writable = writable
        return region.size

    def _region_of(self, owner: ConnId, region_id: int, spans: Sequence[tuple[int, int]]) -> Region:
        region = self._regions.get(region_id)
        if region is None or region.owner != owner:
            raise BadArgumentError(f"no region {region_id} belongs to this connection")
        if region.fd < 0:
            raise BadArgumentError(f"region {region_id} has no descriptor yet")
        for i, (offset, length) in enumerate(spans):
            if offset + length > region.size:
                raise BadArgumentError(
                    f"block {i} at {offset}+{length} lies outside region {region_id} "
                    f"({region.size} bytes)"
                )
        return region

    def check_region(self, owner: ConnId, region_id: int, spans: Sequence[tuple[int, int]]) -> None:
        """Refuse a GET_REGION before it pins anything."""
        self._region_of(owner, region_id, spans)

    async def put_region(
        self,
        owner: ConnId,
        region_id: int,
        keys: Sequence[bytes],
        spans: Sequence[tuple[int, int]],
        checksums: Sequence[int] | None = None,
        namespace: bytes = b"",
    ) -> Copied:
        """Copy the blocks at ``spans`` of the region, to be stored under
        ``keys``: each is read straight into its RAM slot, off the event
        loop. Returned once copied: the statuses to answer with, and the
        store to call right after answering (see :class:`Copied`). With
        ``checksums``, a block whose bytes do not match its XXH3-64 after the
        copy (the writer changed it meanwhile, or lied) fails the request and
        nothing is stored.

        The blocks land first in the rooms made for this connection after
        its last PUT_REGION (:meth:`_make_region_rooms`), so the request
        waits for no eviction when it is like the last one; then, once
        stored, rooms are made for the next (``namespace``: the
        connection's key prefix, whose share they are made in)."""
        check_keys(self._limits, keys)
        region = self._region_of(owner, region_id, spans)
        check_sizes(self._limits, [n for _, n in spans], "value")
        statuses = [PutStatus.EXISTS] * len(keys)
        # (a touch of each key held, as a PUT of it would)
        todo = [i for i, key in enumerate(keys) if self.ram.get(key) is None]
        if not todo:
            return Copied(statuses, _nothing)
        lengths = [spans[i][1] for i in todo]
        staged = self._stage_many(lengths, [keys[i] for i in todo], self._rooms_for(owner, lengths))
        views = [
            view if view is not None else memoryview(bytearray(spans[i][1]))
            for i, view in zip(todo, staged, strict=True)
        ]
        offsets = [spans[i][0] for i in todo]
        wanted = None if checksums is None else [checksums[i] for i in todo]
        arriving = [keys[i] for i in todo]
        self._reserve_arriving(arriving, owner)

        def release() -> None:
            for view in views:
                self._drop_staged(view)  # unless stored

        def abandoned() -> None:
            release()
            self._abort(arriving, owner)  # (those stored ended when stored)

        def copy() -> Steps[list[int]]:
            torn = []
            for i, (view, offset, slot) in enumerate(zip(views, offsets, staged, strict=True)):
                want = None if wanted is None else wanted[i]
                check = None if want is None else xxhash.xxh3_64()
                for at in range(0, len(view), LOOP_STEP):
                    piece = view[at : at + LOOP_STEP]
                    if slot is not None:
                        blockcopy.fault_in(piece)
                    # Streamed into the slots unless a check reads them at once.
                    _read_into(region, [piece], [offset + at], streamed=check is None)
                    if check is not None:
                        check.update(piece)  # (the bytes copied, while in the cache)
                    yield
                if check is not None and check.intdigest() != want:
                    torn.append(i)
            return torn

        torn = await self._copy(region, copy(), abandoned)
        if torn:
            abandoned()
            self.commits_refused += 1
            raise BadArgumentError(
                f"block {todo[torn[0]]} does not match its checksum after the copy "
                "(changed while it was read, or a wrong checksum); nothing stored"
            )

        def store() -> list[PutStatus]:
            try:
                stored = self._put(arriving, views)  # (each store ends its reservation)
            except BaseException:
                self._abort(arriving, owner)
                raise
            finally:
                release()
            self.region_bytes_in += sum(len(v) for v in views)
            return stored

        if any(view is None for view in staged):
            # A block without a slot makes room as it is stored, which can
            # fail: stored before the answer.
            for i, status in zip(todo, store(), strict=True):
                statuses[i] = status
            return Copied(statuses, _nothing)
        # Every block is in its slot, whose room is made: storing it cannot
        # fail, and a key another writer stored meanwhile answers EXISTS.
        contains = self.ram.contains
        for i, key in zip(todo, arriving, strict=True):
            statuses[i] = PutStatus.EXISTS if contains(key) else PutStatus.STORED
        answered = [statuses[i] for i in todo]

        def store_answered() -> None:
            if store() != answered:  # (nothing ran between the answer and here)
                log.error("region %d: blocks stored otherwise than answered", region_id)
            if not region.closed:  # (its connection is still there)
                self._make_region_rooms(owner, lengths, namespace)

        stored = [k for k, s in zip(arriving, answered, strict=True) if s is PutStatus.STORED]
        return Copied(statuses, store_answered, stored)

    def _rooms_for(self, owner: ConnId, lengths: Sequence[int]) -> list[memoryview]:
        """The rooms made for ``owner``'s PUT_REGION of blocks of ``lengths``:
        one for each of its first blocks while they are of the rooms' length;
        rooms it does not take are freed."""
        rooms = self._region_rooms.pop(owner, None)
        if not rooms:
            return []
        length = len(rooms[0])
        n = 0
        for wanted in lengths[: len(rooms)]:
            if wanted != length:
                break
            n += 1
        for view in rooms[n:]:
            self._drop_staged(view)
        self.region_rooms_used += n
        return rooms[:n]

    def _make_region_rooms(self, owner: ConnId, lengths: Sequence[int], namespace: bytes) -> None:
        """Rooms for ``owner``'s next PUT_REGION, made after the answer to
        this one (which did not wait for their evictions): one for each block
        of ``lengths``, when they are of one length, slots of the arena, and
        with every connection's rooms take at most 1/REGION_ROOMS_SHARE of
        RAM. None where namespaces have shares (a share counts blocks, not
        rooms: docs/tenancy.md)."""
        if owner in self._region_rooms or not lengths or self.ram.budget.shares is not None:
            return
        length = lengths[0]
        if length < self.ram.min_slot or any(n != length for n in lengths):
            return
        size = self.slots.block_size
        held = sum(len(rooms) * size(len(rooms[0])) for rooms in self._region_rooms.values())
        if held + len(lengths) * size(length) > self.ram.capacity // REGION_ROOMS_SHARE:
            return
        rooms = self._stage_rooms(length, len(lengths), namespace)
        if rooms:
            self._region_rooms[owner] = rooms

    def _free_region_rooms(self, owner: ConnId) -> None:
        """``owner``'s rooms made ahead, never handed out: freed at once."""
        for view in self._region_rooms.pop(owner, ()):
            self._drop_staged(view)

    async def get_region(
        self,
        owner: ConnId,
        region_id: int,
        keys: Sequence[bytes],
        spans: Sequence[tuple[int, int]],
        values: Sequence[Buffer | None],
    ) -> list[int | None]:
        """Write the pinned ``values`` into their rooms at ``spans`` of the
        region, off the event loop, and unpin them; the bytes written per key,
        None for a block the daemon does not have."""
        try:
            region = self._region_of(owner, region_id, spans)
            for i, (value, (_, room)) in enumerate(zip(values, spans, strict=True)):
                if value is not None and len(value) > room:
                    raise BadArgumentError(
                        f"block {i} is {len(value)} bytes; its room holds {room}"
                    )
        except BaseException:
            self._unpin(keys, values)
            raise
        present = [(v, off) for v, (off, _) in zip(values, spans, strict=True) if v is not None]

        def copy() -> Steps[None]:
            for value, offset in present:
                view = memoryview(value).cast("B")
                for at in range(0, len(view), LOOP_STEP):
                    _write_from(region, [(view[at : at + LOOP_STEP], offset + at)])
                    yield

        await self._copy(region, copy(), lambda: self._unpin(keys, values))
        self._unpin(keys, values)
        self.region_bytes_out += sum(len(v) for v, _ in present)
        return [None if v is None else len(v) for v in values]

    async def _copy(self, region: Region, copy: Steps[T], release: Callable[[], None]) -> T:
        """``copy``'s steps while ``region`` is in use; see :class:`Copier`."""
        region.busy += 1

        def abandoned() -> None:
            release()
            self._let_go(region)

        try:
            result = await self.copier.run(copy, abandoned)
        except OSError as exc:
            raise TierError(f"region {region.region_id}: {exc}") from exc
        self._let_go(region)
        return result

    def _let_go(self, region: Region) -> None:
        region.busy -= 1
        if region.closed and region.busy == 0:
            _close(region)

    def _drop_region(self, region: Region) -> None:
        del self._regions[region.region_id]
        self._tokens.pop(region.token, None)
        region.closed = True
        if region.busy == 0:
            _close(region)

    # -- lifecycle

    def connection_closed(self, owner: ConnId) -> None:
        self.leases.close(owner)
        ready = self._prepared.pop(owner, None)
        if ready is not None:  # never handed out: no writer can be in it
            self._drop_staged(ready)
        self._free_region_rooms(owner)
        for offset in [o for o, r in self._rooms.items() if r.owner == owner]:
            self._free_room(offset)
        if owner in self._places_of:
            deadline = self._now() + self.staging_timeout
            for offset in [o for o, r in self._places.items() if r.owner == owner]:
                room = self._unplace(offset)
                room.deadline = deadline
                self._quarantine.append(room)
        for region in [r for r in self._regions.values() if r.owner == owner]:
            self._drop_region(region)

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
        if self._quarantine and self._quarantine[0].deadline <= now:
            done = [r for r in self._quarantine if r.deadline <= now]
            self._quarantine = [r for r in self._quarantine if r.deadline > now]
            for room in done:
                assert room.view is not None
                self._drop_staged(room.view)

    def close(self) -> None:
        """End every lease and room (shutdown)."""
        for owner in {lease.owner for lease in self.leases.live()}:
            self.leases.close(owner)
        for offset in list(self._rooms):
            self._free_room(offset)
        for offset in list(self._places):
            self._quarantine.append(self._unplace(offset))
        for owner in list(self._prepared):
            self._drop_staged(self._prepared.pop(owner))
        for owner in list(self._region_rooms):
            self._free_region_rooms(owner)
        for room in self._quarantine:
            assert room.view is not None
            self._drop_staged(room.view)
        self._quarantine = []
        for region in list(self._regions.values()):
            self._drop_region(region)
        self.copier.close()

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
            in_place_rooms=len(self._places),
            in_place_quarantined=len(self._quarantine),
            in_place_prepared=len(self._prepared),
            in_place_commits=self.in_place_commits,
            regions=len(self._regions),
            regions_mapped=sum(r.base != 0 for r in self._regions.values()),
            region_bytes_in=self.region_bytes_in,
            region_bytes_out=self.region_bytes_out,
            region_rooms=sum(map(len, self._region_rooms.values())),
            region_rooms_used=self.region_rooms_used,
            copy_threads=self.copier.threads,
            copy_steps=self.copier.steps,
        )


def may_map(fd: int, st: os.stat_result, uid: int | None) -> bool:
    """Whether the daemon may map a client's region file and copy with memcpy.

    A mapped file that shrinks under a copy faults the daemon (SIGBUS), so
    it maps only a file nobody it does not already trust can shrink: a memfd
    sealed against shrinking (``F_SEAL_SHRINK``), or a file of the daemon's
    own user handed over by a client of that user (who could stop the
    daemon anyway) that no other user can open: writable by its owner alone,
    or without a name (a memfd or unlinked file: only the processes holding
    it, and whoever may trace them, reach it). Any other region is read and
    written with ``pread``/``pwrite``, where a shrunk file is a clear error."""
    seals = getattr(fcntl, "F_GET_SEALS", None)
    if seals is not None:
        with contextlib.suppress(OSError):  # (not a memfd: no seals)
            if fcntl.fcntl(fd, seals) & fcntl.F_SEAL_SHRINK:
                return True
    me = os.geteuid()
    private = st.st_nlink == 0 or not st.st_mode & 0o022
    return uid == me and st.st_uid == me and private


def may_write_in_place(uid: int | None, enabled: bool = True) -> bool:
    """Whether a client of ``uid`` may write blocks into RAM's arena in place
    (and gets the arena writable at the handoff): only a process of the
    daemon's own user, which could already open the daemon's arena through
    ``/proc/<pid>/fd``, stop the daemon or rewrite its files; every other
    user writes through staging, whose bytes the daemon copies and checks."""
    return enabled and uid is not None and uid == os.geteuid()


def _close(region: Region) -> None:
    if region.mapping is not None:
        region.mapping.close()
        region.mapping, region.base, region.writable = None, 0, False
    if region.fd >= 0:
        os.close(region.fd)
        region.fd = -1


def _check_size(region: Region, offsets: Sequence[int], lengths: Sequence[int]) -> None:
    """Before a memcpy from a mapping: the file still holds every block
    (a same-user client that shrinks it mid-copy faults the daemon; one
    that shrank it before is told here)."""
    end = max((o + n for o, n in zip(offsets, lengths, strict=True)), default=0)
    if end > os.fstat(region.fd).st_size:
        raise OSError(f"the region ends before {end}: was it shrunk?")


def _read_into(
    region: Region, views: Sequence[memoryview], offsets: Sequence[int], *, streamed: bool
) -> None:
    """Fill each view from the region at its offset (a copy's step),
    a mapped region's copies ``streamed`` past the caches (kvtier.blockcopy)."""
    if region.base:
        _check_size(region, offsets, [len(v) for v in views])
        for view, offset in zip(views, offsets, strict=True):
            if streamed:
                source = (ctypes.c_char * len(view)).from_address(region.base + offset)
                blockcopy.copy_into(view, memoryview(source))
            else:
                ctypes.memmove(addresses.address_of(view)[0], region.base + offset, len(view))
        return
    fd = region.fd
    for view, offset in zip(views, offsets, strict=True):
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                raise OSError(f"the region ends before {offset + len(view)}: was it shrunk?")
            done += n


def _write_from(region: Region, blocks: Sequence[tuple[Buffer, int]]) -> None:
    """Write each block into the region at its offset (a copy's step)."""
    if region.base and region.writable:
        _check_size(region, [o for _, o in blocks], [len(v) for v, _ in blocks])
        for value, offset in blocks:
            address, length = addresses.address_of(value)
            ctypes.memmove(region.base + offset, address, length)
        return
    fd = region.fd
    for value, offset in blocks:
        view = memoryview(value)
        done = 0
        while done < len(view):
            done += os.pwritev(fd, [view[done:]], offset + done)


def _nothing() -> None:
    """The store of a :class:`Copied` whose blocks are stored already."""


class Copier:
    """Where region copies run: on the event loop, one step of at most
    :data:`~kvtier.model.LOOP_STEP` bytes a loop step (``threads`` 0), or
    each copy whole in one of ``threads`` worker threads.

    On a machine of few cores the loop is the better place (docs/shared-memory.md,
    7.): a worker thread is one more thread wanting a core while writers
    keep them busy, and each copy costs two wake-ups, so a lookup's caller
    waits longer for its turn; on the loop the copies of all clients take
    one core at most, and other requests are answered between steps.

    Invariants: a copy that does not return runs its ``abandoned`` exactly
    once, and never while a step of it may still touch its memory (a copy on
    the loop takes no step after it is cancelled; a cancelled copy in a
    thread runs it once the thread ends); ``steps`` counts the steps taken
    on the loop; ``running`` the copies begun and not ended. Raises what a
    step raises; never swallows a cancellation.
    """

    def __init__(self, threads: int) -> None:
        #: worker threads copies run in (0: on the loop)
        self.threads = threads
        self._executor = (
            ThreadPoolExecutor(threads, thread_name_prefix="kvtier-copy") if threads else None
        )
        self.running = 0
        self.steps = 0

    def __repr__(self) -> str:
        where = f"threads={self.threads}" if self.threads else "on-loop"
        return f"<Copier {where} running={self.running} steps={self.steps}>"

    async def run(self, steps: Steps[T], abandoned: Callable[[], None]) -> T:
        """The copy's result once its every step has run; see the class."""
        self.running += 1
        try:
            if self._executor is None:
                return await self._on_loop(steps, abandoned)
            return await self._in_thread(steps, abandoned)
        finally:
            self.running -= 1

    async def _on_loop(self, steps: Steps[T], abandoned: Callable[[], None]) -> T:
        result: list[T] = []
        try:
            for _ in _collect(steps, result):
                self.steps += 1
                await anyio.lowlevel.checkpoint()  # other requests between steps
        except BaseException:
            steps.close()
            abandoned()
            raise
        return result[0]

    async def _in_thread(self, steps: Steps[T], abandoned: Callable[[], None]) -> T:
        done = asyncio.get_running_loop().run_in_executor(self._executor, _all_of, steps)
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:

            def ended(fut: asyncio.Future[T]) -> None:
                if not fut.cancelled():
                    fut.exception()  # read: nobody is left to report it to
                abandoned()

            done.add_done_callback(ended)
            raise
        except BaseException:
            abandoned()
            raise

    def close(self) -> None:
        """Stop the threads, once the copies they run have ended (shutdown)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)


def _collect(steps: Steps[T], result: list[T]) -> Iterator[None]:
    """``steps``, their result appended to ``result`` after the last."""
    result.append((yield from steps))


def _all_of(steps: Steps[T]) -> T:
    """Every step of a copy, one after another (a worker thread's work)."""
    result: list[T] = []
    for _ in _collect(steps, result):
        pass
    return result[0]

"""Clients' regions: memory files of theirs the daemon copies blocks to and from.

A client whose blocks already sit in a memory file of its own (an engine's
host pool in a memfd) registers that file as a *region*: the daemon then
copies blocks itself, from the region into their RAM slots (PUT_REGION)
and from RAM into the region (GET_REGION), so the bytes cross no socket:
on the event loop, :data:`~kvtier.model.LOOP_STEP` bytes a loop step, or
each copy whole in a worker thread (:class:`~kvtier.core.shared.copier.Copier`),
with memcpy from its own mapping of a file that no process it does not
already trust can shrink (:func:`may_map`: a mapped file shrunk under a
copy faults the daemon), else with ``pread``/``pwrite`` (a read past the
end is a clear error). It uses the descriptor with the access the client
opened it with.

Invariants: a connection holds at most ``MAX_REGIONS``; a staged slot or a
pinned block a copy works on outlives the copy, even when its request is
cancelled (a copy on the loop takes no step after that, one in a thread
ends first), and a region's descriptor is closed (and its mapping
unmapped) only once no copy uses it; a PUT_REGION's keys read PENDING
while their copy runs, and a copy that fails stores nothing and ends
their reservations; rooms made ahead for a connection's next PUT_REGION
are never handed out before it and are freed at once when it goes, or
when RAM needs their room (a :class:`~kvtier.tiers.ram.Keeper`).
Imports the core's checks and stores, the copier, the RAM tier and the
shared records.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import itertools
import logging
import mmap
import os
import secrets
import stat
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import xxhash

from kvtier import addresses, blockcopy
from kvtier.core.checks import check_keys, check_sizes
from kvtier.core.shared.copier import Copier, Steps
from kvtier.core.shared.inplace import nothing
from kvtier.core.stores import Stores
from kvtier.errors import BadArgumentError, ForbiddenError, NoCapacityError, TierError
from kvtier.model import LOOP_STEP, Buffer, ConnId, Copied, Limits, PutStatus
from kvtier.tiers.ram import HeldKind, RamTier, Slots

log = logging.getLogger("kvtier.shared")

T = TypeVar("T")

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


class Regions:
    """Clients' regions, and the copies between them and RAM."""

    def __init__(
        self,
        ram: RamTier,
        slots: Slots,
        stores: Stores,
        unpin: Callable[[Sequence[bytes], Sequence[Buffer | None]], None],
        limits: Limits,
        copier: Copier,
    ) -> None:
        self.ram = ram
        self.slots = slots
        self.stores = stores
        self._unpin = unpin
        self._limits = limits
        #: where the copies run (on the loop unless given threads)
        self.copier = copier
        #: regions by id, and those still waiting for their descriptor by token
        self._regions: dict[int, Region] = {}
        self._tokens: dict[bytes, Region] = {}
        self._ids = itertools.count(1)
        #: the rooms each connection's next PUT_REGION takes first, made once
        #: the answer to its last one had left: as many as it stored, of their
        #: one length (never handed out, so freed at once when it goes)
        self._rooms: dict[ConnId, list[memoryview]] = {}
        self.rooms_used = 0
        #: bytes copied out of regions into RAM, and into them
        self.bytes_in = 0
        self.bytes_out = 0
        #: stores refused: a block that did not match its checksum after the copy
        self.refused = 0

    def __repr__(self) -> str:
        return (
            f"<Regions {len(self._regions)} rooms={sum(map(len, self._rooms.values()))} "
            f"{self.copier!r}>"
        )

    def __len__(self) -> int:
        return len(self._regions)

    @property
    def mapped(self) -> int:
        """Regions the daemon maps and copies with memcpy (:func:`may_map`)."""
        return sum(r.base != 0 for r in self._regions.values())

    @property
    def rooms(self) -> int:
        """Rooms made ahead for connections' next PUT_REGION, held now."""
        return sum(map(len, self._rooms.values()))

    def open(self, owner: ConnId) -> tuple[int, bytes]:
        """A new region of ``owner``'s: its id, and the token that hands its
        descriptor over the handoff socket (:meth:`attach_region`)."""
        if sum(r.owner == owner for r in self._regions.values()) >= MAX_REGIONS:
            raise NoCapacityError(f"a connection holds at most {MAX_REGIONS} regions")
        region = Region(next(self._ids), owner, secrets.token_bytes(16))
        self._regions[region.region_id] = region
        self._tokens[region.token] = region
        return region.region_id, region.token

    def attach(self, token: bytes, fd: int, uid: int | None = None) -> int:
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

    def _of(self, owner: ConnId, region_id: int, spans: Sequence[tuple[int, int]]) -> Region:
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

    def check(self, owner: ConnId, region_id: int, spans: Sequence[tuple[int, int]]) -> None:
        """Refuse a GET_REGION before it pins anything."""
        self._of(owner, region_id, spans)

    async def put(
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
        region = self._of(owner, region_id, spans)
        check_sizes(self._limits, [n for _, n in spans], "value")
        statuses = [PutStatus.EXISTS] * len(keys)
        # (a touch of each key held, as a PUT of it would)
        todo = [i for i, key in enumerate(keys) if self.ram.get(key) is None]
        if not todo:
            return Copied(statuses, nothing)
        lengths = [spans[i][1] for i in todo]
        staged = self.stores.stage_many(
            lengths, [keys[i] for i in todo], self._rooms_for(owner, lengths)
        )
        views = [
            view if view is not None else memoryview(bytearray(spans[i][1]))
            for i, view in zip(todo, staged, strict=True)
        ]
        offsets = [spans[i][0] for i in todo]
        wanted = None if checksums is None else [checksums[i] for i in todo]
        arriving = [keys[i] for i in todo]
        self.stores.reserve_arriving(arriving, owner)

        def release() -> None:
            for view in views:
                self.stores.drop_staged(view)  # unless stored

        def abandoned() -> None:
            release()
            self.stores.abort(arriving, owner)  # (those stored ended when stored)

        def copy() -> Steps[list[int]]:
            torn: list[int] = []
            if wanted is None:  # several blocks' pieces a step, streamed into the slots
                for step in _steps(views, offsets, [s is not None for s in staged]):
                    for piece, _, fault in step:
                        if fault:
                            blockcopy.fault_in(piece)
                    _read_into(
                        region, [p for p, _, _ in step], [o for _, o, _ in step], streamed=True
                    )
                    yield
                return torn
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
            self.refused += 1
            raise BadArgumentError(
                f"block {todo[torn[0]]} does not match its checksum after the copy "
                "(changed while it was read, or a wrong checksum); nothing stored"
            )

        def store() -> list[PutStatus]:
            try:
                stored = self.stores.put(
                    arriving, views, copy=True
                )  # (each store ends its reservation)
            except BaseException:
                self.stores.abort(arriving, owner)
                raise
            finally:
                release()
            self.bytes_in += sum(len(v) for v in views)
            return stored

        if any(view is None for view in staged):
            # A block without a slot makes room as it is stored, which can
            # fail: stored before the answer.
            for i, status in zip(todo, store(), strict=True):
                statuses[i] = status
            return Copied(statuses, nothing)
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
                self._make_rooms(owner, lengths, namespace)

        stored = [k for k, s in zip(arriving, answered, strict=True) if s is PutStatus.STORED]
        return Copied(statuses, store_answered, stored)

    def _rooms_for(self, owner: ConnId, lengths: Sequence[int]) -> list[memoryview]:
        """The rooms made for ``owner``'s PUT_REGION of blocks of ``lengths``:
        one for each of its first blocks while they are of the rooms' length;
        rooms it does not take are freed."""
        rooms = self._rooms.pop(owner, None)
        if not rooms:
            return []
        length = len(rooms[0])
        n = 0
        for wanted in lengths[: len(rooms)]:
            if wanted != length:
                break
            n += 1
        for view in rooms[n:]:
            self.stores.drop_staged(view)
        self.rooms_used += n
        return rooms[:n]

    def _make_rooms(self, owner: ConnId, lengths: Sequence[int], namespace: bytes) -> None:
        """Rooms for ``owner``'s next PUT_REGION, made after the answer to
        this one (which did not wait for their evictions): one for each block
        of ``lengths``, when they are of one length, slots of the arena, and
        with every connection's rooms take at most 1/REGION_ROOMS_SHARE of
        RAM. None where namespaces have shares (a share counts blocks, not
        rooms: docs/tenancy.md)."""
        if owner in self._rooms or not lengths or self.ram.budget.shares is not None:
            return
        length = lengths[0]
        if length < self.ram.min_slot or any(n != length for n in lengths):
            return
        size = self.slots.block_size
        held = sum(len(rooms) * size(len(rooms[0])) for rooms in self._rooms.values())
        if held + len(lengths) * size(length) > self.ram.capacity // REGION_ROOMS_SHARE:
            return
        rooms = self.stores.stage_rooms(length, len(lengths), namespace)
        if rooms:
            self._rooms[owner] = rooms

    # -- the room it holds (a Keeper of the RAM tier)

    def held(self) -> dict[HeldKind, int]:
        size = self.slots.block_size
        return {HeldKind.READY: sum(len(r) * size(len(r[0])) for r in self._rooms.values() if r)}

    yields = HeldKind.READY

    def reclaim(self, need: int) -> int:
        """Give back every connection's rooms made ahead (never handed out)."""
        freed = self.held()[HeldKind.READY]
        for owner in list(self._rooms):
            self._free_rooms(owner)
        return freed

    def _free_rooms(self, owner: ConnId) -> None:
        """``owner``'s rooms made ahead, never handed out: freed at once."""
        for view in self._rooms.pop(owner, ()):
            self.stores.drop_staged(view)

    async def get(
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
            region = self._of(owner, region_id, spans)
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
        self.bytes_out += sum(len(v) for v, _ in present)
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

    def _drop(self, region: Region) -> None:
        del self._regions[region.region_id]
        self._tokens.pop(region.token, None)
        region.closed = True
        if region.busy == 0:
            _close(region)

    def connection_closed(self, owner: ConnId) -> None:
        self._free_rooms(owner)
        for region in [r for r in self._regions.values() if r.owner == owner]:
            self._drop(region)

    def close(self) -> None:
        """Drop every region and room (shutdown), then stop the copier."""
        for owner in list(self._rooms):
            self._free_rooms(owner)
        for region in list(self._regions.values()):
            self._drop(region)
        self.copier.close()


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


def _steps(
    views: Sequence[memoryview], offsets: Sequence[int], faults: Sequence[bool]
) -> Iterator[list[tuple[memoryview, int, bool]]]:
    """A copy's steps: the blocks' pieces (each view's, with its offset in
    the region and whether its slot is faulted in first), as many whole
    pieces a step as fit in LOOP_STEP bytes, a block larger than that in
    pieces of LOOP_STEP; every byte of every view in exactly one piece, in
    order."""
    step: list[tuple[memoryview, int, bool]] = []
    size = 0
    for view, offset, fault in zip(views, offsets, faults, strict=True):
        for at in range(0, len(view), LOOP_STEP):
            piece = view[at : at + LOOP_STEP]
            if step and size + len(piece) > LOOP_STEP:
                yield step
                step, size = [], 0
            step.append((piece, offset + at, fault))
            size += len(piece)
    if step:
        yield step


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

"""Changes to what the daemon holds: PUT (and the arena rooms bodies are
received into), durability, DELETE, and the reservations that announce a
write (RESERVE, ABORT, a writer's connection closing).

:class:`Stores` owns the write propagation (what each lower tier receives,
by its write policy); the pending-write table it reserves in is shared
with the loads (a promotion is a pending write) and the answers (a pending
key reads PENDING).

Invariants: a block is stored into RAM first, and a pending write of its
key ends in the same step (COMPLETED, or ABORTED when RAM refused it);
RAM's evictions reach the write-back tiers; a reservation that holds room
keeps it until its body has an arena slot or is stored, so a block is
counted once from RESERVE to its last byte; a durable PUT is acknowledged
only once every block is on a tier that outlives the daemon, never when
one left RAM unwritten;
a peer's push is kept locally and never written back out to a remote tier.
Imports the core's pure parts, the tiers and the shared records.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Sequence

from kvtier.core.checks import check_keys, check_seconds, check_sizes, check_values
from kvtier.core.context import Context
from kvtier.core.lookup import Where
from kvtier.core.propagation import Propagation, Writer
from kvtier.core.writes import End
from kvtier.core.writing import Deadline
from kvtier.errors import (
    BadArgumentError,
    KvtierError,
    NoCapacityError,
    TierError,
    ValueTooLargeError,
)
from kvtier.model import Buffer, ConnId, PutHint, PutStatus, Reserve, ReserveStatus

log = logging.getLogger("kvtier.service")


class Stores:
    """PUT, staging rooms, durability, DELETE, RESERVE/ABORT."""

    def __init__(
        self,
        c: Context,
        propagation: Propagation,
    ) -> None:
        #: what every part of the service works with
        self.c = c
        self.propagation = propagation

    def __repr__(self) -> str:
        return f"<Stores {self.c.pending!r} writers={len(self.propagation.writers)}>"

    # ------------------------------------------------------------ PUT

    def put(
        self,
        keys: Sequence[bytes],
        values: Sequence[Buffer],
        *,
        source: str | None = None,
        copy: bool = False,
        hints: bytes | None = None,
    ) -> list[PutStatus]:
        """Store into RAM; lower tiers follow their write policy.

        ``source``: the tier the blocks came from (a peer's push): they are
        kept locally and never written back out to a remote tier. ``copy``:
        the values' memory is about to be reused; RAM keeps copies.
        ``hints``: one :class:`~kvtier.model.PutHint` per key (a TAIL block
        is admitted at the cold end of RAM's eviction order)."""
        check_keys(self.c.limits, keys)
        check_values(self.c.limits, values, self.c.ram.capacity)
        if len(keys) == 1:
            cold = hints is not None and bool(hints[0] & PutHint.TAIL)
            self.c.counters.put_tail.value += cold
            return [self.store(keys[0], values[0], source, copy, cold)]
        self.evicted(self.c.ram.make_room(keys, values))  # one eviction pass for the batch
        if hints is None:
            colds = [False] * len(keys)
        else:
            colds = [bool(h & PutHint.TAIL) for h in hints]
            self.c.counters.put_tail.value += sum(colds)
        # RAM admits a batch tail first (its head is then its most recent
        # block: the tail goes first, none is left behind a missing one);
        # the tiers below get it head first (an outage or a crash cuts a
        # chain's tail, never its head)
        statuses: list[PutStatus] = []
        try:
            # The batch's blocks are told held before its reservations end
            # (a reader of the feed never sees them neither held nor pending).
            with self.c.pending.table.held_back(), self.c.ram.budget.tail_first():
                for i in reversed(range(len(keys))):
                    statuses.append(self.store(keys[i], values[i], source, copy, colds[i], False))
        finally:  # (what RAM took flows down, even when a later block fails)
            statuses.reverse()
            done = keys[len(keys) - len(statuses) :]
            local = self.propagation.local
            flows = source is None or (local and source not in local)
            for key, status in zip(done, statuses, strict=True):
                if flows and status is PutStatus.STORED:
                    self._flow_down(key, source)
        return statuses

    def store(
        self,
        key: bytes,
        value: Buffer,
        promoted_from: str | None = None,
        copy: bool = False,
        cold: bool = False,
        flow: bool = True,
    ) -> PutStatus:
        """Store into RAM and complete a pending write of ``key``, if any;
        ``flow``: the block flows down now (else its caller sends it)."""
        res = self.c.pending.table.get(key)
        if res is not None:
            self.c.pending.claim(res)
        try:
            stored, evicted = self.c.ram.put(key, value, copy=copy, cold=cold)
        except KvtierError:
            if res is not None:
                self.c.pending.end(res, End.ABORTED)
            raise
        if res is not None:
            self.c.pending.end(res, End.COMPLETED)
        if stored and self.c.ram.arriving_leases.waiting:  # (a peer's lease came first)
            self.c.ram.lease_landed(key)
        self.evicted(evicted)
        # A client's block flows down by each tier's policy; a promoted one is
        # kept on the local disk when it came from a remote tier, else nowhere.
        local = self.propagation.local
        if stored and flow and (promoted_from is None or (local and promoted_from not in local)):
            self._flow_down(key, promoted_from)
        return PutStatus.STORED if stored else PutStatus.EXISTS

    def _flow_down(self, key: bytes, promoted_from: str | None) -> None:
        kept = self.c.ram.peek(key)
        # (None: its namespace was over its max with it, and it went at
        # once, demoted with the evicted where the policy says so)
        if kept is not None:
            self.propagation.stored(key, kept, promoted_from)

    def evicted(self, evicted: list[tuple[bytes, Buffer]]) -> None:
        """RAM evicted these (the holdings heard of it): write-back tiers take
        them, and the tiers below keep the leased ones."""
        if evicted:
            leased = self.c.ram.retention.evicted_leased
            broken = self.propagation.evicted(evicted, leased)
            if leased:
                self.c.counters.retention_broken.value += broken
                leased.clear()

    def write_room(self) -> asyncio.Future[None] | None:
        """None while every local tier can queue the writes stores make;
        else the future that resolves once it can (:meth:`Propagation.room`)."""
        return self.propagation.room()

    # ------------------------------------------------------------ rooms

    def stage(self, length: int, key: bytes) -> memoryview | None:
        """Room in RAM's shared arena to receive a PUT body of ``length`` bytes
        for ``key`` in place; None when it must be received into a buffer of
        its own (or ``key`` is resident: the body will not be kept). Give it
        back with :meth:`drop_staged` unless a PUT stores it.

        A reservation of ``key`` that holds room gives it up here when the
        body gets a slot: the slot is that room, so the block is counted once
        from RESERVE to the last byte of its PUT. A body received into a
        buffer of its own leaves the reservation its room until it is
        stored, so it is counted all along too."""
        if self.c.ram.contains(key):
            return None
        res = self.c.pending.table.get(key)
        if res is None or not res.size or not self.c.ram.stages(length):
            return self.stage_room(length, key)
        held = res.size
        self.c.pending.claim(res)
        view = self.stage_room(length, key)
        if view is None and self.c.pending.table.get(key) is res:
            self.c.pending.hold(res, held)  # no slot after all: the room stays the reservation's
        return view

    def stage_room(self, length: int, namespace: bytes) -> memoryview | None:
        """Room in RAM's shared arena for a block of ``length`` bytes, made in
        the share of ``namespace``'s namespace (a key of it, or its key
        prefix: a block whose key comes later, written in place by a client)
        as its PUT would make it; None when there is none. Give it back with
        :meth:`drop_staged` unless a PUT stores it."""
        view, evicted = self.c.ram.stage(length, namespace)
        self.evicted(evicted)
        return view

    def stage_many(
        self,
        lengths: Sequence[int],
        keys: Sequence[bytes],
        ready: Sequence[memoryview] = (),
    ) -> list[memoryview | None]:
        """:meth:`stage` for a batch, with the room for all of it made first
        in one eviction pass (:meth:`RamTier.make_room_for`). ``ready``:
        rooms made ahead (:meth:`stage_rooms`), one for each of the first
        blocks, of their lengths; the rest get rooms now."""
        ram, table = self.c.ram, self.c.pending.table
        for key in keys:
            res = table.get(key)
            if res is not None and res.size:  # its room is the slot's now
                self.c.pending.claim(res)
        n = len(ready)
        lengths, keys = lengths[n:], keys[n:]
        self.evicted(ram.make_room_for(keys, lengths))
        staged: list[memoryview | None] = list(ready)
        staged.extend(self.stage(length, key) for length, key in zip(lengths, keys, strict=True))
        return staged

    def stage_rooms(self, length: int, count: int, namespace: bytes) -> list[memoryview]:
        """``count`` rooms of ``length`` bytes for blocks whose keys come later
        (:meth:`stage_room`), made in one eviction pass; fewer when RAM has
        no more."""
        self.evicted(self.c.ram.make_room_for([namespace] * count, [length] * count))
        rooms = []
        for _ in range(count):
            view = self.stage_room(length, namespace)
            if view is None:
                break
            rooms.append(view)
        return rooms

    def drop_staged(self, value: Buffer) -> None:
        self.c.ram.drop_staged(value)

    # ------------------------------------------------------------ durability

    def make_durable(
        self, keys: Sequence[bytes], values: Sequence[Buffer | None]
    ) -> Awaitable[None]:
        """A durable PUT: the awaitable that returns once the blocks are on a
        tier that outlives the daemon; call it in the same step as the store.
        That tier is the disk (per its fsync policy); without one, the first
        remote tier that outlives the daemon (an object store: its write in
        flight is waited for, or one is made); without either, the request
        is refused (:class:`BadArgumentError`, the blocks stay stored as by
        a plain PUT).

        What RAM holds under each key is held from now until written, so no
        eviction between the store and the write can lose it; a value in the
        shared arena that RAM no longer holds may be reused already, so only a
        value of the caller's own memory stands in for it. A block found in
        neither fails the request: durability is never acknowledged unmet."""
        disk, ram = self.c.disk, self.c.ram
        remote = self.propagation.durable_writer() if disk is None else None
        if disk is None and remote is None:
            raise BadArgumentError(
                "DURABLE needs a tier that outlives the daemon, and this one has "
                "no disk tier and no object store: the blocks are stored, not durable"
            )
        held: list[tuple[bytes, Buffer]] = []
        missing: list[bytes] = []
        for key, value in zip(keys, values, strict=True):
            kept = ram.peek(key)
            if kept is None and value is not None and not ram.in_arena_memory(value):
                kept = value
            if kept is None:
                missing.append(key)
                continue
            ram.hold(kept)
            held.append((key, kept))
        return self._write_durably(held, missing, remote)

    async def _write_durably(
        self, held: list[tuple[bytes, Buffer]], missing: list[bytes], remote: Writer | None
    ) -> None:
        disk, ram = self.c.disk, self.c.ram
        try:
            if disk is not None:  # (each write announces itself to the holdings)
                await asyncio.gather(*(disk.write(k, v, durable=True) for k, v in held))
            elif remote is not None:
                durably = self.propagation.durably
                await asyncio.gather(*(durably(remote, k, v) for k, v in held))
        finally:
            for _, v in held:
                ram.let_go(v)
        if missing:
            raise TierError(
                f"{len(missing)} block(s) left RAM before reaching a durable tier (first: "
                f"{missing[0].hex()}); they are not durable, store them again"
            )

    # ------------------------------------------------------------ DELETE

    def delete(
        self, keys: Sequence[bytes], *, remote: bool = True
    ) -> list[bool] | Awaitable[list[bool]]:
        """Delete ``keys`` from every tier: True where a tier held the key. The
        local tiers answer now; with remote tiers (``remote``), the awaitable
        that also asks them."""
        check_keys(self.c.limits, keys)
        deleted = self.delete_local(keys)
        self.propagation.forget(keys)  # (a block deleted is owed to no tier)
        disk = self.c.disk
        # Answered once the disk's files are gone and journalled: a block
        # deleted never comes back with a restart.
        unlinks = disk.in_flight(keys) if disk is not None else []
        remotes = remote and bool(self.c.probing.slots)
        if not remotes and not unlinks:
            return deleted
        return self._delete_rest(keys, deleted, unlinks, remotes)

    async def _delete_rest(
        self,
        keys: Sequence[bytes],
        deleted: list[bool],
        unlinks: list[asyncio.Future[None]],
        remotes: bool,
    ) -> list[bool]:
        if unlinks:
            await asyncio.wait(unlinks)  # (never cancels them)
        if not remotes:
            return deleted
        slots = self.c.probing.slots
        results = await asyncio.gather(
            *(slot.tier.delete(keys) for slot in slots), return_exceptions=True
        )
        for slot, result in zip(slots, results, strict=True):
            if isinstance(result, BaseException):
                if isinstance(result, asyncio.CancelledError):
                    raise result
                raise TierError(f"{slot.name}: delete failed: {result}") from result
            deleted = [a or bool(b) for a, b in zip(deleted, result, strict=True)]
        for key in keys:
            self.c.probing.invalidate(key)
        return deleted

    def delete_local(self, keys: Sequence[bytes]) -> list[bool]:
        """Delete from RAM and disk only."""
        disk = self.c.disk
        out = [self.c.ram.remove(k) | (disk is not None and disk.discard(k)) for k in keys]
        for key in keys:  # (the held ones were by the holdings; the others' kept verdicts too)
            self.c.probing.invalidate(key)
        return out

    # ------------------------------------------------------------ RESERVE / ABORT

    def reserve(self, req: Reserve, owner: ConnId) -> list[ReserveStatus]:
        check_keys(self.c.limits, req.keys)
        check_seconds("deadline", req.deadline)
        check_sizes(self.c.limits, req.sizes)
        deadline = req.deadline or self.c.cfg.pending_deadline
        now = self.c.now()
        statuses: list[ReserveStatus] = []
        locate = self.c.locator.locate
        batch = Deadline()  # (one timer for the request's keys)
        for key, size in zip(req.keys, req.sizes, strict=True):
            where = locate(key, now).where
            if where is Where.RAM or where is Where.DISK or where is Where.REMOTE:
                statuses.append(ReserveStatus.PRESENT)
                continue
            if where is Where.PENDING:
                statuses.append(ReserveStatus.PENDING)
                continue
            if size:
                try:
                    evicted = self.c.ram.reserve(size, key)
                except ValueTooLargeError:
                    statuses.append(ReserveStatus.REFUSED)
                    self.c.counters.reservations.inc("refused")
                    continue
                except NoCapacityError:
                    # No room to hold (pinned blocks and other writers hold
                    # it): granted all the same, without room, so readers
                    # wait for this write rather than repeat it; its PUT
                    # makes its room when it arrives.
                    size, evicted = 0, []
                    self.c.counters.reservations.inc("without_room")
                self.evicted(evicted)  # announced, and written back where the policy says
            self.c.pending.reserve(key, owner, deadline, size, now, batch)
            statuses.append(ReserveStatus.GRANTED)
        granted = statuses.count(ReserveStatus.GRANTED)
        if granted:
            self.c.counters.reservations.inc("granted", n=granted)
        return statuses

    def reserve_arriving(self, keys: Sequence[bytes], owner: ConnId) -> None:
        """Reserve, without holding room, the ``keys`` whose blocks ``owner``
        is copying into their staged slots now (a PUT_REGION): other readers
        find them PENDING, not MISS, until they are stored (the store ends
        the reservation), the copy fails (:meth:`abort`) or the connection
        closes. Keys held anywhere, or already pending, are left as they are."""
        now = self.c.now()
        deadline = self.c.cfg.pending_deadline
        locate, pending = self.c.locator.locate, self.c.pending
        batch = Deadline()  # (one timer for the request's keys)
        granted = 0
        with pending.table.held_back():
            for key in keys:
                if key not in pending.table and locate(key, now).where is Where.ABSENT:
                    pending.reserve(key, owner, deadline, 0, now, batch)
                    granted += 1
        if granted:
            self.c.counters.reservations.inc("granted", n=granted)

    def abort(self, keys: Sequence[bytes], owner: ConnId) -> list[bool]:
        """End ``owner``'s reservations of ``keys``; other writers' are untouched."""
        check_keys(self.c.limits, keys)
        out = []
        table = self.c.pending.table
        with table.held_back():
            for key in keys:
                res = table.get(key)
                out.append(
                    res is not None and res.owner == owner and self.c.pending.end(res, End.ABORTED)
                )
        return out

    def connection_closed(self, owner: ConnId) -> None:
        """A writer went away: its reservations end at once."""
        n = self.c.pending.end_owned_by(owner, End.RELEASED)
        if n:
            log.info("%s closed; released %d reservation(s)", owner, n)

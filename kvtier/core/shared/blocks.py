"""Shared memory for same-host clients: one facade over its four parts.

* :class:`~kvtier.core.shared.leasing.Leasing`: leases on RAM blocks that
  clients read in place;
* :class:`~kvtier.core.shared.staging.StagingRooms`: rooms of the staging
  region, copied into RAM and checked at commit;
* :class:`~kvtier.core.shared.inplace.InPlaceRooms`: RAM slots the daemon's
  own user writes blocks into, which become the blocks;
* :class:`~kvtier.core.shared.regions.Regions`: clients' memory files the
  daemon copies blocks to and from.

Invariants (each part states its own): every lease, room and region of a
connection ends when the connection closes (an in-place room at once when
the writer's process is gone, else after a short quarantine: a thread of
it may still be copying); ``expire`` reclaims
what is past its deadline; ``close`` ends everything; ``stats`` shows what
is live. Imports the parts and the shared records; no sockets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvtier.core.checks import check_sizes
from kvtier.core.shared.copier import Copier
from kvtier.core.shared.inplace import QUARANTINE_SECONDS, InPlaceRooms
from kvtier.core.shared.leasing import Leasing
from kvtier.core.shared.regions import Regions
from kvtier.core.shared.staging import StagingRooms
from kvtier.core.stores import Stores
from kvtier.errors import BadArgumentError
from kvtier.model import Buffer, ConnId, Limits
from kvtier.tiers.ram import Arena, RamTier


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
    #: bytes from the start of the arena, and of the staging region, whose
    #: memory the daemon has allocated and mapped (``shared.preallocate``)
    arena_prepared_bytes: int
    staging_prepared_bytes: int
    #: the daemon is still allocating that memory (requests are slower
    #: meanwhile: the kernel zeroes each page it allocates)
    preparing: bool
    #: RAM slots clients write blocks into in place now, and those of closed
    #: connections waiting out their quarantine before they are freed
    in_place_rooms: int
    in_place_quarantined: int
    #: rooms made ahead for connections writing in place (one for each block
    #: of a connection's last commit, the next ones it will be handed)
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
    """Leases, staging rooms, in-place rooms and regions; a
    :class:`~kvtier.model.SharedService`."""

    def __init__(
        self,
        ram: RamTier,
        staging: Arena,
        *,
        stores: Stores,
        unpin: Callable[[Sequence[bytes], Sequence[Buffer | None]], None],
        now: Callable[[], float],
        lease_timeout: float,
        staging_timeout: float,
        limits: Limits,
        write_in_place: bool = True,
        copier: Copier | None = None,
    ) -> None:
        assert ram.slots is not None, "shared memory needs RAM in the arena"
        self.slots = ram.slots
        self._limits = limits
        self.leasing = Leasing(ram.slots, unpin, now, lease_timeout)
        self.staging = StagingRooms(ram, staging, stores, now, staging_timeout)
        self.in_place = InPlaceRooms(
            ram,
            ram.slots,
            stores,
            now,
            lambda: min(QUARANTINE_SECONDS, self.staging.timeout),
            write_in_place,
        )
        self.regions = Regions(ram, ram.slots, stores, unpin, limits, copier or Copier(0))
        # Rooms made ahead yield to a store that needs their room.
        ram.keepers += [self.in_place, self.regions]
        # The verbs are the parts' own.
        self.grant, self.unlease = self.leasing.grant, self.leasing.unlease
        self.commit, self.commit_in_place = self.staging.commit, self.in_place.commit
        self.commit_many_in_place = self.in_place.commit_many
        self.may_write_in_place = self.in_place.may_write
        self.open_region, self.attach_region = self.regions.open, self.regions.attach
        self.check_region, self.put_region = self.regions.check, self.regions.put
        self.get_region = self.regions.get

    def __repr__(self) -> str:
        return (
            f"<SharedBlocks {self.leasing!r} {self.staging!r} {self.in_place!r} {self.regions!r}>"
        )

    @property
    def lease_timeout(self) -> float:
        return self.leasing.timeout

    @lease_timeout.setter
    def lease_timeout(self, seconds: float) -> None:
        self.leasing.timeout = seconds

    @property
    def staging_timeout(self) -> float:
        return self.staging.timeout

    @staging_timeout.setter
    def staging_timeout(self, seconds: float) -> None:
        self.staging.timeout = seconds

    @property
    def write_in_place(self) -> bool:
        return self.in_place.enabled

    def stage(
        self, owner: ConnId, length: int, in_place: bool = False, namespace: bytes = b""
    ) -> int:
        """Room for a block of ``length`` bytes; returns its offset in the
        staging region, or with ``in_place`` in RAM's arena: a slot of RAM
        the client writes itself (the caller checked it may,
        :func:`~kvtier.core.shared.inplace.may_write_in_place`), which becomes
        the block at COMMIT. Its room is made in ``namespace``'s share (the
        connection's key prefix: docs/tenancy.md), as a PUT of the block
        would make it."""
        if length <= 0:
            raise BadArgumentError("STAGE needs a positive length")
        check_sizes(self._limits, [length], "value")
        if in_place:
            return self.in_place.place(owner, length, namespace)
        return self.staging.stage(owner, length)

    def unstage(self, owner: ConnId, offset: int, in_place: bool = False) -> bool:
        part = self.in_place if in_place else self.staging
        return part.unstage(owner, offset)

    def connection_closed(self, owner: ConnId, writer_gone: bool = False) -> None:
        """``owner`` closed (``writer_gone``: and its process has exited)."""
        self.leasing.connection_closed(owner)
        self.in_place.connection_closed(owner, writer_gone)
        self.regions.connection_closed(owner)
        self.staging.connection_closed(owner)

    def expire(self, now: float) -> None:
        """Revoke leases and reclaim rooms past their deadlines."""
        self.leasing.expire(now)
        self.staging.expire(now)
        self.in_place.expire(now)

    def close(self) -> None:
        """End every lease, room and region (shutdown)."""
        self.leasing.close()
        self.staging.close()
        self.in_place.close()
        self.regions.close()

    def stats(self) -> SharedStats:
        leases, staging, in_place, regions = self.leasing, self.staging, self.in_place, self.regions
        copier = regions.copier
        return SharedStats(
            leases=len(leases.table),
            leases_ended={end.value: n for end, n in leases.table.ended.items()},
            staging_rooms=len(staging),
            staging_allocated_bytes=staging.staging.allocator.allocated_bytes,
            staging_bytes=staging.staging.size,
            staging_expired=staging.expired,
            commits_refused=staging.refused + in_place.refused + regions.refused,
            leased_bytes=leases.leased_bytes,
            arena_bytes=self.slots.arena.size,
            arena_allocated_bytes=self.slots.arena.allocator.allocated_bytes,
            arena_prepared_bytes=self.slots.arena.prepared,
            staging_prepared_bytes=staging.staging.prepared,
            preparing=self.slots.arena.preparing or staging.staging.preparing,
            in_place_rooms=len(in_place),
            in_place_quarantined=in_place.quarantined,
            in_place_prepared=in_place.prepared,
            in_place_commits=in_place.commits,
            regions=len(regions),
            regions_mapped=regions.mapped,
            region_bytes_in=regions.bytes_in,
            region_bytes_out=regions.bytes_out,
            region_rooms=regions.rooms,
            region_rooms_used=regions.rooms_used,
            copy_threads=copier.threads,
            copy_steps=copier.steps,
        )

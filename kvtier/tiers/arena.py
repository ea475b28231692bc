"""The shared arena: RAM blocks in one memory file that same-host clients map.

One anonymous memory file (``memfd_create``) of a fixed size, mapped
read-write by the daemon; its descriptor can be handed to a client over
the Unix socket (SCM_RIGHTS), which maps it read-only and reads blocks in
place. Space is handed out by a :class:`~kvtier.tiers.extents.ExtentAllocator`;
a :class:`Slot` names a block's bytes. The arena never decides what to
evict: the tier's budget and eviction policy do, and free slots only when
no lease holds them (:mod:`kvtier.core.shared.leases`).

Linux only (``memfd_create``); where it is missing the RAM tier keeps its
blocks in process memory and clients use the socket path.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass

from kvtier.tiers.extents import ExtentAllocator


@dataclass(slots=True, frozen=True)
class Slot:
    offset: int
    length: int
    #: the arena bytes it occupies (``length`` rounded up by the allocator)
    size: int


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

    def __repr__(self) -> str:
        return f"<Arena fd={self.fd} {self.allocator!r}>"

    def allocate(self, length: int) -> Slot:
        """Room for ``length`` bytes; raises :class:`~kvtier.tiers.extents.OutOfArena`."""
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


def map_readonly(fd: int, size: int) -> mmap.mmap:
    """A client's read-only mapping of an arena handed to it."""
    return mmap.mmap(fd, size, prot=mmap.PROT_READ)

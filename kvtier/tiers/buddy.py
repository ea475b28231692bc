"""A buddy allocator over one byte range: the shared arena's bookkeeping. Pure.

The range is cut into pages of ``page`` bytes. A request is rounded up to
a power of two pages; a free block of the smallest order that fits is
split in halves until it is that size. A freed block merges with its buddy
(the other half of the block it was split from) whenever that buddy is
free, so freeing everything gives back the blocks the range started as.

A range that is not a power of two pages starts as several top blocks,
largest first, each aligned to its own size, so buddies never straddle two
of them.

Invariants (tested with random sequences): allocated blocks never overlap
and stay inside the range; ``free_bytes + allocated_bytes == size``;
after every block is freed the free lists equal the initial top blocks.
"""

from __future__ import annotations


class OutOfArena(Exception):
    """No free block is large enough (the range is full or fragmented)."""


class BuddyAllocator:
    def __init__(self, size: int, page: int = 4096) -> None:
        if page <= 0 or page & (page - 1):
            raise ValueError("page must be a power of two")
        pages = size // page
        if pages < 1:
            raise ValueError(f"a range of {size} bytes holds no {page}-byte page")
        self.page = page
        self.size = pages * page
        self.max_order = pages.bit_length() - 1
        #: free block offsets, by order (a block of order k is page << k bytes)
        self._free: list[set[int]] = [set() for _ in range(self.max_order + 1)]
        #: order of each allocated block, by offset
        self._allocated: dict[int, int] = {}
        self.allocated_bytes = 0
        offset = 0
        for order in range(self.max_order, -1, -1):
            if pages >> order & 1:
                self._free[order].add(offset)
                offset += page << order
        self._initial = [set(s) for s in self._free]

    def __repr__(self) -> str:
        return (
            f"<BuddyAllocator {self.allocated_bytes}/{self.size} bytes "
            f"blocks={len(self._allocated)} largest_free={self.largest_free}>"
        )

    @property
    def free_bytes(self) -> int:
        return self.size - self.allocated_bytes

    @property
    def largest_free(self) -> int:
        for order in range(self.max_order, -1, -1):
            if self._free[order]:
                return self.page << order
        return 0

    def block_size(self, size: int) -> int:
        """The bytes a request of ``size`` occupies (a power of two pages)."""
        return self.page << self._order(size)

    def _order(self, size: int) -> int:
        pages = max(1, -(-size // self.page))
        return (pages - 1).bit_length()

    def alloc(self, size: int) -> int:
        """The offset of a block of at least ``size`` bytes; raises :class:`OutOfArena`."""
        want = self._order(size)
        if want > self.max_order:
            raise OutOfArena(f"{size} bytes is more than the arena's {self.size}")
        order = want
        while order <= self.max_order and not self._free[order]:
            order += 1
        if order > self.max_order:
            raise OutOfArena(
                f"no free block of {self.page << want} bytes "
                f"({self.free_bytes} bytes free, largest {self.largest_free})"
            )
        offset = self._free[order].pop()
        while order > want:  # split, keeping the lower half
            order -= 1
            self._free[order].add(offset + (self.page << order))
        self._allocated[offset] = want
        self.allocated_bytes += self.page << want
        return offset

    def free(self, offset: int) -> None:
        """Give back the block at ``offset``, merging it with free buddies."""
        order = self._allocated.pop(offset, None)
        if order is None:
            raise ValueError(f"offset {offset} is not an allocated block")
        self.allocated_bytes -= self.page << order
        while order < self.max_order:
            buddy = offset ^ (self.page << order)
            if buddy not in self._free[order]:
                break
            self._free[order].discard(buddy)
            offset = min(offset, buddy)
            order += 1
        self._free[order].add(offset)

    def is_pristine(self) -> bool:
        """Whether nothing is allocated and every block has merged back."""
        return not self._allocated and self._free == self._initial

"""A page-granular extent allocator over one byte range: the arena's bookkeeping. Pure.

A request is rounded up to whole pages (a 300,000-byte block takes 74
pages of 4 KiB, 1% more, not the 512 KiB a power-of-two scheme would).
Free space is a set of extents, merged with their neighbours when freed.
A request takes a free extent of exactly its size when there is one (KV
blocks mostly share one size, so after warm-up nearly every request is an
exact fit, O(1)); otherwise the smallest larger extent, split at its start.

Invariants (tested with random sequences): allocated extents never
overlap and stay inside the range; ``free_bytes + allocated_bytes ==
size``; no two free extents touch (they would have been merged); after
every extent is freed one free extent covers the range.
"""

from __future__ import annotations


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

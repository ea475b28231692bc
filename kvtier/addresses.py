"""Where a buffer lives: the address of its bytes, and the shared file
mapped there (``/proc/self/maps``), through which the daemon can read it
without a copy in this process (a region, docs/shared-memory.md). Used by
the client and the engine integrations (their buffers' places) and the
daemon (its mappings' addresses); imports the shared records only.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.model import Buffer


class _PyBuffer(ctypes.Structure):
    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None


def address_of(buf: Buffer) -> tuple[int, int]:
    """(address, length) of a contiguous buffer's bytes, read-only or not.
    The address holds while the caller keeps the object (and does not resize it)."""
    view = memoryview(buf)
    if not view.c_contiguous:
        raise ValueError("a block's bytes must be contiguous")
    if not view.readonly and view.nbytes:
        # A writable buffer's address through ctypes' own export: a fifth of
        # the cost of the generic path below (a region job asks it per block).
        return ctypes.addressof(ctypes.c_char.from_buffer(view.cast("B"))), view.nbytes
    pb = _PyBuffer()
    if _get_buffer(view, ctypes.byref(pb), 0) != 0:
        raise ValueError("no buffer behind this object")
    try:
        return int(pb.buf or 0), int(pb.len)
    finally:
        _release_buffer(ctypes.byref(pb))


@dataclass(frozen=True, slots=True)
class MappedFile:
    """A shared file mapping of this process (``/proc/self/maps``): the
    daemon can read a buffer inside it from the file itself, with no copy in
    this process (a region, docs/shared-memory.md)."""

    #: the file's path as the mapping names it (" (deleted)" once unlinked)
    path: str
    start: int
    end: int
    #: the file offset mapped at ``start``
    offset: int

    def open(self) -> int:
        """A read-only descriptor of the file: by its path, else (an unlinked
        file; needs CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE) through
        /proc/self/map_files. Raises OSError when neither opens."""
        try:
            return os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            entry = f"/proc/self/map_files/{self.start:x}-{self.end:x}"
            return os.open(entry, os.O_RDONLY | os.O_CLOEXEC)

    def spans_at(
        self, address: int, starts: Sequence[int], length: int
    ) -> list[tuple[int, int]] | None:
        """The (file offset, ``length``) of the bytes at each of ``address`` +
        ``starts``, or None if one lies outside: rows of one buffer, found
        at once rather than one address at a time."""
        if not starts:
            return []
        if not (self.start <= address + min(starts) and address + max(starts) + length <= self.end):
            return None
        base = address - self.start + self.offset
        return [(base + at, length) for at in starts]

    def spans(self, bufs: Sequence[Buffer]) -> list[tuple[int, int]] | None:
        """Each buffer's (file offset, length), or None if one lies outside."""
        out = []
        for buf in bufs:
            address, length = address_of(buf)
            if not (self.start <= address and address + length <= self.end):
                return None
            out.append((address - self.start + self.offset, length))
        return out


def mapped_file(address: int) -> MappedFile | None:
    """The shared file mapping that holds ``address``, or None (private or
    anonymous memory, or no /proc)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                lo, _, hi = fields[0].partition("-")
                start, end = int(lo, 16), int(hi, 16)
                if start <= address < end:
                    if len(fields) < 6 or fields[1][3] != "s" or fields[5][0] != "/":
                        return None
                    return MappedFile(fields[5].rstrip("\n"), start, end, int(fields[2], 16))
    except OSError:
        return None
    return None

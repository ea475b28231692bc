"""Cross-memory attach: copy bytes straight between this process and another
one's address space (``process_vm_readv`` / ``process_vm_writev``, Linux).

One copy, made by the kernel, with no file or mapping in between: the way
Open MPI and UCX move messages between processes on one host. It needs
ptrace read (write) access to the other process: same user and, where Yama
restricts ptrace (``kernel.yama.ptrace_scope`` 1), the other process naming
this one with ``prctl(PR_SET_PTRACER, pid)``; or CAP_SYS_PTRACE. It fails in
containers whose seccomp profile forbids these calls and across PID
namespaces that cannot see each other (the peer's pid then reads as 0).
Every call here blocks: run it in a worker thread. Used by the client (the
addresses of its buffers) and the daemon (the copies); imports the shared
records only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.model import Buffer


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_readv = getattr(_libc, "process_vm_readv", None)
_writev = getattr(_libc, "process_vm_writev", None)
for _fn in (_readv, _writev):
    if _fn is not None:
        _fn.restype = ctypes.c_ssize_t
        _fn.argtypes = [
            ctypes.c_int,
            ctypes.POINTER(_IOVec),
            ctypes.c_ulong,
            ctypes.POINTER(_IOVec),
            ctypes.c_ulong,
            ctypes.c_ulong,
        ]

#: whether this platform has the calls at all
AVAILABLE = _readv is not None and _writev is not None

PR_SET_PTRACER = 0x59616D61
YAMA = "/proc/sys/kernel/yama/ptrace_scope"


def allow_tracer(pid: int) -> bool:
    """Where Yama lets a process be traced only by its ancestors
    (``ptrace_scope`` 1), name ``pid`` (the daemon) as this process's tracer,
    which cross-memory copies need. True if that was done."""
    try:
        with open(YAMA) as fh:
            scope = int(fh.read().strip() or 0)
    except (OSError, ValueError):
        return False
    if scope != 1:
        return False
    return bool(_libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0) == 0)


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
        raise ValueError("cross-memory copies need contiguous buffers")
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


def read_from(pid: int, remote: int, dest: memoryview) -> None:
    """Fill ``dest`` (writable, here) from ``len(dest)`` bytes at ``remote`` in ``pid``."""
    _move(_readv, pid, dest, remote)


def write_to(pid: int, remote: int, src: Buffer) -> None:
    """Copy ``src`` (here) to ``remote`` in ``pid``."""
    _move(_writev, pid, memoryview(src).cast("B"), remote)


def _move(call: object, pid: int, here: memoryview, remote: int) -> None:
    if call is None:
        raise OSError("process_vm_readv is not available on this platform")
    n = here.nbytes
    if n == 0:
        return
    local_addr = address_of(here)[0]
    done = 0
    while done < n:
        local = _IOVec(local_addr + done, n - done)
        far = _IOVec(remote + done, n - done)
        moved = call(pid, ctypes.byref(local), 1, ctypes.byref(far), 1, 0)  # type: ignore[operator]
        if moved < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"cross-memory copy from pid {pid}: {os.strerror(err)}")
        if moved == 0:
            raise OSError(f"cross-memory copy from pid {pid} moved nothing at {remote + done:#x}")
        done += moved


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

"""Writing a block into memory another process shares: a RAM slot, or an
in-place writer's room.

:func:`copy_into` copies with *streaming* stores (kvtier/_blockcopy.c,
built with the package where a C compiler is; x86-64): a plain memcpy of
a block into a cold slot first reads every destination line into the
cache, then writes it back, and evicts the caller's own lines to make room;
streaming stores write whole lines straight to memory. Measured on this
2-vCPU machine, 1 MiB blocks into a 512 MiB ring of slots: 17-19 GB/s
against glibc's memcpy at 6-8 GB/s (``python -m benchmarks.suite``'s
steady rows show what it does for stores). A slot is read long after it
is written, by another process, if ever; a block a client copies out of
shared memory into an engine's buffer is read next by a device's DMA or
a later step, and streams too (loads through the vLLM tier, 64 MiB of
1 MiB blocks: 0.73x memcpy copied plainly, 1.02x streamed, same run),
unless its batch is small enough for the engine's buffers to be cached
(``stream=False``: memcpy's, see ``kvtier.client.shared.CACHED_READ_BYTES``).
Where the extension is not built, or elsewhere than x86-64, the copy is
memcpy's.

:func:`fault_in` maps a shared file's pages into this process before they
are written; :func:`populate` has them allocated and mapped writable.

Invariants: ``copy_into(dst, src)`` leaves the first ``len(src)`` bytes of
``dst`` equal to ``src`` and the rest as they were, and raises ValueError,
writing nothing, when ``dst`` is shorter; when it returns, the stores are
visible to any process that reads after a message this one sends next;
copies of 64 KiB or more, and :func:`fault_in` where the extension is
built, run without the GIL; :func:`copy_many` leaves each destination as
:func:`copy_into` would, or, when one source does not fit, every
destination as it was, and releases the GIL once for the whole batch.
Imports the shared records only.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from types import ModuleType

from kvtier.model import Buffer

#: the compiled half; None where it is not built (no compiler at install).
#: Imported by name: the import contracts' linter reads Python files only
#: and would take a compiled module for the package itself.
_blockcopy: ModuleType | None
try:
    _blockcopy = importlib.import_module("kvtier._blockcopy")
except ImportError:
    _blockcopy = None

__all__ = ["BUILT", "FAULT_AROUND", "STREAMING", "copy_into", "copy_many", "fault_in", "populate"]

#: the extension is built (else every copy is memoryview assignment's)
BUILT = _blockcopy is not None
#: copies stream past the caches (the extension is built, on x86-64)
STREAMING = bool(_blockcopy is not None and _blockcopy.STREAMING)

#: a read fault maps this many bytes of a shared file at once (the kernel's
#: fault-around, 64 KiB unless changed), a write fault one page
FAULT_AROUND = 64 * 1024


def copy_into(dst: memoryview, src: Buffer, *, stream: bool = True) -> None:
    """Copy ``src`` into the start of ``dst`` (writable, C-contiguous),
    streaming the stores where it can, through the caches (memcpy's, still
    without the GIL) when ``stream`` is false."""
    if _blockcopy is not None:
        _blockcopy.copy(dst, src, stream)
        return
    n = memoryview(src).nbytes
    if n > dst.nbytes:
        raise ValueError(f"a block of {n} bytes does not fit {dst.nbytes} bytes")
    dst[:n] = memoryview(src).cast("B")


def copy_many(
    dsts: Sequence[memoryview],
    srcs: Sequence[Buffer],
    *,
    stream: bool = True,
    fault: bool = False,
) -> None:
    """:func:`copy_into` of each ``srcs[i]`` into ``dsts[i]``, the GIL released
    once for them all (where the extension is built): a thread that copies a
    batch need not win the GIL back between its blocks from a thread that
    keeps it busy, which can cost the interpreter's switch interval (5 ms)
    a block. With ``fault``, each destination is first mapped as
    :func:`fault_in` maps it, in the same stretch. Raises ValueError,
    copying nothing, when the lists' lengths differ or a source does not fit
    its destination."""
    if len(dsts) != len(srcs):
        raise ValueError("copy_many needs one source per destination")
    if _blockcopy is not None:
        _blockcopy.copy_many(dsts, srcs, stream, FAULT_AROUND if fault else 0)
        return
    sources = [memoryview(src).cast("B") for src in srcs]
    for dst, src in zip(dsts, sources, strict=True):
        if src.nbytes > dst.nbytes:
            raise ValueError(f"a block of {src.nbytes} bytes does not fit {dst.nbytes} bytes")
    for dst, src in zip(dsts, sources, strict=True):
        if fault:
            fault_in(dst)
        dst[: src.nbytes] = src


def fault_in(view: memoryview) -> None:
    """Map the pages of ``view``, a span of a shared file's mapping, into this
    process before writing it: one read each ``FAULT_AROUND`` bytes maps
    them 16 pages a fault, where a write would fault each page (measured
    here, pages another process had touched: 105-145 against 450-480 us a
    MiB; fresh pages cost their allocation either way). A page already
    mapped costs a read of one byte. Without the GIL where the extension
    is built (a long span faults for milliseconds)."""
    if not view.nbytes:
        return
    if _blockcopy is not None:
        _blockcopy.touch(view, FAULT_AROUND)
        return
    bytes(view[::FAULT_AROUND])
    view[-1]  # the last window, when the span does not start on one


def populate(view: memoryview) -> bool:
    """Have the kernel allocate every page of ``view`` (a span of a writable
    shared mapping) and map it writable into this process, without the GIL
    and without changing a byte (Linux's ``MADV_POPULATE_WRITE``). A page
    allocated this way is one a first copy into it does not fault, and one
    another process's :func:`fault_in` maps 16 at a time (pages that were
    only reserved, ``posix_fallocate``, are mapped one a fault, each zeroed
    as it is). False, doing nothing, where the extension is not built or the
    kernel (before 5.14) has no such advice."""
    if _blockcopy is None or not view.nbytes:
        return False
    return bool(_blockcopy.populate(view))

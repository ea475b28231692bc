"""What kvtier asks of the kernel's CPU scheduler: a thread's slice.

Linux's fair scheduler (EEVDF, 6.6 and later) gives each runnable thread a
*slice*: how long it may run before another thread of the same weight gets
its turn, and how soon, once woken, it is due. Since 6.12 a thread may ask
for its own slice, between 0.1 ms and 100 ms, with ``sched_setattr`` and no
privilege. Its share of the CPU does not change (that is its weight, its
nice value); what changes is latency: a thread woken with a short slice is
due sooner than one that has been running, so it preempts it instead of
waiting out the running thread's slice (1.4 ms by default on 2 CPUs, more
on larger machines).

That is the lookup process's case (docs/lookup-process.md): it sleeps
until a lookup arrives, works for a hundred microseconds and sleeps again,
while writers streaming blocks keep every core busy. With the kernel's
default slice a lookup waited for a writer's slice to end, once for the
lookup process and once for the caller woken by the reply; with 0.1 ms it
does not.

Invariants: :func:`request_slice` changes only the calling thread's slice
(its policy and nice value stay), and returns False, changing nothing,
where the kernel or the platform cannot; 0 restores the kernel's default.
:func:`slice_of` reads any thread's slice (None where it cannot). Imports
nothing of kvtier.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys

__all__ = ["MAX_SLICE", "MIN_SLICE", "request_slice", "slice_of"]

#: the kernel clamps a requested slice to this range (seconds)
MIN_SLICE = 0.0001
MAX_SLICE = 0.1

#: sched_setattr / sched_getattr by machine (Linux's syscall tables)
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}
_SCHED_OTHER = 0


class _SchedAttr(ctypes.Structure):
    """``struct sched_attr`` (SCHED_ATTR_SIZE_VER0)."""

    _fields_ = [
        ("size", ctypes.c_uint32),
        ("policy", ctypes.c_uint32),
        ("flags", ctypes.c_uint64),
        ("nice", ctypes.c_int32),
        ("priority", ctypes.c_uint32),
        ("runtime", ctypes.c_uint64),
        ("deadline", ctypes.c_uint64),
        ("period", ctypes.c_uint64),
    ]


@functools.cache
def _syscalls() -> tuple[ctypes.CDLL, int, int] | None:
    """libc and the two calls' numbers, once; None off Linux or elsewhere."""
    numbers = _SYSCALLS.get(platform.machine())
    if sys.platform != "linux" or numbers is None:
        return None
    return ctypes.CDLL(None, use_errno=True), *numbers


def _kernel_has_custom_slices() -> bool:
    """Custom slices came with Linux 6.12; an older kernel takes the
    request without error and ignores it."""
    try:
        major, minor = (int(part) for part in platform.release().split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (6, 12)


def slice_of(tid: int = 0) -> float | None:
    """The slice, in seconds, of thread ``tid`` (0: the calling thread), as
    the kernel reports it; None where it cannot be read or the thread is not
    under the fair scheduler."""
    calls = _syscalls()
    if calls is None:
        return None
    libc, _, getattr_nr = calls
    attr = _SchedAttr()
    if libc.syscall(getattr_nr, tid, ctypes.byref(attr), ctypes.sizeof(attr), 0) != 0:
        return None
    if attr.policy != _SCHED_OTHER:
        return None
    return float(attr.runtime) / 1e9


def request_slice(seconds: float) -> bool:
    """Ask for a slice of ``seconds`` (clamped to MIN_SLICE..MAX_SLICE) for
    the calling thread, or the kernel's default with 0. True if the kernel
    took it; False, nothing changed, where it cannot (not Linux, Linux
    before 6.12, a thread not under the fair scheduler, a refusal)."""
    calls = _syscalls()
    if calls is None or not _kernel_has_custom_slices():
        return False
    libc, setattr_nr, _ = calls
    if slice_of() is None:  # a real-time or deadline thread keeps its policy
        return False
    runtime = 0 if seconds <= 0 else int(min(max(seconds, MIN_SLICE), MAX_SLICE) * 1e9)
    attr = _SchedAttr(
        size=ctypes.sizeof(_SchedAttr),
        policy=_SCHED_OTHER,
        nice=os.getpriority(os.PRIO_PROCESS, 0),  # (the calling thread's)
        runtime=runtime,
    )
    return bool(libc.syscall(setattr_nr, 0, ctypes.byref(attr), 0) == 0)

"""Sizes for the configuration: byte counts written as "512MiB", and the
"auto" capacities of the RAM and disk tiers, from what this machine has.

Part of the configuration (it loads pydantic's byte-size parser); the
client never imports it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import ByteSize, TypeAdapter, ValidationError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

RAM_AUTO_FRACTION = 0.25
RAM_AUTO_CAP = 16 * GiB
RAM_AUTO_FLOOR = 64 * MiB
DISK_AUTO_FRACTION = 0.10
DISK_AUTO_CAP = 64 * GiB


def free_disk_bytes(path: Path) -> int:
    """Free bytes on the file system that holds ``path`` (or its nearest parent)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    st = os.statvfs(probe)
    return st.f_bavail * st.f_frsize


def auto_disk_capacity(free: int) -> int:
    """A tenth of the free space, at most 64 GiB, at least 64 MiB."""
    return max(RAM_AUTO_FLOOR, min(DISK_AUTO_CAP, int(free * DISK_AUTO_FRACTION)))


def available_memory() -> int:
    """MemAvailable from /proc/meminfo, else physical memory."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def auto_ram_capacity(available: int) -> int:
    """A quarter of available memory, at most 16 GiB, at least 64 MiB."""
    return max(RAM_AUTO_FLOOR, min(RAM_AUTO_CAP, int(available * RAM_AUTO_FRACTION)))


_BYTE_SIZE: TypeAdapter[ByteSize] = TypeAdapter(ByteSize)


def parse_size(value: Any) -> int:
    """A positive byte count from an int or a string such as ``"512MiB"``."""
    try:
        size = int(_BYTE_SIZE.validate_python(value))
    except ValidationError:
        raise ValueError(
            f"expected a size such as 1048576, '512MiB' or '8GiB', got {value!r}"
        ) from None
    if size <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    return size

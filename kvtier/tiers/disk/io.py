"""Blocking file I/O of the disk tier. Runs on the tier's thread pool, never
on the event loop.

A block is written to a temporary name in its final directory and renamed
into place, so a reader only ever sees whole files; a scan removes the
temporary files a crash left and discards files that fail their checks.

Imports the format and the block checksum; never asyncio, the core or metrics.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.errors import DataDirInUseError
from kvtier.model import Buffer
from kvtier.tiers.base import block_checksum
from kvtier.tiers.disk.format import (
    FORMAT_VERSION,
    HEADER,
    MAGIC,
    PEEK,
    SUFFIX,
    TMP_MARK,
    CorruptBlock,
    block_name,
    block_path,
    file_size,
    parse_header,
)

log = logging.getLogger("kvtier.disk")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_block(
    path: Path, key: bytes, value: Buffer, fsync: bool, victims: Sequence[Path]
) -> None:
    unlink_all(victims)
    header = HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(key), len(value), block_checksum(key, value))
    tmp = path.with_name(f"{path.name}{TMP_MARK}{uuid.uuid4().hex}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileNotFoundError:  # the bucket's first block: its directory is made now
        path.parent.mkdir(exist_ok=True)
        fsync_dir(path.parent.parent)  # (the bucket outlives a crash, whatever the fsync policy)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            written = os.writev(fd, [header, key, value])
            total = file_size(key, len(value))
            if written < total:  # a short vectored write: finish plainly
                rest = memoryview(b"".join([header, key, bytes(value)]))[written:]
                while rest:
                    rest = rest[os.write(fd, rest) :]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        unlink_all([tmp])
        raise
    if fsync:
        fsync_dir(path.parent)


def read_block(root: Path, key: bytes) -> tuple[memoryview, int]:
    """``key``'s stored bytes under ``root`` and the checksum its header
    keeps (its path found here, off the event loop); the header, length and
    key are checked here, the checksum by the one rule that admits a block
    (:meth:`~kvtier.tiers.sealing.Sealer.admit`)."""
    with open(block_path(root, key), "rb") as fh:
        data = fh.read()
    got_key, _value_len, digest = parse_header(data, len(data))
    if got_key != key:
        raise CorruptBlock("file holds another key")
    return memoryview(data)[HEADER.size + len(key) :], digest


def check_block(data: bytes) -> tuple[bytes, memoryview]:
    """(key, value) of a whole block file's bytes; raises CorruptBlock when
    its header, length or checksum does not hold."""
    key, _value_len, digest = parse_header(data, len(data))
    value = memoryview(data)[HEADER.size + len(key) :]
    if block_checksum(key, value) != digest:
        raise CorruptBlock("checksum mismatch")
    return key, value


def unlink_all(paths: Sequence[Path]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def sync_paths(paths: Sequence[Path]) -> None:
    dirs = set()
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue  # evicted or deleted since; nothing to make durable
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        dirs.add(path.parent)
    for d in dirs:
        fsync_dir(d)


@dataclass(slots=True)
class ScanResult:
    #: (key, file size) of each file read (every file, or those not ``known``)
    entries: list[tuple[bytes, int]]
    #: the ``known`` keys whose file is not in the directory
    missing: list[bytes] = field(default_factory=list)
    temp_removed: int = 0
    corrupt_removed: int = 0


def scan_bucket(bucket: Path, known: Sequence[bytes] = ()) -> ScanResult:
    """Index one fan-out directory: headers only, of the files not ``known``
    (keys this bucket holds, whose files are only listed); torn and stray
    files go."""
    result = ScanResult([])
    names = {block_name(key) + SUFFIX: key for key in known}
    try:
        it = os.scandir(bucket)
    except FileNotFoundError:
        result.missing = list(known)
        return result
    with it:
        for entry in it:
            name = entry.name
            if TMP_MARK in name:
                unlink_all([Path(entry.path)])
                result.temp_removed += 1
                continue
            if not name.endswith(SUFFIX):
                continue
            if names and names.pop(name, None) is not None:
                continue  # known: listed, not read
            try:
                size = entry.stat().st_size
                with open(entry.path, "rb") as fh:
                    head = fh.read(PEEK)
                key, _value_len, _digest = parse_header(head, size)
                if block_name(key) + SUFFIX != name:
                    raise CorruptBlock("file name does not match its key")
            except FileNotFoundError:
                continue
            except (CorruptBlock, OSError) as exc:
                log.warning("discarding unreadable block file %s: %s", entry.path, exc)
                unlink_all([Path(entry.path)])
                result.corrupt_removed += 1
                continue
            result.entries.append((key, size))
    result.missing = list(names.values())
    return result


def missing_files(paths: Sequence[Path]) -> list[bool]:
    """Whether each file is absent (checked again, now)."""
    return [not os.path.exists(path) for path in paths]


#: the file whose lock marks a data directory as one daemon's
LOCK_FILE = "lock"


def lock_directory(root: Path) -> int:
    """Hold ``root`` for this process: an exclusive lock on its lock file,
    kept while the returned descriptor is open (the kernel lets go of it
    when the process ends, however it ends). The file names the holder's
    pid. Raises :class:`~kvtier.errors.DataDirInUseError` while another
    process holds it: two daemons in one directory would each evict and
    index the other's blocks."""
    fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise DataDirInUseError(
            f"another kvtier daemon (pid {holder}) keeps its blocks in {root}; "
            "give this one a data directory of its own (--data-dir)"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd

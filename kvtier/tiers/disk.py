"""Disk tier: one directory of crash-safe block files with an in-memory index.

Layout: ``<root>/<2 hex>/<32 hex>.blk`` where the name is a BLAKE2b-128 hash
of the key, so keys never become paths and any key bytes are safe. Each file
is a header (magic, format version, key length, value length, XXH3-64 of key
and value), the key, then the value.

Crash safety: a block is written to a temporary name in its final directory
and renamed into place, so a reader only ever sees whole files; a file that
is torn anyway (power loss before its data reached the disk) fails its
length or checksum check and is discarded, never served. Temporary files
left by a crash are removed at start.

Durability (``fsync``):

* ``none`` - no fsync: survives a process crash, not a power loss;
* ``batch`` - writes are synced in groups (one executor hop fsyncs every
  file and directory written since the last sync); a durable PUT waits for
  the sync that covers it;
* ``always`` - each file and its directory are fsynced before the write
  completes.

File I/O runs on a small dedicated thread pool rather than aiofiles: a
whole block write (open, write, fsync, rename) is one hop to a thread
instead of one per call, and the pool bounds how many blocks hit the disk
at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import logging
import os
import struct
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import xxhash

from kvtier.errors import TierError, ValueTooLargeError
from kvtier.tiers.base import Buffer, LocalTier, TierStats
from kvtier.tiers.policy import EvictionPolicy, LRUPolicy, NoRoom, plan_eviction

log = logging.getLogger("kvtier.disk")

FsyncPolicy = Literal["none", "batch", "always"]

MAGIC = b"KVTB"
FORMAT_VERSION = 1
#: magic, format version, reserved, key length, value length, xxh3_64(key + value)
HEADER = struct.Struct("<4sBBHQQ")
SUFFIX = ".blk"
TMP_MARK = ".tmp-"
_PEEK = HEADER.size + 4096  # enough to hold any header and key


class CorruptBlock(Exception):
    """A block file failed its format, length, key or checksum check."""


def block_name(key: bytes) -> str:
    return hashlib.blake2b(key, digest_size=16).hexdigest()


def checksum(key: bytes, value: Buffer) -> int:
    h = xxhash.xxh3_64()
    h.update(key)
    h.update(value)
    return h.intdigest()


def file_size(key: bytes, value_len: int) -> int:
    return HEADER.size + len(key) + value_len


def parse_header(buf: bytes, file_len: int) -> tuple[bytes, int, int]:
    """(key, value length, checksum) from a file's first bytes; raises CorruptBlock."""
    if len(buf) < HEADER.size:
        raise CorruptBlock("shorter than a header")
    magic, version, _reserved, key_len, value_len, digest = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptBlock("bad magic")
    if version != FORMAT_VERSION:
        raise CorruptBlock(f"unknown format version {version}")
    if len(buf) < HEADER.size + key_len:
        raise CorruptBlock("truncated key")
    key = bytes(buf[HEADER.size : HEADER.size + key_len])
    if file_len != HEADER.size + key_len + value_len:
        raise CorruptBlock(
            f"file is {file_len} bytes, header says {HEADER.size + key_len + value_len}"
        )
    return key, value_len, digest


# ---------------------------------------------------------------- blocking helpers
# These run on the tier's thread pool, never on the event loop.


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_block(
    path: Path, key: bytes, value: Buffer, fsync: bool, victims: Sequence[Path]
) -> None:
    _unlink_all(victims)
    header = HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(key), len(value), checksum(key, value))
    tmp = path.with_name(f"{path.name}{TMP_MARK}{uuid.uuid4().hex}")
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
        _unlink_all([tmp])
        raise
    if fsync:
        _fsync_dir(path.parent)


def _read_block(path: Path, key: bytes) -> memoryview:
    with open(path, "rb") as fh:
        data = fh.read()
    got_key, _value_len, digest = parse_header(data, len(data))
    if got_key != key:
        raise CorruptBlock("file holds another key")
    value = memoryview(data)[HEADER.size + len(key) :]
    if checksum(key, value) != digest:
        raise CorruptBlock("checksum mismatch")
    return value


def _unlink_all(paths: Sequence[Path]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _sync_paths(paths: Sequence[Path]) -> None:
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
        _fsync_dir(d)


@dataclass(slots=True)
class ScanResult:
    entries: list[tuple[bytes, int]]  # key, file size
    temp_removed: int = 0
    corrupt_removed: int = 0


def _scan_bucket(bucket: Path) -> ScanResult:
    """Index one fan-out directory: headers only; torn and stray files go."""
    result = ScanResult([])
    try:
        it = os.scandir(bucket)
    except FileNotFoundError:
        return result
    with it:
        for entry in it:
            name = entry.name
            if TMP_MARK in name:
                _unlink_all([Path(entry.path)])
                result.temp_removed += 1
                continue
            if not name.endswith(SUFFIX):
                continue
            try:
                size = entry.stat().st_size
                with open(entry.path, "rb") as fh:
                    head = fh.read(_PEEK)
                key, _value_len, _digest = parse_header(head, size)
                if block_name(key) + SUFFIX != name:
                    raise CorruptBlock("file name does not match its key")
            except FileNotFoundError:
                continue
            except (CorruptBlock, OSError) as exc:
                log.warning("discarding unreadable block file %s: %s", entry.path, exc)
                _unlink_all([Path(entry.path)])
                result.corrupt_removed += 1
                continue
            result.entries.append((key, size))
    return result


# ---------------------------------------------------------------- the tier


class DiskTier(LocalTier):
    """Blocks in one directory. Invariant: indexed bytes plus bytes being
    written never exceed ``capacity``; files are removed before the write
    that needed their room."""

    name = "disk"

    def __init__(
        self,
        root: Path,
        capacity: int,
        *,
        fsync: FsyncPolicy = "batch",
        io_threads: int = 4,
        policy: EvictionPolicy[bytes] | None = None,
    ) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.root = Path(root)
        self.capacity = capacity
        self.fsync = fsync
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="kvtier-disk")
        self._policy: EvictionPolicy[bytes] = policy if policy is not None else LRUPolicy()
        self._index: dict[bytes, int] = {}  # key -> file size
        self._pins: dict[bytes, int] = {}
        self._writing: dict[bytes, asyncio.Future[None]] = {}
        self._file_writes: set[bytes] = set()  # keys whose file write is in flight
        self._deleted_while_writing: set[bytes] = set()
        self.used_bytes = 0
        self.inflight_bytes = 0
        self.evictions = 0
        # counters, exposed through stats()
        self.reads = self.read_bytes = 0
        self.writes = self.written_bytes = 0
        self.corrupt = 0
        self.enospc = 0
        self.write_errors = 0
        self.temp_removed = 0
        # index rebuild
        self.buckets_total = 256
        self.buckets_scanned = 0
        self._scanned: asyncio.Future[None] | None = None
        # batch fsync
        self._dirty: list[Path] = []
        self._write_gen = 0
        self._synced_gen = 0
        self._syncing: asyncio.Future[None] | None = None

    def __repr__(self) -> str:
        return (
            f"<DiskTier {self.root} used={self.used_bytes}/{self.capacity} "
            f"blocks={len(self._index)} writing={len(self._writing)} "
            f"scanned={self.buckets_scanned}/{self.buckets_total}>"
        )

    # -- paths

    def path_of(self, key: bytes) -> Path:
        name = block_name(key)
        return self.root / name[:2] / (name + SUFFIX)

    # -- start: the index is rebuilt while the daemon already serves

    def prepare(self) -> None:
        """Create the directory tree (synchronous; called once at startup)."""
        self.root.mkdir(parents=True, exist_ok=True)
        for i in range(256):
            (self.root / f"{i:02x}").mkdir(exist_ok=True)
        self._scanned = asyncio.get_running_loop().create_future()

    @property
    def scanning(self) -> bool:
        return self._scanned is not None and not self._scanned.done()

    @property
    def scan_done(self) -> asyncio.Future[None] | None:
        return self._scanned

    async def rebuild_index(self) -> None:
        """Scan every bucket into the index; ``scan_done`` resolves however it ends."""
        assert self._scanned is not None, "prepare() first"
        loop = asyncio.get_running_loop()
        found = 0
        # Scan as many buckets at once as there are I/O threads; merge in order.
        scans = [
            loop.run_in_executor(self._pool, _scan_bucket, self.root / f"{i:02x}")
            for i in range(256)
        ]
        try:
            for i, scan in enumerate(scans):
                result = await scan
                for key, size in result.entries:
                    if key not in self._index and key not in self._writing:
                        self._index[key] = size
                        self.used_bytes += size
                        self._policy.admit(key)
                        found += 1
                self.temp_removed += result.temp_removed
                self.corrupt += result.corrupt_removed
                self.buckets_scanned = i + 1
                if (i + 1) % 64 == 0:
                    log.info(
                        "disk index rebuild: %d/256 buckets, %d blocks, %d bytes",
                        i + 1,
                        found,
                        self.used_bytes,
                    )
            if self.used_bytes > self.capacity:
                await self._shrink_to_capacity()
        finally:
            for scan in scans:
                scan.cancel()  # only if the rebuild itself was cancelled
            if not self._scanned.done():
                self._scanned.set_result(None)
        log.info(
            "disk index rebuilt: %d blocks, %d bytes; removed %d temporary and %d corrupt files",
            found,
            self.used_bytes,
            self.temp_removed,
            self.corrupt,
        )

    async def _shrink_to_capacity(self) -> None:
        victims = self._evict(self.used_bytes - self.capacity, 0)
        await asyncio.get_running_loop().run_in_executor(self._pool, _unlink_all, victims)

    # -- index (synchronous)

    def contains(self, key: bytes) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def _drop(self, key: bytes) -> int:
        size = self._index.pop(key)
        self.used_bytes -= size
        self._policy.remove(key)
        return size

    def _evict(self, need: int, free: int) -> list[Path]:
        """Remove victims from the index; returns their paths to unlink."""
        index, pins = self._index, self._pins
        victims = plan_eviction(
            need,
            free,
            self._policy.candidates(),
            size_of=lambda k: index[k],
            pinned=lambda k: pins.get(k, 0) > 0,
        )
        for key in victims:
            self._drop(key)
        self.evictions += len(victims)
        return [self.path_of(k) for k in victims]

    # -- reads

    async def read(self, key: bytes) -> Buffer | None:
        """The block, or None if absent; a corrupt file is discarded and counted."""
        if key not in self._index:
            return None
        self._pins[key] = self._pins.get(key, 0) + 1
        self._policy.touch(key)
        path = self.path_of(key)
        try:
            value = await asyncio.get_running_loop().run_in_executor(
                self._pool, _read_block, path, key
            )
        except FileNotFoundError:
            self._forget(key)
            return None
        except CorruptBlock as exc:
            log.warning("discarding corrupt block %s (%s): %s", key.hex(), path, exc)
            self.corrupt += 1
            self._forget(key)
            await asyncio.get_running_loop().run_in_executor(self._pool, _unlink_all, [path])
            return None
        except OSError as exc:
            raise TierError(f"disk: reading {path} failed: {exc}") from exc
        finally:
            left = self._pins.get(key, 1) - 1
            if left:
                self._pins[key] = left
            else:
                self._pins.pop(key, None)
        self.reads += 1
        self.read_bytes += len(value)
        return value

    def _forget(self, key: bytes) -> None:
        if key in self._index:
            self._drop(key)

    # -- writes

    async def write(self, key: bytes, value: Buffer, *, durable: bool = False) -> None:
        """Store ``key`` (idempotent; concurrent writes of one key share one file write)."""
        loop = asyncio.get_running_loop()
        # Another write (or an unlink) of this key is in flight: let it land first.
        while (pending := self._writing.get(key)) is not None:
            await asyncio.shield(pending)
        if key in self._index:
            self._policy.touch(key)
        else:
            size = file_size(key, len(value))
            if size > self.capacity:
                raise ValueTooLargeError(
                    f"block of {size} bytes is larger than the disk tier ({self.capacity} bytes)"
                )
            try:
                victims = self._evict(size, self.capacity - self.used_bytes - self.inflight_bytes)
            except NoRoom as exc:
                raise TierError(f"disk: {exc}") from None
            done: asyncio.Future[None] = loop.create_future()
            self._writing[key] = done
            self._file_writes.add(key)
            self.inflight_bytes += size
            path = self.path_of(key)
            try:
                await loop.run_in_executor(
                    self._pool, _write_block, path, key, value, self.fsync == "always", victims
                )
            except OSError as exc:
                self.write_errors += 1
                if exc.errno == errno.ENOSPC:
                    self.enospc += 1
                    raise TierError(f"disk full writing {path}: {exc.strerror}") from exc
                raise TierError(f"disk: writing {path} failed: {exc}") from exc
            finally:
                self.inflight_bytes -= size
                self._file_writes.discard(key)
                del self._writing[key]
                if not done.done():
                    done.set_result(None)
            self.writes += 1
            self.written_bytes += len(value)
            if key in self._deleted_while_writing:
                self._deleted_while_writing.discard(key)
                await loop.run_in_executor(self._pool, _unlink_all, [path])
                return
            self._index[key] = size
            self.used_bytes += size
            self._policy.admit(key)
            if self.fsync == "batch":
                self._dirty.append(path)
                self._write_gen += 1
        if durable and self.fsync == "batch":
            await self.sync()

    async def sync(self) -> None:
        """Return once every write completed before this call is on stable storage."""
        if self.fsync != "batch":
            return
        target = self._write_gen
        loop = asyncio.get_running_loop()
        while self._synced_gen < target:
            if self._syncing is None:
                paths, self._dirty = self._dirty, []
                gen = self._write_gen
                self._syncing = loop.create_future()
                try:
                    await loop.run_in_executor(self._pool, _sync_paths, paths)
                    self._synced_gen = max(self._synced_gen, gen)
                finally:
                    fut, self._syncing = self._syncing, None
                    fut.set_result(None)
            else:
                await asyncio.shield(self._syncing)

    def discard(self, key: bytes) -> bool:
        """Remove ``key`` from the index now; its file is unlinked in the background.

        A write of the same key issued meanwhile waits for the unlink, so it
        can never be undone by it.
        """
        if key in self._file_writes:
            if key in self._deleted_while_writing:
                return False
            self._deleted_while_writing.add(key)  # unlinked once its write lands
            return True
        if key not in self._index:
            return False
        self._drop(key)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._writing[key] = done
        unlink = loop.run_in_executor(self._pool, _unlink_all, [self.path_of(key)])

        def finished(_f: asyncio.Future[None]) -> None:
            if self._writing.get(key) is done:
                del self._writing[key]
            done.set_result(None)

        unlink.add_done_callback(finished)
        return True

    async def remove(self, key: bytes) -> bool:
        found = self.discard(key)
        pending = self._writing.get(key)
        if pending is not None:
            await asyncio.shield(pending)
        return found

    # -- Tier interface

    async def batch_load(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        return [await self.read(k) for k in keys]

    async def batch_store(self, keys: Sequence[bytes], values: Sequence[Buffer]) -> None:
        await asyncio.gather(*(self.write(k, v) for k, v in zip(keys, values, strict=True)))

    async def delete(self, keys: Sequence[bytes]) -> list[bool]:
        return [await self.remove(k) for k in keys]

    async def close(self) -> None:
        if self.fsync == "batch" and self._dirty:
            await self.sync()
        self._pool.shutdown(wait=True)

    def stats(self) -> TierStats:
        return TierStats(
            name=self.name,
            capacity_bytes=self.capacity,
            used_bytes=self.used_bytes,
            blocks=len(self._index),
            evictions=self.evictions,
            extra={
                "reads": self.reads,
                "read_bytes": self.read_bytes,
                "writes": self.writes,
                "written_bytes": self.written_bytes,
                "corrupt_discarded": self.corrupt,
                "enospc": self.enospc,
                "write_errors": self.write_errors,
                "writes_in_flight": len(self._writing),
                "index_buckets_scanned": self.buckets_scanned,
                "index_buckets_total": self.buckets_total,
            },
        )

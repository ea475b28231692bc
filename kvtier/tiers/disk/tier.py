"""Disk tier: one directory of crash-safe block files with an in-memory index.

Layout: ``<root>/<2 hex>/<32 hex>.blk`` where the name is a BLAKE2b-128 hash
of the key, so keys never become paths and any key bytes are safe. Each file
is a header (magic, format version, key length, value length, XXH3-64 of key
and value), the key, then the value: sealed (:mod:`kvtier.tiers.sealing`)
where its namespace has an encryption key.

Crash safety: a block is written to a temporary name in its final directory
and renamed into place, so a reader only ever sees whole files; a file that
is torn anyway (power loss before its data reached the disk) fails its
length or checksum check and is discarded, never served. Temporary files
left by a crash are removed at start.

The index persists (``<root>/index/``, :mod:`~kvtier.tiers.disk.journaling`):
each block file put in place is journalled (ADD) by the I/O thread that
renamed it, each one removed (REMOVE) by the thread that unlinked it, so a
start loads the snapshot, replays the journal and answers from a whole
index at once; a pass over the block files then, one bucket at a time,
adds the files the journal missed and drops the entries whose file is
gone (each checked again while no write of its key can begin). Without
usable index files a start scans the block files as before (lookups of
keys not indexed yet answer RETRY meanwhile), journalling what it finds,
and compacts once it is done.

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

Imports the tiers' base, budget, policy and retention; never the core or metrics.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

from kvtier import collector
from kvtier.errors import TierError, ValueTooLargeError
from kvtier.model import Buffer, Retention
from kvtier.tiers.base import DiskStats, LocalTier
from kvtier.tiers.budget import Budget, Gone
from kvtier.tiers.disk.format import CorruptBlock, block_path, by_bucket, file_size
from kvtier.tiers.disk.io import (
    ScanResult,
    lock_directory,
    missing_files,
    read_block,
    scan_bucket,
    sync_paths,
    unlink_all,
    write_block,
)
from kvtier.tiers.disk.journal import Op, Record
from kvtier.tiers.disk.journaling import COMPACT_AFTER_BYTES, GROUP_SECONDS, IndexJournal, Loaded
from kvtier.tiers.disk.owedfile import OwedFile
from kvtier.tiers.policy import EvictionPolicy, NoRoom
from kvtier.tiers.retention import Arrivals, RetentionBook, grant_held, leased_cap, retaining
from kvtier.tiers.sealing import TORN, Sealer, SealError

log = logging.getLogger("kvtier.disk")

FsyncPolicy = Literal["none", "batch", "always"]


class DiskTier(LocalTier):
    """Blocks in one directory. Invariant: indexed bytes plus bytes being
    written never exceed ``capacity``; files are removed before the write
    that needed their room."""

    outlives_daemon = True

    name = "disk"

    def __init__(
        self,
        root: Path,
        capacity: int,
        *,
        fsync: FsyncPolicy = "batch",
        io_threads: int = 4,
        policy: EvictionPolicy[bytes] | None = None,
        compact_after: int = COMPACT_AFTER_BYTES,
        sealer: Sealer | None = None,
        retained_share: float = 0.8,
    ) -> None:
        self.root = Path(root)
        #: seals the blocks of namespaces with a key, and admits every block read
        self.sealer = sealer if sealer is not None else Sealer()
        #: retention leases on the blocks here (docs/retention.md): kept
        #: before unleased ones when the disk makes room; in memory only
        self.retention = RetentionBook(self._retention_cap)
        #: the share of the disk (or of a namespace's max) leases may hold
        self.retained_share = retained_share
        #: leases given for blocks whose write here is on its way
        self.arriving_leases = Arrivals()
        #: the index: key -> file size, pins, eviction order; ``held`` is bytes being written
        self.budget = Budget(capacity, retaining(policy, self.retention))
        self.fsync = fsync
        #: the disk's I/O threads: every blocking file operation runs here
        self.executor = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="kvtier-disk")
        self.io_threads = io_threads
        #: a write or unlink of each key in flight; a second write waits for it
        self._writing: dict[bytes, asyncio.Future[None]] = {}
        #: keys deleted while their file write was in flight: unlinked once it lands
        self._deleted_while_writing: set[bytes] = set()
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
        #: the index's files: what a start loads instead of scanning
        self.journal = IndexJournal(
            self.root / "index", fsync_each=fsync == "always", compact_after=compact_after
        )
        #: how the index was loaded at start (None: not yet)
        self.loaded: Loaded | None = None
        #: a compaction of the index's files in flight
        self._compacting: asyncio.Future[None] | None = None
        #: the timer that writes the journal's held records
        self._grouping: asyncio.TimerHandle | None = None
        #: the held lock of the directory (:meth:`prepare` to :meth:`close`)
        self._lock: int | None = None

    def __repr__(self) -> str:
        return (
            f"<DiskTier {self.root} used={self.used_bytes}/{self.capacity} "
            f"blocks={len(self.budget)} writing={len(self._writing)} "
            f"scanned={self.buckets_scanned}/{self.buckets_total}>"
        )

    # -- paths

    def owed_file(self, tier: str) -> OwedFile:
        """Where the blocks owed to the remote tier ``tier`` are listed
        (:mod:`kvtier.tiers.disk.owedfile`), beside this tier's blocks."""
        return OwedFile(self.root / "owed" / tier)

    def path_of(self, key: bytes) -> Path:
        return block_path(self.root, key)

    # -- start: the index is rebuilt while the daemon already serves

    def prepare(self) -> None:
        """Create the directory and hold it (:func:`lock_directory`:
        synchronous; called once at startup). Its 256 fan-out directories
        are made as their first block is written (:func:`write_block`): on
        a fresh disk, making them all would take a start 100 ms."""
        self.root.mkdir(parents=True, exist_ok=True)
        if self._lock is None:
            self._lock = lock_directory(self.root)
        self._scanned = asyncio.get_running_loop().create_future()

    async def load_index(self) -> Loaded:
        """Load the index from its files, before the daemon serves: whole at
        once (no scan pending), or nothing (the scan that follows rebuilds it)."""
        assert self._scanned is not None, "prepare() first"
        with collector.held_off():  # (millions of keys, built at once)
            # (a thread of its own: before the daemon serves, nothing else waits on it)
            loaded = await asyncio.to_thread(self.journal.load)
            if loaded.index is not None:
                self.budget.admit_many(loaded.index)
        self.loaded = loaded
        if loaded.index is not None:
            self._scanned.set_result(None)  # lookups answer from the index now
            if self.used_bytes > self.capacity:  # (a smaller disk.capacity than last run)
                await self._shrink_to_capacity()
            log.info("disk index loaded: %s", loaded.describe())
        else:
            log.info("disk index: no usable index files (%s); scanning the blocks", loaded.reason)
        return loaded

    @property
    def scanning(self) -> bool:
        return self._scanned is not None and not self._scanned.done()

    @property
    def scan_done(self) -> asyncio.Future[None] | None:
        return self._scanned

    async def rebuild_index(self) -> None:
        """Scan every bucket into the index; ``scan_done`` resolves however it
        ends. After an index loaded from its files, a gentle pass (one bucket
        at a time, each listed: only files the index does not know are
        read) that adds the block files the journal missed and drops the
        entries whose file is gone; otherwise the rebuild, as many buckets
        at once as there are I/O threads, and a compaction that marks the
        index whole once it is done."""
        assert self._scanned is not None, "prepare() first"
        loop = asyncio.get_running_loop()
        reconcile = self._scanned.done()
        found = dropped = 0
        buckets = [self.root / f"{i:02x}" for i in range(256)]
        ahead = 1 if reconcile else self.io_threads
        known: list[list[bytes]] = [[] for _ in range(256)]
        scans: list[asyncio.Future[ScanResult]] = []
        try:
            if reconcile:
                known = await loop.run_in_executor(self.executor, by_bucket, list(self.budget))
            for i in range(256):
                while len(scans) < min(i + ahead, 256):
                    j = len(scans)
                    scans.append(
                        loop.run_in_executor(self.executor, scan_bucket, buckets[j], known[j])
                    )
                result = await scans[i]
                known[i] = []
                added: list[Record] = []
                for key, size in result.entries:
                    if key not in self.budget and key not in self._writing:
                        self.budget.admit(key, size)
                        added.append(Record(Op.ADD, key, size))
                found += len(added)
                if added:
                    await loop.run_in_executor(self.executor, self.journal.append, added)
                if result.missing:
                    dropped += await self._drop_missing(result.missing)
                self.temp_removed += result.temp_removed
                self.corrupt += result.corrupt_removed
                self.buckets_scanned = i + 1
                if (i + 1) % 64 == 0 and not reconcile:
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
        if not reconcile:
            await self.compact()  # the snapshot marks the index whole
            log.info(
                "disk index rebuilt: %d blocks found, %d bytes; "
                "removed %d temporary and %d corrupt files",
                found,
                self.used_bytes,
                self.temp_removed,
                self.corrupt,
            )
        else:
            log.info(
                "disk index reconciled with the block files: %d blocks added, %d whose "
                "file was gone dropped; removed %d temporary and %d corrupt files",
                found,
                dropped,
                self.temp_removed,
                self.corrupt,
            )

    async def compact(self) -> None:
        """Compact the index's files into a new snapshot (one at a time)."""
        while self._compacting is not None:
            await asyncio.wait([self._compacting])
        await asyncio.shield(self._start_compaction())

    def _journalled(self) -> None:
        """Records were appended to the journal: have them written within
        ``GROUP_SECONDS`` (as one frame with the others appended meanwhile),
        and start a compaction in the background once the journal has grown."""
        if self._grouping is None and self.journal.held:
            self._grouping = asyncio.get_running_loop().call_later(GROUP_SECONDS, self._group)
        if self.journal.due and self._compacting is None:
            self._start_compaction()

    def _group(self) -> None:
        """Write the journal's held records (on an I/O thread)."""
        self._grouping = None
        written = asyncio.get_running_loop().run_in_executor(self.executor, self.journal.flush)

        def ended(fut: asyncio.Future[None]) -> None:
            if not fut.cancelled() and (exc := fut.exception()) is not None:
                log.warning("writing the disk index's journal failed: %s", exc)

        written.add_done_callback(ended)

    def _start_compaction(self) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        self._compacting = done = loop.run_in_executor(self.executor, self.journal.compact)

        def ended(fut: asyncio.Future[None]) -> None:
            if self._compacting is fut:
                self._compacting = None
            if not fut.cancelled() and (exc := fut.exception()) is not None:
                log.warning("compacting the disk index's files failed: %s", exc)

        done.add_done_callback(ended)
        return done

    async def _shrink_to_capacity(self) -> None:
        victims = self._evict(0)  # until indexed plus in-flight bytes fit
        await asyncio.get_running_loop().run_in_executor(self.executor, self._unlink, victims)
        self._journalled()

    # -- files and their journal records (on the I/O threads)

    def _unlink(self, keys: Sequence[bytes]) -> None:
        """Unlink the keys' files, then journal that they are gone."""
        try:
            unlink_all([self.path_of(k) for k in keys])
        finally:
            self.journal.append([Record(Op.REMOVE, k) for k in keys])

    def _write_file(
        self, path: Path, key: bytes, value: Buffer, size: int, victims: Sequence[bytes]
    ) -> None:
        """Write ``key``'s file, sealed where its namespace has a key (first
        unlinking the victims' files), then journal both: the ADD is on
        stable storage with the file when the policy syncs; a write that
        fails journals the key gone."""
        gone = [Record(Op.REMOVE, k) for k in victims]
        paths = [self.path_of(k) for k in victims]
        try:
            value = self.sealer.seal(key, value)
            write_block(path, key, value, self.fsync == "always", paths)
        except BaseException:
            self.journal.append([*gone, Record(Op.REMOVE, key)])
            raise
        self.journal.append([*gone, Record(Op.ADD, key, size)])

    def _read_file(self, key: bytes) -> Buffer:
        """``key``'s block from its file, admitted by the one rule
        (:meth:`~kvtier.tiers.sealing.Sealer.admit`)."""
        stored, digest = read_block(self.root, key)
        return self.sealer.admit(key, stored, checksum=digest)

    def _remove_missing(self, keys: Sequence[bytes]) -> list[bytes]:
        """The keys whose file is absent, journalled as gone."""
        absent = missing_files([self.path_of(k) for k in keys])
        gone = [k for k, a in zip(keys, absent, strict=True) if a]
        self.journal.append([Record(Op.REMOVE, k) for k in gone])
        return gone

    def _sync_files(self, paths: Sequence[Path]) -> None:
        sync_paths(paths)
        self.journal.sync()

    # -- index (synchronous)

    def contains(self, key: bytes) -> bool:
        """Whether the disk holds ``key``: indexed, or its file write is in
        flight (it is indexed, and pinned, from the moment the write begins:
        a block RAM demoted is never absent from both; :meth:`read` waits
        for the write to land)."""
        return key in self.budget

    def __len__(self) -> int:
        return len(self.budget)

    def _evict(self, need: int, key: bytes | None = None) -> list[bytes]:
        """Remove victims from the index (making room for ``key``'s namespace,
        when known); returns their keys, whose files to unlink."""
        victims = self.budget.evict_for(need, key)
        self.retention.evicted_leased.clear()  # (counted by the book; nothing below)
        return victims

    # -- retention

    def retain(self, keys: Sequence[bytes], retention: Retention, now: float) -> int:
        """Lease the ``keys`` held here to ``retention`` (or renew their
        lease), and the others as their writes land; returns how many were held."""
        budget = self.budget
        held = [k for k in keys if k in budget]
        if len(held) < len(keys):
            self.arriving_leases.add((k for k in keys if k not in budget), retention, now)
        grant_held(self.retention, budget, held, retention, now)
        return len(held)

    def release_session(self, session: bytes, namespace: bytes) -> int:
        """End ``namespace``'s ``session``'s lease here."""
        return self.retention.release(session, namespace)

    def supersede(self, session: bytes, keys: Sequence[bytes]) -> int:
        """``keys`` are ``session``'s whole prompt: its other leases here end."""
        return self.retention.supersede(session, keys)

    def expire_leases(self, now: float) -> int:
        """End the leases here whose time passed."""
        self.arriving_leases.expire(now)
        return self.retention.expire(now)

    def _retention_cap(self, ns: bytes) -> int:
        return leased_cap(self.budget, self.retained_share, ns)

    # -- reads

    async def read(self, key: bytes) -> Buffer | None:
        """The block, or None if absent; a corrupt file is discarded and counted.
        A write (or unlink) of ``key`` in flight lands first."""
        await self._landed(key)
        if key not in self.budget:
            return None
        self.budget.pin(key)
        self.budget.touch(key)
        try:
            value = await asyncio.get_running_loop().run_in_executor(
                self.executor, self._read_file, key
            )
        except FileNotFoundError:
            await self._drop_missing([key])
            return None
        except (CorruptBlock, SealError) as exc:
            path = self.path_of(key)
            if isinstance(exc, SealError) and exc.failure not in TORN:
                # (counted by the sealer, by reason)
                log.warning("discarding block %s (%s) that does not open: %s", key.hex(), path, exc)
            else:
                log.warning("discarding corrupt block %s (%s): %s", key.hex(), path, exc)
                self.corrupt += 1
            if key in self.budget:
                self.budget.drop_pins(key)
                self.budget.remove(key, Gone.LOST)
            await asyncio.get_running_loop().run_in_executor(self.executor, self._unlink, [key])
            self._journalled()
            return None
        except OSError as exc:
            raise TierError(f"disk: reading {self.path_of(key)} failed: {exc}") from exc
        finally:
            self.budget.unpin(key)
        self.reads += 1
        self.read_bytes += len(value)
        return value

    async def read_found(self, key: bytes) -> Buffer | None:
        """The block, whether or not the index knows it yet: a file the
        journal missed before a crash is read all the same (the start's pass
        over the files adopts it later). None where there is no good file."""
        value = await self.read(key)
        if value is not None or key in self.budget:
            return value
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self.executor, self._read_file, key
            )
        except (OSError, CorruptBlock, SealError):
            return None  # (a damaged file is the pass's to count and remove)

    def _forget(self, key: bytes) -> None:
        """``key``'s file write failed: the disk does not hold it (the I/O
        thread journals what became of the file)."""
        if key in self.budget:
            self.budget.drop_pins(key)
            self.budget.remove(key, Gone.LOST)

    async def _drop_missing(self, keys: Sequence[bytes]) -> int:
        """Drop the keys whose file was found gone (a read, the pass over the
        files), journalled. Each is checked again while no write of it can
        begin, so a file that landed meanwhile keeps its entry and a later
        write's ADD always follows the REMOVE. Returns how many went."""
        loop = asyncio.get_running_loop()
        keys = [k for k in keys if k in self.budget and k not in self._writing]
        if not keys:
            return 0
        done: asyncio.Future[None] = loop.create_future()
        for key in keys:
            self._writing[key] = done
        try:
            gone = await loop.run_in_executor(self.executor, self._remove_missing, keys)
            for key in gone:
                if key in self.budget:
                    self.budget.drop_pins(key)
                    self.budget.remove(key, Gone.LOST)
            # Deleted meanwhile with its file still there: unlinked before a write begins.
            present = set(keys).difference(gone)
            deleted = [k for k in present if k in self._deleted_while_writing]
            if deleted:
                await loop.run_in_executor(self.executor, self._unlink, deleted)
            self._journalled()
        finally:
            for key in keys:
                self._deleted_while_writing.discard(key)
                if self._writing.get(key) is done:
                    del self._writing[key]
            done.set_result(None)
        return len(gone)

    async def _landed(self, key: bytes) -> None:
        """Return once no write (or unlink) of ``key`` is in flight: each that
        was, or began meanwhile, has landed (never cancelled from here)."""
        while (pending := self._writing.get(key)) is not None:
            await asyncio.shield(pending)

    # -- writes

    async def write(self, key: bytes, value: Buffer, *, durable: bool = False) -> None:
        """Store ``key`` (idempotent; concurrent writes of one key share one file write).

        The key is indexed (and pinned: never an eviction's victim) from the
        moment its file write begins, so the disk holds it from then on; a
        write that fails removes it again (lost), one deleted meanwhile
        unlinks its file once it lands."""
        loop = asyncio.get_running_loop()
        await self._landed(key)
        if key in self.budget:
            self.budget.touch(key)
        else:
            size = file_size(key, self._sealed_len(key, value))
            if size > self.capacity:
                raise ValueTooLargeError(
                    f"block of {size} bytes is larger than the disk tier ({self.capacity} bytes)"
                )
            try:
                victims = self._evict(size, key)
            except NoRoom as exc:
                raise TierError(f"disk: {exc}") from None
            done: asyncio.Future[None] = loop.create_future()
            self._writing[key] = done
            self.budget.admit(key, size)
            self.budget.pin(key)
            path = self.path_of(key)
            deleted = False
            try:
                await loop.run_in_executor(
                    self.executor, self._write_file, path, key, value, size, victims
                )
                self.writes += 1
                self.written_bytes += len(value)
                # Deleted meanwhile: unlinked before a later write of the key starts.
                deleted = key in self._deleted_while_writing
                if deleted:
                    await loop.run_in_executor(self.executor, self._unlink, [key])
            except OSError as exc:
                self.write_errors += 1
                self._forget(key)  # not held after all
                if exc.errno == errno.ENOSPC:
                    self.enospc += 1
                    raise TierError(f"disk full writing {path}: {exc.strerror}") from exc
                raise TierError(f"disk: writing {path} failed: {exc}") from exc
            except BaseException:
                self._forget(key)  # cancelled: whether its file landed is unknown
                raise
            finally:
                self._deleted_while_writing.discard(key)
                del self._writing[key]
                if not done.done():
                    done.set_result(None)
                self._journalled()
            if deleted:
                return
            self.budget.unpin(key)
            if self.arriving_leases.waiting:
                self.arriving_leases.land(key, self.retention, self.budget)
            if self.budget.shares is not None:
                # Writes of one namespace in flight together each found room
                # within its max; the last to land makes it true again.
                try:
                    late = self._evict(0, key)
                except NoRoom:
                    late = []
                if late:
                    await loop.run_in_executor(self.executor, self._unlink, late)
                    self._journalled()
            if self.fsync == "batch":
                self._dirty.append(path)
                self._write_gen += 1
        if durable and self.fsync == "batch":
            await self.sync()

    def _sealed_len(self, key: bytes, value: Buffer) -> int:
        size = self.sealer.sealed_size(key, value)
        assert size is not None, "the disk tier has no codec"
        return size

    @property
    def unsynced_writes(self) -> int:
        """Writes completed but not yet on stable storage (fsync ``batch``)."""
        return self._write_gen - self._synced_gen

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
                    await loop.run_in_executor(self.executor, self._sync_files, paths)
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
        if key not in self.budget:
            return False
        self.budget.drop_pins(key)
        self.budget.remove(key, Gone.DELETED)
        if key in self._writing:  # its file write is in flight
            self._deleted_while_writing.add(key)  # unlinked once it lands
            return True
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._writing[key] = done
        unlink = loop.run_in_executor(self.executor, self._unlink, [key])

        def finished(_f: asyncio.Future[None]) -> None:
            if self._writing.get(key) is done:
                del self._writing[key]
            done.set_result(None)
            self._journalled()

        unlink.add_done_callback(finished)
        return True

    def in_flight(self, keys: Sequence[bytes]) -> list[asyncio.Future[None]]:
        """The file operations of ``keys`` in flight (a write, or the unlink a
        delete began): once they are done, each key's file is as the index
        says and journalled so."""
        return [f for k in keys if (f := self._writing.get(k)) is not None]

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
        if self._grouping is not None:  # (the journal's close writes what it holds)
            self._grouping.cancel()
            self._grouping = None
        if self.fsync == "batch" and self._dirty:
            await self.sync()
        if self._compacting is not None:
            await asyncio.wait([self._compacting])  # (a failure is logged where it ends)
        self.executor.shutdown(wait=True)
        self.journal.close()
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def filesystem(self) -> tuple[int, int]:
        """(free bytes, size) of the filesystem holding the blocks; (0, 0) if unknown."""
        try:
            st = os.statvfs(self.root)
        except OSError:
            return 0, 0
        return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize

    def stats(self) -> DiskStats:
        fs_free, fs_size = self.filesystem()
        stats = DiskStats(
            name=self.name,
            capacity_bytes=self.capacity,
            used_bytes=self.used_bytes,
            blocks=len(self.budget),
            evictions=self.evictions,
            reads=self.reads,
            read_bytes=self.read_bytes,
            writes=self.writes,
            written_bytes=self.written_bytes,
            corrupt_discarded=self.corrupt,
            enospc=self.enospc,
            write_errors=self.write_errors,
            writes_in_flight=len(self._writing),
            index_buckets_scanned=self.buckets_scanned,
            index_buckets_total=self.buckets_total,
            index_loaded_from=""
            if self.loaded is None
            else ("snapshot" if self.loaded.index is not None else "scan"),
            index_load_seconds=self.loaded.seconds if self.loaded is not None else 0.0,
            index_journal_bytes=self.journal.journal_bytes,
            index_compactions=self.journal.compactions,
            filesystem_free_bytes=fs_free,
            filesystem_size_bytes=fs_size,
        )
        return self.sealer.counts.fill(stats)

"""The disk index's files: reading them at start, appending, compacting.

The acting half of :mod:`kvtier.tiers.disk.journal` (the format). Every
method blocks: the disk tier calls them on its I/O threads, never on the
event loop. Appends come from several threads at once; each record is
written whole under one lock, so records of one key keep the order in
which the tier made its changes (the tier never runs two file operations
of one key at once).

A start (:meth:`IndexJournal.load`) trusts the index only with a snapshot:
the newest one, then every journal of its generation or later (a torn
tail, a crash in the middle of an append, ends its journal). Records are
appended in groups, as frames of up to ``FRAME_RECORDS`` (the tier writes
what is held every ``GROUP_SECONDS``), so a journal of millions of PUTs
reads as fast as a snapshot of them. Without one,
or with one that cannot be read, the files are removed and the tier scans
its block files instead, journalling what it finds; when that scan ends
the tier compacts (:meth:`IndexJournal.compact`), and the snapshot it
writes marks the index whole. Each start appends to a journal of its own.

Compaction rotates to a new journal under the lock, then writes the next
snapshot (the last one with the journals since replayed) aside, renames
it into place and removes what it replaces: a crash at any point leaves
either the old snapshot and its journals or the new one, both whole.

Invariants: after :meth:`load` returns an index, that index is the
snapshot's with every whole journal record since applied in order;
``journal_bytes`` counts the bytes written since the last snapshot; a
record is on stable storage when :meth:`append` returns with ``fsync``
``always``, or once :meth:`sync` returns; records are written in the order
they were appended, held ones before a sync, a compaction or a close.
Imports the format and the tier's file I/O only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.tiers.disk.io import fsync_dir
from kvtier.tiers.disk.journal import (
    FRAME_RECORDS,
    Batch,
    IndexFormatError,
    Kind,
    Record,
    decode,
    encode_all,
    header,
    journal_name,
    parse_name,
    plan_start,
    replay,
    snapshot_name,
    snapshot_records,
)

log = logging.getLogger("kvtier.disk")

#: journals past this many bytes since the last snapshot are compacted into a new one
COMPACT_AFTER_BYTES = 64 * 1024 * 1024
#: seconds appended records may wait to be written as one frame (with up to
#: FRAME_RECORDS of them): a start reads a journal a frame at a time, so one
#: written a record a frame (a PUT each) reads 20x slower than a snapshot
#: (2,000,000 PUTs: about 10 s, not 0.5 s). The disk tier writes what is
#: held on this period; a sync, a compaction and a clean stop write it first.
GROUP_SECONDS = 0.05
#: a record's bytes in a frame besides its key: op, key length, file size
RECORD_BYTES = 11


@dataclass(frozen=True, slots=True)
class Loaded:
    """What a start found (:class:`Found`), and how long reading it took."""

    found: Found
    seconds: float

    @property
    def index(self) -> dict[bytes, int] | None:
        """The index (None: scan the block files)."""
        return self.found.index

    @property
    def reason(self) -> str:
        return self.found.reason

    def describe(self) -> str:
        found = self.found
        if found.index is None:
            return f"scan ({found.reason})"
        torn = ", a torn tail dropped" if found.torn else ""
        return (
            f"snapshot {found.snapshot} + {found.records} journal records{torn}, "
            f"{len(found.index)} blocks in {self.seconds:.2f}s"
        )


class IndexJournal:
    """One disk tier's index files under ``directory`` (see the module)."""

    def __init__(
        self, directory: Path, *, fsync_each: bool, compact_after: int = COMPACT_AFTER_BYTES
    ) -> None:
        self.directory = Path(directory)
        #: fsync the journal after each append (the tier's ``fsync = "always"``)
        self.fsync_each = fsync_each
        self.compact_after = compact_after
        self._lock = threading.Lock()
        self._fd = -1
        #: the journal appended to now, and the snapshot the index replays from
        self.generation = 0
        self.base: int | None = None
        #: bytes appended since the last snapshot
        self.journal_bytes = 0
        self.compactions = 0
        #: records appended and not written yet: the next frame's, and their
        #: bytes in it (a record's columns and key)
        self._held: list[Record] = []
        self._held_bytes = 0

    def __repr__(self) -> str:
        state = "open" if self._fd >= 0 else "closed"
        return (
            f"<IndexJournal {self.directory} {state} snapshot={self.base} "
            f"journal={self.generation} bytes={self.journal_bytes} "
            f"compactions={self.compactions}>"
        )

    @property
    def due(self) -> bool:
        """Whether the journals since the snapshot (and the records held
        for them) are worth compacting."""
        return self.journal_bytes + self._held_bytes >= self.compact_after

    # -- start

    def load(self) -> Loaded:
        """Read the index, then open a journal for this run's changes."""
        started = time.monotonic()
        self.directory.mkdir(parents=True, exist_ok=True)
        found = read_index(self.directory)
        if found.index is None:
            self._remove(lambda _kind, _gen: True)
            self.base, self.generation = None, 0
        else:
            self.base, self.generation = found.snapshot, found.last + 1
            self.journal_bytes = found.journal_bytes
        self._fd = self._begin(self.generation)
        return Loaded(found, time.monotonic() - started)

    # -- appends

    @property
    def held(self) -> int:
        """Records appended and not yet written (:meth:`flush` writes them)."""
        return len(self._held)

    def append(self, records: Sequence[Record]) -> None:
        """Add ``records`` at the journal's end (whole, in order): written
        with the records appended with them, as one frame, once a frame's
        worth is held or at the next :meth:`flush` (at once, and synced,
        with ``fsync_each``). A record not written when the process dies is
        one the next start's pass over the block files finds again."""
        if not records:
            return
        with self._lock:
            if self._fd < 0:
                return  # closed: the next start scans what this run left unjournalled
            self._held.extend(records)
            self._held_bytes += sum(RECORD_BYTES + len(r.key) for r in records)
            if self.fsync_each or len(self._held) >= FRAME_RECORDS:
                self._write_held()

    def flush(self) -> None:
        """Write the records held (see :meth:`append`)."""
        with self._lock:
            if self._fd >= 0:
                self._write_held()

    def _write_held(self) -> None:
        """(the lock held, the journal open)"""
        if not self._held:
            return
        data = encode_all(self._held)
        try:
            _write_all(self._fd, data)
        finally:  # (held counts them until written: a reader without the lock sees so)
            self._held, self._held_bytes = [], 0
        self.journal_bytes += len(data)
        if self.fsync_each:
            os.fsync(self._fd)

    def sync(self) -> None:
        """Put every record appended so far on stable storage."""
        with self._lock:
            if self._fd >= 0:
                self._write_held()
                os.fsync(self._fd)

    # -- compaction

    def compact(self) -> None:
        """Write the next snapshot (see the module); one at a time."""
        with self._lock:
            if self._fd < 0:
                return
            old = self.generation
            self._write_held()  # (into the journal the snapshot replays)
            fd = self._begin(old + 1)
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd, self.generation = fd, old + 1
            self.journal_bytes = 0
        base = self.base
        index: dict[bytes, int] = {}
        if base is not None:
            replay(index, _snapshot(self.directory, base))
        for gen in range(0 if base is None else base, old + 1):
            with contextlib.suppress(FileNotFoundError):
                data = (self.directory / journal_name(gen)).read_bytes()
                replay(index, decode(data, Kind.JOURNAL, gen).batches)
        final = self.directory / snapshot_name(old + 1)
        aside = final.with_name(final.name + ".tmp")
        fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            _write_all(fd, header(Kind.SNAPSHOT, old + 1) + encode_all(snapshot_records(index)))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(aside, final)
        fsync_dir(self.directory)
        self.base = old + 1
        self.compactions += 1
        self._remove(lambda kind, gen: gen <= old if kind is Kind.JOURNAL else gen < old + 1)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                self._write_held()
                os.fsync(self._fd)
                os.close(self._fd)
                self._fd = -1

    # -- files

    def _begin(self, generation: int) -> int:
        path = self.directory / journal_name(generation)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        _write_all(fd, header(Kind.JOURNAL, generation))
        os.fsync(fd)
        fsync_dir(self.directory)
        return fd

    def _remove(self, which: Callable[[Kind, int], bool]) -> None:
        """Remove the index files ``which(kind, generation)`` picks, and strays."""
        for name in os.listdir(self.directory):
            parsed = parse_name(name)
            if parsed is None:
                if name.endswith(".tmp"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.directory / name)
                continue
            if which(*parsed):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.directory / name)


@dataclass(frozen=True, slots=True)
class Found:
    """The index as its files hold it (None: they cannot be used, ``reason``)."""

    index: dict[bytes, int] | None
    #: the snapshot's generation, and the journal records replayed after it
    snapshot: int | None
    records: int
    #: a journal ended in a torn record (a crash in the middle of an append)
    torn: bool
    #: why the files could not be used (``index`` None)
    reason: str
    #: the newest generation of a file read, and the journals' bytes
    last: int = 0
    journal_bytes: int = 0


def read_index(directory: Path) -> Found:
    """The index the files in ``directory`` hold: the newest snapshot, then
    every journal since (a torn tail ends its journal). Changes nothing."""
    names = os.listdir(directory) if directory.is_dir() else []
    base, journals = plan_start(names)
    records, torn, size = 0, False, 0
    try:
        if base is None:
            raise IndexFormatError("no snapshot")
        index: dict[bytes, int] = {}
        replay(index, _snapshot(directory, base))
        for gen in journals:
            data = (directory / journal_name(gen)).read_bytes()
            decoded = decode(data, Kind.JOURNAL, gen)
            replay(index, decoded.batches)
            records += decoded.count
            torn = torn or decoded.torn
            size += len(data)
    except (IndexFormatError, OSError) as exc:
        return Found(None, None, 0, False, str(exc))
    return Found(index, base, records, torn, "", max([base, *journals]), size)


def _snapshot(directory: Path, generation: int) -> list[Batch]:
    """A snapshot's records; a snapshot is whole or not used at all."""
    data = (directory / snapshot_name(generation)).read_bytes()
    decoded = decode(data, Kind.SNAPSHOT, generation)
    if decoded.torn:
        raise IndexFormatError(f"snapshot {generation} is damaged at byte {decoded.end}")
    return decoded.batches


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]

"""The blocks a remote tier is owed, kept beside the disk tier's blocks, so
that writes a store missed while it was down reach it after a restart too.

The file half of :class:`kvtier.core.outbox.Outbox`: the keys owed to one
tier (and their sizes) under ``<disk root>/owed/<tier>/``, in the disk
index's own files (:mod:`kvtier.tiers.disk.journaling`: a snapshot and a
journal of ADD and REMOVE records, framed and checksummed, a torn tail
dropped). The blocks themselves are the disk tier's: a start reads the
keys back, and each is read from the disk when it is sent.

Records are held and written in groups (:meth:`OwedFile.flush`, on the
loop: a frame of owed keys is small), never synced one by one: a crash
loses at most the last group, whose blocks a later PUT writes through
again. Invariants: :meth:`load` returns the keys owed when the last run
wrote its records, in the order they were first owed; a file that cannot
be read is started again empty (logged), never an error that stops the
daemon. Imports the index's files only.
"""

from __future__ import annotations

import logging
from pathlib import Path

from kvtier.tiers.disk.journal import Op, Record
from kvtier.tiers.disk.journaling import IndexJournal

log = logging.getLogger("kvtier.disk")

#: bytes of records written since the last snapshot before the next is made
COMPACT_AFTER = 4 * 1024 * 1024


class OwedFile:
    """The keys owed to one remote tier, on the disk (see the module)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._journal = IndexJournal(self.directory, fsync_each=False, compact_after=COMPACT_AFTER)

    def __repr__(self) -> str:
        return f"<OwedFile {self.directory} held={self._journal.held}>"

    def load(self) -> dict[bytes, int]:
        """The keys owed and their sizes; then records this run's changes."""
        loaded = self._journal.load()
        owed = loaded.index
        if owed is None:
            if "no snapshot" not in loaded.reason:
                log.warning("%s: unreadable (%s): starting empty", self.directory, loaded.reason)
            owed = {}
        self._journal.compact()  # (a snapshot of what was read: the next start trusts it)
        return owed

    def owed(self, key: bytes, size: int) -> None:
        self._journal.append([Record(Op.ADD, key, size)])

    def settled(self, keys: list[bytes]) -> None:
        """``keys`` are no longer owed (sent, given up or deleted)."""
        self._journal.append([Record(Op.REMOVE, key) for key in keys])

    @property
    def held(self) -> int:
        """Records not written yet."""
        return self._journal.held

    def flush(self) -> None:
        """Write the records held, as one frame."""
        self._journal.flush()
        if self._journal.due:
            self._journal.compact()

    def close(self) -> None:
        self._journal.close()

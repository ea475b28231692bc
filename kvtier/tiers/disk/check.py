"""``kvtier disk check DATA_DIR``: a data directory verified offline.

Reads the index files as a start would (:func:`read_index`, changing
nothing) and every block file whole: its header, its name against its key,
its checksum. Then compares the two: entries whose file is gone, files the
index does not name, sizes that differ. Run it on a directory no daemon is
serving (a daemon's writes in flight would read as differences). Blocking;
imports the tier's format, file I/O and index files only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.tiers.disk.format import SUFFIX, TMP_MARK, CorruptBlock, block_name
from kvtier.tiers.disk.io import check_block
from kvtier.tiers.disk.journaling import read_index


@dataclass(slots=True)
class Report:
    index: str
    indexed: int = 0
    files: int = 0
    file_bytes: int = 0
    #: block files that fail their checks, and why
    corrupt: list[tuple[Path, str]] = field(default_factory=list)
    temporary: int = 0
    #: index entries whose file is missing, files the index does not name,
    #: and entries whose size is not their file's
    missing: int = 0
    unindexed: int = 0
    wrong_size: int = 0

    @property
    def ok(self) -> bool:
        """No corrupt file, and (with index files) the index matches the files."""
        return not self.corrupt and not (self.missing or self.unindexed or self.wrong_size)

    def lines(self) -> list[str]:
        out = [
            f"index: {self.index}",
            f"block files: {self.files} ({self.file_bytes} bytes), "
            f"{len(self.corrupt)} corrupt, {self.temporary} temporary",
            f"index against files: {self.missing} entries without a file, "
            f"{self.unindexed} files not indexed, {self.wrong_size} sizes that differ",
        ]
        out += [f"corrupt: {path}: {why}" for path, why in self.corrupt]
        out.append("ok" if self.ok else "NOT OK")
        return out


def check_data_dir(root: Path) -> Report:
    """Verify ``root`` (a disk tier's ``disk.path``); see the module."""
    found = read_index(root / "index")
    index = found.index
    if index is None:
        report = Report(f"none usable ({found.reason}): a start scans the block files")
    else:
        torn = ", a torn tail" if found.torn else ""
        report = Report(
            f"snapshot {found.snapshot} + {found.records} journal records{torn}, "
            f"{len(index)} blocks",
            indexed=len(index),
        )
    files: dict[bytes, int] = {}
    for i in range(256):
        bucket = root / f"{i:02x}"
        if not bucket.is_dir():
            continue
        for entry in os.scandir(bucket):
            if TMP_MARK in entry.name:
                report.temporary += 1
                continue
            if not entry.name.endswith(SUFFIX):
                continue
            path = Path(entry.path)
            data = path.read_bytes()
            try:
                key, _value = check_block(data)
                if block_name(key) + SUFFIX != entry.name:
                    raise CorruptBlock("file name does not match its key")
            except CorruptBlock as exc:
                report.corrupt.append((path, str(exc)))
                continue
            files[key] = len(data)
            report.files += 1
            report.file_bytes += len(data)
    if index is not None:
        report.missing = sum(1 for k in index if k not in files)
        report.unindexed = sum(1 for k in files if k not in index)
        report.wrong_size = sum(1 for k, n in index.items() if k in files and files[k] != n)
    return report

"""The disk index on disk: a snapshot and a journal of what changed since. Pure.

The disk tier finds its blocks again at start from ``<root>/index/``
instead of reading every block file: ``snapshot.<gen>`` holds the index
(each block's key and file size) as it was when ``journal.<gen>`` was
begun, and each journal holds the changes since, in the order they
happened: ADD once a block's file is in place, REMOVE once its file is
gone. A later generation's snapshot is the replay of the one before
(:func:`replay`), so a start reads the newest snapshot it can trust and
every journal of that generation or later.

Both files are a header (magic, format version, kind, generation) and
then records, each framed by its payload's length and XXH3-64, so a torn
tail (a crash in the middle of an append) ends the file where the last
whole record ends and is never misread: :func:`decode` returns the records
before it and where they end. A file of another format version, kind or
generation is :class:`IndexFormatError` (the tier then falls back to
scanning its block files).

Invariants: ``decode(header + b"".join(records))`` returns every record
in order; a prefix of that cut anywhere returns the whole records before
the cut, and ``torn`` is true exactly when bytes follow them; a flipped
byte in a record ends the file at that record. Imports xxhash only.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import xxhash

MAGIC = b"KVTI"
#: the format of these files; a start that finds another scans the block files
FORMAT_VERSION = 1
#: magic, format version, kind, reserved, generation
HEADER = struct.Struct("<4sBBHQ")
#: a record's frame: payload length, XXH3-64 of the payload
FRAME = struct.Struct("<IQ")
#: a record's payload: op, key length, file size (the key follows)
ENTRY = struct.Struct("<BHQ")
#: no record is larger (a key is at most 65,535 bytes)
MAX_RECORD = ENTRY.size + 0xFFFF


class IndexFormatError(Exception):
    """An index file that cannot be used: bad magic, another version, kind or generation."""


class Kind(enum.IntEnum):
    SNAPSHOT = 1
    JOURNAL = 2


class Op(enum.IntEnum):
    ADD = 1  # the block's file is in place: key, file size
    REMOVE = 2  # the block's file is gone


@dataclass(frozen=True, slots=True)
class Record:
    op: Op
    key: bytes
    #: the block file's size (0 for REMOVE)
    size: int = 0


@dataclass(frozen=True, slots=True)
class Decoded:
    records: list[Record]
    #: bytes of the file that hold its header and whole records
    end: int
    #: bytes followed the last whole record (a torn append, or damage)
    torn: bool


def header(kind: Kind, generation: int) -> bytes:
    return HEADER.pack(MAGIC, FORMAT_VERSION, kind, 0, generation)


def encode(record: Record) -> bytes:
    payload = ENTRY.pack(record.op, len(record.key), record.size) + record.key
    return FRAME.pack(len(payload), xxhash.xxh3_64_intdigest(payload)) + payload


def encode_all(records: Iterable[Record]) -> bytes:
    return b"".join(encode(r) for r in records)


def decode(data: bytes | memoryview, kind: Kind, generation: int) -> Decoded:
    """The whole records of an index file of ``kind`` and ``generation``;
    raises :class:`IndexFormatError` for a file that is not one."""
    view = memoryview(data)
    if len(view) < HEADER.size:
        raise IndexFormatError("shorter than its header")
    magic, version, got_kind, _reserved, got_gen = HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise IndexFormatError("bad magic")
    if version != FORMAT_VERSION:
        raise IndexFormatError(f"format version {version}, not {FORMAT_VERSION}")
    if got_kind != kind or got_gen != generation:
        raise IndexFormatError(f"kind {got_kind} of generation {got_gen}, not {kind} {generation}")
    records: list[Record] = []
    at = HEADER.size
    while at + FRAME.size <= len(view):
        length, digest = FRAME.unpack_from(view, at)
        start = at + FRAME.size
        if not ENTRY.size <= length <= MAX_RECORD or start + length > len(view):
            break
        payload = view[start : start + length]
        if xxhash.xxh3_64_intdigest(payload) != digest:
            break
        op, key_len, size = ENTRY.unpack_from(payload, 0)
        if op not in (Op.ADD, Op.REMOVE) or ENTRY.size + key_len != length:
            break
        records.append(Record(Op(op), bytes(payload[ENTRY.size :]), size))
        at = start + length
    return Decoded(records, at, at < len(view))


def replay(index: dict[bytes, int], records: Iterable[Record]) -> dict[bytes, int]:
    """``index`` (key -> file size) with ``records`` applied in order, in place."""
    for r in records:
        if r.op is Op.ADD:
            index[r.key] = r.size
        else:
            index.pop(r.key, None)
    return index


def snapshot_records(index: dict[bytes, int]) -> Iterator[Record]:
    return (Record(Op.ADD, key, size) for key, size in index.items())


def snapshot_name(generation: int) -> str:
    return f"snapshot.{generation}"


def journal_name(generation: int) -> str:
    return f"journal.{generation}"


def parse_name(name: str) -> tuple[Kind, int] | None:
    """(kind, generation) of an index file's name; None for any other name."""
    stem, _, gen = name.partition(".")
    kind = {"snapshot": Kind.SNAPSHOT, "journal": Kind.JOURNAL}.get(stem)
    if kind is None or not gen.isdigit():
        return None
    return kind, int(gen)


def plan_start(names: Sequence[str]) -> tuple[int | None, list[int]]:
    """What a start reads, from the names in the index directory: the newest
    snapshot's generation (None: none, start from an empty index) and the
    journals to replay after it, oldest first (those of its generation or later)."""
    snapshots: list[int] = []
    journals: list[int] = []
    for name in names:
        parsed = parse_name(name)
        if parsed is None:
            continue
        kind, gen = parsed
        (snapshots if kind is Kind.SNAPSHOT else journals).append(gen)
    base = max(snapshots, default=None)
    return base, sorted(g for g in journals if base is None or g >= base)

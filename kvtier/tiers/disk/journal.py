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
then frames of records (one append's, or up to ``FRAME_RECORDS`` of a
snapshot's, in columns: a start reads millions in a few seconds), each
framed by its payload's length and XXH3-64, so a torn tail (a crash in
the middle of an append) ends the file where the last whole frame ends
and is never misread: :func:`decode` returns the frames before it and
where they end. A file of another format version, kind or
generation is :class:`IndexFormatError` (the tier then falls back to
scanning its block files).

Invariants: ``decode(header + frames)`` returns every record in order; a
prefix of that cut anywhere returns the whole frames before the cut, and
``torn`` is true exactly when bytes follow them; a flipped byte in a frame
ends the file at that frame. Imports xxhash only.
"""

from __future__ import annotations

import array
import enum
import itertools
import struct
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import xxhash

MAGIC = b"KVTI"
#: the format of these files; a start that finds another scans the block files
FORMAT_VERSION = 1
#: magic, format version, kind, reserved, generation
HEADER = struct.Struct("<4sBBHQ")
#: a frame: payload length, XXH3-64 of the payload
FRAME = struct.Struct("<IQ")
#: a frame's payload: the count of its records, then their ops (a byte
#: each), key lengths (u16 each), file sizes (u64 each) and keys, in columns
COUNT = struct.Struct("<I")
#: records written in one frame at most (a snapshot's are cut into frames)
FRAME_RECORDS = 4096


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
class Batch:
    """One frame's records, in columns."""

    ops: bytes
    keys: list[bytes]
    sizes: array.array[int]

    @property
    def adds_only(self) -> bool:
        return self.ops.count(Op.ADD) == len(self.ops)

    def records(self) -> Iterator[Record]:
        for op, key, size in zip(self.ops, self.keys, self.sizes, strict=True):
            yield Record(Op(op), key, size)


@dataclass(frozen=True, slots=True)
class Decoded:
    batches: list[Batch]
    #: bytes of the file that hold its header and whole frames
    end: int
    #: bytes followed the last whole frame (a torn append, or damage)
    torn: bool

    @property
    def records(self) -> list[Record]:
        return [r for b in self.batches for r in b.records()]

    @property
    def count(self) -> int:
        return sum(len(b.ops) for b in self.batches)


def header(kind: Kind, generation: int) -> bytes:
    return HEADER.pack(MAGIC, FORMAT_VERSION, kind, 0, generation)


def encode(records: Sequence[Record]) -> bytes:
    """One frame of ``records`` (at most ``FRAME_RECORDS``): appended whole, or torn whole."""
    ops = bytes(r.op for r in records)
    lens = array.array("H", (len(r.key) for r in records))
    sizes = array.array("Q", (r.size for r in records))
    if _SWAP:
        lens.byteswap()
        sizes.byteswap()
    payload = b"".join(
        (COUNT.pack(len(records)), ops, lens.tobytes(), sizes.tobytes(), *(r.key for r in records))
    )
    return FRAME.pack(len(payload), xxhash.xxh3_64_intdigest(payload)) + payload


def encode_all(records: Iterable[Record]) -> bytes:
    """``records`` in frames of at most ``FRAME_RECORDS``."""
    out: list[bytes] = []
    chunk: list[Record] = []
    for r in records:
        chunk.append(r)
        if len(chunk) == FRAME_RECORDS:
            out.append(encode(chunk))
            chunk = []
    if chunk:
        out.append(encode(chunk))
    return b"".join(out)


def decode(data: bytes | memoryview, kind: Kind, generation: int) -> Decoded:
    """The whole frames of an index file of ``kind`` and ``generation``;
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
    batches: list[Batch] = []
    at = HEADER.size
    while at + FRAME.size <= len(view):
        length, digest = FRAME.unpack_from(view, at)
        start = at + FRAME.size
        if start + length > len(view):
            break
        payload = view[start : start + length]
        if xxhash.xxh3_64_intdigest(payload) != digest:
            break
        batch = _batch(payload)
        if batch is None:
            break
        batches.append(batch)
        at = start + length
    return Decoded(batches, at, at < len(view))


def _batch(payload: memoryview) -> Batch | None:
    """A frame's records; None for a payload that does not add up."""
    if len(payload) < COUNT.size:
        return None
    (n,) = COUNT.unpack_from(payload, 0)
    at = COUNT.size
    ops = bytes(payload[at : at + n])
    lens, sizes = array.array("H"), array.array("Q")
    lens.frombytes(payload[at + n : at + 3 * n])
    sizes.frombytes(payload[at + 3 * n : at + 11 * n])
    if _SWAP:
        lens.byteswap()
        sizes.byteswap()
    at += 11 * n
    if len(ops) != n or len(sizes) != n or at + sum(lens) != len(payload):
        return None
    if any(op != Op.ADD and op != Op.REMOVE for op in set(ops)):
        return None
    raw = bytes(payload[at:])
    if n and min(lens) == max(lens):  # keys of one length (a namespace's): at a stride
        step = lens[0]
        keys = [raw[i : i + step] for i in range(0, n * step, step)]
    else:
        ends = list(itertools.accumulate(lens))
        keys = [raw[end - length : end] for end, length in zip(ends, lens, strict=True)]
    return Batch(ops, keys, sizes)


def replay(index: dict[bytes, int], batches: Iterable[Batch]) -> dict[bytes, int]:
    """``index`` (key -> file size) with ``batches`` applied in order, in place."""
    for b in batches:
        if b.adds_only:
            index.update(zip(b.keys, b.sizes, strict=True))
            continue
        for op, key, size in zip(b.ops, b.keys, b.sizes, strict=True):
            if op == Op.ADD:
                index[key] = size
            else:
                index.pop(key, None)
    return index


def snapshot_records(index: dict[bytes, int]) -> Iterator[Record]:
    return (Record(Op.ADD, key, size) for key, size in index.items())


#: the columns are little-endian on disk
_SWAP = sys.byteorder != "little"


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

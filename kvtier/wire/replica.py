"""The lookup process's two streams: the daemon's feed and the process's reports. Pure.

The daemon writes the *feed* (docs/lookup-process.md) into a ring in
memory both processes map (:class:`FeedRing`): records of what changed in
what it holds, each a one-byte :class:`~kvtier.model.FeedOp`, a two-byte
key length and the key. The process writes *reports* on a socket pair:
each a four-byte length, then a one-byte :class:`~kvtier.model.ReportKind`,
then for an answered lookup how many times it was asked alike, the states
it answered (a four-byte count and one byte each), the namespace prefix of
the connection that asked (a one-byte length; empty: the default
namespace) and the LOOKUP's meta as the client sent it.

Invariants: the ring's reader reads only records the writer published
whole, and the writer never overwrites what the reader has not read; a
report is whole in one decode or not taken (a partial one waits in the
buffer for its rest); a decoded record never aliases the memory it came
from.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from kvtier.model import Buffer, FeedOp, Lookup, ReportKind
from kvtier.wire.codecs import DEFAULT_SCOPE, KeyScope, decode_lookup
from kvtier.wire.framing import CodecError

_FEED_HEAD = struct.Struct("<BH")
_U32 = struct.Struct("<I")
_REPORT_HEAD = struct.Struct("<IB")
_ANSWERED = struct.Struct("<IIB")  # times asked, states, namespace prefix bytes


class Report(NamedTuple):
    """One report of the lookup process."""

    kind: ReportKind
    #: ANSWERED: the lookup, its states, and how many times it was asked
    lookup: Lookup | None = None
    states: bytes = b""
    times: int = 0
    #: the key prefix of the namespace that asked (empty: the default one)
    prefix: bytes = b""


_FEED_OPS = {int(op): op for op in FeedOp}
_REPORT_KINDS = {int(kind): kind for kind in ReportKind}


#: the ring's header, as 32-bit words (each read and written in one aligned
#: access, never byte by byte as struct's standard sizes are): bytes written
#: (the daemon's), bytes read (the process's), whether the writer holds
#: records the ring had no room for, and how many times the reader has read
#: (the process's heartbeat: it reads at least every few tens of ms)
_WRITTEN, _READ, _BEHIND, _READS = 0, 2, 4, 6
RING_HEADER = 64
#: a record's op byte that says: nothing more before the ring wraps
_PAD = 0
_MASK = 0xFFFFFFFF


class FeedRing:
    """The feed: a ring of records in memory both processes map.

    The daemon :meth:`write` s records and then publishes how many bytes it
    has written; the process :meth:`read` s up to that and then publishes
    how many it has read. Each side writes only its own counter (a 4-byte
    aligned store), and a record is published only once it is whole, so
    neither waits for the other. A record that would not fit before the
    ring's end starts at its beginning (a PAD byte, or too few bytes for a
    head, marks the gap). A write that would overtake the reader takes
    nothing and says so; the writer then keeps its records and raises the
    *behind* flag until they are all in, so that the reader knows that what
    it read is not all there is. Each :meth:`read` counts itself
    (:meth:`reads`): a reader that has stopped reading shows, even when
    nothing was written.
    """

    def __init__(self, mem: memoryview) -> None:
        self.size = len(mem) - RING_HEADER
        if self.size <= _FEED_HEAD.size or self.size & (self.size - 1):
            raise ValueError("a feed ring's data is a power of two bytes")
        self._data = mem[RING_HEADER:]
        self._head = mem[:RING_HEADER].cast("I")

    def __repr__(self) -> str:
        written, read = self._head[_WRITTEN], self._head[_READ]
        behind = " behind" if self.behind() else ""
        return (
            f"<FeedRing size={self.size} written={written} read={read} "
            f"reads={self.reads()}{behind}>"
        )

    def reads(self) -> int:
        """How many times the reader has read the ring (modulo 2**32)."""
        return self._head[_READS]

    def behind(self) -> bool:
        """Whether the writer holds records the ring had no room for (read
        it before :meth:`read`: what it says holds for what that reads)."""
        return bool(self._head[_BEHIND])

    def set_behind(self, behind: bool) -> None:
        """Set before the first record kept out, cleared after the last is written."""
        self._head[_BEHIND] = int(behind)

    def write(self, records: list[tuple[FeedOp, bytes]]) -> bool:
        """Append ``records`` (all or none); False when they do not fit."""
        written, read = self._head[_WRITTEN], self._head[_READ]
        size, data = self.size, self._data
        free = size - ((written - read) & _MASK)
        pack = _FEED_HEAD.pack
        # Every record's bytes at once, then copied in one piece, or two where
        # the ring wraps (a snapshot is millions of records).
        parts = [pack(op, len(key)) + key for op, key in records]
        if max(map(len, parts), default=0) > size:
            need = max(map(len, parts))
            raise ValueError(f"a feed record of {need} bytes is larger than the ring")
        blob = b"".join(parts)
        total = len(blob)
        if total > free:
            return False
        at = written % size
        if at + total <= size:
            data[at : at + total] = blob
        else:  # the records that fit before the ring's end, the gap, the rest
            room, cut = size - at, 0
            for part in parts:
                if cut + len(part) > room:
                    break
                cut += len(part)
            gap = room - cut
            total += gap
            if total > free:
                return False
            view = memoryview(blob)
            data[at : at + cut] = view[:cut]
            if gap:
                data[at + cut] = _PAD
            data[: len(blob) - cut] = view[cut:]
        self._head[_WRITTEN] = (written + total) & _MASK  # published
        return True

    def read(self) -> list[tuple[FeedOp, bytes]]:
        """The records published since the last read, in order."""
        written, pos = self._head[_WRITTEN], self._head[_READ]
        size, data, unpack = self.size, self._data, _FEED_HEAD.unpack_from
        out: list[tuple[FeedOp, bytes]] = []
        while pos != written:
            at = pos % size
            if at + _FEED_HEAD.size > size or data[at] == _PAD:
                pos = (pos + size - at) & _MASK
                continue
            op, n = unpack(data, at)
            kind = _FEED_OPS.get(op)
            if kind is None or at + _FEED_HEAD.size + n > size:
                raise CodecError(f"bad feed record at {pos}")
            out.append((kind, bytes(data[at + _FEED_HEAD.size : at + _FEED_HEAD.size + n])))
            pos = (pos + _FEED_HEAD.size + n) & _MASK
        self._head[_READ] = pos  # read up to here
        self._head[_READS] = (self._head[_READS] + 1) & _MASK
        return out


def encode_report(
    kind: ReportKind,
    lookup: Buffer = b"",
    states: bytes = b"",
    count: int = 1,
    prefix: bytes = b"",
) -> bytes:
    """A report; for ANSWERED, ``lookup`` is the LOOKUP's meta as it came,
    asked ``count`` times with the same answer on a connection of the
    namespace whose key ``prefix`` this is (empty: the default namespace)."""
    if kind is not ReportKind.ANSWERED:
        return _REPORT_HEAD.pack(1, kind)
    n = _ANSWERED.size + len(prefix) + len(states) + len(lookup)
    head = _REPORT_HEAD.pack(1 + n, kind)
    return b"".join((head, _ANSWERED.pack(count, len(states), len(prefix)), prefix, states, lookup))


def decode_reports(buf: bytearray) -> list[Report]:
    """The whole reports at the start of ``buf``, removed from it; an
    answered lookup's keys decoded in its namespace's scope (as the
    process decoded them)."""
    out: list[Report] = []
    pos, end = 0, len(buf)
    while pos + _U32.size <= end:
        (n,) = _U32.unpack_from(buf, pos)
        if n < 1:
            raise CodecError("empty report")
        if pos + _U32.size + n > end:
            break
        body = bytes(buf[pos + _U32.size : pos + _U32.size + n])
        kind = _REPORT_KINDS.get(body[0])
        if kind is None:
            raise CodecError(f"unknown report kind {body[0]}")
        out.append(_decode_answered(body) if kind is ReportKind.ANSWERED else Report(kind))
        pos += _U32.size + n
    del buf[:pos]
    return out


def _decode_answered(body: bytes) -> Report:
    at = 1 + _ANSWERED.size
    if len(body) < at:
        raise CodecError("truncated report")
    count, n, p = _ANSWERED.unpack_from(body, 1)
    if at + p + n > len(body):
        raise CodecError("truncated report states")
    prefix = body[at : at + p]
    states = body[at + p : at + p + n]
    scope = KeyScope(prefix) if prefix else DEFAULT_SCOPE
    req = decode_lookup(memoryview(body)[at + p + n :], None, scope)
    if len(req.keys) != n:
        raise CodecError(f"report of {len(req.keys)} keys with {n} states")
    return Report(ReportKind.ANSWERED, req, states, count, prefix)

"""Codecs of the shared-memory operations (see docs/protocol.md, "Shared memory").

GET_SHARED answers each key with a lease on the block's place in the
arena, the bytes themselves (a block that is not in the arena), or
nothing; it also carries the ids of leases the client is done with, so a
reader releases the last batch in its next request. UNLEASE releases
without asking for more. STAGE, COMMIT and UNSTAGE move a block in
through the writable staging region: the client asks for room, writes
the block there, and commits it under a key with its checksum.

REGION, PUT_REGION and GET_REGION let the daemon copy blocks itself to and
from a memory file of the client's (an engine's host pool in a memfd):
REGION answers a region id and a token; the client hands the file's
descriptor over the handoff socket with the token (:data:`REGION_HANDOFF`);
then PUT_REGION and GET_REGION name blocks by key and place in the region.

Pure, like the rest of the wire package.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.model import Buffer, Leased, PutStatus
from kvtier.wire.codecs import (
    MISSING,
    KeyScope,
    _decode_u32_array,
    _expect_end,
    _pack_u32s,
    decode_keys,
    encode_keys,
)
from kvtier.wire.framing import CodecError

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
#: kind, lease id, offset, length
_ENTRY = struct.Struct("<BQQI")
#: offset, length, checksum, flags
_COMMIT = struct.Struct("<QIQB")

KIND_MISSING = 0
KIND_LEASED = 1
KIND_INLINE = 2

#: the handoff message (sent with the descriptors): a tag, the arena's size
#: and the staging region's size
HANDOFF = struct.Struct("<8sQQ")
HANDOFF_TAG = b"KVSHM1\0\0"

#: a client's region handed over the handoff socket (sent with its
#: descriptor, after the daemon's own message): a tag and the token REGION gave
REGION_HANDOFF = struct.Struct("<8s16s")
REGION_TAG = b"KVREG1\0\0"
#: the daemon's answer to it: 0 (attached) or an error code, the region's
#: size, and the length of the error message that follows
REGION_ATTACHED = struct.Struct("<BQH")
#: REGION's reply: the region id, then its token
_REGION = struct.Struct("<I16s")
#: PUT_REGION / GET_REGION head: the region id and flags
_REGION_IO = struct.Struct("<IB")
REGION_CHECKSUMS = 0x01  # PUT_REGION: one XXH3-64 per block follows the spans
#: one block's place in a region: offset, length (PUT) or room (GET)
_SPAN = struct.Struct("<QQ")

COMMIT_KEEP_ROOM = 0x01  # the staging room stays the client's for the next block
#: the room is a slot of the arena the client wrote in place (STAGE_IN_PLACE):
#: the slot becomes the block; with KEEP_ROOM the reply carries a new room
COMMIT_IN_PLACE = 0x02
#: with IN_PLACE: the block carries no checksum (the daemon stores what its
#: writer wrote, as a PUT over the socket stores what arrived)
COMMIT_UNCHECKED = 0x04
#: STAGE / UNSTAGE flag: a room in the arena itself, written in place
STAGE_IN_PLACE = 0x01
#: an in-place COMMIT's reply when no new room could be had
NO_ROOM = (1 << 64) - 1


@dataclass(slots=True, frozen=True)
class Commit:
    key: bytes
    offset: int
    length: int
    checksum: int
    keep_room: bool
    #: the room is an arena slot written in place (else a staging room)
    in_place: bool = False
    #: ``checksum`` means nothing: the block is not checked (in place only)
    unchecked: bool = False


def _encode_ids(ids: Sequence[int]) -> bytes:
    return _U32.pack(len(ids)) + b"".join(_U64.pack(i) for i in ids)


def _decode_ids(buf: Buffer, offset: int, max_ids: int) -> tuple[list[int], int]:
    if offset + 4 > len(buf):
        raise CodecError("truncated lease id list")
    (n,) = _U32.unpack_from(buf, offset)
    offset += 4
    if n > max_ids:
        raise CodecError(f"{n} lease ids exceed the maximum of {max_ids}")
    end = offset + 8 * n
    if end > len(buf):
        raise CodecError(f"lease id list announces {n} ids; frame too short")
    return [v for (v,) in _U64.iter_unpack(buf[offset:end])], end


def encode_get_shared(releases: Sequence[int], keys: Sequence[bytes], prefix: bytes = b"") -> bytes:
    return _encode_ids(releases) + encode_keys(keys, prefix)


def decode_get_shared(
    buf: Buffer, max_batch: int, scope: KeyScope | None = None
) -> tuple[list[int], list[bytes]]:
    ids, offset = _decode_ids(memoryview(buf), 0, max_batch)
    keys, end, _ = decode_keys(buf, offset, max_batch, scope)
    if end != len(buf):
        raise CodecError("GET_SHARED carries lease ids and a key list only")
    return ids, keys


def encode_get_shared_reply(
    entries: Sequence[Leased | Buffer | None],
) -> tuple[bytes, list[Buffer]]:
    meta = [_U32.pack(len(entries))]
    data: list[Buffer] = []
    for e in entries:
        if e is None:
            meta.append(_ENTRY.pack(KIND_MISSING, 0, 0, 0))
        elif isinstance(e, Leased):
            meta.append(_ENTRY.pack(KIND_LEASED, e.lease_id, e.offset, e.length))
        else:
            meta.append(_ENTRY.pack(KIND_INLINE, 0, 0, len(e)))
            data.append(e)
    return b"".join(meta), data


def decode_get_shared_reply(meta: Buffer, data: Buffer) -> list[Leased | memoryview | None]:
    if len(meta) < 4:
        raise CodecError("truncated GET_SHARED reply")
    (n,) = _U32.unpack_from(meta, 0)
    if len(meta) != 4 + n * _ENTRY.size:
        raise CodecError("GET_SHARED reply length does not match its count")
    view = memoryview(data)
    pos = 0
    out: list[Leased | memoryview | None] = []
    for kind, lease_id, offset, length in _ENTRY.iter_unpack(memoryview(meta)[4:]):
        if kind == KIND_MISSING:
            out.append(None)
        elif kind == KIND_LEASED:
            out.append(Leased(lease_id, offset, length))
        elif kind == KIND_INLINE:
            out.append(view[pos : pos + length])
            pos += length
        else:
            raise CodecError(f"unknown GET_SHARED entry kind {kind}")
    if pos != len(view):
        raise CodecError("GET_SHARED reply data length does not match its entries")
    return out


def encode_unlease(ids: Sequence[int]) -> bytes:
    return _encode_ids(ids)


def decode_unlease(buf: Buffer, max_ids: int) -> list[int]:
    ids, end = _decode_ids(memoryview(buf), 0, max_ids)
    if end != len(buf):
        raise CodecError("UNLEASE carries a lease id list only")
    return ids


def encode_u64(value: int) -> bytes:
    return _U64.pack(value)


def decode_u64(buf: Buffer, what: str) -> int:
    if len(buf) != 8:
        raise CodecError(f"{what} carries one 8-byte number")
    (value,) = _U64.unpack(buf)
    return int(value)


def encode_stage(length: int, in_place: bool = False) -> bytes:
    """STAGE's (and UNSTAGE's, with an offset) request: the number, then a
    flags byte when the room is in the arena."""
    return _U64.pack(length) + (bytes([STAGE_IN_PLACE]) if in_place else b"")


def decode_stage(buf: Buffer, what: str) -> tuple[int, bool]:
    """The number and whether the room is in place; see :func:`encode_stage`."""
    if len(buf) == 8:
        return decode_u64(buf, what), False
    if len(buf) != 9:
        raise CodecError(f"{what} carries one 8-byte number and an optional flags byte")
    flags = buf[8]
    if flags & ~STAGE_IN_PLACE:
        raise CodecError(f"unknown {what} flags 0x{flags:02x}")
    return decode_u64(buf[:8], what), bool(flags & STAGE_IN_PLACE)


def encode_commit(c: Commit, prefix: bytes = b"") -> bytes:
    flags = (
        (COMMIT_KEEP_ROOM if c.keep_room else 0)
        | (COMMIT_IN_PLACE if c.in_place else 0)
        | (COMMIT_UNCHECKED if c.unchecked else 0)
    )
    return _COMMIT.pack(c.offset, c.length, c.checksum, flags) + encode_keys([c.key], prefix)


def decode_commit(buf: Buffer, scope: KeyScope | None = None) -> Commit:
    if len(buf) < _COMMIT.size:
        raise CodecError("truncated COMMIT")
    offset, length, checksum, flags = _COMMIT.unpack_from(buf, 0)
    if flags & ~(COMMIT_KEEP_ROOM | COMMIT_IN_PLACE | COMMIT_UNCHECKED):
        raise CodecError(f"unknown COMMIT flags 0x{flags:02x}")
    if flags & COMMIT_UNCHECKED and not flags & COMMIT_IN_PLACE:
        raise CodecError("only a COMMIT in place may carry no checksum")
    keys, end, _ = decode_keys(buf, _COMMIT.size, 1, scope)
    if len(keys) != 1 or end != len(buf):
        raise CodecError("COMMIT carries exactly one key")
    return Commit(
        keys[0],
        offset,
        length,
        checksum,
        bool(flags & COMMIT_KEEP_ROOM),
        bool(flags & COMMIT_IN_PLACE),
        bool(flags & COMMIT_UNCHECKED),
    )


#: an in-place COMMIT's reply: its status byte and the next room's offset
COMMIT_REPLY_SIZE = 1 + _U64.size


def encode_commit_reply(status: PutStatus, room: int | None) -> bytes:
    """An in-place COMMIT's reply: the status, then the offset of the next
    room (:data:`NO_ROOM`: none)."""
    return bytes([int(status)]) + _U64.pack(NO_ROOM if room is None else room)


def decode_commit_reply(buf: Buffer) -> tuple[PutStatus, int | None]:
    if len(buf) != COMMIT_REPLY_SIZE:
        raise CodecError("an in-place COMMIT's reply is a status and an 8-byte offset")
    (room,) = _U64.unpack_from(buf, 1)
    try:
        status = PutStatus(buf[0])
    except ValueError:
        raise CodecError(f"unknown PUT status {buf[0]}") from None
    return status, None if room == NO_ROOM else int(room)


def encode_commit_many(commits: Sequence[Commit], prefix: bytes = b"") -> bytes:
    """COMMIT_MANY: in-place commits without checksums, as one request: the
    count, each one's offset, length and flags, then their keys."""
    return (
        _U32.pack(len(commits))
        + b"".join(
            _COMMIT.pack(
                c.offset,
                c.length,
                0,
                COMMIT_IN_PLACE | COMMIT_UNCHECKED | (COMMIT_KEEP_ROOM if c.keep_room else 0),
            )
            for c in commits
        )
        + encode_keys([c.key for c in commits], prefix)
    )


def decode_commit_many(buf: Buffer, max_batch: int, scope: KeyScope | None = None) -> list[Commit]:
    """COMMIT_MANY's commits: each one in place and unchecked (a block with
    a checksum, or in a staging room, is a COMMIT of its own)."""
    if len(buf) < 4:
        raise CodecError("truncated COMMIT_MANY")
    (n,) = _U32.unpack_from(buf, 0)
    if not 0 < n <= max_batch:
        raise CodecError(f"COMMIT_MANY carries {n} commits; 1 to {max_batch} are allowed")
    end = 4 + n * _COMMIT.size
    if end > len(buf):
        raise CodecError(f"COMMIT_MANY announces {n} commits; frame too short")
    heads = list(_COMMIT.iter_unpack(buf[4:end]))
    keys, after, _ = decode_keys(buf, end, n, scope)
    if len(keys) != n or after != len(buf):
        raise CodecError("COMMIT_MANY carries one key per commit")
    out = []
    for key, (offset, length, _, flags) in zip(keys, heads, strict=True):
        if flags & ~COMMIT_KEEP_ROOM != COMMIT_IN_PLACE | COMMIT_UNCHECKED:
            raise CodecError(f"a COMMIT_MANY commit is in place and unchecked, not 0x{flags:02x}")
        out.append(Commit(key, offset, length, 0, bool(flags & COMMIT_KEEP_ROOM), True, True))
    return out


def encode_commit_many_reply(answers: Sequence[tuple[PutStatus, int | None]]) -> bytes:
    """Each commit's status and next room (:data:`NO_ROOM`: none), in order."""
    return b"".join(encode_commit_reply(status, room) for status, room in answers)


def decode_commit_many_reply(buf: Buffer, n: int) -> list[tuple[PutStatus, int | None]]:
    size = COMMIT_REPLY_SIZE
    if len(buf) != size * n:
        raise CodecError(f"a COMMIT_MANY reply of {len(buf)} bytes does not answer {n} commits")
    view = memoryview(buf)
    return [decode_commit_reply(view[i * size : (i + 1) * size]) for i in range(n)]


# --------------------------------------------------------------------------- regions


@dataclass(slots=True, frozen=True)
class RegionIO:
    """Blocks to copy between a region and RAM: ``spans[i]`` is key i's
    (offset, length) in the region: the block's length for PUT_REGION, the
    room it may fill for GET_REGION. ``checksums`` (PUT_REGION): each
    block's XXH3-64, checked by the daemon after its copy (a block that
    changed meanwhile stores nothing)."""

    region: int
    keys: list[bytes]
    spans: list[tuple[int, int]]
    checksums: list[int] | None = None


def encode_region_reply(region: int, token: bytes) -> bytes:
    return _REGION.pack(region, token)


def decode_region_reply(buf: Buffer) -> tuple[int, bytes]:
    if len(buf) != _REGION.size:
        raise CodecError("REGION reply is a region id and a 16-byte token")
    region, token = _REGION.unpack(buf)
    return int(region), bytes(token)


def encode_region_io(io: RegionIO, prefix: bytes = b"") -> bytes:
    if len(io.spans) != len(io.keys):
        raise ValueError(f"{len(io.keys)} keys but {len(io.spans)} spans")
    sums = io.checksums
    if sums is not None and len(sums) != len(io.keys):
        raise ValueError(f"{len(io.keys)} keys but {len(sums)} checksums")
    return (
        _REGION_IO.pack(io.region, REGION_CHECKSUMS if sums is not None else 0)
        + encode_keys(io.keys, prefix)
        + b"".join(_SPAN.pack(off, n) for off, n in io.spans)
        + (b"".join(_U64.pack(c) for c in sums) if sums is not None else b"")
    )


def decode_region_io(buf: Buffer, max_batch: int, scope: KeyScope | None = None) -> RegionIO:
    if len(buf) < _REGION_IO.size:
        raise CodecError("truncated region request")
    region, flags = _REGION_IO.unpack_from(buf, 0)
    if flags & ~REGION_CHECKSUMS:
        raise CodecError(f"unknown region request flags 0x{flags:02x}")
    keys, end, _ = decode_keys(buf, _REGION_IO.size, max_batch, scope)
    per_key = _SPAN.size + (8 if flags & REGION_CHECKSUMS else 0)
    if len(buf) - end != len(keys) * per_key:
        raise CodecError("a region request carries one (offset, length) per key")
    stop = end + len(keys) * _SPAN.size
    spans = [(int(o), int(n)) for o, n in _SPAN.iter_unpack(memoryview(buf)[end:stop])]
    sums = None
    if flags & REGION_CHECKSUMS:
        sums = [int(c) for (c,) in _U64.iter_unpack(memoryview(buf)[stop:])]
    return RegionIO(int(region), keys, spans, sums)


def encode_region_lengths(lengths: Sequence[int | None]) -> bytes:
    """GET_REGION's reply: per key, the bytes written into its room, or
    MISSING where the daemon has no such block."""
    return _U32.pack(len(lengths)) + _pack_u32s(MISSING if n is None else n for n in lengths)


def decode_region_lengths(buf: Buffer) -> list[int | None]:
    if len(buf) < 4:
        raise CodecError("truncated GET_REGION reply")
    (n,) = _U32.unpack_from(buf, 0)
    lengths, end = _decode_u32_array(buf, 4, n)
    _expect_end(buf, end)
    return [None if v == MISSING else v for v in lengths]

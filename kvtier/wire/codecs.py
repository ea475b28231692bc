"""Wire protocol v1 message layouts: one encoder and decoder per operation.

Pure: records of :mod:`kvtier.model` in, bytes out, and back. No I/O; must
not import the core, the tiers, the server or the client. See
docs/protocol.md for the layouts.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import struct
import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

from kvtier.errors import BatchTooLargeError, ForbiddenError
from kvtier.model import (
    KNOWN_PUT_HINTS,
    NAMESPACE_ESCAPE,
    NAMESPACE_MARK,
    Buffer,
    Lookup,
    LookupMode,
    LookupReply,
    PutStatus,
    Reserve,
    Retention,
)
from kvtier.wire.framing import MAX_KEY_BYTES_V1, CodecError

MISSING = 0xFFFFFFFF  # a GET reply length meaning "no such block"

_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_KEYS_HEAD = struct.Struct("<IH")  # count, uniform key length (0: a lengths array follows)
_LOOKUP_HEAD = struct.Struct("<BBHdd")  # mode, flags, window, wait, max_pending_wait
LOOKUP_PEEK = 0x01  # LOOKUP flag: a look that is not a read (Lookup.peek)
LOOKUP_BUDGET = 0x02  # LOOKUP flag: a budget in seconds (f64) follows the head (Lookup.budget)
LOOKUP_WHOLE = 0x04  # LOOKUP flag: the keys are a session's whole prompt (Lookup.whole)
_LOOKUP_REPLY_HEAD = struct.Struct("<IB3xI")  # prefix hits, defer, count

#: Formats never depend on a request's size: arrays of u16/u32 go through
#: ``array`` (C speed, no compiled format), uniform keys through one cached
#: format per key length that unpacks _KEY_CHUNK keys at a time.
_KEY_CHUNK = 64
_BIG_ENDIAN = sys.byteorder == "big"
assert array("H").itemsize == 2 and array("I").itemsize == 4


@functools.lru_cache(maxsize=256)
def _key_format(length: int, count: int) -> struct.Struct:
    """``count`` keys of ``length`` bytes; count is at most _KEY_CHUNK."""
    return struct.Struct(f"{length}s" * count)


def _u16s(buf: Buffer, offset: int, n: int) -> array[int]:
    out = array("H")
    out.frombytes(buf[offset : offset + 2 * n])
    if _BIG_ENDIAN:
        out.byteswap()
    return out


def _u32s(buf: Buffer, offset: int, n: int) -> array[int]:
    out = array("I")
    out.frombytes(buf[offset : offset + 4 * n])
    if _BIG_ENDIAN:
        out.byteswap()
    return out


def _pack_u16s(values: Iterable[int]) -> bytes:
    out = array("H", values)
    if _BIG_ENDIAN:
        out.byteswap()
    return out.tobytes()


def _pack_u32s(values: Iterable[int]) -> bytes:
    try:
        out = array("I", values)
    except OverflowError as exc:
        raise CodecError("a length does not fit in 32 bits") from exc
    if _BIG_ENDIAN:
        out.byteswap()
    return out.tobytes()


def _check_count(n: int, max_keys: int | None) -> None:
    """Refuse an oversized batch from its count alone, before decoding anything."""
    if max_keys is not None and n > max_keys:
        raise BatchTooLargeError(f"batch of {n} keys exceeds the maximum of {max_keys}")


# --------------------------------------------------------------------------- keys


class KeyScope:
    """The keys one connection may name: its namespace's (docs/tenancy.md).

    A namespaced client sends every key with its namespace's ``prefix``
    (:func:`~kvtier.model.namespace_prefix`); a key without it is refused
    (ForbiddenError), so no client reaches another namespace's blocks. A
    default-namespace client's key that starts with the namespace mark is
    escaped as it is decoded, so it cannot name a namespaced key either.
    Checked over the frame's bytes, one strided comparison per prefix byte
    for a list of equal-length keys: a check costs no Python step per key.
    """

    __slots__ = ("_columns", "closed", "prefix")

    def __init__(self, prefix: bytes = b"", *, closed: bool = False) -> None:
        self.prefix = prefix
        #: no key at all: the connection must name a namespace it may use first
        self.closed = closed
        #: each prefix byte, for the strided check
        self._columns = [prefix[i : i + 1] for i in range(len(prefix))]

    def __repr__(self) -> str:
        return f"<KeyScope {'closed' if self.closed else repr(self.prefix)}>"

    def _refuse(self) -> ForbiddenError:
        if self.closed:
            return ForbiddenError("name a namespace this user may use at HELLO first")
        return ForbiddenError("a key outside this connection's namespace")

    def uniform(self, region: bytes, n: int, length: int) -> bool:
        """Check ``n`` keys of ``length`` bytes laid end to end in ``region``;
        True if some default-namespace key needs escaping. (Strided slices
        of bytes run at C speed; a memoryview's do not.)"""
        if self.closed:
            raise self._refuse()
        if self.prefix:
            columns = [region[i::length] for i in range(len(self.prefix))]
            if length <= len(self.prefix) or columns != [byte * n for byte in self._columns]:
                raise self._refuse()
            return False
        return NAMESPACE_MARK in region[::length]

    def each(self, keys: list[bytes]) -> list[bytes]:
        """Check (and escape) keys of mixed lengths, one at a time."""
        if self.closed:
            raise self._refuse()
        prefix = self.prefix
        if prefix:
            n = len(prefix)
            if not all(len(k) > n and k.startswith(prefix) for k in keys):
                raise self._refuse()
            return keys
        return escape(keys)


#: the default namespace's scope: every key, escaped where it must be
DEFAULT_SCOPE = KeyScope()
#: a scope that admits no key: a connection whose uid must name its namespace
NO_KEYS = KeyScope(closed=True)


def escape(keys: list[bytes]) -> list[bytes]:
    """Default-namespace keys as stored: one that starts with the namespace
    mark gets the escape in front."""
    return [NAMESPACE_ESCAPE + k if k[:1] == _MARK else k for k in keys]


_MARK = bytes((NAMESPACE_MARK,))


def encode_keys(keys: Sequence[bytes], prefix: bytes = b"") -> bytes:
    """A key list; ``prefix`` (a namespaced client's) goes before every key."""
    return _after(b"", keys, prefix)


def _after(head: bytes, keys: Sequence[bytes], prefix: bytes) -> bytes:
    """``head`` then the key list, in one join (the prefix is its separator,
    so each key gets it without a copy of its own)."""
    n = len(keys)
    if n == 0:
        return head + _KEYS_HEAD.pack(0, 0)
    lengths = list(map(len, keys))
    first = lengths[0]
    extra = len(prefix)
    if 0 < first + extra <= MAX_KEY_BYTES_V1 and lengths.count(first) == n:
        if not prefix:
            return b"".join((head, _KEYS_HEAD.pack(n, first), b"".join(keys)))
        return prefix.join((head + _KEYS_HEAD.pack(n, first + extra), *keys))
    if max(lengths) + extra > MAX_KEY_BYTES_V1:
        raise CodecError(f"a key is longer than {MAX_KEY_BYTES_V1} bytes")
    if prefix:
        lengths = [length + extra for length in lengths]
    return prefix.join((head + _KEYS_HEAD.pack(n, 0) + _pack_u16s(lengths), *keys))


def single_key(buf: Buffer) -> bool:
    """Whether the key list at the start of ``buf`` holds exactly one key."""
    return len(buf) >= _KEYS_HEAD.size and _KEYS_HEAD.unpack_from(buf, 0)[0] == 1


def decode_keys(
    buf: Buffer, offset: int = 0, max_keys: int | None = None, scope: KeyScope | None = None
) -> tuple[list[bytes], int, int]:
    """A key list: the keys, the offset after it, the uniform key length (0 if mixed).

    The count is checked against ``max_keys`` and the frame's length before
    anything is decoded, so the work is bounded by the bytes received. With
    a ``scope`` (a client's connection; none on the peer port, whose keys are
    already stored keys) the keys are checked, or escaped, for its namespace.
    """
    end = len(buf)
    if offset + _KEYS_HEAD.size > end:
        raise CodecError("truncated key list header")
    n, uniform = _KEYS_HEAD.unpack_from(buf, offset)
    _check_count(n, max_keys)
    offset += _KEYS_HEAD.size
    if uniform:
        stop = offset + n * uniform
        if stop > end:
            raise CodecError(f"key list announces {n} keys of {uniform} bytes; frame too short")
        if n == 0:
            return [], stop, 0
        marked = scope is not None and scope.uniform(bytes(buf[offset:stop]), n, uniform)
        whole, rest = divmod(n, _KEY_CHUNK)
        tail = offset + whole * _KEY_CHUNK * uniform
        keys: list[bytes] = []
        if whole:
            chunks = _key_format(uniform, _KEY_CHUNK).iter_unpack(memoryview(buf)[offset:tail])
            keys = list(itertools.chain.from_iterable(chunks))
        if rest:
            keys.extend(_key_format(uniform, rest).unpack_from(buf, tail))
        if marked:
            return escape(keys), stop, 0
        return keys, stop, uniform
    if offset + 2 * n > end:
        raise CodecError(f"key list announces {n} keys; frame too short")
    lengths = _u16s(buf, offset, n)
    offset += 2 * n
    stop = offset + sum(lengths)
    if stop > end:
        raise CodecError("key bytes run past the end of the frame")
    raw = bytes(buf[offset:stop])
    keys = []
    pos = 0
    for length in lengths:
        keys.append(raw[pos : pos + length])
        pos += length
    if scope is not None:
        keys = scope.each(keys)
    return keys, stop, 0


def _expect_end(buf: Buffer, offset: int) -> None:
    if offset != len(buf):
        raise CodecError(f"{len(buf) - offset} unexpected trailing bytes in message")


def _encode_str(text: str) -> bytes:
    raw = text.encode()[:0xFFFF]
    return _U16.pack(len(raw)) + raw


def _decode_u16_bytes(buf: Buffer, offset: int, what: str) -> tuple[bytes, int]:
    """A ``u16`` length, then that many bytes; the offset after them."""
    if offset + 2 > len(buf):
        raise CodecError(f"truncated {what}")
    (n,) = _U16.unpack_from(buf, offset)
    offset += 2
    if offset + n > len(buf):
        raise CodecError(f"truncated {what}")
    return bytes(buf[offset : offset + n]), offset + n


def _decode_str(buf: Buffer, offset: int) -> tuple[str, int]:
    raw, end = _decode_u16_bytes(buf, offset, "string")
    try:
        return raw.decode(), end
    except UnicodeDecodeError as exc:
        raise CodecError("string is not UTF-8") from exc


def _decode_u32_array(buf: Buffer, offset: int, n: int) -> tuple[array[int], int]:
    stop = offset + 4 * n
    if stop > len(buf):
        raise CodecError("truncated length array")
    return _u32s(buf, offset, n), stop


def _decode_count_bytes(buf: Buffer, offset: int = 0) -> bytes:
    if offset + 4 > len(buf):
        raise CodecError("truncated count")
    (n,) = _U32.unpack_from(buf, offset)
    offset += 4
    _expect_end(buf, offset + n)
    return bytes(buf[offset : offset + n])


def _encode_count_bytes(values: Iterable[int]) -> bytes:
    raw = bytes(values)
    return _U32.pack(len(raw)) + raw


# --------------------------------------------------------------------------- LOOKUP


def encode_lookup(req: Lookup, prefix: bytes = b"") -> bytes:
    tag = req.request_tag
    if len(tag) > 255:
        raise CodecError("request tag longer than 255 bytes")
    flags = (
        (LOOKUP_PEEK if req.peek else 0)
        | (LOOKUP_BUDGET if req.budget > 0 else 0)
        | (LOOKUP_WHOLE if req.whole else 0)
    )
    head = _LOOKUP_HEAD.pack(int(req.mode), flags, req.window, req.wait, req.max_pending_wait)
    if req.budget > 0:
        head += _F64.pack(req.budget)
    return _after(head + _U8.pack(len(tag)) + tag, req.keys, prefix)


def decode_lookup(
    buf: Buffer, max_keys: int | None = None, scope: KeyScope | None = None
) -> Lookup:
    if len(buf) < _LOOKUP_HEAD.size + 1:
        raise CodecError("truncated LOOKUP")
    mode, flags, window, wait, max_pending_wait = _LOOKUP_HEAD.unpack_from(buf, 0)
    try:
        lookup_mode = LookupMode(mode)
    except ValueError as exc:
        raise CodecError(f"unknown lookup mode {mode}") from exc
    if flags & ~(LOOKUP_PEEK | LOOKUP_BUDGET | LOOKUP_WHOLE):
        raise CodecError(f"unknown LOOKUP flags 0x{flags:02x}")
    offset = _LOOKUP_HEAD.size
    budget = 0.0
    if flags & LOOKUP_BUDGET:
        if len(buf) < offset + _F64.size + 1:
            raise CodecError("truncated LOOKUP budget")
        (budget,) = _F64.unpack_from(buf, offset)
        if not math.isfinite(budget) or budget <= 0:
            raise CodecError(f"a LOOKUP budget is a positive number of seconds, not {budget}")
        offset += _F64.size
    (tag_len,) = _U8.unpack_from(buf, offset)
    offset += 1
    tag = bytes(buf[offset : offset + tag_len])
    if len(tag) != tag_len:
        raise CodecError("truncated request tag")
    keys, end, key_len = decode_keys(buf, offset + tag_len, max_keys, scope)
    _expect_end(buf, end)
    return Lookup(
        keys,
        lookup_mode,
        window,
        wait,
        max_pending_wait,
        tag,
        key_len,
        bool(flags & LOOKUP_PEEK),
        budget,
        bool(flags & LOOKUP_WHOLE),
    )


def encode_lookup_reply(reply: LookupReply) -> bytes:
    return (
        _LOOKUP_REPLY_HEAD.pack(reply.prefix_hits, int(reply.defer), len(reply.raw_states))
        + reply.raw_states
    )


def decode_lookup_reply(buf: Buffer) -> LookupReply:
    if len(buf) < _LOOKUP_REPLY_HEAD.size:
        raise CodecError("truncated LOOKUP reply")
    hits, defer, n = _LOOKUP_REPLY_HEAD.unpack_from(buf, 0)
    start = _LOOKUP_REPLY_HEAD.size
    _expect_end(buf, start + n)
    return LookupReply(bytes(buf[start : start + n]), hits, bool(defer))


# --------------------------------------------------------------------------- GET


def encode_get_reply(values: Sequence[Buffer | None]) -> tuple[bytes, list[Buffer]]:
    """Meta (lengths, MISSING for absent blocks) and the data parts."""
    lengths = [MISSING if v is None else len(v) for v in values]
    meta = _U32.pack(len(lengths)) + _pack_u32s(lengths)
    return meta, [v for v in values if v is not None]


def decode_get_reply(meta: Buffer, data: Buffer) -> list[memoryview | None]:
    if len(meta) < 4:
        raise CodecError("truncated GET reply")
    (n,) = _U32.unpack_from(meta, 0)
    lengths, end = _decode_u32_array(meta, 4, n)
    _expect_end(meta, end)
    view = memoryview(data)
    out: list[memoryview | None] = []
    pos = 0
    for length in lengths:
        if length == MISSING:
            out.append(None)
            continue
        out.append(view[pos : pos + length])
        pos += length
    if pos != len(view):
        raise CodecError("GET reply data length does not match its lengths")
    return out


# --------------------------------------------------------------------------- PUT


def encode_put(
    keys: Sequence[bytes],
    values: Sequence[Buffer],
    hints: Sequence[int] | None = None,
    prefix: bytes = b"",
) -> tuple[bytes, list[Buffer]]:
    """Meta and data of a PUT; with ``hints`` (one :class:`PutHint` per key)
    the frame must carry :data:`FLAG_HINTS`."""
    if len(keys) != len(values):
        raise CodecError("PUT needs one value per key")
    lengths = [len(v) for v in values]
    meta = encode_keys(keys, prefix) + _pack_u32s(lengths)
    if hints is not None:
        if len(hints) != len(keys):
            raise CodecError("PUT hints need one byte per key")
        meta += bytes(hints)
    return meta, list(values)


def decode_put(
    meta: Buffer,
    data: Buffer,
    max_keys: int | None = None,
    *,
    hinted: bool = False,
    scope: KeyScope | None = None,
) -> tuple[list[bytes], list[Buffer], bytes | None]:
    """Keys, values and (``hinted``: the frame has FLAG_HINTS) one hint byte
    per key. A value is a zero-copy view when the frame holds one."""
    keys, offset, _ = decode_keys(meta, 0, max_keys, scope)
    lengths, end = _decode_u32_array(meta, offset, len(keys))
    hints = None
    if hinted:
        hints = bytes(meta[end : end + len(keys)])
        if len(hints) != len(keys):
            raise CodecError("PUT hints need one byte per key")
        if any(h & ~KNOWN_PUT_HINTS for h in hints):
            raise CodecError("unknown PUT hint bits")
        end += len(keys)
    _expect_end(meta, end)
    if sum(lengths) != len(data):
        raise CodecError(
            f"PUT value lengths add up to {sum(lengths)} bytes but the frame carries {len(data)}"
        )
    if len(keys) == 1:
        return keys, [data], hints
    # Several values share one receive buffer: copy each out so that a block
    # evicted later does not keep its neighbours' memory alive.
    view = memoryview(data)
    values: list[Buffer] = []
    pos = 0
    for length in lengths:
        values.append(bytes(view[pos : pos + length]))
        pos += length
    return keys, values, hints


def encode_put_reply(statuses: Sequence[PutStatus]) -> bytes:
    return _encode_count_bytes(int(s) for s in statuses)


def decode_put_reply(buf: Buffer) -> list[PutStatus]:
    return [PutStatus(s) for s in _decode_count_bytes(buf)]


# --------------------------------------------------------------------------- DELETE


def encode_delete_reply(deleted: Sequence[bool]) -> bytes:
    return _encode_count_bytes(int(d) for d in deleted)


def decode_delete_reply(buf: Buffer) -> list[bool]:
    return [bool(d) for d in _decode_count_bytes(buf)]


# ---------------------------------------------------------------- RESERVE / ABORT / RELEASE

_F64 = struct.Struct("<d")


def encode_reserve(req: Reserve, prefix: bytes = b"") -> bytes:
    if len(req.sizes) != len(req.keys):
        raise CodecError("RESERVE needs one size per key")
    return b"".join(
        (
            _F64.pack(req.deadline),
            encode_keys(req.keys, prefix),
            _pack_u32s(req.sizes),
        )
    )


def decode_reserve(
    buf: Buffer, max_keys: int | None = None, scope: KeyScope | None = None
) -> Reserve:
    if len(buf) < _F64.size:
        raise CodecError("truncated RESERVE")
    (deadline,) = _F64.unpack_from(buf, 0)
    keys, offset, _ = decode_keys(buf, _F64.size, max_keys, scope)
    sizes, end = _decode_u32_array(buf, offset, len(keys))
    _expect_end(buf, end)
    return Reserve(keys, list(sizes), deadline)


def encode_status_bytes(values: Iterable[int]) -> bytes:
    return _encode_count_bytes(values)


def decode_status_bytes(buf: Buffer) -> list[int]:
    return list(_decode_count_bytes(buf))


# --------------------------------------------------------------------------- retention

_RETAIN_TAIL = struct.Struct("<dB")  # ttl seconds, priority


def encode_retention(retention: Retention) -> bytes:
    """A retention lease as a request's meta starts with it (FLAG_RETAIN):
    the session id's length (u8) and bytes, the ttl (f64 seconds) and the
    priority (u8)."""
    session = retention.session
    return _U8.pack(len(session)) + session + _RETAIN_TAIL.pack(retention.ttl, retention.priority)


def split_retention(meta: Buffer) -> tuple[Retention, memoryview]:
    """The lease a FLAG_RETAIN request's meta starts with, and the rest of it."""
    view = memoryview(meta)
    if len(view) < 1:
        raise CodecError("truncated retention lease")
    end = 1 + view[0] + _RETAIN_TAIL.size
    if len(view) < end:
        raise CodecError("truncated retention lease")
    ttl, priority = _RETAIN_TAIL.unpack_from(view, 1 + view[0])
    try:
        retention = Retention(bytes(view[1 : 1 + view[0]]), ttl, priority)
    except ValueError as exc:
        raise CodecError(str(exc)) from None
    return retention, view[end:]


def encode_tag(tag: bytes) -> bytes:
    if len(tag) > 255:
        raise CodecError("request tag longer than 255 bytes")
    return _U8.pack(len(tag)) + tag


def decode_tag(buf: Buffer) -> bytes:
    if len(buf) < 1:
        raise CodecError("truncated request tag")
    n = buf[0]
    _expect_end(buf, 1 + n)
    return bytes(buf[1 : 1 + n])


# --------------------------------------------------------------------------- STATS / errors


def encode_json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def decode_json(buf: Buffer) -> Any:
    try:
        return json.loads(bytes(buf))
    except ValueError as exc:
        raise CodecError("invalid JSON body") from exc


def encode_error(message: str) -> bytes:
    return message.encode()[:4096]


def decode_error(buf: Buffer) -> str:
    return bytes(buf).decode(errors="replace")

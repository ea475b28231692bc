"""Wire protocol v1 framing: the header, flags, opcodes and the frame reader.

Pure: bytes in, frames out. No I/O, no asyncio, nothing of kvtier but
:mod:`kvtier.model`; must not import the core, the tiers, the server or the
client. See docs/protocol.md for the specification. Structural errors raise
:class:`CodecError` subclasses; the server and the client map them onto the
kvtier error hierarchy at their edges.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.model import LOOP_STEP, Buffer

MAGIC = b"KV"
VERSION = 1
SUPPORTED_VERSIONS = (1,)

#: magic, version, opcode, flags, status, request id, meta length, data length
HEADER = struct.Struct("<2sBBHHQII")
HEADER_SIZE = HEADER.size  # 24

FLAG_REPLY = 0x0001
FLAG_DURABLE = 0x0002  # PUT: acknowledge once the block is durable
FLAG_HINTS = 0x0004  # PUT: one hint byte per key follows the lengths (PutHint)
FLAG_MORE = 0x0008  # reply: more replies follow for this request (SUBSCRIBE)
#: LOOKUP, PUT: the meta starts with a retention lease (encode_retention)
#: for the request's blocks
FLAG_RETAIN = 0x0010
KNOWN_REQUEST_FLAGS = FLAG_DURABLE | FLAG_HINTS | FLAG_RETAIN

#: Hard ceilings of the v1 encoding (the configured limits must be below them).
MAX_KEY_BYTES_V1 = 0xFFFF
MAX_FRAME_BYTES_V1 = 0xFFFFFFFF


class Op(enum.IntEnum):
    HELLO = 0x01
    PING = 0x02
    STATS = 0x03
    LOOKUP = 0x10
    GET = 0x11
    PUT = 0x12
    DELETE = 0x13
    RESERVE = 0x20
    ABORT = 0x21
    RELEASE = 0x22
    RETAIN = 0x23
    UNRETAIN = 0x24
    GET_SHARED = 0x30
    UNLEASE = 0x31
    STAGE = 0x32
    COMMIT = 0x33
    UNSTAGE = 0x34
    COMMIT_MANY = 0x35
    REGION = 0x38
    PUT_REGION = 0x39
    GET_REGION = 0x3A
    SUBSCRIBE = 0x40


class CodecError(Exception):
    """A frame or message does not follow the v1 encoding."""


class BadMagic(CodecError):
    """The stream does not carry kvtier frames; framing is lost."""


class OversizedFrame(CodecError):
    """A header announces a body above the frame limit; framing is abandoned."""

    def __init__(self, header: Header, limit: int) -> None:
        super().__init__(
            f"frame body of {header.meta_len + header.data_len} bytes exceeds "
            f"the maximum frame size of {limit} bytes"
        )
        self.header = header


@dataclass(slots=True, frozen=True)
class Header:
    version: int
    opcode: int
    flags: int
    status: int
    request_id: int
    meta_len: int
    data_len: int


@dataclass(slots=True, frozen=True)
class Frame:
    header: Header
    meta: Buffer
    data: Buffer


def pack_header(
    opcode: int, request_id: int, meta_len: int, data_len: int, flags: int = 0, status: int = 0
) -> bytes:
    return HEADER.pack(MAGIC, VERSION, opcode, flags, status, request_id, meta_len, data_len)


def unpack_header(buf: Buffer, offset: int = 0) -> Header:
    magic, version, opcode, flags, status, rid, meta_len, data_len = HEADER.unpack_from(buf, offset)
    if magic != MAGIC:
        raise BadMagic(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    return Header(version, opcode, flags, status, rid, meta_len, data_len)


def frame_parts(
    opcode: int,
    request_id: int,
    meta: Buffer = b"",
    data: Sequence[Buffer] = (),
    flags: int = 0,
    status: int = 0,
) -> list[Buffer]:
    """The buffers of one frame, for a vectored write (no re-joining)."""
    data_len = 0
    for part in data:
        data_len += len(part)
    parts: list[Buffer] = [pack_header(opcode, request_id, len(meta), data_len, flags, status)]
    if meta:
        parts.append(meta)
    parts.extend(data)
    return parts


# --------------------------------------------------------------------------- the frame reader


_MIN_TAIL = 16 * 1024
#: a receive into a frame's own buffer fills at most LOOP_STEP bytes: a large
#: frame arrives over several loop steps, so the loop answers other
#: connections between them


class _Direct:
    """A frame received straight into its destination: meta, then data."""

    __slots__ = ("data", "filled", "header", "meta", "own")

    def __init__(self, header: Header, meta: memoryview, data: memoryview, own: bool) -> None:
        self.header = header
        self.meta = meta
        self.data = data
        self.filled = 0
        #: its body is a buffer of the reader's own (not a sink's destination)
        self.own = own

    @property
    def size(self) -> int:
        return len(self.meta) + len(self.data)

    def buffer(self) -> memoryview:
        if self.filled < len(self.meta):
            return self.meta[self.filled : self.filled + LOOP_STEP]
        at = self.filled - len(self.meta)
        return self.data[at : at + LOOP_STEP]

    def put(self, chunk: memoryview) -> None:
        """Copy bytes that arrived in the ring buffer (the frame's first part)."""
        cut = max(0, min(len(chunk), len(self.meta) - self.filled))
        if cut:
            self.meta[self.filled : self.filled + cut] = chunk[:cut]
        rest = chunk[cut:]
        if rest:
            at = self.filled + cut - len(self.meta)
            self.data[at : at + len(rest)] = rest
        self.filled += len(chunk)


#: where a frame's data part should land (a caller's buffer), or None; it is
#: given the frame's meta when that has already arrived, else None
Sink = Callable[[Header, "Buffer | None"], "memoryview | None"]


class FrameReader:
    """Incremental frame assembler for ``asyncio.BufferedProtocol``.

    Small frames are received into one reusable buffer and many are parsed per
    ``recv``; a frame whose body exceeds ``direct_threshold`` is received
    straight into a buffer of its own (no copy), which becomes the frame's
    ``meta``/``data`` views. With a ``sink``, a frame whose data part has a
    destination (a caller's buffer of at least ``data_len`` bytes) is
    received straight into it, and its ``data`` is that very view when it
    has exactly ``data_len`` bytes (else a view of its head).
    Bodies above ``max_frame`` raise :class:`OversizedFrame` and leave the
    reader unusable (the caller closes).
    """

    def __init__(
        self,
        max_frame: int,
        buffer_size: int = 256 * 1024,
        direct_threshold: int = 64 * 1024,
        sink: Sink | None = None,
    ) -> None:
        if buffer_size < direct_threshold + HEADER_SIZE:
            raise ValueError("buffer_size must hold a header plus a direct_threshold body")
        self.max_frame = max_frame
        self.direct_threshold = direct_threshold
        self._sink = sink
        self._buf = bytearray(buffer_size)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        #: the frame being received outside the ring buffer, if any
        self._direct: _Direct | None = None

    def __repr__(self) -> str:
        d = self._direct
        mode = f"direct {d.filled}/{d.size}" if d is not None else "ring"
        return f"<FrameReader {mode} buffered={self._end - self._start}>"

    @property
    def idle(self) -> bool:
        """True when no partial frame is buffered."""
        return self._direct is None and self._start == self._end

    @property
    def partial_data(self) -> memoryview | None:
        """The data part of the frame being received, while it is received
        outside the ring buffer (a sink's destination, or a buffer of its own)."""
        return self._direct.data if self._direct is not None else None

    @property
    def own_bytes(self) -> int:
        """Bytes of a buffer of its own that the frame being received takes
        (none when it lands in a sink's destination, or in the ring buffer)."""
        direct = self._direct
        return direct.size if direct is not None and direct.own else 0

    @property
    def partial_header(self) -> Header | None:
        """The header of the frame being received, once it has arrived."""
        if self._direct is not None:
            return self._direct.header
        if self._end - self._start >= HEADER_SIZE:
            return unpack_header(self._view, self._start)
        return None

    def discard(self) -> int:
        """Drop a partial frame (its sender went away); returns the bytes dropped."""
        dropped = self._end - self._start
        if self._direct is not None:
            dropped = HEADER_SIZE + self._direct.filled
        self._direct = None
        self._start = self._end = 0
        return dropped

    def detach(self, request_id: int) -> None:
        """The caller of ``request_id`` gave up: the rest of its frame, if being
        received into the caller's buffer, goes to a scratch buffer instead."""
        direct = self._direct
        if direct is not None and direct.header.request_id == request_id:
            direct.data = memoryview(bytearray(len(direct.data)))

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        if self._direct is not None:
            return self._direct.buffer()
        # Compact before the tail gets small, so that a recv never reads a
        # few bytes at a time; a partial frame here is at most
        # HEADER_SIZE + direct_threshold bytes, which always fits.
        if len(self._buf) - self._end < _MIN_TAIL and self._start > 0:
            self._compact()
        return self._view[self._end :]

    def _compact(self) -> None:
        pending = self._end - self._start
        self._buf[:pending] = self._view[self._start : self._end]
        self._start, self._end = 0, pending

    def buffer_updated(self, nbytes: int) -> list[Frame]:
        frames: list[Frame] = []
        direct = self._direct
        if direct is not None:
            direct.filled += nbytes
            if direct.filled < direct.size:
                return frames
            self._direct = None
            frames.append(Frame(direct.header, direct.meta, direct.data))
            return frames
        self._end += nbytes
        self._parse(frames)
        return frames

    def _destination(self, header: Header, meta: Buffer | None) -> memoryview | None:
        if self._sink is None or not header.data_len:
            return None
        dest = self._sink(header, meta)
        if dest is None or len(dest) < header.data_len:
            return None
        return dest if len(dest) == header.data_len else dest[: header.data_len]

    def _parse(self, frames: list[Frame]) -> None:
        view = self._view
        while self._end - self._start >= HEADER_SIZE:
            header = unpack_header(view, self._start)
            body_len = header.meta_len + header.data_len
            if body_len > self.max_frame:
                raise OversizedFrame(header, self.max_frame)
            body_start = self._start + HEADER_SIZE
            available = self._end - body_start
            meta_end = body_start + header.meta_len
            dest = None
            if self._sink is not None and header.data_len:
                arrived = view[body_start:meta_end] if available >= header.meta_len else None
                dest = self._destination(header, arrived)
            if available >= body_len:
                frame_end = meta_end + header.data_len
                meta = bytes(view[body_start:meta_end])
                if dest is not None:
                    dest[:] = view[meta_end:frame_end]
                    frames.append(Frame(header, meta, dest))
                else:
                    frames.append(Frame(header, meta, bytes(view[meta_end:frame_end])))
                self._start = frame_end
                continue
            if dest is not None:
                direct = _Direct(header, memoryview(bytearray(header.meta_len)), dest, False)
            elif body_len > self.direct_threshold:
                body = memoryview(bytearray(body_len))
                direct = _Direct(header, body[: header.meta_len], body[header.meta_len :], True)
            else:
                break
            direct.put(view[body_start : self._end])
            self._direct = direct
            self._start = self._end = 0
            break
        if self._start == self._end:
            self._start = self._end = 0

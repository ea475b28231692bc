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
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.model import Buffer

MAGIC = b"KV"
VERSION = 1
SUPPORTED_VERSIONS = (1,)

#: magic, version, opcode, flags, status, request id, meta length, data length
HEADER = struct.Struct("<2sBBHHQII")
HEADER_SIZE = HEADER.size  # 24

FLAG_REPLY = 0x0001
FLAG_DURABLE = 0x0002  # PUT: acknowledge once the block is durable
KNOWN_REQUEST_FLAGS = FLAG_DURABLE

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


class FrameReader:
    """Incremental frame assembler for ``asyncio.BufferedProtocol``.

    Small frames are received into one reusable buffer and many are parsed per
    ``recv``; a frame whose body exceeds ``direct_threshold`` is received
    straight into a buffer of its own (no copy), which becomes the frame's
    ``meta``/``data`` views. Bodies above ``max_frame`` raise
    :class:`OversizedFrame` and leave the reader unusable (the caller closes).
    """

    def __init__(
        self,
        max_frame: int,
        buffer_size: int = 256 * 1024,
        direct_threshold: int = 64 * 1024,
    ) -> None:
        if buffer_size < direct_threshold + HEADER_SIZE:
            raise ValueError("buffer_size must hold a header plus a direct_threshold body")
        self.max_frame = max_frame
        self.direct_threshold = direct_threshold
        self._buf = bytearray(buffer_size)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self._body: bytearray | None = None
        self._body_filled = 0
        self._body_header: Header | None = None

    def __repr__(self) -> str:
        mode = f"direct {self._body_filled}/{len(self._body)}" if self._body is not None else "ring"
        return f"<FrameReader {mode} buffered={self._end - self._start}>"

    @property
    def idle(self) -> bool:
        """True when no partial frame is buffered."""
        return self._body is None and self._start == self._end

    def discard(self) -> int:
        """Drop a partial frame (its sender went away); returns the bytes dropped."""
        dropped = self._end - self._start
        if self._body is not None:
            dropped = HEADER_SIZE + self._body_filled
        self._body, self._body_header, self._body_filled = None, None, 0
        self._start = self._end = 0
        return dropped

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        if self._body is not None:
            return memoryview(self._body)[self._body_filled :]
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
        if self._body is not None:
            self._body_filled += nbytes
            if self._body_filled < len(self._body):
                return frames
            frames.append(self._finish_direct())
            return frames
        self._end += nbytes
        self._parse(frames)
        return frames

    def _finish_direct(self) -> Frame:
        assert self._body is not None and self._body_header is not None
        body, header = memoryview(self._body), self._body_header
        self._body, self._body_header, self._body_filled = None, None, 0
        return Frame(header, body[: header.meta_len], body[header.meta_len :])

    def _parse(self, frames: list[Frame]) -> None:
        view = self._view
        while self._end - self._start >= HEADER_SIZE:
            header = unpack_header(view, self._start)
            body_len = header.meta_len + header.data_len
            if body_len > self.max_frame:
                raise OversizedFrame(header, self.max_frame)
            body_start = self._start + HEADER_SIZE
            available = self._end - body_start
            if available >= body_len:
                meta_end = body_start + header.meta_len
                frame_end = meta_end + header.data_len
                frames.append(
                    Frame(header, bytes(view[body_start:meta_end]), bytes(view[meta_end:frame_end]))
                )
                self._start = frame_end
                continue
            if body_len > self.direct_threshold:
                body = bytearray(body_len)
                body[:available] = view[body_start : self._end]
                self._body, self._body_header, self._body_filled = body, header, available
                self._start = self._end = 0
            break
        if self._start == self._end:
            self._start = self._end = 0

"""The client's side of one connection: frames in, replies matched to callers.

A ``BufferedProtocol`` that receives reply frames into reusable buffers, or
straight into a caller's buffer for ``get_into`` (a *sink* registered by
request id), and resolves each request's future. A frame with request id 0
and an error status is the server refusing the connection: every pending
request fails with it. Invariants: a request id's sink is dropped when its
caller gives up (:meth:`ClientProtocol.forget`), so a late reply never
writes into a buffer its owner has taken back; every pending future ends
when the connection does.
"""

from __future__ import annotations

import asyncio
from typing import cast

from kvtier import wire
from kvtier.errors import ConnectionClosedError, ProtocolError, RequestTimeoutError, error_from_code
from kvtier.model import Buffer
from kvtier.wire import Frame
from kvtier.wire.flow_control import FlowControl

#: reply frames a stream may hold unread before the connection stops reading
STREAM_BACKLOG = 64


class ClientProtocol(asyncio.BufferedProtocol):
    def __init__(self, max_frame: int) -> None:
        self.reader = wire.FrameReader(max_frame, sink=self._sink)
        self.transport: asyncio.Transport | None = None
        self.pending: dict[int, asyncio.Future[Frame]] = {}
        #: caller buffers that GET replies land in, by request id (get_into)
        self.sinks: dict[int, memoryview] = {}
        #: streaming requests (SUBSCRIBE): their reply frames, in order, by request id
        self.streams: dict[int, asyncio.Queue[Frame | Exception]] = {}
        self.closed_exc: Exception | None = None
        self.flow: FlowControl | None = None
        self.closed_event = asyncio.Event()

    def __repr__(self) -> str:
        return f"<ClientProtocol pending={len(self.pending)} {self.flow!r} {self.reader!r}>"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the Transport API without subclassing it
        self.transport = cast(asyncio.Transport, transport)
        self.flow = FlowControl(self.transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.reader.get_buffer(sizehint)

    def _sink(self, header: wire.Header, meta: Buffer | None) -> memoryview | None:
        if header.status:
            return None  # an error reply carries a message, not a block
        return self.sinks.pop(header.request_id, None)

    def forget(self, rid: int) -> None:
        """Request ``rid`` is over: its reply may no longer touch the caller's buffer."""
        self.pending.pop(rid, None)
        if self.sinks.pop(rid, None) is None:
            self.reader.detach(rid)

    def buffer_updated(self, nbytes: int) -> None:
        try:
            frames = self.reader.buffer_updated(nbytes)
        except wire.CodecError as exc:
            self._fail(ProtocolError(f"bad reply stream from the server: {exc}"))
            if self.transport is not None:
                self.transport.abort()
            return
        for frame in frames:
            if frame.header.request_id == 0 and frame.header.status:
                # Unasked: the server refuses this connection and closes it.
                self._fail(error_from_code(frame.header.status, wire.decode_error(frame.meta)))
                continue
            stream = self.streams.get(frame.header.request_id)
            if stream is not None:
                stream.put_nowait(frame)
                if stream.qsize() >= STREAM_BACKLOG and self.transport is not None:
                    self.transport.pause_reading()  # the stream's reader resumes it
                continue
            fut = self.pending.pop(frame.header.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(frame)
            # else: the caller timed out or was cancelled; the late reply is dropped

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._fail(ConnectionClosedError(f"connection to the daemon closed: {exc or 'EOF'}"))
        if self.flow is not None:
            self.flow.closed()
        self.closed_event.set()

    def _fail(self, exc: Exception) -> None:
        if self.closed_exc is None:
            self.closed_exc = exc
        pending, self.pending = self.pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(exc)
        for stream in self.streams.values():
            stream.put_nowait(exc)

    def pause_writing(self) -> None:
        if self.flow is not None:
            self.flow.pause_writing()

    def resume_writing(self) -> None:
        if self.flow is not None:
            self.flow.resume_writing()

    def stream_taken(self, stream: asyncio.Queue[Frame | Exception]) -> None:
        """A stream's reader took a frame: read again once it has caught up."""
        if stream.qsize() < STREAM_BACKLOG // 4 and self.transport is not None:
            self.transport.resume_reading()

    async def drain(self) -> None:
        if self.flow is not None:
            await self.flow.drain()


def checked(frame: Frame) -> Frame:
    """``frame``, or the :class:`~kvtier.errors.KvtierError` its error reply carries."""
    if frame.header.status:
        raise error_from_code(frame.header.status, wire.decode_error(frame.meta))
    return frame


def expire(fut: asyncio.Future[Frame], seconds: float) -> None:
    if not fut.done():
        fut.set_exception(RequestTimeoutError(f"no reply within {seconds}s"))

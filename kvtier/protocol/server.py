"""The Unix-socket server: frames in, service calls, frames out.

One ``BufferedProtocol`` per connection receives frames into reusable
buffers (see :class:`~kvtier.protocol.codec.FrameReader`). Requests that
complete without awaiting are answered inline; the others run as tasks in
the daemon's task group, so replies may leave out of order (request ids
pair them up) and a slow request never blocks a fast one.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import stat
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

from kvtier._version import __version__
from kvtier.errors import (
    ErrorCode,
    KvtierError,
    ShuttingDownError,
    SocketInUseError,
    UnsafeSocketDirError,
    UnsupportedVersionError,
)
from kvtier.errors import UnknownOpcodeError as _UnknownOpcode
from kvtier.metrics import Metrics
from kvtier.protocol import codec
from kvtier.protocol.codec import FLAG_REPLY, Buffer, Frame, Op
from kvtier.service import Service

log = logging.getLogger("kvtier.server")

Spawn = Callable[[Coroutine[Any, Any, None]], Any]

_OP_NAMES = {int(op): op.name.lower() for op in Op}
_ERROR_NAMES = {int(c): c.name.lower() for c in ErrorCode}


@dataclass(slots=True)
class Reply:
    """A reply's meta and data; ``on_sent`` runs once the frame is handed to the transport."""

    meta: bytes
    data: Sequence[Buffer] = ()
    on_sent: Callable[[], None] | None = None


def prepare_socket_path(path: Path) -> None:
    """Make ``path``'s directory (0700 when we create it) and clear a stale socket.

    A socket file that still answers belongs to a live daemon and is not
    stolen; a socket file nobody answers on is left over from a dead one.
    """
    parent = path.parent
    if not parent.exists():
        parent.mkdir(mode=0o700, parents=True)
        os.chmod(parent, 0o700)
    else:
        # Another user who controls the directory could swap the socket for
        # their own: refuse directories we cannot trust.
        st = os.stat(parent)
        if st.st_uid not in (os.getuid(), 0):
            raise UnsafeSocketDirError(
                f"socket directory {parent} belongs to uid {st.st_uid}, not to this user"
            )
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            raise UnsafeSocketDirError(
                f"socket directory {parent} is writable by every user; use a private directory"
            )
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketInUseError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        log.info("removing stale socket %s left by a daemon that is gone", path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    except OSError as exc:
        raise SocketInUseError(f"cannot tell whether {path} is in use: {exc}") from exc
    finally:
        probe.close()
    raise SocketInUseError(f"another kvtier daemon is serving on {path}")


def bind_unix_socket(path: Path) -> socket.socket:
    """A listening socket at ``path``, created with mode 0600."""
    prepare_socket_path(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise SocketInUseError(f"another process bound {path} meanwhile") from exc
        raise
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    sock.listen(512)
    sock.setblocking(False)
    return sock


class Connection(asyncio.BufferedProtocol):
    """One client connection."""

    def __init__(self, server: Server, conn_id: int) -> None:
        self.server = server
        self.conn_id = conn_id
        self.reader = codec.FrameReader(server.max_frame)
        self.transport: asyncio.Transport | None = None
        self.inflight = 0
        self.closed = False
        self._write_paused = False
        self._read_paused = False
        self._eof = False
        self._waiting: set[asyncio.Task[None]] = set()
        #: resolved when the client has sent EOF
        self.eof: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        #: set once this connection has nothing left to do (used by shutdown)
        self.done = asyncio.Event()

    def __repr__(self) -> str:
        return (
            f"<Connection #{self.conn_id} inflight={self.inflight} closed={self.closed} "
            f"write_paused={self._write_paused} {self.reader!r}>"
        )

    # -- asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the Transport API without subclassing it
        self.transport = cast(asyncio.Transport, transport)
        self.server.connection_opened(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        for task in list(self._waiting):
            task.cancel()
        try:
            self.server.connection_closed(self)
        finally:
            self.done.set()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.reader.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.server.metrics.received_bytes.inc(nbytes)
        try:
            frames = self.reader.buffer_updated(nbytes)
        except codec.OversizedFrame as exc:
            self._fatal(
                exc.header.opcode, exc.header.request_id, ErrorCode.FRAME_TOO_LARGE, str(exc)
            )
            return
        except codec.BadMagic as exc:
            self._fatal(0, 0, ErrorCode.MALFORMED, f"{exc}; closing the connection")
            return
        for frame in frames:
            self._dispatch(frame)
        self._maybe_finish()

    def eof_received(self) -> bool | None:
        # The client finished sending: replies still in flight are written,
        # then the connection closes (see _maybe_finish).
        self._eof = True
        # The client sends nothing more, so it cannot ask again: waiting
        # lookups answer now with what is known.
        if not self.eof.done():
            self.eof.set_result(None)
        if self.inflight:
            return True  # keep the write side open until they are done
        return None

    def pause_writing(self) -> None:
        self._write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._update_reading()

    # -- flow control: stop reading requests while replies back up or too
    # many requests are in flight, so one client cannot grow our memory.

    def _update_reading(self) -> None:
        if self.transport is None:
            return
        want_pause = self._write_paused or self.inflight >= self.server.max_inflight
        if want_pause and not self._read_paused:
            self._read_paused = True
            self.transport.pause_reading()
        elif not want_pause and self._read_paused:
            self._read_paused = False
            self.transport.resume_reading()

    # -- requests

    def _dispatch(self, frame: Frame) -> None:
        header = frame.header
        started = time.perf_counter()
        op_name = _OP_NAMES.get(header.opcode, "unknown")
        try:
            if header.version not in codec.SUPPORTED_VERSIONS:
                raise UnsupportedVersionError(
                    f"protocol version {header.version} is not supported; "
                    f"this server speaks {list(codec.SUPPORTED_VERSIONS)}"
                )
            if header.flags & FLAG_REPLY or header.status:
                raise codec.CodecError("a request must have the reply flag and status clear")
            if header.flags & ~codec.KNOWN_REQUEST_FLAGS:
                raise codec.CodecError(f"unknown flags 0x{header.flags:04x}")
            if self.server.shutting_down and not self.server.admits_during_shutdown(self):
                raise ShuttingDownError("the daemon is shutting down")
            handler = self.server.handlers.get(header.opcode)
            if handler is None:
                raise _UnknownOpcode(f"unknown opcode 0x{header.opcode:02x}")
            result = handler(self, frame)
        except Exception as exc:  # converted to an error reply at this edge
            self._reply_error(header.opcode, header.request_id, exc, op_name, started)
            return
        if isinstance(result, Reply):
            self._reply(header.opcode, header.request_id, result)
            self.server.metrics.observe_request(op_name, "ok", time.perf_counter() - started)
            return
        self.inflight += 1
        self._update_reading()
        task = self.server.spawn(
            self._finish(header.opcode, header.request_id, result, op_name, started)
        )
        if header.opcode == Op.LOOKUP:
            # A waiting lookup only waits for its caller: when the caller goes,
            # so does it (the probes it joined are shared and carry on).
            self._waiting.add(task)
            task.add_done_callback(self._waiting.discard)

    async def _finish(
        self, opcode: int, request_id: int, pending: Awaitable[Reply], op_name: str, started: float
    ) -> None:
        try:
            try:
                reply = await pending
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._reply_error(opcode, request_id, exc, op_name, started)
                return
            self._reply(opcode, request_id, reply)
            self.server.metrics.observe_request(op_name, "ok", time.perf_counter() - started)
        finally:
            self.inflight -= 1
            self._update_reading()
            self._maybe_finish()

    def _reply(self, opcode: int, request_id: int, reply: Reply) -> None:
        try:
            self._write(
                codec.frame_parts(opcode, request_id, reply.meta, reply.data, flags=FLAG_REPLY)
            )
        finally:
            if reply.on_sent is not None:
                reply.on_sent()

    def _reply_error(
        self, opcode: int, request_id: int, exc: Exception, op_name: str, started: float
    ) -> None:
        code, message = _error_of(exc)
        if code == ErrorCode.INTERNAL:
            log.error("request %s #%d failed", op_name, request_id, exc_info=exc)
        self.server.metrics.observe_request(
            op_name, _ERROR_NAMES.get(code, "error"), time.perf_counter() - started
        )
        if code in (ErrorCode.MALFORMED, ErrorCode.UNSUPPORTED_VERSION, ErrorCode.UNKNOWN_OPCODE):
            self.server.metrics.protocol_errors.labels(_ERROR_NAMES[code]).inc()
        self._write(
            codec.frame_parts(
                opcode, request_id, codec.encode_error(message), flags=FLAG_REPLY, status=code
            )
        )

    def _write(self, parts: list[Buffer]) -> None:
        if self.transport is None or self.transport.is_closing():
            return  # the client is gone; its reply has nowhere to go
        self.transport.writelines(parts)
        self.server.metrics.sent_bytes.inc(sum(len(p) for p in parts))

    def _fatal(self, opcode: int, request_id: int, code: ErrorCode, message: str) -> None:
        """Framing is lost: say why, then close only this connection."""
        log.warning("connection #%d: %s", self.conn_id, message)
        self.server.metrics.protocol_errors.labels(_ERROR_NAMES[code]).inc()
        self.server.metrics.observe_request(
            _OP_NAMES.get(opcode, "unknown"), _ERROR_NAMES[code], 0.0
        )
        self._write(
            codec.frame_parts(
                opcode, request_id, codec.encode_error(message), flags=FLAG_REPLY, status=code
            )
        )
        if self.transport is not None:
            self.transport.close()  # flushes the error reply first

    def _maybe_finish(self) -> None:
        """Close once nothing is in flight, after EOF or during shutdown."""
        if (
            (self.server.shutting_down or self._eof)
            and self.inflight == 0
            and self.reader.idle
            and self.transport is not None
            and not self.transport.is_closing()
        ):
            self.transport.close()

    def close_if_idle(self) -> None:
        self._maybe_finish()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


def _error_of(exc: BaseException) -> tuple[ErrorCode, str]:
    if isinstance(exc, KvtierError):
        return exc.code, exc.message
    if isinstance(exc, codec.CodecError):
        return ErrorCode.MALFORMED, str(exc)
    return ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}"


Handler = Callable[[Connection, Frame], "Reply | Awaitable[Reply]"]


class Server:
    """Accepts connections and routes frames to the service."""

    def __init__(
        self,
        service: Service,
        metrics: Metrics,
        spawn: Spawn,
        *,
        max_frame: int,
        max_inflight: int,
        server_name: str = f"kvtier/{__version__}",
    ) -> None:
        self.service = service
        self.metrics = metrics
        self.spawn = spawn
        self.max_frame = max_frame
        self.max_inflight = max_inflight
        self.server_name = server_name
        self.connections: set[Connection] = set()
        self.shutting_down = False
        self._busy_at_shutdown: set[Connection] = set()
        self._next_id = 0
        self._aserver: asyncio.AbstractServer | None = None
        self.handlers: dict[int, Handler] = {
            Op.HELLO: self._hello,
            Op.PING: self._ping,
            Op.STATS: self._stats,
            Op.LOOKUP: self._lookup,
            Op.GET: self._get,
            Op.PUT: self._put,
            Op.DELETE: self._delete,
            Op.RESERVE: self._reserve,
            Op.ABORT: self._abort,
            Op.RELEASE: self._release,
        }

    def __repr__(self) -> str:
        return f"<Server connections={len(self.connections)} shutting_down={self.shutting_down}>"

    # -- lifecycle

    async def start(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        self._aserver = await loop.create_unix_server(self._new_connection, sock=sock)

    def _new_connection(self) -> Connection:
        self._next_id += 1
        return Connection(self, self._next_id)

    def connection_opened(self, conn: Connection) -> None:
        self.connections.add(conn)
        self.metrics.connections.inc()
        self.metrics.connections_open.inc()

    def connection_closed(self, conn: Connection) -> None:
        self.connections.discard(conn)
        self._busy_at_shutdown.discard(conn)
        self.metrics.connections_open.dec()
        self.service.connection_closed(conn.conn_id)

    def admits_during_shutdown(self, conn: Connection) -> bool:
        """A frame that was partly received when shutdown began is still served."""
        if conn in self._busy_at_shutdown:
            if conn.reader.idle:
                self._busy_at_shutdown.discard(conn)
            return True
        return False

    async def shutdown(self, grace: float) -> None:
        """Stop accepting, let in-flight requests finish within ``grace``, then close."""
        self.shutting_down = True
        if self._aserver is not None:
            self._aserver.close()
        self._busy_at_shutdown = {c for c in self.connections if not c.reader.idle}
        for conn in list(self.connections):
            conn.close_if_idle()
        waiters = [conn.done.wait() for conn in list(self.connections)]
        if waiters:
            try:
                async with asyncio.timeout(grace):
                    await asyncio.gather(*waiters)
            except TimeoutError:
                log.warning(
                    "%d connection(s) still busy after the %.1fs grace period; closing them",
                    len(self.connections),
                    grace,
                )
                for conn in list(self.connections):
                    conn.abort()
        if self._aserver is not None:
            await self._aserver.wait_closed()

    # -- handlers: decode, call the service, encode

    def _hello(self, conn: Connection, frame: Frame) -> Reply:
        hello = codec.decode_hello(frame.meta)
        version = codec.negotiate_version(hello)
        if version is None:
            raise UnsupportedVersionError(
                f"client speaks versions {hello.min_version}..{hello.max_version}; "
                f"this server speaks {list(codec.SUPPORTED_VERSIONS)}"
            )
        limits = self.service.limits
        return Reply(
            codec.encode_hello_reply(
                codec.HelloReply(
                    version=version,
                    max_key_bytes=limits.max_key_bytes,
                    max_batch=limits.max_batch,
                    max_frame_bytes=self.max_frame,
                    max_block_bytes=limits.max_block_bytes,
                    server_name=self.server_name,
                )
            )
        )

    def _ping(self, conn: Connection, frame: Frame) -> Reply:
        return Reply(bytes(frame.meta))

    def _stats(self, conn: Connection, frame: Frame) -> Reply:
        stats = self.service.stats()
        stats["server"] = {"connections": len(self.connections), "version": self.server_name}
        return Reply(codec.encode_json(stats))

    def _lookup(self, conn: Connection, frame: Frame) -> Reply | Awaitable[Reply]:
        result = self.service.lookup(codec.decode_lookup(frame.meta), conn.conn_id, conn.eof)
        if isinstance(result, codec.LookupReply):
            return Reply(codec.encode_lookup_reply(result))
        return _then(result, lambda r: Reply(codec.encode_lookup_reply(r)))

    def _get(self, conn: Connection, frame: Frame) -> Reply | Awaitable[Reply]:
        keys = _only_keys(frame, "GET")
        result = self.service.get_pinned(keys)
        if isinstance(result, list):
            return self._get_reply(keys, result)
        return _then(result, lambda values: self._get_reply(keys, values))

    def _get_reply(self, keys: list[bytes], values: list[Buffer | None]) -> Reply:
        try:
            meta, data = codec.encode_get_reply(values)
        except BaseException:
            self.service.unpin(keys, values)
            raise
        return Reply(meta, data, on_sent=lambda: self.service.unpin(keys, values))

    def _put(self, conn: Connection, frame: Frame) -> Reply | Awaitable[Reply]:
        keys, values = codec.decode_put(frame.meta, frame.data)
        durable = bool(frame.header.flags & codec.FLAG_DURABLE)
        result = self.service.put(keys, values, durable)
        if isinstance(result, list):
            return Reply(codec.encode_put_reply(result))
        return _then(result, lambda r: Reply(codec.encode_put_reply(r)))

    def _delete(self, conn: Connection, frame: Frame) -> Reply | Awaitable[Reply]:
        result = self.service.delete(_only_keys(frame, "DELETE"))
        if isinstance(result, list):
            return Reply(codec.encode_delete_reply(result))
        return _then(result, lambda r: Reply(codec.encode_delete_reply(r)))

    def _reserve(self, conn: Connection, frame: Frame) -> Reply:
        if frame.data:
            raise codec.CodecError("RESERVE carries no data")
        statuses = self.service.reserve(codec.decode_reserve(frame.meta), conn.conn_id)
        return Reply(codec.encode_status_bytes(statuses))

    def _abort(self, conn: Connection, frame: Frame) -> Reply:
        aborted = self.service.abort(_only_keys(frame, "ABORT"), conn.conn_id)
        return Reply(codec.encode_status_bytes(aborted))

    def _release(self, conn: Connection, frame: Frame) -> Reply:
        if frame.data:
            raise codec.CodecError("RELEASE carries no data")
        existed = self.service.release(codec.decode_tag(frame.meta))
        return Reply(bytes([int(existed)]))


T = TypeVar("T")


async def _then(pending: Awaitable[T], make: Callable[[T], Reply]) -> Reply:
    return make(await pending)


def _only_keys(frame: Frame, op: str) -> list[bytes]:
    keys, end = codec.decode_keys(frame.meta)
    if end != len(frame.meta) or frame.data:
        raise codec.CodecError(f"{op} carries only a key list")
    return keys

"""One client connection: frames in, handlers called, replies out.

A ``BufferedProtocol`` receives frames into reusable buffers (see
:class:`~kvtier.wire.framing.FrameReader`). A handler that answers without
awaiting is replied to inline; one that must wait runs as a task in the
daemon's task group, so replies may leave out of order (request ids pair
them up) and a slow request never blocks a fast one on the same connection.

Invariants: reading pauses while replies back up or ``max_inflight``
requests are running, so one client cannot grow the daemon's memory; a
connection closes once nothing is in flight after EOF or during shutdown;
a reply's blocks stay pinned until the transport has written them out (it
holds views of them, not copies); a PUT body received into RAM's arena is
stored or given back, whatever happens to the frame; ``done`` is set in
``connection_lost`` whatever happened.

A connection knows its server only as a :class:`Host` (and its op table as
an :class:`OpTable`): what it needs of them, and no more. Imports the wire,
the shared records and the errors; never the core, the server or the ops.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, cast

from kvtier import wire
from kvtier.errors import (
    ErrorCode,
    ForbiddenError,
    KvtierError,
    ShuttingDownError,
    UnknownOpcodeError,
    UnsupportedVersionError,
)
from kvtier.loops import IdlePoll
from kvtier.model import Buffer, ConnId, Spawn
from kvtier.server.counters import ServerCounters
from kvtier.server.gate import PeerGate, Refusal
from kvtier.server.sockets import Peer, PeerPolicy, peer_of
from kvtier.tasks import LASTING_TASK
from kvtier.wire import FLAG_REPLY, Frame, Op
from kvtier.wire.flow_control import FlowControl

log = logging.getLogger("kvtier.server")

OP_NAMES = {int(op): op.name.lower() for op in Op}
ERROR_NAMES = {int(c): c.name.lower() for c in ErrorCode}
#: the protocol-error label of a frame cut short by the client closing
TRUNCATED = "truncated_frame"
#: the protocol-error label of a frame whose bytes stopped arriving (server.body_timeout)
BODY_TIMEOUT = "body_timeout"
#: the largest first frame the peer gate reads: a HELLO fits many times over
_GATE_FRAME = 4096
#: requests that store blocks: each waits for the end of its loop step, so
#: that the reads which arrived with it are answered first (:meth:`Connection._hold`)
STORES = frozenset({Op.PUT, Op.COMMIT, Op.COMMIT_MANY, Op.PUT_REGION})
_CLOSES_FRAMING = (ErrorCode.MALFORMED, ErrorCode.UNSUPPORTED_VERSION, ErrorCode.UNKNOWN_OPCODE)


@dataclass(slots=True)
class Reply:
    """A reply's meta and data; ``on_sent`` runs once the transport has
    written the frame out, ``then`` right after the frame is handed to it,
    in the same step (whether or not the client is still there)."""

    meta: bytes
    data: list[Buffer] = field(default_factory=list)
    on_sent: Callable[[], None] | None = None
    then: Callable[[], None] | None = None


@dataclass(slots=True)
class Later:
    """A handler's answer that needs awaiting: the server runs it as a task.

    ``answer`` is what the service returned to await (the verb's coroutine);
    ``reply`` turns its result into the reply (absent: the result is one)."""

    answer: Awaitable[Any]
    reply: Callable[[Any], Reply] | None = None
    #: ends with the caller: cancelled when the connection goes (a waiting lookup)
    cancel_on_close: bool = False
    #: lasts as long as the connection (a stream): settling does not wait for it
    lasting: bool = False


#: what answers one opcode: a reply now, or one to await
Handler = Callable[["Connection", Frame], "Reply | Later"]


class Scopes(Protocol):
    """Which keys a new connection may name before its HELLO."""

    def first_scope(self, peer: Peer | None) -> wire.KeyScope: ...


class OpTable(Protocol):
    """The handlers a connection calls, where PUT bodies land, and what
    happens when a connection's owner goes."""

    @property
    def handlers(self) -> Mapping[int, Handler]: ...

    @property
    def access(self) -> Scopes | None: ...

    def receive_into(
        self, conn: Connection, header: wire.Header, meta: Buffer | None
    ) -> memoryview | None: ...

    def drop_staged(self, view: Buffer) -> None:
        """A body :meth:`receive_into` gave room for was not stored: give the room back."""

    def write_room(self) -> asyncio.Future[None] | None:
        """None while stores may go on; else what resolves once they may."""

    def connection_closed(self, owner: ConnId, writer_gone: bool = False) -> None:
        """``owner`` went (``writer_gone``: its process has exited): whatever it held ends."""


class Host(Protocol):
    """What a connection needs of the server that accepted it."""

    @property
    def ops(self) -> OpTable: ...

    @property
    def counters(self) -> ServerCounters: ...

    @property
    def peers(self) -> PeerPolicy: ...

    @property
    def gate(self) -> PeerGate | None: ...

    @property
    def idle_poll(self) -> IdlePoll: ...

    @property
    def spawn(self) -> Spawn: ...

    @property
    def max_frame(self) -> int: ...

    @property
    def max_inflight(self) -> int: ...

    @property
    def handshake_timeout(self) -> float | None: ...

    @property
    def max_unauthenticated(self) -> int | None: ...

    @property
    def shutting_down(self) -> bool: ...

    def connection_opened(self, conn: Connection) -> None: ...

    def authenticated(self, conn: Connection) -> None: ...

    def connection_ended(self, conn: Connection) -> None: ...

    def connection_closed(self, conn: Connection) -> None: ...

    def admits_during_shutdown(self, conn: Connection) -> bool: ...

    def hold(self, conn: Connection) -> None: ...

    def observe(self, op: str, outcome: str, seconds: float) -> None: ...


def _close_if_unstarted(answer: Awaitable[Any], _task: asyncio.Task[None]) -> None:
    """A task cancelled before it ran never awaited the verb: close its
    coroutine, so it is not reported as never awaited."""
    if inspect.iscoroutine(answer) and inspect.getcoroutinestate(answer) == inspect.CORO_CREATED:
        answer.close()


class Connection(asyncio.BufferedProtocol):
    """One client connection."""

    def __init__(self, server: Host, conn_id: int) -> None:
        self.server = server
        self.conn_id = ConnId(conn_id)
        #: the connecting process's credentials (Unix socket), once connected
        self.peer: Peer | None = None
        #: before the peer gate admits it, a connection may send one small frame
        self.reader = wire.FrameReader(
            server.max_frame if server.gate is None else _GATE_FRAME, sink=self._receive_into
        )
        #: PUT bodies received straight into RAM's arena, by id, until their
        #: frames are handled (each is stored or given back)
        self._staged: dict[int, memoryview] = {}
        #: frames handled at the end of this loop step (:meth:`_hold`): a
        #: store, and every later frame of this connection, behind it
        self._held: deque[Frame] = deque()
        #: whether this connection agreed to shared memory at HELLO
        self.shared = False
        #: the keys it may name (its namespace's, docs/tenancy.md); None on the
        #: peer port, whose keys are stored keys already
        self.scope: wire.KeyScope | None = None
        #: its namespace, as named at HELLO (the default: empty)
        self.namespace = b""
        #: what runs once replies still in the transport's buffer are written out
        #: (a reply's block stays pinned until the kernel has its bytes)
        self._unflushed: list[Callable[[], None]] = []
        self.transport: asyncio.Transport | None = None
        self.flow: FlowControl | None = None
        #: requests running as tasks; bounded by the server's max_inflight
        self.inflight = 0
        self.closed = False
        #: whether the peer gate (if any) has admitted this connection
        self.admitted = server.gate is None
        #: whether its handshake deadline (if any) no longer applies
        self._handshaken = server.handshake_timeout is None and server.max_unauthenticated is None
        self._eof = False
        #: reads so far, and as the last stall check saw them (:meth:`stalled`)
        self._reads = 0
        self._reads_seen = 0
        self._still_checks = 0
        #: the lower tiers' room for writes this connection's stores wait for
        #: (reading pauses until it resolves)
        self._room: asyncio.Future[None] | None = None
        #: waiting lookups, cancelled when the connection goes
        self._waiting: set[asyncio.Task[None]] = set()
        #: resolved when the client has sent EOF
        self.eof: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        #: set once this connection has nothing left to do (used by shutdown)
        self.done = asyncio.Event()

    def __repr__(self) -> str:
        ns = f" namespace={self.namespace.decode()}" if self.namespace else ""
        return (
            f"<Connection #{self.conn_id.value}{ns} inflight={self.inflight} "
            f"held={len(self._held)} closed={self.closed} eof={self._eof} "
            f"{self.flow!r} {self.reader!r}>"
        )

    # -- asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the Transport API without subclassing it
        self.transport = cast(asyncio.Transport, transport)
        self.flow = FlowControl(self.transport)
        peer = self.peer = peer_of(transport.get_extra_info("socket"))
        if not self.server.peers.allows(peer):
            self._refuse(peer)
            return
        access = self.server.ops.access
        if access is not None:
            self.scope = access.first_scope(peer)
        self.server.connection_opened(self)

    def _refuse(self, peer: Peer | None) -> None:
        """Not a user this daemon serves: say so, count it, close before reading anything."""
        who = f"uid {peer.uid} gid {peer.gid} pid {peer.pid}" if peer else "unknown peer"
        log.warning("connection #%d refused: %s is not allowed", self.conn_id.value, who)
        self.server.counters.connections_refused.inc("not_allowed" if peer else "no_credentials")
        message = f"{who} may not use this daemon (server.allowed_uids / allowed_gids)"
        self._write(
            wire.frame_parts(
                0, 0, wire.encode_error(message), flags=FLAG_REPLY, status=ErrorCode.FORBIDDEN
            )
        )
        assert self.transport is not None
        self.transport.close()

    def _admit(self, frame: Frame) -> bool:
        """The peer gate's verdict on a connection's first frame."""
        gate = self.server.gate
        assert gate is not None
        refusal = gate.admit(frame)
        if refusal is None:
            self.admitted = self._handshaken = True
            self.reader.max_frame = self.server.max_frame
            self.server.authenticated(self)
            return True
        self._refuse_peer(refusal, frame.header.opcode, frame.header.request_id)
        return False

    def handshake_failed(self, refusal: Refusal) -> None:
        """No accepted HELLO (or first frame) in time, or too many connections
        wait for theirs: count it and drop the connection at once (a client
        that sends nothing may read nothing either)."""
        transport = self.transport
        if transport is None or self.closed:
            return
        log.warning("connection #%d closed: %s", self.conn_id.value, refusal.value)
        self.server.counters.connections_refused.inc(refusal.value)
        self.reader.discard()
        transport.abort()

    def _refuse_peer(self, refusal: Refusal, opcode: int = 0, request_id: int = 0) -> None:
        """Count it, say why in one error frame, close before reading more."""
        log.warning("peer connection #%d refused: %s", self.conn_id.value, refusal.value)
        self.server.counters.connections_refused.inc(refusal.value)
        message = "peer authentication failed: send HELLO with the shared peer token first"
        self._write(
            wire.frame_parts(
                opcode,
                request_id,
                wire.encode_error(message),
                flags=FLAG_REPLY,
                status=ErrorCode.FORBIDDEN,
            )
        )
        self.reader.discard()
        if self.transport is not None:
            self.transport.close()  # after the error reply is flushed

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        self._discard_partial_frame()
        self._drop_staged()
        self._flushed()
        if self.flow is not None:
            self.flow.closed()
        for task in list(self._waiting):
            task.cancel()
        try:
            self.server.connection_closed(self)
        finally:
            self.done.set()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.reader.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self._reads += 1
        self.server.counters.received_bytes.value += nbytes
        self.server.idle_poll.touch()  # the next request is likely close behind
        try:
            frames = self.reader.buffer_updated(nbytes)
        except wire.OversizedFrame as exc:
            if not self.admitted:  # too big to be a HELLO: not a peer
                self._refuse_peer(Refusal.NOT_HELLO, exc.header.opcode, exc.header.request_id)
                return
            self._fatal(
                exc.header.opcode, exc.header.request_id, ErrorCode.FRAME_TOO_LARGE, str(exc)
            )
            return
        except wire.BadMagic as exc:
            if not self.admitted:  # not speaking kvtier at all
                self._refuse_peer(Refusal.NOT_HELLO)
                return
            self._fatal(0, 0, ErrorCode.MALFORMED, f"{exc}; closing the connection")
            return
        if frames and not self._handshaken and self.admitted:
            self._handshaken = True  # a first frame in time (local socket)
            self.server.authenticated(self)
        for frame in frames:
            if not self.admitted and not self._admit(frame):
                return  # refused and closing: nothing more of it is read
            if self._held or frame.header.opcode in STORES:
                self._hold(frame)
            else:
                self._dispatch(frame)
        self._maybe_finish()

    def _hold(self, frame: Frame) -> None:
        """Handle ``frame`` at the end of this loop step, once the reads that
        arrived with it on other connections are answered: a LOOKUP never
        waits behind the stores of a step, only behind the one running when
        it arrives. Later frames of this connection wait behind it (its
        requests keep their order). Counted in flight meanwhile: an EOF or
        a shutdown waits for it, and reading pauses past ``max_inflight``."""
        if not self._held:
            self.server.hold(self)
        self._held.append(frame)
        self.inflight += 1
        self._update_reading()

    def release_held(self) -> None:
        """Handle the held frames in order; none if the connection has closed
        meanwhile (a body it received into RAM went with it). A store that
        finds the lower tiers' writes at their bound (:meth:`_wait_for_room`)
        keeps the frames behind it held until they have room."""
        held, self._held = self._held, deque()
        self.inflight -= len(held)
        if not self.closed:
            while held and self._room is None:
                self._dispatch(held.popleft())
            if held:  # handed back once there is room
                self._held = held
                self.inflight += len(held)
        self._update_reading()
        self._maybe_finish()

    def eof_received(self) -> bool | None:
        # The client finished sending: replies still in flight are written,
        # then the connection closes (see _maybe_finish).
        self._eof = True
        # The client sends nothing more, so it cannot ask again (waiting
        # lookups answer now with what is known), cannot PUT what it reserved
        # (its reservations end now) and cannot finish a partial frame.
        if not self.eof.done():
            self.eof.set_result(None)
        self._discard_partial_frame()
        self.server.connection_ended(self)
        if self.inflight:
            return True  # keep the write side open until they are done
        return None

    def stalled(self, checks: int) -> bool:
        """Whether this connection has been inside a frame, with nothing of it
        arriving, for ``checks`` calls in a row (the server calls it
        periodically). A connection the daemon is not reading from (its own
        flow control) is never stalled: nothing can arrive."""
        paused = self.flow is not None and self.flow.read_paused
        if self.reader.idle or self.closed or self._eof or paused:
            self._still_checks = 0
            return False
        if self._reads != self._reads_seen:
            self._reads_seen = self._reads
            self._still_checks = 0
            return False
        self._still_checks += 1
        return self._still_checks >= checks

    def body_timed_out(self, timeout: float) -> None:
        """Nothing of the frame being received came for ``timeout`` seconds:
        say so, count it, and drop the connection (the room its body held is
        given back and its reservations end as it goes)."""
        header = self.reader.partial_header
        log.warning(
            "connection #%d closed: %s; nothing of its frame arrived for %.1fs",
            self.conn_id.value,
            BODY_TIMEOUT,
            timeout,
        )
        self.server.counters.protocol_errors.inc(BODY_TIMEOUT)
        if header is not None:
            message = f"nothing of this frame arrived for {timeout:g}s (server.body_timeout)"
            self._write(
                wire.frame_parts(
                    header.opcode,
                    header.request_id,
                    wire.encode_error(message),
                    flags=FLAG_REPLY,
                    status=ErrorCode.TIMEOUT,
                )
            )
        if self.transport is not None:
            self.transport.abort()  # a client that stalls may not read either

    def _receive_into(self, header: wire.Header, meta: Buffer | None) -> memoryview | None:
        if not self.admitted:
            return None
        view = self.server.ops.receive_into(self, header, meta)
        if view is not None:
            self._staged[id(view)] = view
        return view

    def _drop_staged(self) -> None:
        staged, self._staged = self._staged, {}
        for view in staged.values():
            self.server.ops.drop_staged(view)

    def _discard_partial_frame(self) -> None:
        if self.reader.idle:
            return
        # Only the partial frame's room: complete frames held behind a store
        # are still handled, with theirs.
        partial = self.reader.partial_data
        if partial is not None:
            staged = self._staged.pop(id(partial), None)
            if staged is not None:
                self.server.ops.drop_staged(staged)
        dropped = self.reader.discard()
        self.server.counters.protocol_errors.inc(TRUNCATED)
        log.info(
            "connection #%d ended inside a frame; discarded %d byte(s)",
            self.conn_id.value,
            dropped,
        )

    def pause_writing(self) -> None:
        if self.flow is not None:
            self.flow.pause_writing()
        self._update_reading()

    def resume_writing(self) -> None:
        if self.flow is not None:
            self.flow.resume_writing()
        transport = self.transport
        if self._unflushed and (transport is None or not transport.get_write_buffer_size()):
            self._flushed()
        self._update_reading()

    def _flushed(self) -> None:
        """Everything written has reached the kernel: run what waited for it."""
        callbacks, self._unflushed = self._unflushed, []
        if callbacks and self.transport is not None:
            self.transport.set_write_buffer_limits()  # back to the defaults
        for callback in callbacks:
            callback()

    def _update_reading(self) -> None:
        """Stop reading requests while replies back up or too many are in flight."""
        if self.transport is None or self.flow is None:
            return
        self.flow.reading(
            not self.flow.write_paused
            and self.inflight < self.server.max_inflight
            and self._room is None
        )

    def _wait_for_room(self) -> None:
        """A store was handled while the lower tiers' writes are at their
        bound: read nothing more until they have room (its writes are queued
        all the same; the writer is slowed, nothing is dropped)."""
        if self._room is not None:
            return
        room = self.server.ops.write_room()
        if room is not None:
            self._room = room
            room.add_done_callback(self._room_back)
            self._update_reading()

    def _room_back(self, _room: object) -> None:
        self._room = None
        if self._held:
            self.server.hold(self)
        self._update_reading()

    # -- requests

    def _dispatch(self, frame: Frame) -> None:
        header = frame.header
        started = time.perf_counter()
        op_name = OP_NAMES.get(header.opcode, "unknown")
        try:
            if header.version not in wire.SUPPORTED_VERSIONS:
                raise UnsupportedVersionError(
                    f"protocol version {header.version} is not supported; "
                    f"this server speaks {list(wire.SUPPORTED_VERSIONS)}"
                )
            if header.flags & FLAG_REPLY or header.status:
                raise wire.CodecError("a request must have the reply flag and status clear")
            if header.flags & ~wire.KNOWN_REQUEST_FLAGS:
                raise wire.CodecError(f"unknown flags 0x{header.flags:04x}")
            if self.server.shutting_down and not self.server.admits_during_shutdown(self):
                raise ShuttingDownError("the daemon is shutting down")
            handler = self.server.ops.handlers.get(header.opcode)
            if handler is None:
                answers = ", ".join(
                    OP_NAMES.get(op, hex(op)).upper() for op in self.server.ops.handlers
                )
                raise UnknownOpcodeError(
                    f"unknown opcode 0x{header.opcode:02x}: this socket answers {answers}"
                )
            gate = self.server.gate
            if gate is not None and not gate.allows(header.opcode):
                raise ForbiddenError(f"{op_name.upper()} is not allowed on the peer port")
            answer = handler(self, frame)
        except Exception as exc:  # converted to an error reply at this edge
            self._reply_error(header.opcode, header.request_id, exc, op_name, started)
            return
        finally:
            if self._staged:
                staged = self._staged.pop(id(frame.data), None)
                if staged is frame.data:
                    self.server.ops.drop_staged(staged)  # no-op when stored
        if header.opcode in STORES:
            self._wait_for_room()
        if isinstance(answer, Reply):
            self._reply(header.opcode, header.request_id, answer)
            self.server.observe(op_name, "ok", time.perf_counter() - started)
            return
        self.inflight += 1
        self._update_reading()
        task = self.server.spawn(
            self._finish(header.opcode, header.request_id, answer, op_name, started)
        )
        task.add_done_callback(partial(_close_if_unstarted, answer.answer))
        if answer.lasting:
            task.set_name(f"{LASTING_TASK}{op_name} #{self.conn_id.value}")
        if answer.cancel_on_close:
            # A waiting lookup only waits for its caller: when the caller goes,
            # so does it (the probes it joined are shared and carry on).
            self._waiting.add(task)
            task.add_done_callback(self._waiting.discard)

    async def _finish(
        self, opcode: int, request_id: int, later: Later, op_name: str, started: float
    ) -> None:
        try:
            try:
                result = await later.answer
                reply = result if later.reply is None else later.reply(result)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._reply_error(opcode, request_id, exc, op_name, started)
                return
            self._reply(opcode, request_id, reply)
            self.server.observe(op_name, "ok", time.perf_counter() - started)
        finally:
            self.inflight -= 1
            self._update_reading()
            self._maybe_finish()

    def _reply(self, opcode: int, request_id: int, reply: Reply) -> None:
        try:
            self._write(
                wire.frame_parts(opcode, request_id, reply.meta, reply.data, flags=FLAG_REPLY)
            )
        finally:
            if reply.on_sent is not None:
                self._after_flush(reply.on_sent)
            if reply.then is not None:
                try:
                    reply.then()
                except Exception:  # answered already: only the log can tell
                    log.exception("after the reply to %s #%d", OP_NAMES.get(opcode), request_id)
            # The caller's next request follows its answer: poll from the end
            # of the work the answer took, not from the request's arrival.
            self.server.idle_poll.touch()

    async def push(self, opcode: int, request_id: int, meta: Buffer) -> None:
        """One more reply to a streaming request (flag MORE), once the
        transport can take it: a slow reader holds its stream, not the daemon."""
        if self.flow is not None:
            await self.flow.drain()
        self._write(
            wire.frame_parts(opcode, request_id, meta, (), flags=FLAG_REPLY | wire.FLAG_MORE)
        )

    def _after_flush(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once the transport has written out what it holds: it
        keeps views of a reply's blocks, which must not change until then."""
        transport = self.transport
        if transport is None or not transport.get_write_buffer_size():
            callback()
            return
        if not self._unflushed:
            # resume_writing now means "all written": the transport pauses at
            # any backlog and resumes when it is empty
            transport.set_write_buffer_limits(high=0, low=0)
        self._unflushed.append(callback)

    def _reply_error(
        self, opcode: int, request_id: int, exc: Exception, op_name: str, started: float
    ) -> None:
        code, message = error_of(exc)
        if code == ErrorCode.INTERNAL:
            log.error("request %s #%d failed", op_name, request_id, exc_info=exc)
        self.server.observe(op_name, ERROR_NAMES.get(code, "error"), time.perf_counter() - started)
        if code in _CLOSES_FRAMING:
            self.server.counters.protocol_errors.inc(ERROR_NAMES[code])
        self._write(
            wire.frame_parts(
                opcode, request_id, wire.encode_error(message), flags=FLAG_REPLY, status=code
            )
        )

    def _write(self, parts: list[Buffer]) -> None:
        if self.transport is None or self.transport.is_closing():
            return  # the client is gone; its reply has nowhere to go
        self.transport.writelines(parts)
        self.server.counters.sent_bytes.value += sum(len(p) for p in parts)

    def _fatal(self, opcode: int, request_id: int, code: ErrorCode, message: str) -> None:
        """Framing is lost: say why, then close only this connection."""
        log.warning("connection #%d: %s", self.conn_id.value, message)
        self.server.counters.protocol_errors.inc(ERROR_NAMES[code])
        self.server.observe(OP_NAMES.get(opcode, "unknown"), ERROR_NAMES[code], 0.0)
        self._write(
            wire.frame_parts(
                opcode, request_id, wire.encode_error(message), flags=FLAG_REPLY, status=code
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


def error_of(exc: BaseException) -> tuple[ErrorCode, str]:
    """The wire error code and message of an exception: the server's one mapping."""
    if isinstance(exc, KvtierError):
        return exc.code, exc.message
    if isinstance(exc, wire.CodecError):
        return ErrorCode.MALFORMED, str(exc)
    return ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}"

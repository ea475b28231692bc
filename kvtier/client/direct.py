"""Loads in the caller's own thread: shared-memory reads with no event loop between.

An engine that loads blocks from a thread of its own (LMCache's storage
manager calls its backends' ``batched_get_blocking`` in the engine's
thread) pays two thread hand-offs a load when the read runs on an event
loop: onto the loop, and back to the caller with the result. On a small
block each costs as much as copying it. A :class:`DirectReader` reads as
:meth:`SharedSession.get_many_into <kvtier.client.shared.SharedSession.get_many_into>`
does, but on a connection of its own, in the calling thread, blocking:
one GET_SHARED written, its reply read, the leased blocks copied in one
call without the GIL (:func:`~kvtier.client.shared.copy_entries`), the
leases given back by one UNLEASE. It only reads; lookups and stores stay
with the async client.

Invariants: one request on the connection at a time (callers from several
threads take turns); a GET_SHARED's reply is the first frame with its
request id, and the UNLEASE replies before it are read and dropped; every
lease taken is given back, by UNLEASE or by the connection's end (a read
that fails or runs out of time closes the connection, so no lease it took
outlives it); a reader closed stays closed, and maps the daemon's memory
once, as every session of the process does (:func:`~kvtier.client.shared.attach`).
Imports the wire, the records and the client's shared-memory half.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

from kvtier import wire
from kvtier._version import __version__
from kvtier.client.options import key_prefix
from kvtier.client.protocol import checked
from kvtier.client.shared import CACHED_READ_BYTES, MappedMemory, attach, copy_entries
from kvtier.defaults import DEFAULT_TIMEOUT, default_socket_path
from kvtier.errors import (
    BadArgumentError,
    ConnectionClosedError,
    DaemonUnavailableError,
    ProtocolError,
    RequestTimeoutError,
    error_from_code,
)
from kvtier.model import Leased
from kvtier.wire import Frame, Op

#: the name a direct reader gives the daemon at HELLO
DIRECT_NAME = f"kvtier-python-direct/{__version__}"
#: the largest reply read before HELLO's says the daemon's frame limit
HELLO_REPLY_BYTES = 64 * 1024


class DirectReader:
    """Blocking reads of blocks into the caller's buffers, through shared memory.

    Open with :meth:`connect`; a daemon that offers no shared memory to this
    process is refused with :class:`~kvtier.errors.DaemonUnavailableError`
    (read through the async client instead)."""

    def __init__(
        self,
        sock: socket.socket,
        path: Path,
        timeout: float,
        prefix: bytes,
        server: wire.HelloReply,
    ) -> None:
        self._sock = sock
        self.path = path
        #: seconds the daemon may take to answer a request
        self.timeout = timeout
        self._prefix = prefix
        self.server = server
        self._mapped: MappedMemory | None = None
        self._arena = memoryview(b"")
        self._ids = itertools.count(1)
        #: one request at a time on the connection
        self._turn = threading.Lock()
        #: replies received and not yet read, parsed as the wire parses them
        self._frames = wire.FrameReader(server.max_frame_bytes)
        self._ready: deque[Frame] = deque()
        self.closed = False
        #: blocks read, and leases taken, over the reader's life
        self.blocks_read = 0
        self.leases_taken = 0

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (
            f"<DirectReader {self.path} {state} blocks_read={self.blocks_read}"
            f" leases_taken={self.leases_taken} {self._mapped!r}>"
        )

    @classmethod
    def connect(
        cls,
        path: str | Path | None = None,
        *,
        namespace: str = "",
        timeout: float = DEFAULT_TIMEOUT,
    ) -> DirectReader:
        """Connect to the daemon at ``path`` (its default socket when None),
        say HELLO asking for shared memory in ``namespace``, and map it."""
        path = Path(path) if path is not None else default_socket_path()
        prefix = key_prefix(namespace)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            try:
                sock.connect(str(path))
            except OSError as exc:
                raise DaemonUnavailableError(
                    f"no kvtier daemon is listening on {path}: {exc}"
                ) from exc
            hello = wire.Hello(1, wire.VERSION, DIRECT_NAME, shared=True, namespace=namespace)
            reader = cls(
                sock, path, timeout, prefix, wire.HelloReply(1, 0, 0, HELLO_REPLY_BYTES, 0, "")
            )
            frame = reader._call(Op.HELLO, wire.encode_hello(hello))
            reader.server = server = wire.decode_hello_reply(frame.meta)
            reader._frames.max_frame = server.max_frame_bytes
            if server.shared is None:
                raise DaemonUnavailableError(f"the daemon at {path} offers no shared memory")
            try:
                reader._mapped = attach(server.shared.path, timeout)
            except OSError as exc:
                raise DaemonUnavailableError(
                    f"shared memory offered but not usable: {exc}"
                ) from exc
            reader._arena = memoryview(reader._mapped.arena)
        except BaseException:
            sock.close()
            raise
        return reader

    def __enter__(self) -> DirectReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection (the daemon ends its leases) and let go of the mapping."""
        with self._turn:
            self._close()

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._sock.close()
        mapped, self._mapped = self._mapped, None
        self._arena.release()
        if mapped is not None:
            mapped.release()

    # -- reads

    def get_many_into(self, keys: Sequence[bytes], views: Sequence[memoryview]) -> list[int | None]:
        """Copy each block into its view: the bytes each filled, or None
        where the daemon has no such block (or it is being written). A block
        longer than its view raises :class:`~kvtier.errors.ValueTooLargeError`
        and nothing is copied. Past the reader's timeout, or with the
        connection lost, raises a :class:`~kvtier.errors.KvtierError` and the
        reader is closed (the caller connects again)."""
        if len(keys) != len(views):
            raise BadArgumentError(f"{len(keys)} keys for {len(views)} destinations")
        return self.read_into(keys, lambda: views)

    def read_into(
        self, keys: Sequence[bytes], buffers: Callable[[], Sequence[memoryview | None]]
    ) -> list[int | None]:
        """:meth:`get_many_into`, with the destinations taken once the
        blocks are asked for: ``buffers()`` runs while the daemon answers,
        and returns a view for each key, or None for a key not to copy
        (read as None). The caller's own work before a load (allocating
        its buffers) then costs no time of the load's. A ``buffers()`` that
        raises, or returns a view too few or too many, closes the reader
        (the daemon ends the leases of an answer nobody copies)."""
        step = self.server.max_batch or len(keys) or 1
        with self._turn:
            if not keys:
                views = buffers()
                if views:
                    raise BadArgumentError(f"0 keys for {len(views)} destinations")
                return []
            asked = self._ask(keys[:step])
            try:
                views = buffers()
                if len(views) != len(keys):
                    raise BadArgumentError(f"{len(keys)} keys for {len(views)} destinations")
            except BaseException:
                self._close()
                raise
            stream = sum(len(v) for v in views if v is not None) > CACHED_READ_BYTES
            out = self._copy(asked, keys[:step], views[:step], stream)
            # (more keys than one request may carry: the rest in turn)
            for lo in range(step, len(keys), step):
                more = self._ask(keys[lo : lo + step])
                out += self._copy(more, keys[lo : lo + step], views[lo : lo + step], stream)
        self.blocks_read += sum(1 for n in out if n is not None)
        return out

    def _ask(self, keys: Sequence[bytes]) -> tuple[int, float]:
        """A GET_SHARED of ``keys`` written: its request id and the time its
        answer is due by."""
        if self.closed:
            raise ConnectionClosedError("the reader is closed")
        deadline = time.monotonic() + self.timeout
        return self._post(Op.GET_SHARED, wire.encode_get_shared((), keys, self._prefix)), deadline

    def _copy(
        self,
        asked: tuple[int, float],
        keys: Sequence[bytes],
        views: Sequence[memoryview | None],
        stream: bool,
    ) -> list[int | None]:
        """The blocks ``asked`` for copied into ``views``; their lease given back."""
        frame = self._reply(*asked)
        entries = wire.decode_get_shared_reply(frame.meta, frame.data)
        leases = {e.lease_id for e in entries if isinstance(e, Leased)}
        self.leases_taken += len(leases)
        try:
            return copy_entries(self._arena, keys, views, entries, stream)
        finally:
            if leases:
                # (the connection lost: its leases ended with it)
                with contextlib.suppress(ConnectionClosedError):
                    self._post(Op.UNLEASE, wire.encode_unlease(sorted(leases)))

    # -- the connection

    def _call(self, op: int, meta: bytes) -> Frame:
        """Write one request and read its reply; an error reply raises its error."""
        if self.closed:
            raise ConnectionClosedError("the reader is closed")
        deadline = time.monotonic() + self.timeout
        return self._reply(self._post(op, meta), deadline)

    def _reply(self, rid: int, deadline: float) -> Frame:
        """Request ``rid``'s reply, by ``deadline`` (the replies of earlier
        posts before it are dropped); an error reply raises its error."""
        try:
            while True:
                frame = self._frame(deadline)
                if frame.header.request_id == rid:
                    break
                if frame.header.request_id == 0 and frame.header.status:
                    # unasked: the daemon refuses the connection and closes it
                    raise error_from_code(frame.header.status, wire.decode_error(frame.meta))
        except BaseException:
            self._close()  # its reply's state unknown: the daemon ends its leases
            raise
        return checked(frame)  # an error reply leaves the connection as it was

    def _post(self, op: int, meta: bytes) -> int:
        """Write one request; its reply is read (and dropped) by a later call."""
        rid = next(self._ids)
        try:
            self._sock.sendall(b"".join(wire.frame_parts(op, rid, meta)))
        except OSError as exc:
            self._close()
            raise ConnectionClosedError(f"connection to the daemon lost: {exc}") from exc
        return rid

    def _frame(self, deadline: float) -> Frame:
        """The next reply frame, received by the one frame reader of the wire."""
        ready = self._ready
        sock = self._sock
        try:
            while not ready:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                sock.settimeout(left)
                n = sock.recv_into(self._frames.get_buffer())
                if not n:
                    raise ConnectionClosedError("the daemon closed the connection")
                ready.extend(self._frames.buffer_updated(n))
        except TimeoutError:
            raise RequestTimeoutError(f"no reply within {self.timeout}s") from None
        except wire.CodecError as exc:
            raise ProtocolError(f"bad reply stream from the daemon: {exc}") from exc
        except OSError as exc:
            raise ConnectionClosedError(f"connection to the daemon lost: {exc}") from exc
        return ready.popleft()


__all__ = ["DirectReader"]

"""The shared-memory handoff: descriptors for same-host clients, over a Unix socket.

A client that was offered shared memory at HELLO connects to this socket
(next to the daemon's own, same permission bits, same SO_PEERCRED check)
and receives, in one message with SCM_RIGHTS, a descriptor of RAM's arena
and a read-write descriptor of the staging region; it maps both and the
connection closes. The arena is read-only, except to a client the
``writable`` check lets write blocks in place (one of the daemon's own
user). A client the policy refuses gets nothing.

A client may answer on the same connection with a region of its own: the
token REGION gave it and, with SCM_RIGHTS, the descriptor of its memory
file (:data:`~kvtier.wire.REGION_HANDOFF`). The daemon attaches it to the
connection REGION came from and answers with a status and the file's size.

Invariants: the arena descriptor handed out cannot be mapped writable,
unless ``writable`` says so of the client's uid;
every accepted connection is closed whatever happened, and every
descriptor received is either owned by a region or closed; one client
cannot hold up another's handoff (each is served apart, for at most
``REGION_WAIT`` seconds); the socket file is removed by :meth:`close`.
Imports the wire, the errors and the server's socket helpers only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path

from kvtier.errors import BadArgumentError, ErrorCode, KvtierError
from kvtier.server.sockets import Peer, PeerPolicy, bind_unix_socket, peer_of
from kvtier.wire import HANDOFF, HANDOFF_TAG, REGION_ATTACHED, REGION_HANDOFF, REGION_TAG

log = logging.getLogger("kvtier.server")

#: how long a client that took the arena may take to send a region (most
#: close at once: only the arena was wanted)
REGION_WAIT = 1.0


class Handoff:
    def __init__(
        self,
        path: Path,
        *,
        arena_fd: int,
        arena_bytes: int,
        arena_rw_fd: int | None = None,
        writable: Callable[[int | None], bool] | None = None,
        staging_fd: int,
        staging_bytes: int,
        peers: PeerPolicy,
        mode: int,
        attach: Callable[[bytes, int, int | None], int] | None = None,
    ) -> None:
        self.path = path
        self._fds = [arena_fd, staging_fd]
        #: the arena opened read-write, and who may have it instead (a client
        #: of this uid writes blocks in place); None: everyone gets read-only
        self._arena_rw_fd = arena_rw_fd
        self._writable = writable
        self._message = HANDOFF.pack(HANDOFF_TAG, arena_bytes, staging_bytes)
        self._peers = peers
        self._mode = mode
        #: attaches a client's region by its token (the shared blocks'), with
        #: the client's uid; the region owns the descriptor once it returns
        self._attach = attach
        self._sock: socket.socket | None = None
        #: descriptors handed out, and connections refused
        self.handed = 0
        self.refused = 0
        #: of the descriptors handed, those with the arena writable
        self.handed_writable = 0
        #: client regions attached, and refused
        self.regions = 0
        self.regions_refused = 0

    def __repr__(self) -> str:
        return (
            f"<Handoff {self.path} handed={self.handed} writable={self.handed_writable} "
            f"refused={self.refused} "
            f"regions={self.regions} regions_refused={self.regions_refused}>"
        )

    def bind(self) -> None:
        self._sock = bind_unix_socket(self.path, self._mode)

    async def serve(self) -> None:
        """Hand out descriptors (and take regions) until cancelled."""
        sock = self._sock
        assert sock is not None, "bind() first"
        loop = asyncio.get_running_loop()
        async with asyncio.TaskGroup() as clients:
            while True:
                conn, _ = await loop.sock_accept(sock)
                clients.create_task(self._serve_one(conn))

    async def _serve_one(self, conn: socket.socket) -> None:
        try:
            peer = peer_of(conn)
            if self._hand(conn, peer) and self._attach is not None:
                attach = self._attach
                uid = peer.uid if peer is not None else None
                await self._take_region(conn, lambda token, fd: attach(token, fd, uid))
        except (OSError, TimeoutError) as exc:
            log.info("shared memory handoff failed: %s", exc)
        finally:
            conn.close()

    def _hand(self, conn: socket.socket, peer: Peer | None) -> bool:
        if not self._peers.allows(peer):
            self.refused += 1
            who = f"uid {peer.uid} pid {peer.pid}" if peer else "unknown peer"
            log.warning("shared memory refused to %s", who)
            return False
        conn.setblocking(True)
        conn.settimeout(1.0)  # one small message to a local client
        fds = self._fds
        rw, writable = self._arena_rw_fd, self._writable
        if rw is not None and writable is not None and writable(peer.uid if peer else None):
            fds = [rw, fds[1]]
            self.handed_writable += 1
        socket.send_fds(conn, [self._message], fds)
        self.handed += 1
        return True

    async def _take_region(self, conn: socket.socket, attach: Callable[[bytes, int], int]) -> None:
        """A region the client may send back: attach it and answer."""
        conn.setblocking(False)
        try:
            async with asyncio.timeout(REGION_WAIT):
                await _readable(conn)
        except TimeoutError:
            return
        msg, fds, _flags, _addr = socket.recv_fds(conn, REGION_HANDOFF.size, 1)
        if not msg and not fds:
            return  # the arena was all it wanted
        status, size, why = ErrorCode.OK, 0, b""
        try:
            if len(msg) != REGION_HANDOFF.size or len(fds) != 1:
                raise BadArgumentError("a region is a tag and a token, with one descriptor")
            tag, token = REGION_HANDOFF.unpack(msg)
            if tag != REGION_TAG:
                raise BadArgumentError("not a kvtier region message")
            size = attach(token, fds[0])
            fds = []  # the region's now
            self.regions += 1
        except (KvtierError, OSError) as exc:
            status = exc.code if isinstance(exc, KvtierError) else ErrorCode.BAD_ARGUMENT
            why = str(exc).encode()[:1024]
            self.regions_refused += 1
            log.info("client region refused: %s", exc)
        finally:
            for fd in fds:
                os.close(fd)
        conn.setblocking(True)
        conn.settimeout(1.0)
        conn.sendall(REGION_ATTACHED.pack(status, size, len(why)) + why)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        for fd in [*self._fds, *([self._arena_rw_fd] if self._arena_rw_fd is not None else [])]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []
        self._arena_rw_fd = None


async def _readable(conn: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(conn.fileno(), wake)
    try:
        await ready
    finally:
        loop.remove_reader(conn.fileno())

"""The shared-memory handoff: descriptors for same-host clients, over a Unix socket.

A client that was offered shared memory at HELLO connects to this socket
(next to the daemon's own, same permission bits, same SO_PEERCRED check)
and receives, in one message with SCM_RIGHTS, a read-only descriptor of
RAM's arena and a read-write descriptor of the staging region; it maps
both and the connection closes. A client the policy refuses gets nothing.

Invariants: the arena descriptor handed out cannot be mapped writable;
every accepted connection is closed whatever happened; the socket file is
removed by :meth:`close`. Imports the server's socket helpers only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from pathlib import Path

from kvtier.server.sockets import PeerPolicy, bind_unix_socket, peer_of
from kvtier.wire import HANDOFF, HANDOFF_TAG

log = logging.getLogger("kvtier.server")


class Handoff:
    def __init__(
        self,
        path: Path,
        *,
        arena_fd: int,
        arena_bytes: int,
        staging_fd: int,
        staging_bytes: int,
        peers: PeerPolicy,
        mode: int,
    ) -> None:
        self.path = path
        self._fds = [arena_fd, staging_fd]
        self._message = HANDOFF.pack(HANDOFF_TAG, arena_bytes, staging_bytes)
        self._peers = peers
        self._mode = mode
        self._sock: socket.socket | None = None
        #: descriptors handed out, and connections refused
        self.handed = 0
        self.refused = 0

    def __repr__(self) -> str:
        return f"<Handoff {self.path} handed={self.handed} refused={self.refused}>"

    def bind(self) -> None:
        self._sock = bind_unix_socket(self.path, self._mode)

    async def serve(self) -> None:
        """Hand out descriptors until cancelled."""
        sock = self._sock
        assert sock is not None, "bind() first"
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(sock)
            try:
                self._hand(conn)
            except OSError as exc:
                log.info("shared memory handoff failed: %s", exc)
            finally:
                conn.close()

    def _hand(self, conn: socket.socket) -> None:
        peer = peer_of(conn)
        if not self._peers.allows(peer):
            self.refused += 1
            who = f"uid {peer.uid} pid {peer.pid}" if peer else "unknown peer"
            log.warning("shared memory refused to %s", who)
            return
        conn.setblocking(True)
        conn.settimeout(1.0)  # one small message to a local client
        socket.send_fds(conn, [self._message], self._fds)
        self.handed += 1

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []

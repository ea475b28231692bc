"""Accept connections, count what they do, shut down gracefully.

The server owns the listening socket, the set of open connections, the op
table and the request counters (read by metrics at scrape time). Shutdown
stops accepting, lets in-flight requests finish within a grace period, then
closes what is left: connections drain by their own events, never by
polling. Imports the wire, the shared records and the errors; never the
core or metrics.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Callable, Coroutine
from typing import Any, Generic, TypeVar

from kvtier._version import __version__
from kvtier.loops import IdlePoll
from kvtier.model import Spawn
from kvtier.server.connection import Connection, OpTable
from kvtier.server.counters import ServerCounters
from kvtier.server.gate import PeerGate, Refusal
from kvtier.server.ops import Feed
from kvtier.server.sockets import PeerPolicy, process_gone

log = logging.getLogger("kvtier.server")

#: checks of stalled frames per ``body_timeout``: a stall is found between
#: one and (1 + 1/BODY_CHECKS) timeouts after the last byte arrived
BODY_CHECKS = 4


def _not_started(coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
    coro.close()
    raise RuntimeError("the server has not been started")


#: the op table a server's connections call
OpsT = TypeVar("OpsT", bound=OpTable)


class Server(Generic[OpsT]):
    """Accepts connections and routes frames to the op table."""

    def __init__(
        self,
        ops: Callable[[Server[OpsT]], OpsT],
        *,
        max_frame: int,
        max_inflight: int,
        peers: PeerPolicy | None = None,
        gate: PeerGate | None = None,
        server_name: str = f"kvtier/{__version__}",
        handshake_timeout: float | None = None,
        max_unauthenticated: int | None = None,
        body_timeout: float | None = None,
        idle_poll: IdlePoll | None = None,
    ) -> None:
        """``ops``: makes the op table this server's connections call (given
        the server: its stats and feed). ``handshake_timeout``: seconds a
        new connection has to be admitted by the gate (or, without one, to
        send its first frame) before it is closed; None: no deadline.
        ``max_unauthenticated``: connections waiting for that at most; past
        it, the oldest is closed.
        ``body_timeout``: seconds a connection may stall inside a frame
        before it is closed (:meth:`_check_bodies`); None: no limit.
        ``idle_poll``: the loop's poller, touched as requests arrive (one per
        loop, shared by its servers); None: the loop sleeps between them."""
        #: runs a request that needs awaiting; the task group's, from :meth:`start`
        self.spawn: Spawn = _not_started
        self.max_frame = max_frame
        #: requests one connection may have running at once before reading pauses
        self.max_inflight = max_inflight
        self.server_name = server_name
        #: who may connect (checked at accept)
        self.peers = peers if peers is not None else PeerPolicy(None)
        #: the peer listener's token check and op list; None on the local socket
        self.gate = gate
        self.counters = ServerCounters()
        #: keeps the loop polling a while after each request arrives
        self.idle_poll = idle_poll if idle_poll is not None else IdlePoll(0)
        #: the lookup process's feed (replies that confirm a store filed after
        #: them announce it); None without a lookup process
        self.feed: Feed | None = None
        self.handshake_timeout = handshake_timeout
        self.max_unauthenticated = max_unauthenticated
        self.body_timeout = body_timeout
        self._body_timer: asyncio.TimerHandle | None = None
        #: connections not admitted yet, oldest first, and their deadline timers
        self._unauthenticated: dict[Connection, asyncio.TimerHandle | None] = {}
        self.ops = ops(self)
        self.connections: set[Connection] = set()
        self.shutting_down = False
        #: connections that had a partial frame when shutdown began: that frame is served
        self._busy_at_shutdown: set[Connection] = set()
        self._next_id = 0
        self._aserver: asyncio.AbstractServer | None = None
        #: connections with frames held until the end of this loop step, in
        #: the order they were held; one callback a step hands them back
        self._holding: dict[Connection, None] = {}
        # bound once: every request records one
        self._observed: dict[tuple[str, str], Any] = {}

    def __repr__(self) -> str:
        gate = f" {self.gate!r}" if self.gate is not None else ""
        return (
            f"<Server connections={len(self.connections)} holding={len(self._holding)} "
            f"shutting_down={self.shutting_down}{gate} {self.idle_poll!r}>"
        )

    def hold(self, conn: Connection) -> None:
        """``conn`` holds frames until the end of this loop step (its stores
        wait for the reads that came with them): handed back, connection by
        connection in the order they were held, by one callback scheduled now.
        Frames held while that callback runs wait for the next step."""
        if not self._holding:
            asyncio.get_running_loop().call_soon(self._release_held)
        self._holding[conn] = None

    def _release_held(self) -> None:
        holding, self._holding = self._holding, {}
        for conn in holding:
            try:
                conn.release_held()
            except Exception:
                # One connection's fault never leaves the others' frames held
                # (unanswered, and their connections never closing at EOF).
                log.exception("connection #%d: handling its held frames failed", conn.conn_id.value)
                conn.abort()

    def stats(self) -> dict[str, Any]:
        return {
            "connections": len(self.connections),
            "requests_waiting": sum(c.inflight for c in self.connections),
            # bodies being received into buffers of their own, outside RAM's
            # capacity (one frame per connection at most: max_frame_bytes)
            "receiving_bytes": sum(c.reader.own_bytes for c in self.connections),
            "version": self.server_name,
            "lookup_process": self._lookup_process_stats(),
        }

    def _lookup_process_stats(self) -> dict[str, Any]:
        if self.feed is None:
            return {"state": "off"}
        return {**self.feed.stats(), "restarts": int(self.counters.lookup_restarts.value)}

    def observe(self, op: str, outcome: str, seconds: float) -> None:
        cells = self._observed.get((op, outcome))
        if cells is None:
            cells = self._observed[(op, outcome)] = (
                self.counters.requests.bind(op, outcome),
                self.counters.request_seconds.bind(op),
            )
        cells[0].value += 1
        cells[1].observe(seconds)

    # -- lifecycle

    async def start(self, sock: socket.socket, spawn: Spawn) -> None:
        """Serve on ``sock`` (a bound Unix socket); ``spawn`` runs awaited requests."""
        self.spawn = spawn
        loop = asyncio.get_running_loop()
        self._aserver = await loop.create_unix_server(self._new_connection, sock=sock)
        self._watch_bodies()

    async def start_tcp(
        self, host: str, port: int, tls: ssl.SSLContext | None, spawn: Spawn
    ) -> int:
        """Listen on TCP (the peer port); returns the port bound (``port`` 0 picks one)."""
        self.spawn = spawn
        loop = asyncio.get_running_loop()
        self._aserver = await loop.create_server(
            self._new_connection, host, port, ssl=tls, reuse_address=True
        )
        self._watch_bodies()
        bound: int = self._aserver.sockets[0].getsockname()[1]
        return bound

    def _watch_bodies(self) -> None:
        """Check every ``body_timeout / BODY_CHECKS`` seconds for connections
        stalled inside a frame (until shutdown)."""
        if self.body_timeout is not None and not self.shutting_down:
            self._body_timer = asyncio.get_running_loop().call_later(
                self.body_timeout / BODY_CHECKS, self._check_bodies
            )

    def _check_bodies(self) -> None:
        """Close each connection that has received nothing of the frame it is
        inside for ``BODY_CHECKS`` checks in a row: its frame stalled for
        ``body_timeout`` seconds at least (and less than one check more)."""
        for conn in [c for c in self.connections if c.stalled(BODY_CHECKS)]:
            conn.body_timed_out(self.body_timeout or 0.0)
        self._watch_bodies()

    def _new_connection(self) -> Connection:
        self._next_id += 1
        return Connection(self, self._next_id)

    def connection_opened(self, conn: Connection) -> None:
        self.connections.add(conn)
        self.counters.connections.value += 1
        if self.handshake_timeout is None and self.max_unauthenticated is None:
            return
        timer = None
        if self.handshake_timeout is not None:
            timer = asyncio.get_running_loop().call_later(
                self.handshake_timeout, conn.handshake_failed, Refusal.HANDSHAKE_TIMEOUT
            )
        self._unauthenticated[conn] = timer
        if self.max_unauthenticated is not None:
            while len(self._unauthenticated) > self.max_unauthenticated:
                oldest = next(iter(self._unauthenticated))
                self.authenticated(oldest)
                oldest.handshake_failed(Refusal.UNAUTHENTICATED_LIMIT)

    def authenticated(self, conn: Connection) -> None:
        """``conn`` is past its handshake (or gone): its deadline no longer applies."""
        timer = self._unauthenticated.pop(conn, None)
        if timer is not None:
            timer.cancel()

    @property
    def unauthenticated_count(self) -> int:
        return len(self._unauthenticated)

    def connection_ended(self, conn: Connection) -> None:
        """The client sent EOF: whatever it owned and can no longer complete ends now."""
        self.ops.connection_closed(conn.conn_id)

    def connection_closed(self, conn: Connection) -> None:
        self.authenticated(conn)
        self.connections.discard(conn)
        self._busy_at_shutdown.discard(conn)
        self.ops.connection_closed(conn.conn_id, writer_gone=process_gone(conn.peer))

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
        if self._body_timer is not None:
            self._body_timer.cancel()
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

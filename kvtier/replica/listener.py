"""The lookup process's listener: the replica's feed read in, the lookup
socket served, and the reports sent back to the daemon.

The process (docs/lookup-process.md) answers LOOKUP on a Unix socket of
its own, next to the daemon's, from a replica of what the daemon holds
(:mod:`kvtier.replica.replica`). The socket is served by the daemon's own
connection code (:class:`~kvtier.server.server.Server`), with an op table of
three operations (:class:`LookupOps`): HELLO, PING and LOOKUP.

Invariants: the process answers a lookup only after reading every record
published before it; a lookup the replica cannot answer exactly is
answered with the status REFERRED and nothing else; a bad frame gets an
error reply and closes only its own connection; the process stops when
the daemon closes its end or goes; the first lookup of a request tag that
carries a PENDING bound (and the first after half the tag's lifetime) is
reported before its answer, so a RELEASE the client sends next finds the
state. Imports the wire, the server and the shared records.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path

from kvtier import wire
from kvtier.errors import ReferredError
from kvtier.loops import IdlePoll
from kvtier.model import Buffer, ConnId, FeedRecords, Lookup, LookupReply, ReportKind
from kvtier.server.connection import Connection, Handler, Reply
from kvtier.server.ops import NamespaceAccess
from kvtier.server.server import Server
from kvtier.server.sockets import PeerPolicy, bind_unix_socket
from kvtier.tasks import TaskSet
from kvtier.wire.codecs import DEFAULT_SCOPE, NO_KEYS, KeyScope
from kvtier.wire.framing import Frame, Op
from kvtier.wire.replica import FeedRing, encode_report

log = logging.getLogger("kvtier.lookups")

#: seconds between two reads of the feed while no lookup comes: the process
#: reads it before each lookup, and does not wake for every change
FEED_POLL = 0.05
#: seconds the process gathers reports before it sends them: the daemon
#: applies a lookup's touches and counts that much later, wakes once for
#: many lookups, and touches the keys of a lookup asked again meanwhile once
REPORT_DELAY = 0.002
#: request tags the process remembers telling the daemon of (the oldest forgotten first)
MAX_TOLD_TAGS = 65536
#: lookups one connection may have unanswered: every one is answered at once
MAX_INFLIGHT = 1
#: seconds the lookup socket's connections get to finish once the feed ends
SHUTDOWN_GRACE = 1.0


class LookupListener:
    """The process's side: the replica's feed in, the lookup socket served."""

    def __init__(
        self,
        sock: socket.socket,
        ring: FeedRing,
        *,
        apply: Callable[[FeedRecords], None],
        answer: Callable[[Lookup], LookupReply | None],
        hello: Callable[[wire.Hello], wire.HelloReply],
        peers: PeerPolicy,
        access: NamespaceAccess,
        max_frame: int,
        max_batch: int,
        idle_poll: IdlePoll | None = None,
        tag_ttl: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._ring = ring
        #: request tags whose state the daemon has been told of, and when:
        #: a lookup of a tag not told within half ``tag_ttl`` (the daemon
        #: keeps an idle tag's state that long) is reported before its
        #: answer, so a RELEASE the client sends next finds the state
        self._told: OrderedDict[tuple[bytes, bytes], float] = OrderedDict()
        self._tell_every = tag_ttl / 2
        self._clock = clock
        #: keeps the loop polling a while after each request arrives
        self.idle_poll = idle_poll if idle_poll is not None else IdlePoll(0)
        self._apply = apply
        self._answer = answer
        self.hello = hello
        self.peers = peers
        #: who may use which namespace
        self.access = access
        self.max_frame = max_frame
        self.max_batch = max_batch
        #: reports not yet sent: gathered for a while, or the daemon is slow to read
        self._unsent = bytearray()
        #: lookups answered since the last send: (namespace prefix, meta,
        #: states) -> times asked
        self._answered: dict[tuple[bytes, bytes, bytes], int] = {}
        self._report_timer: asyncio.TimerHandle | None = None
        #: the next read of the feed between lookups
        self._poll_timer: asyncio.TimerHandle | None = None
        #: the daemon holds changes the ring had no room for: refer every lookup
        self.behind = False
        #: set when the feed ends: the daemon closed its end, or is gone
        self.ended = asyncio.Event()
        self.answered = 0
        self.referred = 0

    def __repr__(self) -> str:
        state = "ended" if self.ended.is_set() else "fed"
        return (
            f"<LookupListener {state} answered={self.answered} referred={self.referred} "
            f"unsent={len(self._unsent)}>"
        )

    async def serve(self, path: Path, mode: int) -> None:
        """Serve ``path`` until the feed ends."""
        loop = asyncio.get_running_loop()
        # The daemon never writes to the socket pair: it reads at its end only.
        loop.add_reader(self._sock.fileno(), self._daemon_gone)
        self._poll_timer = loop.call_later(FEED_POLL, self._poll)
        server = Server(
            lambda _server: LookupOps(self),
            max_frame=self.max_frame,
            max_inflight=MAX_INFLIGHT,
            peers=self.peers,
            idle_poll=self.idle_poll,
        )
        tasks = TaskSet()  # (no handler of the lookup socket awaits)
        await server.start(bind_unix_socket(path, mode), tasks.spawn)
        try:
            self.report(ReportKind.READY)
            await self.ended.wait()
        finally:
            if self._poll_timer is not None:
                self._poll_timer.cancel()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            with contextlib.suppress(ValueError, OSError):
                loop.remove_reader(self._sock.fileno())
            await server.shutdown(SHUTDOWN_GRACE)

    def _daemon_gone(self) -> None:
        try:
            chunk = self._sock.recv(1)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self.ended.set()

    def _poll(self) -> None:
        self.catch_up()
        if not self.ended.is_set():
            self._poll_timer = asyncio.get_running_loop().call_later(FEED_POLL, self._poll)

    def catch_up(self) -> None:
        """Apply every record the daemon has published."""
        if not self.ended.is_set():
            self.behind = self._ring.behind()  # (first: it covers what is read next)
            self._apply(self._ring.read())

    def lookup(self, meta: Buffer, scope: KeyScope = DEFAULT_SCOPE) -> LookupReply | None:
        """The answer to the LOOKUP of ``meta`` from a connection whose keys
        are ``scope``'s (its namespace's), or None: ask the daemon."""
        req = wire.decode_lookup(meta, self.max_batch, scope)
        self.catch_up()
        if self.ended.is_set():
            return None
        reply = None if self.behind else self._answer(req)
        if reply is None:
            self.referred += 1
            self.report(ReportKind.REFERRED)
        else:
            self.answered += 1
            # The same lookup answered alike again is one report, asked twice.
            asked = (scope.prefix, bytes(meta), reply.raw_states)
            self._answered[asked] = self._answered.get(asked, 0) + 1
            if (
                req.request_tag
                and req.max_pending_wait > 0
                and self._first_in_a_while(scope.prefix, req.request_tag)
            ):
                self._send_reports()  # before the answer: the tag has state from now on
            else:
                self._report_soon()
        return reply

    def _first_in_a_while(self, prefix: bytes, tag: bytes) -> bool:
        """Whether ``tag`` (of ``prefix``'s namespace) was not told to the
        daemon within the last ``tag_ttl / 2`` seconds; it is told now."""
        told, now = self._told, self._clock()
        at = told.get((prefix, tag))
        if at is not None and now - at < self._tell_every:
            return False
        told[(prefix, tag)] = now
        told.move_to_end((prefix, tag))
        while len(told) > MAX_TOLD_TAGS:
            told.popitem(last=False)
        return True

    def report(self, kind: ReportKind) -> None:
        """Tell the daemon, within :data:`REPORT_DELAY` (READY at once)."""
        self._unsent += encode_report(kind)
        if kind is ReportKind.READY:
            self._send_reports()
        else:
            self._report_soon()

    def _report_soon(self) -> None:
        if self._report_timer is None:
            loop = asyncio.get_running_loop()
            self._report_timer = loop.call_later(REPORT_DELAY, self._send_reports)

    def _send_reports(self) -> None:
        if self._report_timer is not None:
            self._report_timer.cancel()
        self._report_timer = None
        for (prefix, meta, states), count in self._answered.items():
            self._unsent += encode_report(ReportKind.ANSWERED, meta, states, count, prefix)
        self._answered.clear()
        loop = asyncio.get_running_loop()
        try:
            n = self._sock.send(self._unsent)
        except BlockingIOError:
            n = 0
        except OSError:
            self.ended.set()
            return
        del self._unsent[:n]
        fd = self._sock.fileno()
        if self._unsent:
            loop.add_writer(fd, self._send_reports)
        else:
            loop.remove_writer(fd)


class LookupOps:
    """The lookup socket's op table: HELLO, PING and LOOKUP, each answered at once."""

    def __init__(self, listener: LookupListener) -> None:
        self._listener = listener
        #: who may use which namespace
        self.access = listener.access
        self.handlers: Mapping[int, Handler] = {
            Op.HELLO: self.hello,
            Op.PING: self.ping,
            Op.LOOKUP: self.lookup,
        }

    def __repr__(self) -> str:
        return f"<LookupOps {self._listener!r}>"

    def hello(self, conn: Connection, frame: Frame) -> Reply:
        hello = wire.decode_hello(frame.meta)
        agreed = self._listener.hello(hello)
        conn.namespace, conn.scope = self.access.scope_for(hello.namespace, conn.peer)
        return Reply(wire.encode_hello_reply(agreed))

    def ping(self, conn: Connection, frame: Frame) -> Reply:
        return Reply(bytes(frame.meta))

    def lookup(self, conn: Connection, frame: Frame) -> Reply:
        if frame.header.flags & wire.FLAG_RETAIN:  # (a lease is the daemon's to keep)
            raise ReferredError("a lookup with a retention lease: ask the daemon")
        scope = conn.scope if conn.scope is not None else NO_KEYS
        reply = self._listener.lookup(frame.meta, scope)
        if reply is None:
            raise ReferredError("ask the daemon")
        return Reply(wire.encode_lookup_reply(reply))

    def receive_into(
        self, conn: Connection, header: wire.Header, meta: Buffer | None
    ) -> memoryview | None:
        return None  # no request here has a body

    def drop_staged(self, view: Buffer) -> None:
        pass

    def write_room(self) -> asyncio.Future[None] | None:
        return None

    def connection_closed(self, owner: ConnId, writer_gone: bool = False) -> None:
        pass  # a lookup holds nothing

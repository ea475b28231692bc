"""The lookup process's plumbing: the daemon's end of the feed, and the process's listener.

A lookup process (docs/lookup-process.md) answers LOOKUP on a Unix socket
of its own, next to the daemon's, from a replica of what the daemon holds.
The daemon writes the replica's feed into a ring in shared memory
(:class:`~kvtier.wire.replica.FeedRing`); the process sends its reports
back on a socket pair:

* :class:`FeedWriter`, in the daemon, writes the feed's records and reads
  the process's reports.
* :class:`LookupListener`, in the process, reads the feed into the replica
  and serves the lookup socket: HELLO, PING and LOOKUP, nothing else.

Read-your-writes: the daemon writes each change to the ring as it happens,
before any reply that confirms it (a block a reply says is stored and
that is filed right after the reply, :class:`~kvtier.model.Copied`, is
written before the reply: :meth:`FeedWriter.announce`), and the process
reads the whole ring before it answers a lookup. So a client that was
told its block is stored, or deleted, finds it so at the lookup socket,
and no reply costs a system call more. A ring the process does not empty
in time (it stopped reading) ends the feed: the process stops, and its
clients ask the daemon.

Invariants: the process answers a lookup only after reading every record
published before it; a lookup the replica cannot answer exactly is
answered with the status REFERRED and nothing else; a bad frame gets an
error reply and closes only its own connection; the process stops when
the daemon closes its end or goes. Imports the wire, the errors and the
server's socket helpers only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import cast

from kvtier import wire
from kvtier.errors import ErrorCode, KvtierError
from kvtier.loops import IdlePoll
from kvtier.model import Buffer, FeedOp, FeedRecords, Lookup, LookupReply, ReportKind
from kvtier.server.ops import NamespaceAccess
from kvtier.server.sockets import Peer, PeerPolicy, bind_unix_socket, peer_of
from kvtier.wire.codecs import DEFAULT_SCOPE, NO_KEYS, KeyScope
from kvtier.wire.framing import FLAG_REPLY, Frame, Op
from kvtier.wire.replica import FeedRing, Report, decode_reports, encode_report

log = logging.getLogger("kvtier.lookups")

#: bytes read from the other end at a time
_RECV = 1 << 18
#: seconds between two reads of the feed while no lookup comes: the process
#: reads it before each lookup, and does not wake for every change
FEED_POLL = 0.05
#: the feed ring's bytes (a power of two): about 100,000 changes between two reads
FEED_RING_BYTES = 4 << 20
#: changes the daemon keeps while the ring is full, at most: past it, the feed ends
FEED_BACKLOG = 1 << 18
#: seconds between two tries to write what the ring had no room for
FEED_RETRY = 0.01
#: seconds a listening process may go without reading its feed (it reads
#: every FEED_POLL at least) before the daemon ends it as stuck
FEED_STALL = 10.0
#: seconds the process gathers reports before it sends them: the daemon
#: applies a lookup's touches and counts that much later, wakes once for
#: many lookups, and touches the keys of a lookup asked again meanwhile once
REPORT_DELAY = 0.002
#: request tags the process remembers telling the daemon of (the oldest forgotten first)
MAX_TOLD_TAGS = 65536


@dataclass(slots=True, frozen=True)
class Settings:
    """What the daemon tells its lookup process."""

    #: the socket pair's end for reports, and the feed ring's memory file:
    #: descriptors the process inherits
    report_fd: int
    ring_fd: int
    #: the lookup socket's path and permission bits
    path: str
    mode: int
    #: who may connect (None: whoever can open the socket)
    uids: list[int] | None
    gids: list[int]
    #: who may use which namespace (:meth:`NamespaceAccess.to_json`)
    access: dict[str, object]
    max_key_bytes: int
    max_batch: int
    max_block_bytes: int
    max_frame_bytes: int
    server_name: str
    #: the daemon has remote tiers
    remotes: bool
    #: seconds the process's loop polls after each request (``server.idle_poll``)
    idle_poll: float = 0.0
    #: seconds of the scheduler slice the process asks for (``server.lookup_slice``)
    slice: float = 0.0
    #: seconds the daemon keeps an idle request tag's state (``lookup.request_state_ttl``)
    request_state_ttl: float = 60.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Settings:
        return cls(**json.loads(text))


OnReport = Callable[[Report], None]


class FeedWriter:
    """The daemon's end: the feed ring written, the reports read."""

    def __init__(
        self,
        sock: socket.socket,
        ring: FeedRing,
        holds: Callable[[bytes], bool],
        on_report: OnReport,
    ) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._ring = ring
        #: whether a local tier holds a key now
        self._holds = holds
        self._on_report = on_report
        #: report bytes received and not yet whole
        self._reports = bytearray()
        #: records written, in all
        self.written = 0
        #: records the ring had no room for, in order, and how many
        self._backlog: deque[FeedRecords] = deque()
        self.backlogged = 0
        #: records the backlog may hold before the feed ends: FEED_BACKLOG,
        #: plus the first write (the snapshot of all a daemon holds, which
        #: can be far larger than the ring: a disk index of millions of blocks)
        self._most: int | None = None
        self._retry: asyncio.TimerHandle | None = None
        #: the feed has ended (the ring full, or the process went)
        self.ended = False
        #: it ended because the process stopped reading it (FEED_STALL)
        self.stalled = False
        #: set once the feed has ended
        self.done = asyncio.Event()
        #: lookups the process answered, and referred to the daemon
        self.answered = 0
        self.referred = 0
        #: set once the process listens
        self.listening = asyncio.Event()
        #: set once it listens or the feed has ended: its start is decided
        self.decided = asyncio.Event()
        #: the ring's read count at the last check that the process reads
        self._reads = ring.reads()
        loop = asyncio.get_running_loop()
        loop.add_reader(sock.fileno(), self.read_reports)
        self._watch = loop.call_later(FEED_STALL, self._check_reading)

    def __repr__(self) -> str:
        return (
            f"<FeedWriter {self.state} written={self.written} answered={self.answered} "
            f"referred={self.referred} {self._ring!r}>"
        )

    @property
    def state(self) -> str:
        if self.ended:
            return "stalled" if self.stalled else "ended"
        return "listening" if self.listening.is_set() else "starting"

    @property
    def reads(self) -> int:
        """How many times the process has read its feed (modulo 2**32)."""
        return self._ring.reads()

    def stats(self) -> dict[str, object]:
        return {
            "state": self.state,
            "answered": self.answered,
            "referred": self.referred,
            "feed_records": self.written,
            "feed_backlog": self.backlogged,
            "feed_reads": self.reads,
        }

    def write(self, records: FeedRecords) -> None:
        """Publish ``records`` to the process now, or (the ring full) as soon
        as it has room, the process referring every lookup meanwhile."""
        if self.ended:
            return
        if self._most is None:
            self._most = FEED_BACKLOG + len(records)
        if not self._backlog and len(records) < 64 and self._ring.write(records):
            self.written += len(records)  # (the common case: a change or a few)
            return
        for chunk in _chunks(records, self._ring.size // 4):
            if not self._backlog and self._ring.write(chunk):
                self.written += len(chunk)
                continue
            if not self._backlog:
                # Before any reply that confirms what the ring lacks.
                self._ring.set_behind(True)
                self._retry = asyncio.get_running_loop().call_later(FEED_RETRY, self._catch_up)
            self._backlog.append(chunk)
            self.backlogged += len(chunk)
            if self.backlogged > self._most:
                self.end("the lookup process fell too far behind its feed")
                return

    def _catch_up(self) -> None:
        """Write what the ring had no room for, as it has room now."""
        self._retry = None
        backlog = self._backlog
        while backlog and self._ring.write(backlog[0]):
            chunk = backlog.popleft()
            self.backlogged -= len(chunk)
            self.written += len(chunk)
        if backlog:
            self._retry = asyncio.get_running_loop().call_later(FEED_RETRY, self._catch_up)
        else:
            self._ring.set_behind(False)

    def _check_reading(self) -> None:
        """End the feed of a listening process that has not read it for
        FEED_STALL seconds: alive but stuck (stopped, or looping), it holds
        up every lookup its clients send it until they give up on it, and
        the daemon starts another once this one is gone."""
        reads = self.reads
        if self.listening.is_set() and reads == self._reads:
            self.stalled = True
            self.end(f"the lookup process has not read its feed for {FEED_STALL:g}s")
            return
        self._reads = reads
        self._watch = asyncio.get_running_loop().call_later(FEED_STALL, self._check_reading)

    def announce(self, keys: Sequence[bytes]) -> None:
        """A reply is about to say ``keys`` are stored, and the store runs
        right after it, in the same loop step (:class:`~kvtier.model.Copied`):
        the process hears of them before the reply goes."""
        self.write([(FeedOp.HELD, k) for k in keys])

    def settle(self, keys: Sequence[bytes]) -> None:
        """After such a store: any of ``keys`` it did not store is gone."""
        if not self.ended:
            self.write([(FeedOp.GONE, k) for k in keys if not self._holds(k)])

    def read_reports(self) -> None:
        """Apply every report the process has sent so far (called when the
        socket is readable, and by RELEASE, which must hear of every lookup
        of its tag answered before it)."""
        while not self.ended:
            try:
                chunk = self._sock.recv(_RECV)
            except BlockingIOError:
                return
            except OSError as exc:
                self.end(f"the lookup process's reports failed: {exc}")
                return
            if not chunk:
                self.end("the lookup process closed its end")
                return
            self._apply_reports(chunk)
            if len(chunk) < _RECV:
                return

    def _apply_reports(self, chunk: bytes) -> None:
        self._reports += chunk
        try:
            reports = decode_reports(self._reports)
        except KvtierError as exc:  # (malformed, or keys outside the scope it names)
            self.end(f"bad report from the lookup process: {exc}")
            return
        for report in reports:
            if report.kind is ReportKind.ANSWERED:
                self.answered += report.times
            elif report.kind is ReportKind.REFERRED:
                self.referred += 1
            else:
                self.listening.set()
                self.decided.set()
            self._on_report(report)

    def end(self, why: str = "") -> None:
        if self.ended:
            return
        self.ended = True
        if why:
            log.warning("lookup process: %s; lookups go to the daemon", why)
        if self._retry is not None:
            self._retry.cancel()
        self._watch.cancel()
        self._backlog.clear()
        with contextlib.suppress(ValueError, OSError):
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
        self._sock.close()  # the process sees its end close, and stops
        self.done.set()
        self.decided.set()


def _chunks(records: FeedRecords, most: int) -> Iterator[FeedRecords]:
    """``records`` in parts of about ``most`` bytes of the ring at most (a
    snapshot is written in parts, each of which fits once the reader reads)."""
    start, size = 0, 0
    for i, (_, key) in enumerate(records):
        size += 3 + len(key)
        if size > most and i > start:
            yield records[start:i]
            start, size = i, 3 + len(key)
    if start < len(records):
        yield records[start:]


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
        server = await loop.create_unix_server(
            lambda: LookupConnection(self), sock=bind_unix_socket(path, mode)
        )
        try:
            self.report(ReportKind.READY)
            await self.ended.wait()
        finally:
            if self._poll_timer is not None:
                self._poll_timer.cancel()
            server.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            with contextlib.suppress(ValueError, OSError):
                loop.remove_reader(self._sock.fileno())

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


class LookupConnection(asyncio.BufferedProtocol):
    """One client of the lookup socket."""

    def __init__(self, listener: LookupListener) -> None:
        self.listener = listener
        self.reader = wire.FrameReader(listener.max_frame)
        self.transport: asyncio.Transport | None = None
        self.peer: Peer | None = None
        #: the keys this connection may name: its namespace's (HELLO names it)
        self.scope = NO_KEYS

    def __repr__(self) -> str:
        return (
            f"<LookupConnection open={self.transport is not None} {self.scope!r} {self.reader!r}>"
        )

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.peer = peer_of(transport.get_extra_info("socket"))
        if self.listener.peers.allows(self.peer):
            self.scope = self.listener.access.first_scope(self.peer)
            return
        message = "this user may not use this daemon (server.allowed_uids / allowed_gids)"
        self._reply(0, 0, wire.encode_error(message), ErrorCode.FORBIDDEN)
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.reader.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.listener.idle_poll.touch()  # the next lookup is likely close behind
        try:
            frames = self.reader.buffer_updated(nbytes)
        except wire.CodecError as exc:
            self._reply(0, 0, wire.encode_error(f"{exc}; closing"), ErrorCode.MALFORMED)
            if self.transport is not None:
                self.transport.close()
            return
        for frame in frames:
            self._handle(frame)

    def _handle(self, frame: Frame) -> None:
        op, rid = frame.header.opcode, frame.header.request_id
        try:
            if op == Op.LOOKUP:
                reply = self.listener.lookup(frame.meta, self.scope)
                if reply is None:
                    self._reply(op, rid, b"", ErrorCode.REFERRED)
                else:
                    self._reply(op, rid, wire.encode_lookup_reply(reply))
            elif op == Op.HELLO:
                hello = wire.decode_hello(frame.meta)
                agreed = self.listener.hello(hello)
                _, self.scope = self.listener.access.scope_for(hello.namespace, self.peer)
                self._reply(op, rid, wire.encode_hello_reply(agreed))
            elif op == Op.PING:
                self._reply(op, rid, bytes(frame.meta))
            else:
                message = f"opcode 0x{op:02x}: the lookup socket answers LOOKUP only"
                self._reply(op, rid, wire.encode_error(message), ErrorCode.UNKNOWN_OPCODE)
        except wire.CodecError as exc:
            self._reply(op, rid, wire.encode_error(str(exc)), ErrorCode.MALFORMED)
        except KvtierError as exc:
            self._reply(op, rid, wire.encode_error(exc.message), exc.code)

    def _reply(self, op: int, rid: int, meta: bytes, status: int = 0) -> None:
        if self.transport is not None:
            self.transport.writelines(
                wire.frame_parts(op, rid, meta, flags=FLAG_REPLY, status=status)
            )

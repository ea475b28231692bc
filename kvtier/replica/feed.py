"""The daemon's end of the lookup process's feed: what it holds, written
into a ring in shared memory (:class:`~kvtier.wire.replica.FeedRing`), and
the process's reports read back from a socket pair.

Read-your-writes: the daemon writes each change to the ring as it happens,
before any reply that confirms it (a block a reply says is stored and
that is filed right after the reply, :class:`~kvtier.model.Copied`, is
written before the reply: :meth:`FeedWriter.announce`), and the process
reads the whole ring before it answers a lookup. So a client that was
told its block is stored, or deleted, finds it so at the lookup socket,
and no reply costs a system call more. A ring the process does not empty
in time (it stopped reading) ends the feed: the process stops, and its
clients ask the daemon.

Invariants: records reach the ring in the order they were written (a
backlog the ring had no room for goes first, and past ``bounds.backlog``
records the feed ends rather than grow); a bad report ends the feed;
``done`` is set once the feed has ended, however it ended. Imports the
wire and the shared records only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvtier.errors import KvtierError
from kvtier.model import FeedOp, FeedRecords, ReportKind
from kvtier.wire.replica import FeedRing, Report, decode_reports

log = logging.getLogger("kvtier.lookups")

#: bytes read from the other end at a time
_RECV = 1 << 18


@dataclass(frozen=True, slots=True)
class FeedBounds:
    """The feed's sizes and seconds (tests make them small)."""

    #: the ring's bytes (a power of two): about 100,000 changes between two reads
    ring_bytes: int = 4 << 20
    #: changes the daemon keeps while the ring is full, at most: past it, the feed ends
    backlog: int = 1 << 18
    #: seconds between two tries to write what the ring had no room for
    retry: float = 0.01
    #: seconds a listening process may go without reading its feed (it
    #: reads it every 50 ms at least) before the daemon ends it as stuck
    stall: float = 10.0


#: the feed's bounds unless told otherwise
FEED = FeedBounds()


OnReport = Callable[[Report], None]


class FeedWriter:
    """The daemon's end: the feed ring written, the reports read."""

    def __init__(
        self,
        sock: socket.socket,
        ring: FeedRing,
        holds: Callable[[bytes], bool],
        on_report: OnReport,
        bounds: FeedBounds = FEED,
    ) -> None:
        sock.setblocking(False)
        self.bounds = bounds
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
        #: records the backlog may hold before the feed ends: ``bounds.backlog``,
        #: plus the first write (the snapshot of all a daemon holds, which
        #: can be far larger than the ring: a disk index of millions of blocks)
        self._most: int | None = None
        self._retry: asyncio.TimerHandle | None = None
        #: the feed has ended (the ring full, or the process went)
        self.ended = False
        #: it ended because the process stopped reading it (``bounds.stall``)
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
        self._watch = loop.call_later(bounds.stall, self._check_reading)

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
            self._most = self.bounds.backlog + len(records)
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
                self._retry = asyncio.get_running_loop().call_later(
                    self.bounds.retry, self._catch_up
                )
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
            self._retry = asyncio.get_running_loop().call_later(self.bounds.retry, self._catch_up)
        else:
            self._ring.set_behind(False)

    def _check_reading(self) -> None:
        """End the feed of a listening process that has not read it for
        ``bounds.stall`` seconds: alive but stuck (stopped, or looping), it holds
        up every lookup its clients send it until they give up on it, and
        the daemon starts another once this one is gone."""
        reads = self.reads
        if self.listening.is_set() and reads == self._reads:
            self.stalled = True
            self.end(f"the lookup process has not read its feed for {self.bounds.stall:g}s")
            return
        self._reads = reads
        self._watch = asyncio.get_running_loop().call_later(self.bounds.stall, self._check_reading)

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

"""The lookup process's supervisor: start it, feed it, watch it, start it
again (docs/lookup-process.md).

The daemon owns one :class:`LookupSupervisor` when ``server.lookup_process``
is on. :meth:`~LookupSupervisor.start` runs the process
(``python -m kvtier.replica``) with its settings, its report socket
and its feed ring, and hands the feed to the service (what the daemon holds)
and to the server (replies that announce stores); :meth:`~LookupSupervisor.run`
then feeds it until the daemon stops, and starts it again whenever it goes
before that.

Invariants: at most one lookup process runs; while none listens, the daemon
answers every lookup (clients fall back to its socket); a process that went
is started again at once when the daemon ended it itself
(:meth:`~LookupSupervisor.restart`, a reload), else after a delay that
doubles (:class:`~kvtier.backoff.Backoff`) while processes keep going before
they listen; its socket file is removed once it has gone; once the daemon
stops, none is started again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from kvtier.backoff import Backoff
from kvtier.build import lookups_path
from kvtier.config import Config
from kvtier.core.service import Service
from kvtier.model import ReportKind
from kvtier.replica.feed import FEED, FeedBounds, FeedWriter
from kvtier.replica.settings import Settings
from kvtier.server.ops import NamespaceAccess, Ops, scoped_tag
from kvtier.server.server import Server
from kvtier.wire.replica import RING_HEADER, FeedRing, Report

log = logging.getLogger("kvtier.daemon")


@dataclass(frozen=True, slots=True)
class Timing:
    """The supervisor's seconds, and its feed's bounds (tests make them short)."""

    #: the daemon waits this long for the process to listen before it serves
    start: float = 10.0
    #: the process gets this long to stop once its feed ends
    stop: float = 5.0
    #: a process that went unasked is started again after this long, doubling
    #: after each one that goes before it listens, up to ``restart_most``
    restart_first: float = 1.0
    restart_most: float = 60.0
    #: the feed's sizes and seconds
    feed: FeedBounds = FEED


#: the supervisor's seconds unless told otherwise
TIMING = Timing()


class LookupSupervisor:
    """The daemon's lookup process, started and watched."""

    def __init__(
        self,
        config: Config,
        service: Service,
        server: Server[Ops],
        stopping: asyncio.Event,
        timing: Timing = TIMING,
    ) -> None:
        self._config = config
        self._service = service
        self._server = server
        self._feed: FeedWriter | None = None
        #: set when the daemon stops
        self._stopping = stopping
        self.timing = timing
        #: the process running now (or the last one), once started
        self.process: asyncio.subprocess.Process | None = None
        #: the daemon itself ended the process: start it again at once
        self._again = False

    def __repr__(self) -> str:
        pid = self.process.pid if self.process is not None else None
        listening = self.feed is not None and self.feed.listening.is_set()
        return f"<LookupSupervisor pid={pid} listening={listening} again={self._again}>"

    @property
    def feed(self) -> FeedWriter | None:
        """The running process's feed, once started (the server holds the
        same one: it hands it to the op table and shows it in STATS)."""
        return self._feed

    @property
    def path(self) -> str:
        return lookups_path(self._config)

    async def start(self) -> bool:
        """Start the process and wait (bounded) until it listens or will not;
        False (logged) where it could not be run at all."""
        if not await self._launch():
            return False
        assert self.feed is not None
        try:
            async with asyncio.timeout(self.timing.start):
                await self.feed.decided.wait()
        except TimeoutError:
            log.warning(
                "the lookup process does not listen after %.0fs; serving meanwhile",
                self.timing.start,
            )
        return True

    def restart(self, why: str) -> None:
        """End the running process and start a new one at once (a reload
        that changed what it was started with)."""
        if self.feed is not None:
            self._again = True
            self.feed.end(why)

    def end(self) -> None:
        """The daemon stops: the process sees its feed end, and stops."""
        if self.feed is not None:
            self.feed.end()

    async def run(self) -> None:
        """Feed the process until the daemon stops, starting it again
        whenever it goes before. Meanwhile the daemon answers every lookup."""
        backoff = Backoff(self.timing.restart_first, self.timing.restart_most)
        while True:
            assert self.process is not None and self.feed is not None
            await self._feed_until_gone(self.process, self.feed)
            if self._stopping.is_set():
                return
            if self.feed.listening.is_set():
                backoff.succeeded()  # it served: this is a new failure
            wait = 0.0 if self._again else backoff.failed(time.monotonic())
            self._again = False
            if wait:
                log.warning(
                    "the lookup process went (exit status %s); starting it again in %.3gs",
                    self.process.returncode,
                    wait,
                )
            while True:
                if wait and await self._stopping_within(wait):
                    return
                if await self._launch():
                    break
                wait = backoff.failed(time.monotonic())  # (logged: it could not even be run)
            self._server.counters.lookup_restarts.inc()
            if self._stopping.is_set():  # (it stopped while this one started)
                self.feed.end()

    async def _launch(self) -> bool:
        """Run the process with its report socket and feed ring, and hand its
        feed to the service and the server; False (logged) where it cannot run."""
        config, service, server = self._config, self._service, self._server
        sc, limits = config.server, service.limits
        peers = server.peers  # (the main socket's, as the handoff's)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ring_fd = os.memfd_create("kvtier-feed", os.MFD_CLOEXEC)
        os.ftruncate(ring_fd, RING_HEADER + self.timing.feed.ring_bytes)
        ring = FeedRing(memoryview(mmap.mmap(ring_fd, 0)))
        settings = Settings(
            report_fd=theirs.fileno(),
            ring_fd=ring_fd,
            path=self.path,
            mode=sc.socket_mode,
            uids=None if peers.uids is None else sorted(peers.uids),
            gids=sorted(peers.gids),
            access=(server.ops.access or NamespaceAccess()).to_json(),
            max_key_bytes=limits.max_key_bytes,
            max_batch=limits.max_batch,
            max_block_bytes=limits.max_block_bytes,
            max_frame_bytes=sc.max_frame_bytes,
            server_name=server.server_name,
            remotes=bool(service.remotes),
            idle_poll=sc.idle_poll,
            slice=sc.lookup_slice,
            request_state_ttl=config.lookup.request_state_ttl,
        )
        try:
            self.process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "kvtier.replica",
                settings.to_json(),
                pass_fds=(theirs.fileno(), ring_fd),
                stdin=subprocess.DEVNULL,
            )
        except OSError as exc:
            log.error("the lookup process did not start (%s); the daemon answers every lookup", exc)
            ours.close()
            return False
        finally:
            theirs.close()
            os.close(ring_fd)  # (the mapping stays)
        feed = FeedWriter(ours, ring, service.holds, self._report, self.timing.feed)
        service.feed(feed.write)
        self._feed = server.feed = feed  # (set together, always)
        return True

    async def _feed_until_gone(self, proc: asyncio.subprocess.Process, feed: FeedWriter) -> None:
        """Feed the process until it or the daemon stops; then see it end."""
        try:
            await feed.done.wait()
        finally:
            self._service.stop_feed()
            feed.end()  # the process sees its feed end, and stops
            if feed.stalled:  # (it would not see it)
                with contextlib.suppress(ProcessLookupError):  # (it went meanwhile)
                    proc.kill()
            try:
                async with asyncio.timeout(self.timing.stop):
                    await proc.wait()
            except TimeoutError:
                log.warning("the lookup process did not stop; killing it")
                proc.kill()
                await proc.wait()
            # Gone: its socket goes too (it removes it itself, unless killed),
            # so that no client tries it.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    async def _stopping_within(self, seconds: float) -> bool:
        """Wait ``seconds`` unless the daemon stops first; whether it does."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stopping.wait()
        return self._stopping.is_set()

    def _report(self, report: Report) -> None:
        """What the process tells the daemon: a lookup it answered (the
        daemon keeps its request state and counts it), one it referred, or
        that it listens."""
        kind = report.kind
        if kind is ReportKind.ANSWERED:
            assert report.lookup is not None
            req = scoped_tag(report.lookup, report.prefix)
            self._service.looked_up(req, report.states, report.times)
            self._server.counters.lookup_process.inc("answered", n=report.times)
        elif kind is ReportKind.REFERRED:
            self._server.counters.lookup_process.inc("referred")
        else:
            log.info("lookup process: listening on %s", self.path)

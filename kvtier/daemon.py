"""The daemon: runs the parts :func:`~kvtier.build.build` made, and owns
their lifetime: startup -> serve -> shutdown, and reload on SIGHUP.

Every background task is created in the task group that :meth:`Daemon.run`
owns; shutdown drains in-flight requests, cancels what is left, and waits
for it.

It may import every wing; nothing but the command line imports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from kvtier import loops
from kvtier._version import __version__
from kvtier.build import (
    PEER_TIER,
    Parts,
    access_of,
    build,
    handoff_path,
    lookups_path,
    quotas_of,
)
from kvtier.config import Config, split_address
from kvtier.core.propagation import RemoteSpec
from kvtier.endpoint import start_metrics_server
from kvtier.errors import ConfigError
from kvtier.model import ReportKind, Spawn
from kvtier.reload import Live, apply
from kvtier.server.handoff import Handoff
from kvtier.server.lookups import FEED_RING_BYTES, FeedWriter, Settings
from kvtier.server.ops import NamespaceAccess, scoped_tag
from kvtier.server.sockets import bind_unix_socket
from kvtier.tasks import TaskSet
from kvtier.tiers.base import Tier
from kvtier.tiers.peers import RendezvousPicker
from kvtier.wire.replica import RING_HEADER, FeedRing, Report

log = logging.getLogger("kvtier.daemon")

READY_MESSAGE = "kvtier ready"

#: seconds the daemon waits for its lookup process to listen before it serves
LOOKUP_PROCESS_START = 10.0
#: seconds the lookup process gets to stop once its feed ends
LOOKUP_PROCESS_STOP = 5.0
#: seconds before a lookup process that went unasked is started again,
#: doubling after each one that goes before it listens, up to the most
LOOKUP_RESTART_FIRST = 1.0
LOOKUP_RESTART_MOST = 60.0

__all__ = ["PEER_TIER", "READY_MESSAGE", "Daemon", "install_signal_handlers", "run", "serve"]


class Daemon:
    """One kvtier daemon. ``await Daemon(config).run()`` serves until :meth:`stop`."""

    def __init__(
        self,
        config: Config,
        *,
        remote_tiers: Sequence[Tier | RemoteSpec] | None = None,
        reread: Callable[[], Config] | None = None,
    ) -> None:
        """``remote_tiers`` replaces the configured remote tiers (see
        :func:`~kvtier.build.build`). ``reread`` builds the configuration
        again from its sources, for :meth:`reload`."""
        parts = build(config, remote_tiers=remote_tiers)
        #: everything this daemon runs, built and wired
        self.parts: Parts = parts
        self.config = config
        self._reread = reread
        self._spawn: Spawn | None = None
        # The parts by name.
        self.node_id = parts.node_id
        self.metrics = parts.metrics
        self.arena, self.staging = parts.arena, parts.staging
        self.ram, self.disk = parts.ram, parts.disk
        self.peer_tier, self.remote_tiers = parts.peer_tier, parts.remote_tiers
        self.scheduler, self.service, self.shared = parts.scheduler, parts.service, parts.shared
        #: KV events for routers on ZMQ (None unless ``events.endpoint``)
        self.publisher = parts.publisher
        self.server, self.peer_server = parts.server, parts.peer_server
        self.handoff: Handoff | None = None
        #: the lookup process (``server.lookup_process``), once started
        self.lookup_process: asyncio.subprocess.Process | None = None
        #: the daemon itself ended the lookup process: start it again at once
        self._lookups_again = False
        #: every background task: waiting requests, probes, loads, writes
        self.background = TaskSet()
        #: the peer port bound (``peer.listen`` may ask for port 0)
        self.peer_port: int | None = None
        self.socket_path: Path = config.server.socket_path
        self.metrics_port: int | None = None
        self.ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._socket_ino: int | None = None

    def __repr__(self) -> str:
        state = "stopping" if self._stop.is_set() else ("serving" if self.ready.is_set() else "new")
        return f"<Daemon {state} socket={self.socket_path} {self.service!r}>"

    async def settle(self) -> None:
        """Wait until the background work started so far (writes, loads, probes) is done."""
        await self.background.settle()

    def health(self) -> tuple[bool, bool, dict[str, Any]]:
        """(alive, ready, details) for the probes on the metrics port.

        Alive while the event loop answers and the daemon is not stopping;
        ready once it serves, unless it is stopping or (with
        ``disk.ready_after_scan``) its disk index is still being scanned."""
        stopping = self._stop.is_set()
        state = "stopping" if stopping else ("serving" if self.ready.is_set() else "starting")
        details: dict[str, Any] = {"state": state}
        ready = state == "serving"
        if self.disk is not None:
            scanning = self.disk.scanning
            details["disk"] = "scanning" if scanning else "ready"
            if scanning and self.config.disk.ready_after_scan:
                ready = False
        if self.peer_tier is not None:
            peers = self.peer_tier.stats()
            details["peers"] = {"up": peers.peers_up, "known": peers.peers}
        return not stopping, ready, details

    def reload(self) -> None:
        """Re-read the configuration and apply what can change live (SIGHUP);
        see :mod:`kvtier.reload`. A configuration that does not load changes nothing."""
        if self._reread is None:
            log.warning("reload: this daemon has no configuration source to re-read")
            return
        try:
            new = self._reread()
        except ConfigError as exc:
            log.error("reload failed; the running configuration is kept:\n%s", exc)
            return
        live = Live(
            writers={w.name: w for w in self.service.propagation.writers},
            shared=self.shared,
            set_namespaces=self._set_namespaces,
        )
        peer_tier, spawn = self.peer_tier, self._spawn
        picker = peer_tier.picker if peer_tier is not None else None
        if isinstance(picker, RendezvousPicker) and spawn is not None and not self.config.peer.dns:
            members_of = picker

            def set_members(members: list[str]) -> None:
                for dropped in members_of.set_members(members):
                    spawn(dropped.close())

            live.set_members = set_members
        applied, waiting = apply(self.config, new, live)
        log.info("reloaded: %s", ", ".join(applied) or "nothing changed that applies live")
        if waiting:
            log.warning("changed but not applied until a restart: %s", ", ".join(waiting))

    def _set_namespaces(self, new: Config) -> bool:
        """Apply ``new``'s namespaces: who may use which, and the tiers'
        quotas. False (nothing changed) where quotas would need tiers built
        with namespaces, or the minimums do not fit."""
        budgets = [self.ram.budget, *([self.disk.budget] if self.disk is not None else [])]
        try:
            ram_quotas, disk_quotas = quotas_of(new, self.ram.capacity)
        except ConfigError as exc:
            log.error("reload: %s", exc)
            return False
        if new.namespaces and any(b.shares is None for b in budgets):
            return False  # the tiers were built without namespaces: a restart
        for budget, quotas in zip(budgets, (ram_quotas, disk_quotas), strict=False):
            if budget.shares is not None:
                budget.shares.quotas = quotas
        access = access_of(new)
        feed = self.server.feed
        if feed is not None and access != self.server.ops.access:
            # The lookup process checks who may use which namespace as it
            # started: a new one is started at once, told the new users.
            self._lookups_again = True
            feed.end("who may use which namespace changed; starting it again")
        self.server.ops.access = access
        return True

    def stop(self) -> None:
        """Begin a graceful shutdown (safe to call more than once)."""
        self._stop.set()

    async def run(self) -> None:
        """Start, serve until :meth:`stop`, shut down."""
        sock, runner = await self._startup()
        async with asyncio.TaskGroup() as tasks:  # the daemon's own long-lived tasks
            spawn = self._spawn = self.background.spawn
            scheduler_task = tasks.create_task(self.scheduler.run(), name="kvtier-scheduler")
            try:
                await self._serve(tasks, spawn, sock)
            finally:
                await self._shutdown(runner)
                self.scheduler.stop()
                await scheduler_task

    async def _startup(self) -> tuple[socket.socket, web.AppRunner | None]:
        """Open the tiers, bind the sockets and the metrics port. Failures (a
        socket in use, a port taken) raise plainly, before any task exists,
        and undo what was done."""
        if self.disk is not None:
            self.disk.prepare()
        opened: list[Tier] = []
        sock = None
        try:
            for tier in self.remote_tiers:
                await tier.open()
                opened.append(tier)
            sock = bind_unix_socket(self.socket_path, self.config.server.socket_mode)
            self._socket_ino = os.stat(self.socket_path).st_ino
            self._bind_handoff()
            if self.publisher is not None:
                self.publisher.bind()
            return sock, await self._start_metrics()
        except BaseException:
            if sock is not None:
                sock.close()
                self._remove_socket()
            if self.handoff is not None:
                self.handoff.close()
            if self.publisher is not None:
                self.publisher.close()
            for tier in opened:
                await tier.close()
            raise

    async def _serve(self, tasks: asyncio.TaskGroup, spawn: Spawn, sock: socket.socket) -> None:
        """Start the background work and the servers, then wait for :meth:`stop`."""
        self.service.start(spawn)
        peer_tier = self.peer_tier
        if peer_tier is not None and self.config.peer.dns is not None:
            self.scheduler.every(self.config.peer.dns_interval, lambda: spawn(peer_tier.refresh()))
        if self.disk is not None:
            spawn(self.disk.rebuild_index())  # serves meanwhile: unscanned keys read RETRY
        shared, handoff = self.shared, self.handoff
        handoff_task = None
        if shared is not None and handoff is not None:
            # Serves until shutdown; not background work that settle() waits for.
            handoff_task = tasks.create_task(handoff.serve(), name="kvtier-handoff")
            self.scheduler.every(
                min(1.0, self.config.shared.lease_timeout / 4),
                lambda: shared.expire(self.scheduler.now()),
            )
        publishing = None
        if self.publisher is not None:
            publishing = tasks.create_task(self.publisher.serve(), name="kvtier-kv-events")
        feed = None
        if self.config.server.lookup_process:
            started = await self._start_lookup_process()
            if started is not None:
                proc, feed = started
                tasks.create_task(
                    self._supervise_lookup_process(proc, feed), name="kvtier-lookup-process"
                )
                await _decided(feed)
        try:
            await self.server.start(sock, spawn)
            await self._start_peer_listener(spawn)
            self._announce()
            await self._stop.wait()
        finally:
            for task in (handoff_task, publishing):
                if task is not None:
                    task.cancel()
            if self.server.feed is not None:
                self.server.feed.end()  # its task sees the lookup process stop, then ends

    async def _start_lookup_process(self) -> tuple[asyncio.subprocess.Process, FeedWriter] | None:
        """Start the lookup process (docs/lookup-process.md) and its feed;
        None (logged) where it cannot start."""
        sc, limits = self.config.server, self.service.limits
        peers = self.server.peers  # (the main socket's, as the handoff's)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ring_fd = os.memfd_create("kvtier-feed", os.MFD_CLOEXEC)
        os.ftruncate(ring_fd, RING_HEADER + FEED_RING_BYTES)
        ring = FeedRing(memoryview(mmap.mmap(ring_fd, 0)))
        settings = Settings(
            report_fd=theirs.fileno(),
            ring_fd=ring_fd,
            path=lookups_path(self.config),
            mode=sc.socket_mode,
            uids=None if peers.uids is None else sorted(peers.uids),
            gids=sorted(peers.gids),
            access=(self.server.ops.access or NamespaceAccess()).to_json(),
            max_key_bytes=limits.max_key_bytes,
            max_batch=limits.max_batch,
            max_block_bytes=limits.max_block_bytes,
            max_frame_bytes=sc.max_frame_bytes,
            server_name=self.server.server_name,
            remotes=bool(self.service.remotes),
            idle_poll=sc.idle_poll,
            slice=sc.lookup_slice,
            request_state_ttl=self.config.lookup.request_state_ttl,
        )
        try:
            proc = self.lookup_process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "kvtier.lookup_process",
                settings.to_json(),
                pass_fds=(theirs.fileno(), ring_fd),
                stdin=subprocess.DEVNULL,
            )
        except OSError as exc:
            log.error("the lookup process did not start (%s); the daemon answers every lookup", exc)
            ours.close()
            return None
        finally:
            theirs.close()
            os.close(ring_fd)  # (the mapping stays)
        feed = FeedWriter(ours, ring, self.service.holds, self._lookup_report)
        self.service.feed(feed.write)
        self.server.feed = feed
        return proc, feed

    async def _supervise_lookup_process(
        self, proc: asyncio.subprocess.Process, feed: FeedWriter
    ) -> None:
        """Feed the lookup process until the daemon stops, starting it again
        whenever it goes before: at once when the daemon ended it (a reload),
        else after a delay that doubles while it keeps going before it
        listens. Meanwhile the daemon answers every lookup."""
        delay = LOOKUP_RESTART_FIRST
        while True:
            await self._feed_lookup_process(proc, feed)
            if self._stop.is_set():
                return
            if feed.listening.is_set():
                delay = LOOKUP_RESTART_FIRST  # it served: this is a new failure
            wait = 0.0 if self._lookups_again else delay
            self._lookups_again = False
            if wait:
                log.warning(
                    "the lookup process went (exit status %s); starting it again in %.3gs",
                    proc.returncode,
                    wait,
                )
            started = None
            while started is None:  # (None, logged: it could not even be run)
                if wait:
                    if await self._stopping_within(wait):
                        return
                    delay = min(delay * 2, LOOKUP_RESTART_MOST)
                started = await self._start_lookup_process()
                wait = delay
            proc, feed = started
            self.server.counters.lookup_restarts.inc()
            if self._stop.is_set():  # (it stopped while this one started)
                feed.end()

    async def _stopping_within(self, seconds: float) -> bool:
        """Wait ``seconds`` unless the daemon stops first; whether it does."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stop.wait()
        return self._stop.is_set()

    async def _feed_lookup_process(
        self, proc: asyncio.subprocess.Process, feed: FeedWriter
    ) -> None:
        """Feed the lookup process until it or the daemon stops; then see it end."""
        try:
            await feed.done.wait()
        finally:
            self.service.stop_feed()
            feed.end()  # the process sees its feed end, and stops
            if feed.stalled:  # (it would not see it)
                with contextlib.suppress(ProcessLookupError):  # (it went meanwhile)
                    proc.kill()
            try:
                async with asyncio.timeout(LOOKUP_PROCESS_STOP):
                    await proc.wait()
            except TimeoutError:
                log.warning("the lookup process did not stop; killing it")
                proc.kill()
                await proc.wait()
            # Gone: its socket goes too (it removes it itself, unless killed),
            # so that no client tries it.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lookups_path(self.config))

    def _lookup_report(self, report: Report) -> None:
        kind = report.kind
        if kind is ReportKind.ANSWERED:
            assert report.lookup is not None
            req = scoped_tag(report.lookup, report.prefix)
            self.service.looked_up(req, report.states, report.times)
            self.server.counters.lookup_process.inc("answered", n=report.times)
        elif kind is ReportKind.REFERRED:
            self.server.counters.lookup_process.inc("referred")
        else:
            log.info("lookup process: listening on %s", lookups_path(self.config))

    def _bind_handoff(self) -> None:
        """The socket that hands the arena to same-host clients, beside the main one."""
        if self.arena is None or self.staging is None:
            return
        sc = self.config.server
        self.handoff = Handoff(
            Path(handoff_path(self.config)),
            arena_fd=self.arena.readonly_fd(),
            arena_rw_fd=os.dup(self.arena.fd) if self.config.shared.write_in_place else None,
            writable=self.shared.may_write_in_place if self.shared is not None else None,
            arena_bytes=self.arena.size,
            staging_fd=os.dup(self.staging.fd),
            staging_bytes=self.staging.size,
            peers=self.server.peers,
            mode=sc.socket_mode,
            attach=self.shared.attach_region if self.shared is not None else None,
        )
        self.handoff.bind()

    async def _start_peer_listener(self, spawn: Spawn) -> None:
        pc, peers = self.config.peer, self.peer_server
        if pc.listen is None or peers is None:
            return
        host, port = split_address(pc.listen)
        try:
            self.peer_port = await peers.start_tcp(host, port, pc.server_tls(), spawn)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot listen for peers on {pc.listen}: {exc}") from exc

    async def _start_metrics(self) -> web.AppRunner | None:
        mc = self.config.metrics
        if not mc.enabled:
            return None
        try:
            runner, self.metrics_port = await start_metrics_server(
                self.metrics, mc.host, mc.port, self.health
            )
        except OSError as exc:
            raise OSError(
                exc.errno, f"cannot serve metrics on {mc.host}:{mc.port}: {exc.strerror}"
            ) from exc
        return runner

    def _announce(self) -> None:
        mc = self.config.metrics
        metrics_url = f"http://{mc.host}:{self.metrics_port}/metrics" if mc.enabled else "disabled"
        log.info(
            "%s: kvtier %s socket=%s metrics=%s peer=%s ram=%d bytes disk=%s",
            READY_MESSAGE,
            __version__,
            self.socket_path,
            metrics_url,
            f"{split_address(self.config.peer.listen or ':0')[0]}:{self.peer_port}"
            if self.peer_port is not None
            else "disabled",
            self.ram.capacity,
            f"{self.disk.root} ({self.disk.capacity} bytes)"
            if self.disk is not None
            else "disabled",
        )
        self.ready.set()

    async def _shutdown(self, runner: web.AppRunner | None) -> None:
        log.info(
            "shutting down: draining in-flight requests (grace %.1fs)",
            self.config.server.shutdown_grace,
        )
        self.service.begin_shutdown()  # waiting lookups and GETs answer now
        grace = self.config.server.shutdown_grace
        if self.peer_server is not None:
            await asyncio.gather(self.server.shutdown(grace), self.peer_server.shutdown(grace))
        else:
            await self.server.shutdown(grace)
        self._remove_socket()
        if self.handoff is not None:
            self.handoff.close()
        if self.publisher is not None:
            self.publisher.close()
        # Probes and promotions still running are cut short; each resolves
        # its waiters in its own finally. One that ignores its cancellation is
        # abandoned after a bound (and logged), never waited for forever.
        await self.background.stop(self.config.server.shutdown_task_timeout)
        self.service.close()
        if self.shared is not None:
            self.shared.close()
        await self.ram.close()
        for arena in (self.arena, self.staging):
            if arena is not None:
                arena.close()
        if self.disk is not None:
            await self.disk.close()
        for tier in self.remote_tiers:
            await tier.close()
        if runner is not None:
            await runner.cleanup()
        log.info("kvtier stopped")

    def _remove_socket(self) -> None:
        # Only remove the file we bound: another daemon may have replaced it.
        with contextlib.suppress(FileNotFoundError):
            if os.stat(self.socket_path).st_ino == self._socket_ino:
                os.unlink(self.socket_path)


async def _decided(feed: FeedWriter) -> None:
    """Until the lookup process listens (or will not), so that a client that
    connects once the daemon is ready finds it; bounded."""
    try:
        async with asyncio.timeout(LOOKUP_PROCESS_START):
            await feed.decided.wait()
    except TimeoutError:
        log.warning(
            "the lookup process does not listen after %.0fs; serving meanwhile",
            LOOKUP_PROCESS_START,
        )


def install_signal_handlers(daemon: Daemon) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, daemon.stop)
    loop.add_signal_handler(signal.SIGHUP, daemon.reload)


async def serve(config: Config, reread: Callable[[], Config] | None = None) -> None:
    daemon = Daemon(config, reread=reread)
    install_signal_handlers(daemon)
    await daemon.run()


def run(config: Config, reread: Callable[[], Config] | None = None) -> None:
    """Run the daemon to completion on the loop :mod:`kvtier.loops` chooses;
    SIGHUP calls ``reread`` and applies the live settings."""
    loops.run(serve(config, reread))

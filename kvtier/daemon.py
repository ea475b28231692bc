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
import os
import signal
import socket
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
    keyrings_of,
    quotas_of,
)
from kvtier.config import Config, split_address
from kvtier.core.propagation import RemoteSpec
from kvtier.endpoint import start_metrics_server
from kvtier.errors import ConfigError
from kvtier.model import Spawn
from kvtier.reload import Live, apply
from kvtier.server.handoff import Handoff
from kvtier.server.sockets import bind_unix_socket
from kvtier.supervisors.lookup_process import TIMING, LookupSupervisor, Timing
from kvtier.tasks import TaskSet
from kvtier.tiers.base import Tier
from kvtier.tiers.peers import RendezvousPicker
from kvtier.tiers.ram import prepare_memory

log = logging.getLogger("kvtier.daemon")

READY_MESSAGE = "kvtier ready"

__all__ = ["PEER_TIER", "READY_MESSAGE", "Daemon", "install_signal_handlers", "run", "serve"]


class Daemon:
    """One kvtier daemon. ``await Daemon(config).run()`` serves until :meth:`stop`."""

    def __init__(
        self,
        config: Config,
        *,
        remote_tiers: Sequence[Tier | RemoteSpec] | None = None,
        reread: Callable[[], Config] | None = None,
        lookup_timing: Timing = TIMING,
    ) -> None:
        """``remote_tiers`` replaces the configured remote tiers (see
        :func:`~kvtier.build.build`). ``reread`` builds the configuration
        again from its sources, for :meth:`reload`. ``lookup_timing``: the
        lookup process supervisor's seconds."""
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
        #: the lookup process's supervisor (``server.lookup_process``), once started
        self.lookups: LookupSupervisor | None = None
        self._lookup_timing = lookup_timing
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

    @property
    def lookup_process(self) -> asyncio.subprocess.Process | None:
        """The lookup process running now (or the last one), once started."""
        return self.lookups.process if self.lookups is not None else None

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
            rings = keyrings_of(new)  # (the key files again, even where the paths are as they were)
        except ConfigError as exc:
            log.error("reload failed; the running configuration is kept:\n%s", exc)
            return
        self.parts.keys.replace(rings)
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
        if self.lookups is not None and access != self.server.ops.access:
            # The lookup process checks who may use which namespace as it
            # started: a new one is started at once, told the new users.
            self.lookups.restart("who may use which namespace changed; starting it again")
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
        data directory or a socket in use, a port taken) raise plainly,
        before any task exists, and undo what was done."""
        opened: list[Tier] = []
        sock = None
        try:
            if self.disk is not None:
                opened.append(self.disk)  # (closed on a failure: its directory let go)
                self.disk.prepare()
                await self.disk.load_index()  # whole at once, or rebuilt by a scan once serving
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
        disk = self.disk
        loaded = disk is not None and disk.loaded is not None and disk.loaded.index is not None
        if disk is not None and not loaded:
            # Serves meanwhile: without an index loaded, unscanned keys read RETRY.
            spawn(disk.rebuild_index())
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
        if self.config.server.lookup_process:
            lookups = LookupSupervisor(
                self.config, self.service, self.server, self._stop, self._lookup_timing
            )
            if await lookups.start():
                self.lookups = lookups
                tasks.create_task(lookups.run(), name="kvtier-lookup-process")
        try:
            await self.server.start(sock, spawn)
            await self._start_peer_listener(spawn)
            self._announce()
            if self.config.shared.preallocate and self.arena is not None:
                memory = [(self.arena, self.ram.capacity)]
                if self.staging is not None:
                    memory.append((self.staging, self.staging.size))
                spawn(prepare_memory(memory))
            if disk is not None and loaded:
                # The pass over the files of an index loaded whole: after the
                # start, not competing with the lookup process's first snapshot.
                spawn(disk.rebuild_index())
            await self._stop.wait()
        finally:
            for task in (handoff_task, publishing):
                if task is not None:
                    task.cancel()
            if self.lookups is not None:
                self.lookups.end()  # its task sees the lookup process stop, then ends

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
            f"{self.disk.root} ({self.disk.capacity} bytes; index: {self._index_loaded()})"
            if self.disk is not None
            else "disabled",
        )
        self.ready.set()

    def _index_loaded(self) -> str:
        loaded = self.disk.loaded if self.disk is not None else None
        return "none" if loaded is None else loaded.describe()

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

"""The daemon: the one place that wires config, tiers, core, server and
metrics together, and owns their lifetime (startup -> serve -> shutdown).

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
import secrets
import signal
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from kvtier import loops
from kvtier._version import __version__
from kvtier.config import (
    Config,
    LookupConfig,
    PeerConfig,
    RemoteTierConfig,
    S3TierConfig,
    split_address,
)
from kvtier.core.local import LocalView
from kvtier.core.propagation import RemoteSpec, WritePolicy
from kvtier.core.service import Service
from kvtier.core.shared.blocks import SharedBlocks
from kvtier.core.timers.scheduler import Scheduler
from kvtier.endpoint import start_metrics_server
from kvtier.errors import ConfigError
from kvtier.metrics import Metrics
from kvtier.model import Limits, Spawn
from kvtier.reload import Live, apply
from kvtier.server.gate import PeerGate
from kvtier.server.handoff import Handoff
from kvtier.server.server import Server
from kvtier.server.sockets import PeerPolicy, bind_unix_socket
from kvtier.tiers.arena import Arena
from kvtier.tiers.base import Tier
from kvtier.tiers.breaker import CircuitBreaker
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.memory import MemoryRemoteTier
from kvtier.tiers.peer import Peer, PeerCounters, PeerTier
from kvtier.tiers.peers import RendezvousPicker
from kvtier.tiers.policy import make_policy
from kvtier.tiers.ram import RamTier
from kvtier.tiers.s3 import S3Tier
from kvtier.wire import SharedOffer

log = logging.getLogger("kvtier.daemon")

READY_MESSAGE = "kvtier ready"


#: the peer tier's name: labels its metrics and marks blocks peers pushed here
PEER_TIER = "peers"


def build_peer_tier(pc: PeerConfig, node_id: str) -> PeerTier:
    """The peer tier over ``pc``'s members, ranked by rendezvous hashing."""
    counters = PeerCounters()
    tls = pc.client_tls()
    token = pc.secret()
    picker: RendezvousPicker[Peer]

    def found_self(address: str) -> None:
        picker.is_self(address)  # the peer object for it holds no connection

    def make_peer(address: str) -> Peer:
        return Peer(
            address,
            token=token,
            tls=tls,
            connect_timeout=pc.connect_timeout,
            request_timeout=pc.request_timeout,
            breaker=CircuitBreaker(pc.breaker_failures, pc.breaker_reset),
            counters=counters,
            node_id=node_id,
            on_self=found_self,
        )

    picker = RendezvousPicker(
        make_peer, members=pc.members, dns=pc.dns, self_address=pc.self_address()
    )
    return PeerTier(PEER_TIER, picker, counters)


def build_remote_tier(tc: RemoteTierConfig, lookup: LookupConfig) -> Tier:
    if isinstance(tc, S3TierConfig):
        return S3Tier(tc, probe_timeout=lookup.probe_timeout, load_timeout=lookup.load_timeout)
    return MemoryRemoteTier(tc.name)


class Daemon:
    """One kvtier daemon. ``await Daemon(config).run()`` serves until :meth:`stop`."""

    def __init__(
        self,
        config: Config,
        *,
        remote_tiers: Sequence[Tier | RemoteSpec] | None = None,
        reread: Callable[[], Config] | None = None,
    ) -> None:
        """``remote_tiers`` replaces the configured remote tiers (tests and benchmarks
        inject doubles, or real tiers built with a test clock); a bare tier gets
        write policy none. ``reread`` builds the configuration again from its
        sources, for :meth:`reload`."""
        self.config = config
        self._reread = reread
        self._spawn: Spawn | None = None
        #: this run's identity, in every HELLO reply: a daemon that dials its
        #: own address among the peers recognises itself by it
        self.node_id = secrets.token_hex(8)
        self.metrics = Metrics()
        ram_bytes = config.ram.capacity_bytes()
        shc = config.shared
        #: RAM's blocks in a memory file same-host clients map (None: off or not Linux)
        self.arena: Arena | None = None
        self.staging: Arena | None = None
        if shc.enabled and hasattr(os, "memfd_create"):
            # A quarter more than the budget: blocks deleted or evicted while
            # still read keep their slots until let go (pages cost nothing
            # until written).
            self.arena = Arena(ram_bytes + ram_bytes // 4, name="kvtier-ram")
            self.staging = Arena(shc.staging_bytes, name="kvtier-staging")
        self.ram = RamTier(
            ram_bytes, make_policy(config.ram.policy), arena=self.arena, min_slot=shc.min_block
        )
        self.disk: DiskTier | None = None
        if config.disk.enabled:
            self.disk = DiskTier(
                config.disk.path,
                config.disk.capacity_bytes(),
                fsync=config.disk.fsync,
                io_threads=config.disk.io_threads,
                policy=make_policy(config.disk.policy),
            )
            self.metrics.watch_disk(self.disk.stats)
        if remote_tiers is None:
            specs = [
                RemoteSpec(
                    build_remote_tier(tc, config.lookup),
                    WritePolicy(tc.write_policy),
                    tc.max_pending_write_bytes,
                )
                for tc in config.remote_tiers
            ]
        else:
            specs = [t if isinstance(t, RemoteSpec) else RemoteSpec(t) for t in remote_tiers]
        pc = config.peer
        self.peer_tier: PeerTier | None = None
        if pc.enabled:
            # First among the remote tiers: a peer answers faster than S3.
            self.peer_tier = build_peer_tier(pc, self.node_id)
            push = WritePolicy.WRITE_THROUGH if pc.push == "owner" else WritePolicy.NONE
            specs.insert(0, RemoteSpec(self.peer_tier, push, pc.max_pending_push_bytes))
            self.metrics.watch_peers(self.peer_tier)
        self.remote_tiers = [spec.tier for spec in specs]
        for tier in self.remote_tiers:
            if isinstance(tier, S3Tier):
                self.metrics.watch_s3(tier)
        self.scheduler = Scheduler(
            batch_window=config.lookup.probe_batch_window,
            max_batch=config.lookup.probe_max_batch,
        )
        self.service = Service(
            Limits(
                max_key_bytes=config.server.max_key_bytes,
                max_batch=config.server.max_batch,
                max_block_bytes=int(config.server.max_block_bytes),
            ),
            self.ram,
            lookup=config.lookup,
            disk=self.disk,
            disk_cfg=config.disk,
            remotes=specs,
            scheduler=self.scheduler,
        )
        self.shared: SharedBlocks | None = None
        self.handoff: Handoff | None = None
        if self.staging is not None:
            service = self.service
            self.shared = SharedBlocks(
                self.ram,
                self.staging,
                put=lambda keys, values: service.put(keys, values, copy=True),
                unpin=service.unpin,
                now=self.scheduler.now,
                lease_timeout=shc.lease_timeout,
                staging_timeout=shc.staging_timeout,
                limits=service.limits,
            )
            self.metrics.watch_shared(self.shared.stats)
        self.metrics.watch_core(self.service.counters, self.service.map_sizes)
        self.metrics.watch_tiers(lambda: [t.stats() for t in self.service.tiers()])
        #: every background task, all children of run()'s task group
        self._tasks: set[asyncio.Task[Any]] = set()
        self.server: Server | None = None
        self.peer_server: Server | None = None
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
        while pending := [
            t for t in (*self._tasks, *self.service.tasks) if t is not asyncio.current_task()
        ]:
            await asyncio.wait(pending)

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

    def stop(self) -> None:
        """Begin a graceful shutdown (safe to call more than once)."""
        self._stop.set()

    async def run(self) -> None:
        # Startup failures (socket in use, metrics port taken) raise plainly,
        # before any background task exists.
        if self.disk is not None:
            self.disk.prepare()
        opened: list[Tier] = []
        sock = None
        runner: web.AppRunner | None = None
        try:
            for tier in self.remote_tiers:
                await tier.open()
                opened.append(tier)
            sock = bind_unix_socket(self.socket_path, self.config.server.socket_mode)
            self._socket_ino = os.stat(self.socket_path).st_ino
            self._bind_handoff()
            runner = await self._start_metrics()
        except BaseException:
            if sock is not None:
                sock.close()
                self._remove_socket()
            if self.handoff is not None:
                self.handoff.close()
            for tier in opened:
                await tier.close()
            raise
        async with asyncio.TaskGroup() as tasks:

            def spawn(coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
                task = tasks.create_task(coro)
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                return task

            self._spawn = spawn
            scheduler_task = tasks.create_task(self.scheduler.run(), name="kvtier-scheduler")
            self.service.start(tasks.create_task)  # the service keeps count of its own
            peer_tier = self.peer_tier
            if peer_tier is not None and self.config.peer.dns is not None:
                self.scheduler.every(
                    self.config.peer.dns_interval, lambda: spawn(peer_tier.refresh())
                )
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
            sc = self.config.server
            self.server = server = Server(
                self.service,
                spawn,
                max_frame=int(self.config.server.max_frame_bytes),
                max_inflight=self.config.server.max_inflight_per_connection,
                peers=PeerPolicy.for_socket(sc.socket_mode, sc.allowed_uids, sc.allowed_gids),
                node_id=self.node_id,
                shared=self.shared,
                shared_offer=self._shared_offer(),
            )
            self.metrics.watch_server(server.counters, lambda: len(server.connections))
            try:
                await server.start(sock)
                await self._start_peer_listener(spawn)
                self._announce()
                await self._stop.wait()
            finally:
                if handoff_task is not None:
                    handoff_task.cancel()
                await self._shutdown(server, runner)
                self.scheduler.stop()
                await scheduler_task

    def _bind_handoff(self) -> None:
        """The socket that hands the arena to same-host clients, beside the main one."""
        if self.arena is None or self.staging is None:
            return
        sc = self.config.server
        self.handoff = Handoff(
            Path(f"{self.socket_path}.shm"),
            arena_fd=self.arena.readonly_fd(),
            arena_bytes=self.arena.size,
            staging_fd=os.dup(self.staging.fd),
            staging_bytes=self.staging.size,
            peers=PeerPolicy.for_socket(sc.socket_mode, sc.allowed_uids, sc.allowed_gids),
            mode=sc.socket_mode,
        )
        self.handoff.bind()

    def _shared_offer(self) -> SharedOffer | None:
        if self.handoff is None or self.arena is None or self.staging is None:
            return None
        return SharedOffer(str(self.handoff.path), self.arena.size, self.staging.size)

    async def _start_peer_listener(self, spawn: Spawn) -> None:
        pc = self.config.peer
        if pc.listen is None:
            return
        host, port = split_address(pc.listen)
        sc = self.config.server
        self.peer_server = peers = Server(
            LocalView(self.service, source=PEER_TIER),
            spawn,
            max_frame=int(sc.max_frame_bytes),
            max_inflight=sc.max_inflight_per_connection,
            gate=PeerGate(pc.secret(), allow_delete=pc.allow_delete),
            node_id=self.node_id,
        )
        self.metrics.watch_peer_listener(peers.counters, lambda: len(peers.connections))
        try:
            self.peer_port = await peers.start_tcp(host, port, pc.server_tls())
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

    async def _shutdown(self, server: Server, runner: web.AppRunner | None) -> None:
        log.info(
            "shutting down: draining in-flight requests (grace %.1fs)",
            self.config.server.shutdown_grace,
        )
        self.service.begin_shutdown()  # waiting lookups and GETs answer now
        grace = self.config.server.shutdown_grace
        if self.peer_server is not None:
            await asyncio.gather(server.shutdown(grace), self.peer_server.shutdown(grace))
        else:
            await server.shutdown(grace)
        self._remove_socket()
        if self.handoff is not None:
            self.handoff.close()
        # Probes and promotions still running are cut short; each resolves
        # its waiters in its own finally.
        running = [*self._tasks, *self.service.tasks]
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running)
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

"""Building a daemon: every part made from the configuration, nothing started.

:func:`build` constructs the tiers, the core, the servers and the metrics
and wires them together, in one place and in one order: it opens no
socket, starts no task and touches no file (the disk's directory is made
and scanned when the daemon starts). The :class:`Parts` it returns are what
:class:`~kvtier.daemon.Daemon` runs. Every source of metrics is registered
here, once.

It may import every wing; only the daemon imports it.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtier.config import (
    Config,
    EventsConfig,
    LookupConfig,
    PeerConfig,
    RemoteTierConfig,
    S3TierConfig,
)
from kvtier.core.propagation import RemoteSpec, WritePolicy
from kvtier.core.service import Service
from kvtier.core.shared.blocks import SharedBlocks
from kvtier.core.shared.copier import Copier
from kvtier.core.timers import Scheduler
from kvtier.errors import ConfigError
from kvtier.loops import IdlePoll
from kvtier.metrics import Metrics
from kvtier.model import CacheService, EventSource, Limits, namespace_id
from kvtier.server.gate import PeerGate
from kvtier.server.kv_events import KVEventPublisher
from kvtier.server.ops import NamespaceAccess, Ops
from kvtier.server.server import Server
from kvtier.server.sockets import PeerPolicy
from kvtier.tiers.base import Tier
from kvtier.tiers.breaker import CircuitBreaker
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.keyfiles import read_keyring
from kvtier.tiers.memory import MemoryRemoteTier
from kvtier.tiers.peer import Peer, PeerCounters, PeerTier
from kvtier.tiers.peers import RendezvousPicker
from kvtier.tiers.policy import EvictionPolicy, make_policy
from kvtier.tiers.ram import Arena, RamTier
from kvtier.tiers.s3 import S3Tier
from kvtier.tiers.sealing import Codec, Keyring, Keys, Sealer
from kvtier.tiers.shares import Quota, Shares
from kvtier.wire import SharedOffer

#: the peer tier's name: labels its metrics and marks blocks peers pushed here
PEER_TIER = "peers"


@dataclass(slots=True)
class Parts:
    """What one daemon is made of, built and wired, not started."""

    config: Config
    #: this run's identity, in every HELLO reply: a daemon that dials its own
    #: address among the peers recognises itself by it
    node_id: str
    metrics: Metrics
    #: RAM's blocks in a memory file same-host clients map (None: off or not Linux)
    arena: Arena | None
    #: the region clients write staged blocks into (None with no arena)
    staging: Arena | None
    ram: RamTier
    disk: DiskTier | None
    #: the peer tier, also first among ``remotes`` (None: peers off)
    peer_tier: PeerTier | None
    #: the remote tiers in the order they are asked, with their write policies
    remotes: list[RemoteSpec]
    #: the one scheduler loop: deadlines, probe batches, sweeps
    scheduler: Scheduler
    service: Service
    #: leases and staging for same-host clients (None with no arena)
    shared: SharedBlocks | None
    #: the local socket's server
    server: Server[Ops]
    #: the peer port's server (None unless ``peer.listen``)
    peer_server: Server[Ops] | None
    #: KV events for routers on ZMQ (None unless ``events.endpoint``)
    publisher: KVEventPublisher | None = None
    #: the namespaces' encryption keys, read again on SIGHUP (:func:`keyrings_of`)
    keys: Keys = field(default_factory=Keys)

    def __repr__(self) -> str:
        remotes = [spec.tier.name for spec in self.remotes]
        return (
            f"<Parts node={self.node_id} ram={self.ram.capacity} "
            f"disk={self.disk is not None} remotes={remotes} shared={self.shared is not None} "
            f"peer_port={self.peer_server is not None}>"
        )

    @property
    def remote_tiers(self) -> list[Tier]:
        return [spec.tier for spec in self.remotes]


def quotas_of(config: Config, ram_bytes: int) -> tuple[dict[bytes, Quota], dict[bytes, Quota]]:
    """The namespaces' RAM and disk quotas (``[namespaces.<name>]``); raises
    ConfigError when the guaranteed minimums do not fit in RAM."""
    ram: dict[bytes, Quota] = {}
    disk: dict[bytes, Quota] = {}
    for name, nc in config.namespaces.items():
        ns = namespace_id(name)
        ram[ns] = Quota(nc.ram_min, nc.ram_max, nc.weight)
        disk[ns] = Quota(0, nc.disk_max, nc.weight)
    guaranteed = sum(q.min for q in ram.values())
    if guaranteed > ram_bytes:
        raise ConfigError(
            f"the namespaces' ram_min add up to {guaranteed} bytes, more than the "
            f"RAM tier's {ram_bytes}"
        )
    return ram, disk


def keyrings_of(config: Config) -> dict[bytes, Keyring]:
    """The namespaces' keys, read from their files (``[namespaces.<name>]
    encryption_key_file``); raises ConfigError naming the namespace and the
    file that is missing, unreadable, open to others or not a key."""
    return {
        namespace_id(name): read_keyring(name, nc.encryption_key_file, nc.encryption_old_key_files)
        for name, nc in config.namespaces.items()
        if nc.encryption_key_file is not None
    }


def access_of(config: Config) -> NamespaceAccess:
    """Who may use which namespace, from ``[namespaces.<name>] uids``."""
    return NamespaceAccess(
        uids={
            namespace_id(name): frozenset(nc.uids)
            for name, nc in config.namespaces.items()
            if nc.uids is not None
        },
        configured=frozenset(namespace_id(name) for name in config.namespaces),
        strict=config.server.configured_namespaces_only,
    )


def tier_policy(
    kind: str, capacity: int, quotas: dict[bytes, Quota] | None
) -> EvictionPolicy[bytes]:
    """A tier's eviction policy: shared among namespaces (one ``kind`` policy
    each) when any namespace is configured, else one policy for every block."""
    if quotas is None:
        return make_policy(kind)
    return Shares(capacity, quotas, lambda: make_policy(kind))


def build(config: Config, *, remote_tiers: Sequence[Tier | RemoteSpec] | None = None) -> Parts:
    """Every part of a daemon for ``config``, wired and not started.

    ``remote_tiers`` replaces the configured remote tiers (tests and
    benchmarks inject doubles, or real tiers built with a test clock); a bare
    tier gets write policy none."""
    node_id = secrets.token_hex(8)
    keys = Keys(keyrings_of(config))
    ram_bytes = config.ram.capacity_bytes()
    shc, sc, pc = config.shared, config.server, config.peer
    arena = staging = None
    if shc.enabled and hasattr(os, "memfd_create"):
        # A quarter more than the budget: blocks deleted or evicted while
        # still read keep their slots until let go (pages cost nothing until
        # written).
        arena = Arena(ram_bytes + ram_bytes // 4, name="kvtier-ram")
        staging = Arena(shc.staging_bytes, name="kvtier-staging")
    ram_quotas, disk_quotas = quotas_of(config, ram_bytes)
    shared_tiers = bool(config.namespaces)
    ram = RamTier(
        ram_bytes,
        tier_policy(config.ram.policy, ram_bytes, ram_quotas if shared_tiers else None),
        arena=arena,
        min_slot=shc.min_block,
        retained_share=config.ram.retained_share,
    )
    disk = None
    if config.disk.enabled:
        disk_bytes = config.disk.capacity_bytes()
        disk = DiskTier(
            config.disk.path,
            disk_bytes,
            fsync=config.disk.fsync,
            io_threads=config.disk.io_threads,
            policy=tier_policy(
                config.disk.policy, disk_bytes, disk_quotas if shared_tiers else None
            ),
            sealer=Sealer(keys, max_block_bytes=int(sc.max_block_bytes)),
            retained_share=config.ram.retained_share,
        )
    if remote_tiers is None:
        remotes = [
            RemoteSpec(
                build_remote_tier(tc, config.lookup, keys, int(sc.max_block_bytes)),
                WritePolicy(tc.write_policy),
                tc.max_pending_write_bytes,
                tc.max_backlog_bytes if isinstance(tc, S3TierConfig) else 0,
            )
            for tc in config.remote_tiers
        ]
    else:
        remotes = [t if isinstance(t, RemoteSpec) else RemoteSpec(t) for t in remote_tiers]
    #: one sealer between peers, both ways (its counts are the peer tier's)
    peer_sealer = Sealer(keys, Codec[pc.codec.upper()], max_block_bytes=int(sc.max_block_bytes))
    peer_tier = None
    if pc.enabled:
        # First among the remote tiers: a peer answers faster than S3.
        peer_tier = build_peer_tier(pc, node_id, peer_sealer)
        push = WritePolicy.WRITE_THROUGH if pc.push == "owner" else WritePolicy.NONE
        remotes.insert(0, RemoteSpec(peer_tier, push, pc.max_pending_push_bytes))
    scheduler = Scheduler(
        batch_window=config.lookup.probe_batch_window, max_batch=config.lookup.probe_max_batch
    )
    service = Service(
        Limits(
            max_key_bytes=sc.max_key_bytes,
            max_batch=sc.max_batch,
            max_block_bytes=int(sc.max_block_bytes),
        ),
        ram,
        lookup=config.lookup,
        disk=disk,
        disk_cfg=config.disk,
        remotes=remotes,
        scheduler=scheduler,
    )
    shared = None
    offer = None
    if arena is not None and staging is not None:
        shared = SharedBlocks(
            ram,
            staging,
            stores=service.stores,
            unpin=service.unpin,
            now=scheduler.now,
            lease_timeout=shc.lease_timeout,
            staging_timeout=shc.staging_timeout,
            limits=service.limits,
            write_in_place=shc.write_in_place,
            copier=Copier(shc.copy_thread_count()),
        )
        offer = SharedOffer(handoff_path(config), arena.size, staging.size)
    # One poller for the loop: both listeners' requests keep it awake.
    idle_poll = IdlePoll(sc.idle_poll)
    ops = op_table(
        service, node_id, shared=shared, offer=offer, events=service, access=access_of(config)
    )
    peer_ops = op_table(service.local(PEER_TIER, peer_sealer), node_id)
    server = Server(
        ops,
        max_frame=int(sc.max_frame_bytes),
        max_inflight=sc.max_inflight_per_connection,
        peers=PeerPolicy.for_socket(sc.socket_mode, sc.allowed_uids, sc.allowed_gids),
        # Who may connect is checked at accept; an allowed user still has a
        # deadline for its first frame where the socket is shared.
        handshake_timeout=sc.handshake_timeout
        if sc.allowed_uids is not None or sc.allowed_gids is not None
        else None,
        body_timeout=sc.body_timeout,
        idle_poll=idle_poll,
    )
    peer_server = None
    if pc.listen is not None:
        peer_server = Server(
            peer_ops,
            max_frame=int(sc.max_frame_bytes),
            max_inflight=sc.max_inflight_per_connection,
            gate=PeerGate(pc.secret(), allow_delete=pc.allow_delete),
            handshake_timeout=pc.handshake_timeout,
            max_unauthenticated=pc.max_unauthenticated,
            body_timeout=sc.body_timeout,
            idle_poll=idle_poll,
        )
    parts = Parts(
        config=config,
        node_id=node_id,
        metrics=Metrics(),
        arena=arena,
        staging=staging,
        ram=ram,
        disk=disk,
        peer_tier=peer_tier,
        remotes=remotes,
        scheduler=scheduler,
        service=service,
        shared=shared,
        server=server,
        peer_server=peer_server,
        publisher=build_publisher(config.events, service),
        keys=keys,
    )
    _watch(parts)
    return parts


def op_table(
    service: CacheService,
    node_id: str,
    *,
    shared: SharedBlocks | None = None,
    offer: SharedOffer | None = None,
    events: EventSource | None = None,
    access: NamespaceAccess | None = None,
) -> Callable[[Server[Ops]], Ops]:
    """What makes a server's op table over ``service``, offering shared
    memory, block events and namespaces where given (the local socket), or
    none of them (the peer port)."""

    def make(server: Server[Ops]) -> Ops:
        return Ops(
            service,
            max_frame=server.max_frame,
            server_name=server.server_name,
            node_id=node_id,
            server_stats=server.stats,
            shared=shared,
            shared_offer=offer,
            events=events,
            access=access,
            feed=lambda: server.feed,
        )

    return make


def build_publisher(ec: EventsConfig, service: Service) -> KVEventPublisher | None:
    """The KV-event publisher of ``ec`` over the service's block events, or None."""
    if ec.endpoint is None:
        return None
    node = ec.node or socket.gethostname()
    return KVEventPublisher(
        service,
        endpoint=ec.endpoint,
        replay_endpoint=ec.replay_endpoint,
        buffer_steps=ec.buffer_steps,
        hwm=ec.hwm,
        node=node,
        topic=ec.topic,
        medium=ec.medium,
        block_size=ec.block_size,
        key_format=ec.key_format,
    )


def _watch(parts: Parts) -> None:
    """Register every source of metrics: the one place that does."""
    m, server, peer_server = parts.metrics, parts.server, parts.peer_server
    m.watch_server(server.counters, lambda: len(server.connections))
    if peer_server is not None:
        m.watch_peer_listener(peer_server.counters, lambda: len(peer_server.connections))
    m.watch_core(parts.service.counters, parts.service.map_sizes)
    m.watch_events(parts.service.events.stats)
    m.watch_namespaces(parts.service.namespace_stats, parts.config.metrics.max_namespaces)
    m.watch_tiers(lambda: [t.stats() for t in parts.service.tiers()])
    m.watch_sources(parts.service.source_costs)
    m.watch_retention(parts.service.retainer.stats)
    if parts.disk is not None:
        m.watch_disk(parts.disk.stats)
    if parts.peer_tier is not None:
        m.watch_peers(parts.peer_tier)
    for tier in parts.remote_tiers:
        if isinstance(tier, S3Tier):
            m.watch_s3(tier)
    if parts.shared is not None:
        m.watch_shared(parts.shared.stats)
    if parts.publisher is not None:
        publisher = parts.publisher
        m.watch_publisher(lambda: publisher.stats)


def lookups_path(config: Config) -> str:
    """The lookup process's socket beside the main one (docs/lookup-process.md)."""
    return f"{config.server.socket_path}.lookups"


def handoff_path(config: Config) -> str:
    """The socket beside the main one that hands the arena to same-host clients."""
    return f"{config.server.socket_path}.shm"


def build_peer_tier(pc: PeerConfig, node_id: str, sealer: Sealer | None = None) -> PeerTier:
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
    return PeerTier(
        PEER_TIER,
        picker,
        counters,
        replicas=pc.replicas,
        sealer=sealer,
        hedge_after=pc.hedge_after,
        hedge_max_ratio=pc.hedge_max_ratio,
    )


def build_remote_tier(
    tc: RemoteTierConfig, lookup: LookupConfig, keys: Keys, max_block: int = 1 << 30
) -> Tier:
    if isinstance(tc, S3TierConfig):
        return S3Tier(
            tc,
            probe_timeout=lookup.probe_timeout,
            load_timeout=lookup.load_timeout,
            sealer=Sealer(keys, Codec[tc.codec.upper()], max_block_bytes=max_block),
        )
    return MemoryRemoteTier(tc.name)

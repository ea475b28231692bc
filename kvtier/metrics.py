"""Prometheus metrics: every owner's counters, read at scrape time, named once.

The server, the core and the tiers count into plain counters
(:mod:`kvtier.counters`) and keep their own stats; nothing on the request
path touches Prometheus. At scrape time one collector reads them all and
names the series; every series is documented in docs/metrics.md. Only the
daemon registers sources here; nothing below it imports this module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvtier.core.counts import CoreCounters, MapSizes, NamespaceStats
from kvtier.core.events import EventStats
from kvtier.core.shared.blocks import SharedStats
from kvtier.counters import Counts, HistogramCell, Histograms
from kvtier.server.counters import ServerCounters
from kvtier.server.kv_events import PublisherStats
from kvtier.tiers.base import DiskStats, TierStats
from kvtier.tiers.peer import PeerTier
from kvtier.tiers.s3 import S3Tier

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _counter(
    name: str,
    doc: str,
    parts: Counts | Sequence[tuple[Sequence[str], Counts]],
    labels: Sequence[str] = (),
) -> CounterMetricFamily:
    """One family from one ``Counts``, or from several under extra ``labels``."""
    if isinstance(parts, Counts):
        parts = [((), parts)]
    family = CounterMetricFamily(name, doc, labels=[*labels, *parts[0][1].labels])
    for prefix, counts in parts:
        for values, value in counts.samples():
            family.add_metric([*prefix, *values], value)
    return family


def _histogram(
    name: str,
    doc: str,
    parts: Histograms | Sequence[tuple[Sequence[str], Histograms]],
    labels: Sequence[str] = (),
) -> HistogramMetricFamily:
    if isinstance(parts, Histograms):
        parts = [((), parts)]
    family = HistogramMetricFamily(name, doc, labels=[*labels, *parts[0][1].labels])
    for prefix, hists in parts:
        for values, cell in hists.samples():
            family.add_metric([*prefix, *values], _buckets(cell), cell.sum)
    return family


def _buckets(cell: HistogramCell) -> list[tuple[str, float]]:
    return [(floatToGoString(le), float(n)) for le, n in cell.cumulative()]  # type: ignore[no-untyped-call]


@dataclass(slots=True)
class _Sources:
    server: ServerCounters | None = None
    connections_open: Callable[[], int] = lambda: 0
    core: CoreCounters | None = None
    maps: Callable[[], MapSizes] | None = None
    tiers: Callable[[], Iterable[TierStats]] = lambda: ()
    #: each source's load cost now (ttfb_seconds, throughput_bytes ...), by name
    sources: Callable[[], dict[str, dict[str, float]]] = dict
    disk: Callable[[], DiskStats] | None = None
    s3: list[S3Tier] = field(default_factory=list)
    peers: PeerTier | None = None
    peer_listener: ServerCounters | None = None
    peer_connections_open: Callable[[], int] = lambda: 0
    shared: Callable[[], SharedStats] | None = None
    events: Callable[[], EventStats] | None = None
    publisher: Callable[[], PublisherStats] | None = None
    namespaces: Callable[[], list[NamespaceStats]] | None = None
    #: the retention leases' figures (Retainer.stats)
    retention: Callable[[], dict[str, Any]] | None = None
    #: namespaces with series of their own; the rest are summed as "other"
    max_namespaces: int = 32


class _Collector(Collector):
    def __init__(self, sources: _Sources) -> None:
        self._s = sources

    def collect(self) -> Iterator[Metric]:
        s = self._s
        if s.server is not None:
            yield from self._server(s.server)
        if s.core is not None:
            yield from self._core(s.core)
        if s.maps is not None:
            yield from self._maps(s.maps())
        yield from self._tiers(list(s.tiers()))
        yield from self._sources(s.sources())
        if s.disk is not None:
            yield from self._disk(s.disk())
        yield from self._s3(s.s3)
        if s.peers is not None:
            yield from self._peers(s.peers)
        if s.peer_listener is not None:
            yield from self._peer_listener(s.peer_listener)
        if s.shared is not None:
            yield from self._shared(s.shared())
        if s.events is not None:
            yield from self._events(s.events())
        if s.publisher is not None:
            yield from self._publisher(s.publisher())
        if s.namespaces is not None:
            yield from self._namespaces(folded(s.namespaces(), s.max_namespaces))
        if s.retention is not None:
            yield from self._retention(s.retention())

    def _retention(self, r: dict[str, Any]) -> Iterator[Metric]:
        leased = GaugeMetricFamily(
            "kvtier_retention_leased_bytes",
            "Bytes of RAM's blocks under a retention lease, by namespace and priority",
            labels=["namespace", "priority"],
        )
        for ns, by in r["leased_bytes_by_priority"].items():
            for priority, n in by.items():
                leased.add_metric([ns, priority], n)
        yield leased
        yield GaugeMetricFamily(
            "kvtier_retention_sessions", "Sessions holding a retention lease", value=r["sessions"]
        )
        blocks = CounterMetricFamily(
            "kvtier_retention_blocks",
            "Blocks by what happened to their retention lease: granted, renewed, released "
            "(the session ended it), expired (its ttl passed), capped (its namespace's "
            "leased bytes passed the cap: an ordinary block now), superseded (its session's "
            "whole prompt no longer named it), evicted (RAM's room was "
            "needed by leased blocks alone; kept below where a tier takes it), broken "
            "(evicted, and no tier kept it)",
            labels=["event"],
        )
        for event, key in (
            ("granted", "granted"),
            ("renewed", "renewed"),
            ("released", "released"),
            ("expired", "expired"),
            ("capped", "capped"),
            ("superseded", "superseded"),
            ("evicted", "evicted_from_ram"),
            ("broken", "broken"),
        ):
            blocks.add_metric([event], r[key])
        yield blocks
        returns = CounterMetricFamily(
            "kvtier_retention_return_blocks",
            "Blocks a session's lookup asked for while its lease held (asked), and the "
            "leading run of them the local tiers held (held): held / asked is the hit "
            "ratio of sessions that came back within their lease",
            labels=["blocks"],
        )
        returns.add_metric(["asked"], r["returns_asked"])
        returns.add_metric(["held"], r["returns_held"])
        yield returns

    def _namespaces(self, stats: list[NamespaceStats]) -> Iterator[Metric]:
        held = GaugeMetricFamily(
            "kvtier_namespace_bytes",
            "Bytes a namespace holds, by tier (with [namespaces] configured)",
            labels=["namespace", "tier"],
        )
        blocks = GaugeMetricFamily(
            "kvtier_namespace_blocks",
            "Blocks a namespace holds, by tier (with [namespaces] configured)",
            labels=["namespace", "tier"],
        )
        lookups = CounterMetricFamily(
            "kvtier_namespace_lookup_keys",
            "Keys a namespace's LOOKUPs asked for, by answer: hit or miss",
            labels=["namespace", "state"],
        )
        evictions = CounterMetricFamily(
            "kvtier_namespace_evictions",
            "Blocks a namespace lost from RAM to make room",
            labels=["namespace"],
        )
        limits = GaugeMetricFamily(
            "kvtier_namespace_ram_limit_bytes",
            "A namespace's RAM quota: min (guaranteed) and max (absent: the whole tier)",
            labels=["namespace", "limit"],
        )
        for n in stats:
            held.add_metric([n.name, "ram"], n.ram_bytes)
            held.add_metric([n.name, "disk"], n.disk_bytes)
            blocks.add_metric([n.name, "ram"], n.ram_blocks)
            blocks.add_metric([n.name, "disk"], n.disk_blocks)
            lookups.add_metric([n.name, "hit"], n.hits)
            lookups.add_metric([n.name, "miss"], n.misses)
            evictions.add_metric([n.name], n.evictions)
            limits.add_metric([n.name, "min"], n.ram_min)
            if n.ram_max is not None:
                limits.add_metric([n.name, "max"], n.ram_max)
        yield from (held, blocks, lookups, evictions, limits)

    def _publisher(self, st: PublisherStats) -> Iterator[Metric]:
        blocks = CounterMetricFamily(
            "kvtier_kv_events_blocks",
            "Blocks announced to routers on the KV event stream, by event",
            labels=["event"],
        )
        blocks.add_metric(["stored"], st.stored)
        blocks.add_metric(["removed"], st.removed)
        yield blocks
        for name, doc, value in (
            ("kvtier_kv_events_batches", "KV event batches published", st.batches),
            (
                "kvtier_kv_events_resyncs",
                "Times routers were resynced (AllBlocksCleared and every block held)",
                st.resyncs,
            ),
            ("kvtier_kv_events_replays", "Replay requests served", st.replays),
        ):
            yield CounterMetricFamily(name, doc, value=value)

    def _events(self, st: EventStats) -> Iterator[Metric]:
        published = CounterMetricFamily(
            "kvtier_events_published",
            "Block events published (SUBSCRIBE), by kind: stored, evicted, deleted",
            labels=["kind"],
        )
        for kind, n in st.published.items():
            published.add_metric([kind], n)
        yield published
        yield GaugeMetricFamily(
            "kvtier_event_subscribers",
            "Connections streaming block events now",
            value=st.subscribers,
        )
        yield CounterMetricFamily(
            "kvtier_event_gaps",
            "Overflows of a subscriber's event queue (it lost events and resyncs from a snapshot)",
            value=st.gaps,
        )
        yield GaugeMetricFamily(
            "kvtier_event_sequence", "The last block event's sequence number", value=st.seq
        )

    def _shared(self, st: SharedStats) -> Iterator[Metric]:
        leases = GaugeMetricFamily(
            "kvtier_shared_leases", "Leases held now on blocks read in place"
        )
        leases.add_metric([], st.leases)
        yield leases
        ended = CounterMetricFamily(
            "kvtier_shared_leases_ended",
            "Leases ended, by how: released, closed (the client went away), revoked (deadline)",
            labels=["end"],
        )
        for end, n in st.leases_ended.items():
            ended.add_metric([end], n)
        yield ended
        for name, doc, value in (
            ("kvtier_shared_arena_bytes", "Size of the shared RAM arena", st.arena_bytes),
            (
                "kvtier_shared_arena_allocated_bytes",
                "Arena bytes holding blocks (slot sizes)",
                st.arena_allocated_bytes,
            ),
            ("kvtier_shared_staging_bytes", "Size of the staging region", st.staging_bytes),
            (
                "kvtier_shared_staging_allocated_bytes",
                "Staging bytes handed to clients now",
                st.staging_allocated_bytes,
            ),
            (
                "kvtier_shared_regions",
                "Clients' memory files the daemon copies blocks to and from, held now",
                st.regions,
            ),
            (
                "kvtier_shared_in_place_rooms",
                "RAM slots clients are writing blocks into in place now",
                st.in_place_rooms,
            ),
            (
                "kvtier_shared_region_rooms",
                "RAM slots made ahead for connections' next PUT_REGION, held now",
                st.region_rooms,
            ),
            (
                "kvtier_shared_in_place_quarantined",
                "In-place rooms of closed connections, freed after the staging timeout",
                st.in_place_quarantined,
            ),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        region_bytes = CounterMetricFamily(
            "kvtier_shared_region_bytes",
            "Bytes the daemon copied out of clients' regions (in) and into them (out)",
            labels=["direction"],
        )
        region_bytes.add_metric(["in"], st.region_bytes_in)
        region_bytes.add_metric(["out"], st.region_bytes_out)
        yield region_bytes
        for name, doc, value in (
            (
                "kvtier_shared_staging_expired",
                "Staging rooms reclaimed after the staging timeout",
                st.staging_expired,
            ),
            (
                "kvtier_shared_in_place_commits",
                "Blocks stored where their writer wrote them (COMMIT in place: no copy)",
                st.in_place_commits,
            ),
            (
                "kvtier_shared_commits_refused",
                "COMMITs refused: wrong checksum or length, or not the client's room",
                st.commits_refused,
            ),
            (
                "kvtier_shared_leased_bytes",
                "Bytes of blocks leased to clients (read without crossing the socket)",
                st.leased_bytes,
            ),
        ):
            yield CounterMetricFamily(name, doc, value=value)

    def _server(self, c: ServerCounters) -> Iterator[Metric]:
        yield _counter("kvtier_requests", "Requests handled, by operation and outcome", c.requests)
        yield _histogram(
            "kvtier_request_duration_seconds",
            "Time from a request frame's arrival to its reply being queued, by operation",
            c.request_seconds,
        )
        yield _counter(
            "kvtier_protocol_errors",
            "Frames rejected before reaching the service, by error code",
            c.protocol_errors,
        )
        yield GaugeMetricFamily(
            "kvtier_connections_open",
            "Client connections currently open",
            value=self._s.connections_open(),
        )
        yield CounterMetricFamily(
            "kvtier_connections", "Client connections accepted", value=c.connections.value
        )
        yield _counter(
            "kvtier_connections_refused",
            "Connections refused at accept, by reason: not_allowed (uid/gid not listed), "
            "no_credentials (the peer's credentials could not be read)",
            c.connections_refused,
        )
        yield CounterMetricFamily(
            "kvtier_received_bytes",
            "Bytes of frames received from clients",
            value=c.received_bytes.value,
        )
        yield CounterMetricFamily(
            "kvtier_sent_bytes", "Bytes of frames sent to clients", value=c.sent_bytes.value
        )
        yield _counter(
            "kvtier_lookup_process_lookups",
            "Lookups at the lookup process's socket, by outcome: answered there, or "
            "referred (the client asked the daemon)",
            c.lookup_process,
        )
        yield CounterMetricFamily(
            "kvtier_lookup_process_restarts",
            "Times the lookup process was started again after it went",
            value=c.lookup_restarts.value,
        )

    def _peers(self, tier: PeerTier) -> Iterator[Metric]:
        c = tier.counters
        yield _counter(
            "kvtier_peer_requests",
            "Requests to peer daemons by peer, operation (lookup, get, put) and outcome "
            "(ok, error, timeout, rejected: the peer is down, cancelled)",
            c.requests,
        )
        yield _counter(
            "kvtier_peer_bytes",
            "Block bytes moved to and from peers, by direction (in: loaded, out: pushed)",
            c.bytes,
        )
        yield _histogram(
            "kvtier_peer_probe_duration_seconds",
            "Time of one LOOKUP at a peer (a batch of probed keys)",
            c.probe_seconds,
        )
        yield _counter(
            "kvtier_peer_connects", "Connection attempts to peers, by outcome", c.connects
        )
        up = GaugeMetricFamily(
            "kvtier_peer_up", "1 while a peer is in use, 0 while it is down", labels=["peer"]
        )
        for peer in tier.picker.peers():
            up.add_metric([peer.address], int(peer.up))
        yield up

    def _peer_listener(self, c: ServerCounters) -> Iterator[Metric]:
        yield _counter(
            "kvtier_peer_listener_requests",
            "Requests from peer daemons on the peer port, by operation and outcome",
            c.requests,
        )
        yield _counter(
            "kvtier_peer_listener_refused",
            "Peer-port connections refused before anything was served, by reason: "
            "not_hello (not a kvtier peer), malformed_hello, no_token, bad_token",
            c.connections_refused,
        )
        yield GaugeMetricFamily(
            "kvtier_peer_listener_connections_open",
            "Peer connections currently open",
            value=self._s.peer_connections_open(),
        )
        yield CounterMetricFamily(
            "kvtier_peer_listener_received_bytes",
            "Bytes received on the peer port",
            value=c.received_bytes.value,
        )
        yield CounterMetricFamily(
            "kvtier_peer_listener_sent_bytes",
            "Bytes sent on the peer port",
            value=c.sent_bytes.value,
        )

    def _core(self, c: CoreCounters) -> Iterator[Metric]:
        yield _counter("kvtier_lookup_keys", "Keys answered by LOOKUP, by state", c.lookup_keys)
        yield _counter(
            "kvtier_probes",
            "Remote-tier key probes by outcome: started (backend asked), joined (a probe "
            "was in flight), cached (answered by a kept verdict)",
            c.probes,
        )
        yield _counter("kvtier_probe_verdicts", "Probe results by verdict", c.probe_verdicts)
        yield _counter(
            "kvtier_probe_failures",
            "Keys whose probe failed, by kind: error, timeout, bad_result",
            c.probe_failures,
        )
        yield _counter(
            "kvtier_probe_superseded",
            "Probe results dropped because the key was invalidated meanwhile",
            c.probe_superseded,
        )
        yield _counter(
            "kvtier_probe_late",
            "Probe answers that came after the probe deadline had resolved them; dropped",
            c.probe_late,
        )
        yield _histogram(
            "kvtier_probe_batch_size", "Keys per batch_lookup call", c.probe_batch_size
        )
        yield _counter(
            "kvtier_reservations",
            "Pending-write events: granted, refused, completed, aborted, released, expired",
            c.reservations,
        )
        yield CounterMetricFamily(
            "kvtier_pending_deadline_expired",
            "PENDING blocks aborted at their write deadline",
            value=c.pending_deadline_expired.value,
        )
        yield CounterMetricFamily(
            "kvtier_lookup_pending_expired",
            "PENDING keys answered MISS to a request past its max_pending_wait",
            value=c.lookup_pending_expired.value,
        )
        yield _counter(
            "kvtier_put_hints",
            "Blocks stored with a writer's hint, by hint (tail: admitted first in eviction order)",
            c.put_hints,
        )
        yield CounterMetricFamily(
            "kvtier_lookup_peeks",
            "LOOKUPs that only peeked: answered without touching the eviction order",
            value=c.lookup_peeks.value,
        )
        yield _counter(
            "kvtier_lookup_budget_cut",
            "Keys a LOOKUP's budget answered MISS (loading them would not save the "
            "engine time against recomputing them), by the tier they would have loaded from",
            c.lookup_budget_cut,
        )
        deferred = c.lookup_deferred_seconds
        family = HistogramMetricFamily(
            "kvtier_lookup_deferred_seconds",
            "How long a request tag was deferred behind one PENDING key",
        )
        family.add_metric([], _buckets(deferred), deferred.sum)
        yield family
        yield _counter(
            "kvtier_promotions",
            "Loads from a lower tier into RAM by outcome: started, completed, absent, failed",
            c.promotions,
        )
        yield _counter(
            "kvtier_demotions",
            "Blocks evicted from RAM and written to a lower tier (write-back), by outcome",
            c.demotions,
        )
        yield _counter(
            "kvtier_tier_writes_dropped",
            "Background writes to a lower tier that were given up: cause backlog (no room: "
            "in flight past the bound, or owed past max_backlog_bytes), failed (the tier "
            "refused and keeps no backlog) or gone (owed, and no local tier held it when sent)",
            c.writes_dropped,
        )
        yield _counter(
            "kvtier_tier_writes_owed",
            "Writes to a remote tier it failed (an outage, a timeout), kept owed and sent "
            "again once it takes writes",
            c.writes_owed,
        )

    def _maps(self, m: MapSizes) -> Iterator[Metric]:
        for name, doc, by_tier in (
            ("kvtier_probes_inflight", "Remote existence probes in flight", m.probes_inflight),
            ("kvtier_verdicts_cached", "Probe verdicts held for reuse", m.verdicts_cached),
            (
                "kvtier_tier_owed_blocks",
                "Blocks a remote tier is owed: written and not yet stored there",
                m.owed_blocks,
            ),
            ("kvtier_tier_owed_bytes", "Bytes of the blocks a remote tier is owed", m.owed_bytes),
        ):
            family = GaugeMetricFamily(name, doc, labels=["tier"])
            for tier, n in by_tier.items():
                family.add_metric([tier], n)
            yield family
        yield GaugeMetricFamily(
            "kvtier_pending_writes",
            "Blocks reading PENDING: reservations and promotions in flight",
            value=m.pending_writes,
        )
        yield GaugeMetricFamily(
            "kvtier_request_states",
            "Request tags with reader-side PENDING state",
            value=m.request_states,
        )

    def _tiers(self, stats: list[TierStats]) -> Iterator[Metric]:
        used = GaugeMetricFamily(
            "kvtier_tier_used_bytes", "Bytes resident in a tier", labels=["tier"]
        )
        blocks = GaugeMetricFamily(
            "kvtier_tier_blocks", "Blocks resident in a tier", labels=["tier"]
        )
        cap = GaugeMetricFamily(
            "kvtier_tier_capacity_bytes", "Configured capacity of a tier", labels=["tier"]
        )
        evictions = CounterMetricFamily(
            "kvtier_tier_evictions", "Blocks evicted from a tier to make room", labels=["tier"]
        )
        for st in stats:
            used.add_metric([st.name], st.used_bytes)
            blocks.add_metric([st.name], st.blocks)
            cap.add_metric([st.name], st.capacity_bytes)
            evictions.add_metric([st.name], st.evictions)
        yield from (used, blocks, cap, evictions)
        hedged = [st for st in stats if st.hedges is not None]
        if hedged:
            family = CounterMetricFamily(
                "kvtier_hedged_reads",
                "Reads from a tier unanswered past its usual time that asked another holder "
                "too (a peer's next owner, the object again, a lower tier): won (the hedge "
                "delivered first), lost (the first read did), skipped (the hedge budget, "
                "hedge_max_ratio of reads, had no token)",
                labels=["tier", "outcome"],
            )
            for st in hedged:
                for outcome, n in (st.hedges or {}).items():
                    family.add_metric([st.name, outcome], n)
            yield family
        yield from self._sealing([st for st in stats if st.seal_failures is not None])

    def _sources(self, sources: dict[str, dict[str, float]]) -> Iterator[Metric]:
        latency = GaugeMetricFamily(
            "kvtier_source_latency_seconds",
            "A source's time to its first byte, as estimated from the loads it served "
            "(its prior before any); what a LOOKUP's budget is weighed against",
            labels=["tier"],
        )
        throughput = GaugeMetricFamily(
            "kvtier_source_throughput_bytes",
            "A source's bytes a second past its first, as estimated from its loads",
            labels=["tier"],
        )
        for name, cost in sources.items():
            latency.add_metric([name], cost["ttfb_seconds"])
            throughput.add_metric([name], cost["throughput_bytes"])
        yield from (latency, throughput)

    def _sealing(self, stats: list[TierStats]) -> Iterator[Metric]:
        sealed = CounterMetricFamily(
            "kvtier_sealed_bytes",
            "Plain bytes of blocks encrypted where they left RAM for a tier "
            "(namespaces with an encryption key)",
            labels=["tier"],
        )
        opened = CounterMetricFamily(
            "kvtier_opened_bytes",
            "Plain bytes of blocks decrypted where they came back from a tier",
            labels=["tier"],
        )
        packed = CounterMetricFamily(
            "kvtier_codec_bytes",
            "Bytes a tier's codec was given (side=in) and made of them (side=out); "
            "out / in is its compression ratio's inverse",
            labels=["tier", "side"],
        )
        failures = CounterMetricFamily(
            "kvtier_seal_failures",
            "Blocks that did not open, answered as misses, by reason: no_key (sealed "
            "under a key not configured), auth (altered, moved or another key's), plain "
            "(not sealed where its namespace seals), format",
            labels=["tier", "reason"],
        )
        for st in stats:
            sealed.add_metric([st.name], st.sealed_bytes or 0)
            opened.add_metric([st.name], st.opened_bytes or 0)
            packed.add_metric([st.name, "in"], st.packed_in_bytes or 0)
            packed.add_metric([st.name, "out"], st.packed_out_bytes or 0)
            for reason, n in (st.seal_failures or {}).items():
                failures.add_metric([st.name, reason], n)
        yield from (sealed, opened, packed, failures)

    def _disk(self, st: DiskStats) -> Iterator[Metric]:
        for name, doc, value in (
            ("kvtier_disk_reads", "Blocks read from the disk tier", st.reads),
            ("kvtier_disk_read_bytes", "Value bytes read from the disk tier", st.read_bytes),
            ("kvtier_disk_writes", "Blocks written to the disk tier", st.writes),
            ("kvtier_disk_written_bytes", "Value bytes written to the disk tier", st.written_bytes),
            (
                "kvtier_disk_corrupt_blocks",
                "Torn or corrupt block files discarded (never served)",
                st.corrupt_discarded,
            ),
            (
                "kvtier_disk_full_errors",
                "Writes that failed because the disk was full",
                st.enospc,
            ),
            ("kvtier_disk_write_errors", "Writes that failed for any reason", st.write_errors),
            (
                "kvtier_disk_index_compactions",
                "Snapshots of the disk index written (its journal compacted)",
                st.index_compactions,
            ),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily(
            "kvtier_disk_index_load_seconds",
            "Seconds the disk index took to load from its files at start (0 after a scan)",
            value=st.index_load_seconds if st.index_loaded_from == "snapshot" else 0.0,
        )
        yield GaugeMetricFamily(
            "kvtier_disk_index_journal_bytes",
            "Bytes journalled since the disk index's last snapshot",
            value=st.index_journal_bytes,
        )
        yield GaugeMetricFamily(
            "kvtier_disk_index_rebuild_progress",
            "Fraction of the disk index rebuilt since start (1 = complete)",
            value=st.index_buckets_scanned / (st.index_buckets_total or 1),
        )
        yield GaugeMetricFamily(
            "kvtier_disk_filesystem_free_bytes",
            "Free bytes (for unprivileged users) on the filesystem holding disk.path",
            value=st.filesystem_free_bytes,
        )
        yield GaugeMetricFamily(
            "kvtier_disk_filesystem_size_bytes",
            "Size of the filesystem holding disk.path",
            value=st.filesystem_size_bytes,
        )

    def _s3(self, tiers: list[S3Tier]) -> Iterator[Metric]:
        if not tiers:
            return
        named = [([t.name], t.counters) for t in tiers]
        yield _counter(
            "kvtier_s3_requests",
            "S3 requests by operation (head, get, put, delete) and outcome (ok, not_found, "
            "error, timeout, rejected: refused by the open circuit breaker)",
            [(n, c.requests) for n, c in named],
            ["tier"],
        )
        yield _histogram(
            "kvtier_s3_request_duration_seconds",
            "S3 request latency, retries included",
            [(n, c.seconds) for n, c in named],
            ["tier"],
        )
        yield _counter(
            "kvtier_s3_bytes",
            "Object bytes moved, by direction (in, out)",
            [(n, c.bytes) for n, c in named],
            ["tier"],
        )
        yield _counter(
            "kvtier_s3_retries",
            "Retries botocore made, by operation",
            [(n, c.retries) for n, c in named],
            ["tier"],
        )
        corrupt = CounterMetricFamily(
            "kvtier_s3_corrupt_objects",
            "Objects whose checksum did not match; answered as a miss, never served",
            labels=["tier"],
        )
        breaker = GaugeMetricFamily(
            "kvtier_s3_breaker_state",
            "Circuit breaker state: 0 closed, 1 half-open (one trial request), 2 open",
            labels=["tier"],
        )
        for tier in tiers:
            corrupt.add_metric([tier.name], tier.counters.corrupt.value)
            breaker.add_metric([tier.name], int(tier.breaker.state))
        yield corrupt
        yield breaker


def folded(stats: list[NamespaceStats], most: int) -> list[NamespaceStats]:
    """The first ``most`` namespaces (configured ones first, then in the order
    they were first seen: a namespace keeps its series) and one "other" that
    sums the rest, so the series stay bounded however many namespaces come."""
    if len(stats) <= most:
        return stats
    rest = stats[most:]
    other = NamespaceStats(
        name="other",
        ram_bytes=sum(n.ram_bytes for n in rest),
        ram_blocks=sum(n.ram_blocks for n in rest),
        disk_bytes=sum(n.disk_bytes for n in rest),
        disk_blocks=sum(n.disk_blocks for n in rest),
        evictions=sum(n.evictions for n in rest),
        hits=sum(n.hits for n in rest),
        misses=sum(n.misses for n in rest),
        ram_min=sum(n.ram_min for n in rest),
        ram_max=None,
    )
    return [*stats[:most], other]


class Metrics:
    """The series of one daemon. The daemon tells it where each owner's counters are."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._sources = _Sources()
        self.registry.register(_Collector(self._sources))

    def __repr__(self) -> str:
        s = self._sources
        return f"<Metrics server={s.server is not None} core={s.core is not None} s3={len(s.s3)}>"

    def watch_server(self, counters: ServerCounters, connections_open: Callable[[], int]) -> None:
        self._sources.server = counters
        self._sources.connections_open = connections_open

    def watch_peers(self, tier: PeerTier) -> None:
        self._sources.peers = tier

    def watch_peer_listener(
        self, counters: ServerCounters, connections_open: Callable[[], int]
    ) -> None:
        self._sources.peer_listener = counters
        self._sources.peer_connections_open = connections_open

    def watch_core(self, counters: CoreCounters, maps: Callable[[], MapSizes]) -> None:
        self._sources.core = counters
        self._sources.maps = maps

    def watch_tiers(self, stats: Callable[[], Iterable[TierStats]]) -> None:
        self._sources.tiers = stats

    def watch_sources(self, costs: Callable[[], dict[str, dict[str, float]]]) -> None:
        self._sources.sources = costs

    def watch_shared(self, stats: Callable[[], SharedStats]) -> None:
        self._sources.shared = stats

    def watch_events(self, stats: Callable[[], EventStats]) -> None:
        self._sources.events = stats

    def watch_publisher(self, stats: Callable[[], PublisherStats]) -> None:
        self._sources.publisher = stats

    def watch_namespaces(self, stats: Callable[[], list[NamespaceStats]], most: int) -> None:
        self._sources.namespaces = stats
        self._sources.max_namespaces = most

    def watch_retention(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._sources.retention = stats

    def watch_disk(self, stats: Callable[[], DiskStats]) -> None:
        self._sources.disk = stats

    def watch_s3(self, tier: S3Tier) -> None:
        self._sources.s3.append(tier)

    def render(self) -> bytes:
        return generate_latest(self.registry)

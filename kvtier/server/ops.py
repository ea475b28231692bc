"""The op table: decode a request, call the service, encode its answer.

Each handler is synchronous: it returns a :class:`Reply` when the service
answered at once (``try_*``), or a :class:`Later` holding the awaitable of
the service's async verb of the same name. The service is any
:class:`~kvtier.model.CacheService`; this module never imports the core.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from kvtier import blockcopy, wire
from kvtier.errors import BadArgumentError, ForbiddenError, UnsupportedVersionError
from kvtier.model import (
    DEFAULT_NAMESPACE,
    BlockEvent,
    Buffer,
    CacheService,
    ConnId,
    Copied,
    EventSource,
    Leased,
    Lookup,
    LookupMode,
    LookupReply,
    PutStatus,
    Retention,
    SharedService,
    client_key,
    namespace_id,
    namespace_name,
    namespace_prefix,
)
from kvtier.server.connection import Connection, Handler, Later, Reply
from kvtier.server.sockets import Peer
from kvtier.wire import DEFAULT_SCOPE, NO_KEYS, Frame, KeyScope, Op

#: events one subscriber may have queued by default, and at most (past it:
#: a gap, and the subscriber resyncs from a snapshot)
EVENT_QUEUE = 65536
MAX_EVENT_QUEUE = 1 << 20
#: events per streamed frame
EVENT_BATCH = 1024
#: blocks one loop step stores at most: a PUT of more is stored over several
#: steps (about 1 ms each for 4 KiB blocks), with lookups answered between
PUT_STEP = 128


@dataclass(frozen=True, slots=True)
class NamespaceAccess:
    """Which local uids may use which namespace (docs/tenancy.md).

    A namespace with a uid list (``[namespaces.<name>] uids``) is open to
    those uids only; one without, to every uid the socket admits. With
    ``strict``, a HELLO may name only a configured namespace. A connection
    that names none is in the default namespace, and needs no HELLO."""

    uids: dict[bytes, frozenset[int]] = field(default_factory=dict)
    configured: frozenset[bytes] = frozenset()
    strict: bool = False

    def check(self, ns: bytes, peer: Peer | None) -> None:
        """Raise ForbiddenError unless ``peer`` may use namespace ``ns``."""
        if self.strict and ns and ns not in self.configured:
            raise ForbiddenError(f"namespace {namespace_name(ns)!r} is not configured here")
        allowed = self.uids.get(ns)
        if allowed is not None and (peer is None or peer.uid not in allowed):
            who = f"uid {peer.uid}" if peer is not None else "a client without credentials"
            raise ForbiddenError(f"{who} may not use namespace {namespace_name(ns)!r}")

    def scope_for(self, name: str, peer: Peer | None) -> tuple[bytes, KeyScope]:
        """The namespace a HELLO names (empty: the default one) and the keys a
        connection of it may name; BadArgumentError for a bad name,
        ForbiddenError where ``peer`` may not use it."""
        try:
            ns = namespace_id(name or "default")
        except ValueError as exc:
            raise BadArgumentError(str(exc)) from None
        self.check(ns, peer)
        return ns, KeyScope(namespace_prefix(ns)) if ns else DEFAULT_SCOPE

    def to_json(self) -> dict[str, Any]:
        """As the lookup process is told it (namespace ids in hex)."""
        return {
            "uids": {ns.hex(): sorted(uids) for ns, uids in self.uids.items()},
            "configured": sorted(ns.hex() for ns in self.configured),
            "strict": self.strict,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> NamespaceAccess:
        return cls(
            uids={bytes.fromhex(ns): frozenset(uids) for ns, uids in d["uids"].items()},
            configured=frozenset(bytes.fromhex(ns) for ns in d["configured"]),
            strict=bool(d["strict"]),
        )

    def first_scope(self, peer: Peer | None) -> KeyScope:
        """A new local connection's scope: the default namespace, or (when its
        uid may not use that) nothing until a HELLO names one it may."""
        try:
            self.check(DEFAULT_NAMESPACE, peer)
        except ForbiddenError:
            return NO_KEYS
        return DEFAULT_SCOPE


def agreed_version(hello: wire.Hello) -> int:
    """The protocol version a HELLO and this server both speak (the highest),
    or UnsupportedVersionError."""
    version = wire.negotiate_version(hello)
    if version is None:
        raise UnsupportedVersionError(
            f"client speaks versions {hello.min_version}..{hello.max_version}; "
            f"this server speaks {list(wire.SUPPORTED_VERSIONS)}"
        )
    return version


class Feed(Protocol):
    """The lookup process's feed, as the handlers use it: told of stores a
    reply confirms (before it goes, and of what did not land after), and
    read for the process's reports before a RELEASE."""

    def read_reports(self) -> None: ...

    def announce(self, keys: Sequence[bytes]) -> None: ...

    def settle(self, keys: Sequence[bytes]) -> None: ...

    def stats(self) -> dict[str, object]: ...


class Ops:
    """Handlers by opcode, over one service."""

    def __init__(
        self,
        service: CacheService,
        *,
        max_frame: int,
        server_name: str,
        server_stats: Callable[[], dict[str, Any]],
        node_id: str = "",
        shared: SharedService | None = None,
        shared_offer: wire.SharedOffer | None = None,
        events: EventSource | None = None,
        access: NamespaceAccess | None = None,
        feed: Callable[[], Feed | None] = lambda: None,
    ) -> None:
        """``feed``: the lookup process's feed now (None without one)."""
        self.service = service
        self._feed = feed
        #: who may use which namespace; None: no namespaces (the peer port,
        #: whose keys are stored keys already)
        self.access = access
        #: the block events SUBSCRIBE streams; None: not offered (a peer port)
        self.events = events
        #: leases and staging for clients that opt in at HELLO; None: not offered
        self.shared = shared
        self.shared_offer = shared_offer if shared is not None else None
        #: keys one request may carry, checked before a key list is decoded
        self.max_batch = service.limits.max_batch
        self.max_frame = max_frame
        self.server_name = server_name
        self.node_id = node_id
        self._server_stats = server_stats
        self.drop_staged, self.write_room = service.drop_staged, service.write_room
        self.handlers: dict[int, Handler] = {
            Op.HELLO: self.hello,
            Op.PING: self.ping,
            Op.STATS: self.stats,
            Op.LOOKUP: self.lookup,
            Op.GET: self.get,
            Op.PUT: self.put,
            Op.DELETE: self.delete,
            Op.RESERVE: self.reserve,
            Op.ABORT: self.abort,
            Op.RELEASE: self.release,
            Op.RETAIN: self.retain,
            Op.UNRETAIN: self.unretain,
            Op.GET_SHARED: self.get_shared,
            Op.UNLEASE: self.unlease,
            Op.STAGE: self.stage,
            Op.COMMIT: self.commit,
            Op.COMMIT_MANY: self.commit_many,
            Op.UNSTAGE: self.unstage,
            Op.REGION: self.region,
            Op.PUT_REGION: self.put_region,
            Op.GET_REGION: self.get_region,
            Op.SUBSCRIBE: self.subscribe,
        }

    def __repr__(self) -> str:
        return f"<Ops {len(self.handlers)} handlers over {type(self.service).__name__}>"

    def connection_closed(self, owner: ConnId, writer_gone: bool = False) -> None:
        """``owner`` closed, or sent EOF (``writer_gone``: its process has exited)."""
        self.service.connection_closed(owner)
        if self.shared is not None:
            self.shared.connection_closed(owner, writer_gone)

    def hello(self, conn: Connection, frame: Frame) -> Reply:
        hello = wire.decode_hello(frame.meta)
        version = agreed_version(hello)
        if self.access is not None:
            conn.namespace, conn.scope = self.access.scope_for(hello.namespace, conn.peer)
        elif hello.namespace:
            raise ForbiddenError("namespaces are named on the local socket, not the peer port")
        limits = self.service.limits
        offer = self.shared_offer if hello.shared else None
        conn.shared = offer is not None
        return Reply(
            wire.encode_hello_reply(
                wire.HelloReply(
                    version=version,
                    max_key_bytes=limits.max_key_bytes,
                    max_batch=limits.max_batch,
                    max_frame_bytes=self.max_frame,
                    max_block_bytes=limits.max_block_bytes,
                    server_name=self.server_name,
                    node_id=self.node_id,
                    shared=offer,
                )
            )
        )

    def ping(self, conn: Connection, frame: Frame) -> Reply:
        return Reply(bytes(frame.meta))

    def stats(self, conn: Connection, frame: Frame) -> Reply:
        stats = self.service.stats()
        if conn.namespace and "namespaces" in stats:  # a tenant sees its own line only
            name = namespace_name(conn.namespace)
            stats["namespaces"] = {k: v for k, v in stats["namespaces"].items() if k == name}
        stats["server"] = self._server_stats()
        if self.shared is not None:
            stats["shared"] = self.shared.stats().as_dict()
        return Reply(wire.encode_json(stats))

    def lookup(self, conn: Connection, frame: Frame) -> Reply | Later:
        retention, meta = None, frame.meta
        if frame.header.flags & wire.FLAG_RETAIN:
            retention, meta = self._retention(frame)
        req = wire.decode_lookup(meta, self.max_batch, conn.scope)
        if conn.namespace and req.request_tag:  # tags are a namespace's own too
            req = scoped_tag(req, namespace_prefix(conn.namespace))
        if retention is not None:  # (renewed before the answer touches them)
            whole = req.whole and req.mode is LookupMode.PREFIX
            self.service.retain(req.keys, retention, lookup=True, whole=whole)
        reply = self.service.lookup(req, conn.eof)
        if isinstance(reply, LookupReply):
            if retention is not None:  # (the blocks the lookup is loading into RAM)
                self.service.retain_arriving(req.keys, retention)
            return Reply(wire.encode_lookup_reply(reply))
        if retention is not None:
            return Later(reply, partial(self._leased_reply, req.keys, retention), True)
        return Later(reply, _lookup_reply, cancel_on_close=True)

    def _leased_reply(
        self, keys: Sequence[bytes], retention: Retention, reply: LookupReply
    ) -> Reply:
        """A leased lookup that waited is answered: the lease reaches what
        landed meanwhile and what is landing now."""
        self.service.retain_arriving(keys, retention)
        return _lookup_reply(reply)

    def get(self, conn: Connection, frame: Frame) -> Reply | Later:
        keys = self._only_keys(conn, frame, "GET")
        values = self.service.get(keys)
        if isinstance(values, list):
            return self._get_reply(keys, values)
        return Later(values, partial(self._get_reply, keys))

    def _get_reply(self, keys: list[bytes], values: list[Buffer | None]) -> Reply:
        """The reply holds the pins until its frame is handed to the transport."""
        try:
            meta, data = wire.encode_get_reply(values)
        except BaseException:
            self.service.unpin(keys, values)
            raise
        return Reply(meta, data, on_sent=lambda: self.service.unpin(keys, values))

    def receive_into(
        self, conn: Connection, header: wire.Header, meta: Buffer | None
    ) -> memoryview | None:
        """Where a PUT's body lands: a RAM slot when it holds one block (the
        block is then stored without a copy), else a buffer of its own."""
        if header.opcode != Op.PUT or meta is None or not wire.single_key(meta):
            return None
        try:
            keys, _, _ = wire.decode_keys(meta, 0, 1, conn.scope)
        except (wire.CodecError, ForbiddenError):
            return None  # the handler reports it
        view = self.service.stage(header.data_len, keys[0])
        if view is not None:
            blockcopy.fault_in(view)  # (the kernel's copy into it then faults no page)
        return view

    def put(self, conn: Connection, frame: Frame) -> Reply | Later:
        durable = bool(frame.header.flags & wire.FLAG_DURABLE)
        try:
            retention, meta = self._retention(frame)
            hinted = bool(frame.header.flags & wire.FLAG_HINTS)
            keys, values, hints = wire.decode_put(
                meta, frame.data, self.max_batch, hinted=hinted, scope=conn.scope
            )
            if len(keys) > PUT_STEP:
                steps = self._put_in_steps(keys, values, hints, durable, retention)
                return Later(steps, _put_reply)
            statuses = self.service.put(keys, values, hints=hints)
            if retention is not None:
                self.service.retain(keys, retention)
        finally:
            self.service.drop_staged(frame.data)  # unless stored
        if durable:
            # Held for the disk in this same step: nothing can evict them first.
            written = self.service.make_durable(keys, values)
            return Later(written, lambda _: _put_reply(statuses))
        return _put_reply(statuses)

    async def _put_in_steps(
        self,
        keys: list[bytes],
        values: list[Buffer],
        hints: bytes | None,
        durable: bool,
        retention: Retention | None,
    ) -> list[PutStatus]:
        """A PUT of many blocks, PUT_STEP blocks per loop step: lookups and
        other connections are answered between the steps."""
        statuses: list[PutStatus] = []
        written = []
        for lo in range(0, len(keys), PUT_STEP):
            hi = lo + PUT_STEP
            step = self.service.put(
                keys[lo:hi], values[lo:hi], hints=hints[lo:hi] if hints is not None else None
            )
            statuses += step
            if retention is not None:
                self.service.retain(keys[lo:hi], retention)
            if durable:  # held for the disk in the step that stored them
                written.append(self.service.make_durable(keys[lo:hi], values[lo:hi]))
            await asyncio.sleep(0)  # allow-sleep: yields the loop; waits for nothing
        for w in written:
            await w
        return statuses

    def delete(self, conn: Connection, frame: Frame) -> Reply | Later:
        keys = self._only_keys(conn, frame, "DELETE")
        deleted = self.service.delete(keys)
        if isinstance(deleted, list):
            return _delete_reply(deleted)
        return Later(deleted, _delete_reply)

    def reserve(self, conn: Connection, frame: Frame) -> Reply:
        if frame.data:
            raise wire.CodecError("RESERVE carries no data")
        req = wire.decode_reserve(frame.meta, self.max_batch, conn.scope)
        statuses = self.service.reserve(req, conn.conn_id)
        return Reply(wire.encode_status_bytes(statuses))

    def abort(self, conn: Connection, frame: Frame) -> Reply:
        aborted = self.service.abort(self._only_keys(conn, frame, "ABORT"), conn.conn_id)
        return Reply(wire.encode_status_bytes(aborted))

    def release(self, conn: Connection, frame: Frame) -> Reply:
        if frame.data:
            raise wire.CodecError("RELEASE carries no data")
        tag = wire.decode_tag(frame.meta)
        if conn.namespace:  # tags are a namespace's own too
            tag = namespace_tag(namespace_prefix(conn.namespace), tag)
        feed = self._feed()
        if feed is not None:
            # A lookup of the tag the lookup process answered before the
            # client sent this was reported before its answer: hear of it now.
            feed.read_reports()
        existed = self.service.release(tag)
        return Reply(bytes([int(existed)]))

    # -- stores the lookup process hears of

    def _announced(
        self, keys: Sequence[bytes], store: Callable[[], None] | None
    ) -> Callable[[], None] | None:
        """``store``, run after a reply that says ``keys`` are stored: the
        lookup process hears of them now, before that reply goes, and after
        ``store`` of any it did not store (a client asking it at once finds
        them, and never finds one that did not land)."""
        feed = self._feed()
        if store is None or feed is None or not keys:
            return store
        feed.announce(keys)

        def then() -> None:
            try:
                store()
            finally:
                feed.settle(keys)

        return then

    def _copied_reply(self, copied: Copied) -> Reply:
        """A region store's reply once its blocks are copied; stored right after."""
        return Reply(
            wire.encode_put_reply(copied.statuses), then=self._announced(copied.keys, copied.store)
        )

    # -- shared memory

    def _shared_of(self, conn: Connection) -> SharedService:
        if self.shared is None or not conn.shared:
            raise ForbiddenError("shared memory was not agreed at HELLO on this connection")
        return self.shared

    def get_shared(self, conn: Connection, frame: Frame) -> Reply | Later:
        shared = self._shared_of(conn)
        if frame.data:
            raise wire.CodecError("GET_SHARED carries no data")
        releases, keys = wire.decode_get_shared(frame.meta, self.max_batch, conn.scope)
        values = self.service.get(keys)
        if not isinstance(values, list):
            shared.unlease(conn.conn_id, releases)
            return Later(values, partial(self._shared_reply, shared, conn, keys))
        # The leases given back end once this answer is written: ending them
        # (unpinning each block) is work the reader need not wait for.
        try:
            reply = self._shared_reply(shared, conn, keys, values)
        except BaseException:
            shared.unlease(conn.conn_id, releases)
            raise
        if releases:
            owner = conn.conn_id

            def unlease() -> None:
                shared.unlease(owner, releases)

            reply.then = unlease
        return reply

    def _shared_reply(
        self,
        shared: SharedService,
        conn: Connection,
        keys: list[bytes],
        values: list[Buffer | None],
    ) -> Reply:
        """Blocks in the arena go out as leases; the rest as bytes, pinned until sent."""
        try:
            entries = shared.grant(conn.conn_id, keys, values)
        except BaseException:
            self.service.unpin(keys, values)
            raise
        inline = [(k, e) for k, e in zip(keys, entries, strict=True) if e is not None]
        inline_keys = [k for k, e in inline if not isinstance(e, Leased)]
        inline_values: list[Buffer | None] = [e for _, e in inline if not isinstance(e, Leased)]
        meta, data = wire.encode_get_shared_reply(entries)
        return Reply(meta, data, on_sent=lambda: self.service.unpin(inline_keys, inline_values))

    def unlease(self, conn: Connection, frame: Frame) -> Reply:
        shared = self._shared_of(conn)
        ended = shared.unlease(conn.conn_id, wire.decode_unlease(frame.meta, self.max_batch))
        return Reply(wire.encode_u64(ended))

    def stage(self, conn: Connection, frame: Frame) -> Reply:
        shared = self._shared_of(conn)
        length, in_place = wire.decode_stage(frame.meta, "STAGE")
        if in_place:
            self._check_in_place(shared, conn)
        namespace = conn.scope.prefix if conn.scope is not None else b""
        return Reply(wire.encode_u64(shared.stage(conn.conn_id, length, in_place, namespace)))

    def _check_in_place(self, shared: SharedService, conn: Connection) -> None:
        if not shared.may_write_in_place(conn.peer.uid if conn.peer is not None else None):
            raise ForbiddenError(
                "writing in place is for clients of the daemon's own user, with "
                "shared.write_in_place on; stage the block instead"
            )

    def commit(self, conn: Connection, frame: Frame) -> Reply | Later:
        shared = self._shared_of(conn)
        c = wire.decode_commit(frame.meta, conn.scope)
        if c.in_place:
            checksum = None if c.unchecked else c.checksum
            copied, room = shared.commit_in_place(
                conn.conn_id, c.key, c.offset, c.length, checksum, c.keep_room
            )
            meta, store = wire.encode_commit_reply(copied.statuses[0], room), copied.store
            holds = copied.keys
        else:
            status = shared.commit(conn.conn_id, c.key, c.offset, c.length, c.checksum, c.keep_room)
            meta, store, holds = wire.encode_put_reply([status]), None, []
        if frame.header.flags & wire.FLAG_DURABLE:
            if store is not None:
                store()  # now: the disk write is of what RAM holds in this step
            durable = self.service.make_durable([c.key], [None])
            return Later(durable, lambda _: Reply(meta))
        # answered first, stored right after (an in-place block: Copied)
        return Reply(meta, then=self._announced(holds, store))

    def commit_many(self, conn: Connection, frame: Frame) -> Reply | Later:
        """In-place commits of many blocks, one reply for all (each block's
        status and next room); stored right after it, or before it, durably,
        when asked."""
        shared = self._shared_of(conn)
        if frame.data:
            raise wire.CodecError("COMMIT_MANY carries no data: the blocks are in place")
        commits = wire.decode_commit_many(frame.meta, self.max_batch, conn.scope)
        done = shared.commit_many_in_place(
            conn.conn_id, [(c.key, c.offset, c.length, c.keep_room) for c in commits]
        )
        meta = wire.encode_commit_many_reply([(copied.statuses[0], room) for copied, room in done])
        if frame.header.flags & wire.FLAG_DURABLE:
            _each([copied.store for copied, _ in done])
            keys = [c.key for c in commits]
            durable = self.service.make_durable(keys, [None] * len(keys))
            return Later(durable, lambda _: Reply(meta))
        # Each block as its own COMMIT's: heard of before the reply, stored
        # right after it, and settled before the next one is stored (whose
        # room may evict it).
        thens = [self._announced(copied.keys, copied.store) for copied, _ in done]
        return Reply(meta, then=partial(_each, [t for t in thens if t is not None]))

    def unstage(self, conn: Connection, frame: Frame) -> Reply:
        shared = self._shared_of(conn)
        offset, in_place = wire.decode_stage(frame.meta, "UNSTAGE")
        return Reply(bytes([int(shared.unstage(conn.conn_id, offset, in_place))]))

    # -- regions: the daemon copies blocks to and from a client's memory file

    def region(self, conn: Connection, frame: Frame) -> Reply:
        shared = self._shared_of(conn)
        if frame.data:
            raise wire.CodecError("REGION carries no data")
        if frame.meta:  # (a process region's probe, which is not served)
            raise BadArgumentError("REGION carries nothing: its file comes over the handoff socket")
        return Reply(wire.encode_region_reply(*shared.open_region(conn.conn_id)))

    def put_region(self, conn: Connection, frame: Frame) -> Later:
        shared = self._shared_of(conn)
        if frame.data:
            raise wire.CodecError("PUT_REGION carries no data: the blocks are in the region")
        io = wire.decode_region_io(frame.meta, self.max_batch, conn.scope)
        namespace = conn.scope.prefix if conn.scope is not None else b""
        copied = shared.put_region(
            conn.conn_id, io.region, io.keys, io.spans, io.checksums, namespace
        )
        # answered once the bytes are copied; stored right after (Copied)
        return Later(copied, self._copied_reply)

    def get_region(self, conn: Connection, frame: Frame) -> Later:
        shared = self._shared_of(conn)
        if frame.data:
            raise wire.CodecError("GET_REGION carries no data")
        io = wire.decode_region_io(frame.meta, self.max_batch, conn.scope)
        shared.check_region(conn.conn_id, io.region, io.spans)
        values = self.service.get(io.keys)  # pinned; get_region unpins them

        async def write() -> list[int | None]:
            got = values if isinstance(values, list) else await values
            return await shared.get_region(conn.conn_id, io.region, io.keys, io.spans, got)

        return Later(write(), lambda lengths: Reply(wire.encode_region_lengths(lengths)))

    # -- events: what this node holds, streamed to a router or an engine

    def subscribe(self, conn: Connection, frame: Frame) -> Later:
        """The connection becomes a stream of block events (replies flagged
        MORE), after a snapshot of what is held if asked; it ends when the
        connection closes, or with a last empty batch once the client has
        half-closed (then the connection closes) or at shutdown."""
        if self.events is None:
            raise ForbiddenError("block events are not served here")
        if frame.data:
            raise wire.CodecError("SUBSCRIBE carries no data")
        snapshot, limit = wire.decode_subscribe(frame.meta)
        limit = min(limit or EVENT_QUEUE, MAX_EVENT_QUEUE)
        stream = self._stream(conn, frame.header.request_id, self.events, snapshot, limit)
        return Later(
            stream, lambda _: Reply(wire.encode_events([])), cancel_on_close=True, lasting=True
        )

    async def _stream(
        self, conn: Connection, request_id: int, source: EventSource, snapshot: bool, limit: int
    ) -> None:
        sub = source.subscribe(limit)  # before the snapshot: nothing falls between
        scope = conn.scope

        def half_closed(_: object) -> None:  # the client asks for nothing more
            sub.closed = True
            sub.ready.set()

        conn.eof.add_done_callback(half_closed)
        try:
            if snapshot:
                held = source.snapshot()
                if scope is not None:
                    held = _scoped(held, scope.prefix)
                for lo in range(0, len(held), EVENT_BATCH):
                    await conn.push(
                        Op.SUBSCRIBE, request_id, wire.encode_events(held[lo : lo + EVENT_BATCH])
                    )
            while True:
                await sub.ready.wait()
                if sub.closed:
                    return
                events = sub.take(EVENT_BATCH)
                if scope is not None:
                    events = _scoped(events, scope.prefix)
                if events:
                    await conn.push(Op.SUBSCRIBE, request_id, wire.encode_events(events))
        finally:
            conn.eof.remove_done_callback(half_closed)
            source.unsubscribe(sub)

    def retain(self, conn: Connection, frame: Frame) -> Reply:
        """A retention lease on blocks however they were stored (a region, in
        place, staged): the meta is a lease, then a key list."""
        retention, meta = self._retention(frame, required=True)
        assert retention is not None
        keys, end, _ = wire.decode_keys(meta, 0, self.max_batch, conn.scope)
        if end != len(meta) or frame.data:
            raise wire.CodecError("RETAIN carries a lease and a key list only")
        self.service.retain(keys, retention)
        return Reply(b"")

    def unretain(self, conn: Connection, frame: Frame) -> Reply:
        """The end of a session's leases (its tag-encoded id); replies with
        how many blocks they held."""
        self._retention(frame)  # (refused on the peer port)
        session = wire.decode_tag(frame.meta)
        n = self.service.release_retention(session, conn.namespace)
        return Reply(wire.encode_u64(n))

    def _retention(self, frame: Frame, required: bool = False) -> tuple[Retention | None, Buffer]:
        """The lease a FLAG_RETAIN request carries, and the rest of its meta
        (on the peer port, a RETAIN's only: the service decides)."""
        peer_port = self.access is None
        if peer_port and not required and frame.header.flags & wire.FLAG_RETAIN:
            raise BadArgumentError("retention leases are set by local clients, not peers")
        if not frame.header.flags & wire.FLAG_RETAIN:
            if required:
                raise wire.CodecError("RETAIN needs FLAG_RETAIN and a lease")
            return None, frame.meta
        return wire.split_retention(frame.meta)

    def _only_keys(self, conn: Connection, frame: Frame, op: str) -> list[bytes]:
        keys, end, _ = wire.decode_keys(frame.meta, 0, self.max_batch, conn.scope)
        if end != len(frame.meta) or frame.data:
            raise wire.CodecError(f"{op} carries only a key list")
        return keys


def namespace_tag(prefix: bytes, tag: bytes) -> bytes:
    """A request tag as the service keeps it, named on a connection of the
    namespace whose key ``prefix`` this is: a namespace's tags are its own
    (prefixed as its keys are)."""
    return prefix + tag


def scoped_tag(req: Lookup, prefix: bytes) -> Lookup:
    """``req``, asked on a connection of the namespace whose key ``prefix``
    this is (empty: the default one), its request tag as the service keeps
    it: the daemon's lookups and those the lookup process reports alike."""
    if prefix and req.request_tag:
        return dataclasses.replace(req, request_tag=namespace_tag(prefix, req.request_tag))
    return req


def _scoped(events: Iterable[BlockEvent], prefix: bytes) -> list[BlockEvent]:
    """The events of one connection's namespace, keys as its client names them
    (gaps and snapshot ends, which name no key, pass)."""
    out = []
    for e in events:
        if not e.key:
            out.append(e)
        elif (key := client_key(e.key, prefix)) is not None:
            out.append(e if key is e.key else BlockEvent(e.seq, e.kind, key, e.tier))
    return out


def _put_reply(statuses: list[PutStatus]) -> Reply:
    return Reply(wire.encode_put_reply(statuses))


def _lookup_reply(reply: LookupReply) -> Reply:
    return Reply(wire.encode_lookup_reply(reply))


def _delete_reply(deleted: list[bool]) -> Reply:
    return Reply(wire.encode_delete_reply(deleted))


def _each(calls: Sequence[Callable[[], None]]) -> None:
    """Call each one, whatever another did; then raise the first failure."""
    failed: Exception | None = None
    for call in calls:
        try:
            call()
        except Exception as exc:
            failed = failed or exc
    if failed is not None:
        raise failed

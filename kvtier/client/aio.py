"""The reference client, async: pipelined over one Unix-socket connection.

Every call sends one or more frames with fresh request ids and awaits the
matching replies, so any number of calls may be in flight at once on one
connection. A miss is ``None``; failures raise :class:`~kvtier.errors.KvtierError`.

Imports only the wire, the shared records, the errors and the light
defaults: never pydantic, aiobotocore, prometheus_client, the core or the
server, so an engine that imports it pays for none of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from pathlib import Path
from types import EllipsisType
from typing import TYPE_CHECKING, Any, Unpack

from kvtier import wire
from kvtier._version import __version__
from kvtier.backoff import Backoff
from kvtier.client.batching import SOCKET_ONLY, WritePath, put_batches
from kvtier.client.options import DEFAULTS, ClientOptions, OptionChanges, key_prefix
from kvtier.client.protocol import ClientProtocol, checked, expire
from kvtier.client.shared import SharedSession, attach, hand_region
from kvtier.defaults import DEFAULT_TIMEOUT, IDLE_POLL, default_socket_path
from kvtier.errors import (
    ConnectionClosedError,
    DaemonUnavailableError,
    ForbiddenError,
    KvtierError,
    ProtocolError,
    ReferredError,
    RequestTimeoutError,
    ValueTooLargeError,
)
from kvtier.loops import IdlePoll
from kvtier.model import (
    BlockEvent,
    Buffer,
    Lookup,
    LookupMode,
    LookupReply,
    PutHint,
    PutStatus,
    Reserve,
    ReserveStatus,
    Retention,
)
from kvtier.wire import FLAG_DURABLE, FLAG_HINTS, FLAG_RETAIN, Frame, HelloReply, Op

if TYPE_CHECKING:
    import ssl

log = logging.getLogger("kvtier.client")

#: seconds, None for no limit, or ``...`` for the client's default
Timeout = float | None | EllipsisType

#: the longest wait between two dials of the daemon's lookup process
#: (``ClientOptions.lookups_redial`` doubling up to it)
LOOKUPS_REDIAL_MOST = 30.0


class Client:
    """Async client. Create with :meth:`connect`; use as an async context manager."""

    def __init__(
        self,
        protocol: ClientProtocol,
        path: Path | str,
        options: ClientOptions,
        token: bytes = b"",
    ) -> None:
        self._protocol = protocol
        #: how this connection was asked to behave (its timeout, name,
        #: namespace, shared memory, lookup process); never changes
        self.options = options
        #: the loop the connection lives on (held: asking asyncio for the
        #: running loop costs a getpid system call, twice a request)
        self._loop = asyncio.get_running_loop()
        #: keeps the loop polling while a reply is awaited (for ``idle_poll``
        #: seconds after each request at most), instead of sleeping
        self.idle_poll = IdlePoll(options.idle_poll, busy=lambda: bool(protocol.pending))
        #: the socket path, or host:port for a peer connection
        self.path = path
        self._token = token
        self._ids = itertools.count(1)
        self.server: HelloReply | None = None
        #: ask for shared memory at HELLO (off again for a daemon without it)
        self._want_shared = options.shared
        #: blocks read (and written) through shared memory (None: over the socket)
        self._shm: SharedSession | None = None
        #: which writes go through shared memory, chosen after HELLO
        self._writes = SOCKET_ONLY
        #: what the daemon expects before every key of the namespace named at
        #: HELLO (docs/tenancy.md); empty: the default namespace
        self._prefix = b""
        #: the daemon's lookup process (docs/lookup-process.md), where it listens;
        #: while no connection to it is open, a lookup dials it again once
        #: the backoff allows (the daemon restarts it)
        self._lookups: Client | None = None
        self._lookups_dial = Backoff(
            options.lookups_redial, max(options.lookups_redial, LOOKUPS_REDIAL_MOST)
        )

    @property
    def timeout(self) -> float | None:
        """Seconds any one call may take; None: no limit."""
        return self.options.timeout

    @property
    def name(self) -> str:
        return self.options.name

    @property
    def namespace(self) -> str:
        return self.options.namespace

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        shm = f" {self._shm!r}" if self._shm is not None else ""
        lookups = f" lookups {self._lookups.idle_poll!r}" if self._lookups is not None else ""
        return (
            f"<Client {self.path} {state} in_flight={len(self._protocol.pending)}"
            f"{shm}{lookups} {self.idle_poll!r}>"
        )

    @property
    def lookups_process(self) -> bool:
        """Whether lookups go to the daemon's lookup process first."""
        return self._lookups is not None and not self._lookups.closed

    @property
    def shared(self) -> bool:
        """Whether blocks travel through shared memory on this connection."""
        return self._shm is not None

    @classmethod
    async def connect(
        cls,
        path: str | Path | None = None,
        options: ClientOptions = DEFAULTS,
        **changes: Unpack[OptionChanges],
    ) -> Client:
        """Connect and negotiate the protocol version (HELLO).

        ``path`` defaults to the daemon's default socket path. ``options``
        (:class:`~kvtier.client.options.ClientOptions`, which says what each
        does), and any of its fields given by name, which change it:
        ``Client.connect(path, namespace="llama", lookup_process=False)``.
        """
        if changes:
            options = dataclasses.replace(options, **changes)
        path = Path(path) if path is not None else default_socket_path()
        prefix = key_prefix(options.namespace)
        loop = asyncio.get_running_loop()
        try:
            _, protocol = await loop.create_unix_connection(
                lambda: ClientProtocol(wire.MAX_FRAME_BYTES_V1), str(path)
            )
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise DaemonUnavailableError(f"no kvtier daemon is listening on {path}: {exc}") from exc
        except OSError as exc:
            raise DaemonUnavailableError(f"cannot connect to {path}: {exc}") from exc
        client = cls(protocol, path, options)
        client._prefix = prefix
        try:
            try:
                client.server = await client.hello()
            except ProtocolError:
                if not options.shared:
                    raise
                # A daemon older than shared memory refuses the HELLO flag.
                client._want_shared = False
                client.server = await client.hello()
            offer = client.server.shared
            if offer is not None:
                await client._map_shared(offer)
            if options.lookup_process:
                await client._dial_lookups()
        except BaseException:
            await client.close()
            raise
        return client

    @classmethod
    async def connect_tcp(
        cls,
        host: str,
        port: int,
        *,
        token: bytes,
        tls: ssl.SSLContext | None = None,
        connect_timeout: float = 1.0,
        timeout: float | None = DEFAULT_TIMEOUT,
        name: str = f"kvtier-peer/{__version__}",
        idle_poll: float = IDLE_POLL,
    ) -> Client:
        """Connect to a daemon's peer port and authenticate with ``token`` (HELLO).

        ``connect_timeout`` bounds the TCP (and TLS) handshake and the HELLO
        alike: authenticating is part of connecting. Blocks never travel
        through shared memory on this connection."""
        options = ClientOptions(
            timeout=timeout, name=name, shared=False, idle_poll=idle_poll, lookup_process=False
        )
        address = f"{host}:{port}"
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect_timeout):
                _, protocol = await loop.create_connection(
                    lambda: ClientProtocol(wire.MAX_FRAME_BYTES_V1),
                    host,
                    port,
                    ssl=tls,
                    server_hostname=host if tls is not None else None,
                )
        except TimeoutError as exc:
            raise DaemonUnavailableError(
                f"no answer from peer {address} within {connect_timeout}s"
            ) from exc
        except OSError as exc:  # ssl.SSLError included: a failed handshake
            raise DaemonUnavailableError(f"cannot connect to peer {address}: {exc}") from exc
        client = cls(protocol, address, options, token)
        try:
            async with asyncio.timeout(connect_timeout):
                client.server = await client.hello()
        except TimeoutError as exc:
            await client.close()
            raise DaemonUnavailableError(
                f"peer {address} did not answer HELLO within {connect_timeout}s"
            ) from exc
        except ConnectionClosedError as exc:
            await client.close()
            # With TLS 1.3 a refused client certificate shows only now.
            raise DaemonUnavailableError(
                f"peer {address} closed the connection at HELLO ({exc}); "
                "if TLS is on, check that both sides use the same CA"
            ) from exc
        except BaseException:
            await client.close()
            raise
        return client

    async def _dial_lookups(self) -> Client | None:
        """Connect to the daemon's lookup process, where one listens for this
        client; None (the daemon answers, until the next attempt) elsewhere."""
        options = self.options
        self._lookups_dial.failed(time.monotonic())  # (one attempt at a time)
        try:
            async with asyncio.timeout(options.lookups_timeout):
                lookups = await Client.connect(
                    Path(f"{self.path}.lookups"),
                    dataclasses.replace(options, shared=False, lookup_process=False),
                )
        except (KvtierError, TimeoutError):
            return None  # none listens, or not for this client, or not in time
        if self.closed:  # closed meanwhile
            await lookups.close()
            return None
        # Its answers come from memory, within microseconds: a poll that gave
        # the CPU away to a busy writer would get it back a scheduler slice
        # after the answer is there (docs/lookup-process.md).
        lookups.idle_poll.yields = False
        self._lookups = lookups
        self._lookups_dial.succeeded()
        return lookups

    async def _drop_lookups(self, lookups: Client) -> None:
        """The lookup process went, or is stuck: the daemon answers, and it is
        dialled again in a while (the daemon starts a new one when it goes)."""
        self._lookups = None
        self._lookups_dial.failed(time.monotonic())
        lookups.drop()
        await lookups.close()

    async def _map_shared(self, offer: wire.SharedOffer) -> None:
        try:
            mapped = await asyncio.to_thread(attach, offer.path, self.timeout or 5.0)
        except OSError as exc:
            log.info("shared memory offered but not usable (%s); using the socket", exc)
            return
        options = self.options
        in_place = mapped.writable and options.write_in_place and options.stage_writes is not False
        self._shm = SharedSession(self, mapped, self._prefix, in_place=in_place)
        self._writes = WritePath.choose(options.stage_writes, True, in_place)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def closed(self) -> bool:
        return self._protocol.transport is None

    async def close(self) -> None:
        if self._lookups is not None:
            await self._lookups.close()
        transport = self._protocol.transport
        if transport is not None:
            if self._shm is not None and not transport.is_closing():
                self._shm.release_rooms()
            transport.close()
            await self._protocol.closed_event.wait()
        if self._shm is not None:
            self._shm.close()

    def drop(self) -> None:
        """Drop the connection now, without waiting; calls in flight fail."""
        if self._lookups is not None:
            self._lookups.drop()
        transport = self._protocol.transport
        if transport is not None:
            transport.abort()

    # -- plumbing

    def _send(
        self,
        op: int,
        meta: Buffer,
        data: Sequence[Buffer] = (),
        flags: int = 0,
        into: memoryview | None = None,
    ) -> asyncio.Future[Frame]:
        proto = self._protocol
        if proto.transport is None or proto.transport.is_closing():
            raise proto.closed_exc or ConnectionClosedError("the client is closed")
        rid = next(self._ids)
        fut: asyncio.Future[Frame] = self._loop.create_future()
        proto.pending[rid] = fut
        if into is not None:
            proto.sinks[rid] = into
            fut.add_done_callback(lambda _f: proto.forget(rid))
        else:
            fut.add_done_callback(lambda _f: proto.pending.pop(rid, None))
        proto.transport.writelines(wire.frame_parts(op, rid, meta, data, flags=flags))
        self.idle_poll.touch()
        return fut

    async def _await(
        self, futs: Sequence[asyncio.Future[Frame]], timeout: float | None
    ) -> list[Frame]:
        try:
            await self._protocol.drain()
            if timeout is None:
                frames = await asyncio.gather(*futs)
            else:
                async with asyncio.timeout(timeout):
                    frames = await asyncio.gather(*futs)
        except TimeoutError:
            raise RequestTimeoutError(f"no reply within {timeout}s") from None
        finally:
            for fut in futs:
                fut.cancel()  # no-op when done; frees the slot when abandoned
        return [checked(frame) for frame in frames]

    async def request(
        self,
        op: int,
        meta: Buffer,
        data: Sequence[Buffer] = (),
        *,
        flags: int = 0,
        timeout: Timeout = ...,
        into: memoryview | None = None,
    ) -> Frame:
        """One request of any operation, and its reply frame: the seam every
        operation is built on (docs/protocol.md gives each op's meta and data).

        An error reply raises its :class:`~kvtier.errors.KvtierError`.
        ``into``: receive the reply's data straight into this buffer."""
        return await self._call(op, meta, data, flags, timeout, into)

    def post(self, op: int, meta: Buffer) -> None:
        """Send one request without waiting for its reply (which is read and
        dropped, an error included). Raises only when the connection is closed."""
        self._send(op, meta).add_done_callback(_drop_reply)

    def send(self, op: int, meta: Buffer, *, flags: int = 0) -> asyncio.Future[Frame]:
        """Write one request now, and return its reply frame's future (an
        error reply is a frame too: :func:`checked` raises it). The caller
        bounds the wait. Raises only when the connection is closed."""
        return self._send(op, meta, flags=flags)

    async def _call(
        self,
        op: int,
        meta: Buffer,
        data: Sequence[Buffer] = (),
        flags: int = 0,
        timeout: Timeout = ...,
        into: memoryview | None = None,
    ) -> Frame:
        """One request, one reply: the per-call fast path (no gather, no timeout context)."""
        fut = self._send(op, meta, data, flags, into=into)
        await self._protocol.drain()
        seconds = self._timeout(timeout)
        handle = None
        if seconds is not None:
            handle = self._loop.call_later(seconds, expire, fut, seconds)
        try:
            frame = await fut
        finally:
            if handle is not None:
                handle.cancel()
        return checked(frame)

    def _timeout(self, timeout: Timeout) -> float | None:
        return self.timeout if isinstance(timeout, EllipsisType) else timeout

    def _max_batch(self) -> int:
        return self.server.max_batch if self.server else 65536

    def _max_frame(self) -> int:
        return self.server.max_frame_bytes if self.server else 64 * 1024 * 1024

    # -- operations

    async def hello(self) -> HelloReply:
        frame = await self._call(
            Op.HELLO,
            wire.encode_hello(
                wire.Hello(
                    1,
                    wire.VERSION,
                    self.name,
                    self._token,
                    shared=self._want_shared,
                    namespace=self.namespace,
                )
            ),
        )
        return wire.decode_hello_reply(frame.meta)

    async def ping(self, payload: bytes = b"", *, timeout: Timeout = ...) -> bytes:
        frame = await self._call(Op.PING, payload, timeout=timeout)
        return bytes(frame.meta)

    async def stats(self, *, timeout: Timeout = ...) -> dict[str, Any]:
        frame = await self._call(Op.STATS, b"", timeout=timeout)
        result: dict[str, Any] = wire.decode_json(frame.meta)
        return result

    async def lookup(
        self,
        keys: Sequence[bytes],
        *,
        mode: LookupMode = LookupMode.KEYS,
        window: int = 0,
        wait: float = 0.0,
        max_pending_wait: float = 0.0,
        request_tag: bytes = b"",
        peek: bool = False,
        budget: float = 0.0,
        retention: Retention | None = None,
        whole: bool = False,
        timeout: Timeout = ...,
    ) -> LookupReply:
        """Per-key states of ``keys`` and the usable prefix (``prefix_hits``, ``defer``).

        ``peek``: a look that is not a read (a router comparing nodes): the
        daemon leaves its eviction order as it was and reads nothing ahead.
        ``budget``: the seconds recomputing these blocks would take; the
        keys past the prefix whose loads save the engine the most time
        answer MISS (docs/lookup.md). ``retention``: the session's lease,
        renewed on the blocks it finds (docs/retention.md); such a lookup
        is the daemon's to answer, never the lookup process's. ``whole``
        (with a lease, in PREFIX mode): ``keys`` are the session's whole
        prompt from its first block, so its leases on blocks outside them
        (a prompt it left) end."""
        if whole and (retention is None or mode is not LookupMode.PREFIX):
            raise ValueError("whole names a leased session's prompt: PREFIX mode, with a lease")
        req = Lookup(
            list(keys),
            mode,
            window,
            wait,
            max_pending_wait,
            request_tag,
            peek=peek,
            budget=budget,
            whole=whole,
        )
        if retention is not None:
            meta = wire.encode_retention(retention) + wire.encode_lookup(req, self._prefix)
            frame = await self._call(Op.LOOKUP, meta, flags=FLAG_RETAIN, timeout=timeout)
            return wire.decode_lookup_reply(frame.meta)
        meta = wire.encode_lookup(req, self._prefix)
        # Requests of this client still in flight to the daemon come first,
        # as on one connection: the lookup then goes there too.
        if not self._protocol.pending:
            lookups = self._lookups
            if (
                lookups is None
                and self.options.lookup_process
                and time.monotonic() >= self._lookups_dial.not_before
            ):
                lookups = await self._dial_lookups()
            if lookups is not None:
                bound, most = self._timeout(timeout), self.options.lookups_timeout
                try:
                    frame = await lookups._call(
                        Op.LOOKUP,
                        meta,
                        timeout=most if bound is None else min(bound, most),
                    )
                    return wire.decode_lookup_reply(frame.meta)
                except ReferredError:
                    pass  # only the daemon can answer this one
                except (ConnectionClosedError, RequestTimeoutError):
                    await self._drop_lookups(lookups)
        frame = await self._call(Op.LOOKUP, meta, timeout=timeout)
        return wire.decode_lookup_reply(frame.meta)

    async def lookup_prefix(
        self,
        keys: Sequence[bytes],
        *,
        retention: Retention | None = None,
        whole: bool = False,
        timeout: Timeout = ...,
    ) -> LookupReply:
        return await self.lookup(
            keys, mode=LookupMode.PREFIX, retention=retention, whole=whole, timeout=timeout
        )

    async def retain(
        self, keys: Sequence[bytes], retention: Retention, *, timeout: Timeout = ...
    ) -> None:
        """Lease the blocks of ``keys`` the daemon's RAM holds to
        ``retention``'s session, or renew their lease (docs/retention.md):
        blocks stored any way (staged, in place, a region) are leased so."""
        step = self._max_batch()
        head = wire.encode_retention(retention)
        futs = [
            self._send(
                Op.RETAIN,
                head + wire.encode_keys(keys[i : i + step], self._prefix),
                flags=FLAG_RETAIN,
            )
            for i in range(0, len(keys), step)
        ]
        await self._await(futs, self._timeout(timeout))

    async def unretain(self, session: bytes, *, timeout: Timeout = ...) -> int:
        """End ``session``'s lease (the session is over); returns how many
        blocks it held."""
        frame = await self._call(Op.UNRETAIN, wire.encode_tag(session), timeout=timeout)
        return wire.decode_u64(frame.meta, "UNRETAIN reply")

    async def get(self, key: bytes, *, timeout: Timeout = ...) -> memoryview | None:
        """The block stored under ``key``, or None."""
        if self._shm is not None:
            return (await self._shm.get_many([key], self._timeout(timeout)))[0]
        frame = await self._call(Op.GET, wire.encode_keys([key], self._prefix), timeout=timeout)
        return wire.decode_get_reply(frame.meta, frame.data)[0]

    async def get_many(
        self, keys: Sequence[bytes], *, timeout: Timeout = ...
    ) -> list[memoryview | None]:
        """Blocks of ``keys`` in order (None where missing); read-only views."""
        step = self._max_batch()
        if self._shm is not None and len(keys) <= step:
            return await self._shm.get_many(keys, self._timeout(timeout))
        futs = [
            self._send(Op.GET, wire.encode_keys(keys[i : i + step], self._prefix))
            for i in range(0, len(keys), step)
        ]
        frames = await self._await(futs, self._timeout(timeout))
        out: list[memoryview | None] = []
        for frame in frames:
            out.extend(wire.decode_get_reply(frame.meta, frame.data))
        return out

    async def get_into(self, key: bytes, dest: Buffer, *, timeout: Timeout = ...) -> int | None:
        """Receive the block under ``key`` straight into ``dest`` (no intermediate copy).

        Returns the block's length (the bytes of ``dest`` written from the
        start), or None if there is no such block. A block larger than
        ``dest`` raises :class:`~kvtier.errors.ValueTooLargeError`; after any
        error the contents of ``dest`` are undefined.
        """
        view = memoryview(dest).cast("B")
        if view.readonly:
            raise ValueError("the destination buffer is read-only")
        if self._shm is not None:
            return (await self._shm.get_many_into([key], [view], self._timeout(timeout)))[0]
        frame = await self._call(
            Op.GET, wire.encode_keys([key], self._prefix), timeout=timeout, into=view
        )
        return _landed(key, view, frame)

    async def get_many_into(
        self, keys: Sequence[bytes], dests: Sequence[Buffer], *, timeout: Timeout = ...
    ) -> list[int | None]:
        """:meth:`get_into` for many keys, pipelined: block ``i`` lands in ``dests[i]``."""
        if len(keys) != len(dests):
            raise ValueError("get_many_into needs one destination per key")
        views = [memoryview(d).cast("B") for d in dests]
        for view in views:
            if view.readonly:
                raise ValueError("a destination buffer is read-only")
        if self._shm is not None and len(keys) <= self._max_batch():
            return await self._shm.get_many_into(keys, views, self._timeout(timeout))
        futs = [
            self._send(Op.GET, wire.encode_keys([key], self._prefix), into=view)
            for key, view in zip(keys, views, strict=True)
        ]
        frames = await self._await(futs, self._timeout(timeout))
        return [_landed(k, v, f) for k, v, f in zip(keys, views, frames, strict=True)]

    async def put(
        self,
        key: bytes,
        value: Buffer,
        *,
        durable: bool = False,
        hint: PutHint = PutHint.NONE,
        retention: Retention | None = None,
        timeout: Timeout = ...,
    ) -> PutStatus:
        """Store one block; EXISTS if it was already there (PUT is idempotent).
        ``hint``: what the writer knows of its reuse (docs/eviction.md);
        ``retention``: the session's lease on it (docs/retention.md)."""
        if retention is not None:
            return (
                await self.put_many(
                    [key],
                    [value],
                    durable=durable,
                    hints=[hint] if hint else None,
                    retention=retention,
                    timeout=timeout,
                )
            )[0]
        if self._shm is not None and self._writes.one(value) and not hint:
            status = await self._shm.put(key, value, durable, self._timeout(timeout))
            if status is not None:
                return status
        meta, data = wire.encode_put([key], [value], [hint] if hint else None, self._prefix)
        flags = (FLAG_DURABLE if durable else 0) | (FLAG_HINTS if hint else 0)
        frame = await self._call(Op.PUT, meta, data, flags, timeout)
        return wire.decode_put_reply(frame.meta)[0]

    async def put_many(
        self,
        keys: Sequence[bytes],
        values: Sequence[Buffer],
        *,
        durable: bool = False,
        hints: Sequence[PutHint] | None = None,
        retention: Retention | None = None,
        timeout: Timeout = ...,
    ) -> list[PutStatus]:
        """Store blocks, pipelined. Large values travel one per frame.
        ``hints``: one :class:`~kvtier.model.PutHint` per key (hinted blocks
        travel over the socket, never through staging); ``retention``: the
        session's lease on them, ``keys`` a chain head first (leased blocks
        travel over the socket too, the lease in the same frame: docs/retention.md)."""
        if len(keys) != len(values) or (hints is not None and len(hints) != len(keys)):
            raise ValueError("put_many needs one value (and one hint) per key")
        if hints is not None and not any(hints):
            hints = None
        if (
            hints is None
            and retention is None
            and self._shm is not None
            and self._writes.many(values)
        ):

            async def over_socket(ks: Sequence[bytes], vs: Sequence[Buffer]) -> list[PutStatus]:
                return await self._put_socket(ks, vs, None, durable, timeout)

            return await self._shm.put_many(
                keys, values, durable, self._timeout(timeout), over_socket
            )
        return await self._put_socket(keys, values, hints, durable, timeout, retention)

    async def _region_put(self, io: wire.RegionIO, timeout: Timeout) -> list[PutStatus]:
        frame = await self._call(
            Op.PUT_REGION, wire.encode_region_io(io, self._prefix), timeout=timeout
        )
        return wire.decode_put_reply(frame.meta)

    async def _put_socket(
        self,
        keys: Sequence[bytes],
        values: Sequence[Buffer],
        hints: Sequence[PutHint] | None,
        durable: bool,
        timeout: Timeout,
        retention: Retention | None = None,
    ) -> list[PutStatus]:
        flags = (FLAG_DURABLE if durable else 0) | (FLAG_HINTS if hints is not None else 0)
        head = b""
        if retention is not None:
            flags |= FLAG_RETAIN
            head = wire.encode_retention(retention)
        batches = put_batches(
            values,
            keys_bytes=[len(k) for k in keys],
            max_frame=self._max_frame(),
            max_batch=self._max_batch(),
        )
        futs = []
        for batch in batches:
            meta, data = wire.encode_put(
                [keys[i] for i in batch],
                [values[i] for i in batch],
                None if hints is None else [hints[i] for i in batch],
                self._prefix,
            )
            futs.append(self._send(Op.PUT, head + meta if head else meta, data, flags=flags))
        frames = await self._await(futs, self._timeout(timeout))
        out = [PutStatus.STORED] * len(keys)
        for batch, frame in zip(batches, frames, strict=True):
            for i, status in zip(batch, wire.decode_put_reply(frame.meta), strict=True):
                out[i] = status
        return out

    @contextlib.asynccontextmanager
    async def lease(
        self, key: bytes, *, timeout: Timeout = ...
    ) -> AsyncIterator[memoryview | None]:
        """The block under ``key`` read in place, or None: a read-only view of the
        daemon's shared memory, valid inside the ``async with`` only (the block
        cannot change or go meanwhile). Without shared memory, a copy."""
        if self._shm is None:
            yield await self.get(key, timeout=timeout)
            return
        async with self._shm.lease(key, self._timeout(timeout)) as view:
            yield view

    async def attach_region(self, fd: int, *, timeout: Timeout = ...) -> int:
        """Let the daemon copy blocks to and from the memory file ``fd`` itself
        (an engine's host pool in a memfd); returns the region id that
        :meth:`put_region` and :meth:`get_region` name. The daemon keeps a
        descriptor of its own, with the access ``fd`` was opened with, until
        this connection closes. Needs shared memory agreed at HELLO."""
        offer = self.server.shared if self.server is not None else None
        if offer is None:
            raise ForbiddenError("regions need the daemon's shared memory on this connection")
        frame = await self._call(Op.REGION, b"", timeout=timeout)
        region, token = wire.decode_region_reply(frame.meta)
        limit = self._timeout(timeout)
        try:
            await asyncio.to_thread(hand_region, offer.path, token, fd, limit or 5.0)
        except OSError as exc:
            raise DaemonUnavailableError(f"handing the region over failed: {exc}") from exc
        return region

    async def put_region(
        self,
        region: int,
        keys: Sequence[bytes],
        spans: Sequence[tuple[int, int]],
        *,
        timeout: Timeout = ...,
    ) -> list[PutStatus]:
        """Store the blocks at ``spans`` ((offset, length) each) of ``region``
        under ``keys``: the daemon reads them from the region itself."""
        out: list[PutStatus] = []
        for lo in range(0, len(keys), self._max_batch()):
            hi = lo + self._max_batch()
            io = wire.RegionIO(region, list(keys[lo:hi]), list(spans[lo:hi]))
            frame = await self._call(
                Op.PUT_REGION, wire.encode_region_io(io, self._prefix), timeout=timeout
            )
            out.extend(wire.decode_put_reply(frame.meta))
        return out

    async def get_region(
        self,
        region: int,
        keys: Sequence[bytes],
        spans: Sequence[tuple[int, int]],
        *,
        timeout: Timeout = ...,
    ) -> list[int | None]:
        """Have the daemon write the blocks under ``keys`` into ``region`` at
        ``spans`` ((offset, room) each); per key the bytes written, or None
        where the daemon has no such block (its room is left as it was)."""
        out: list[int | None] = []
        for lo in range(0, len(keys), self._max_batch()):
            hi = lo + self._max_batch()
            io = wire.RegionIO(region, list(keys[lo:hi]), list(spans[lo:hi]))
            frame = await self._call(
                Op.GET_REGION, wire.encode_region_io(io, self._prefix), timeout=timeout
            )
            out.extend(wire.decode_region_lengths(frame.meta))
        return out

    async def subscribe(
        self, *, snapshot: bool = False, limit: int = 0
    ) -> AsyncGenerator[list[BlockEvent], None]:
        """The daemon's block events, batch by batch, for as long as the caller
        iterates (use a connection of its own: it carries nothing else).

        ``snapshot``: first every block held now (SNAPSHOT events, then
        SNAPSHOT_END), then live events, none lost in between. ``limit``:
        events the daemon may queue for this subscriber (0: its default); past
        it the subscriber gets a GAP event and should subscribe again with a
        snapshot. The iteration ends at the daemon's shutdown."""
        proto = self._protocol
        if proto.transport is None or proto.transport.is_closing():
            raise proto.closed_exc or ConnectionClosedError("the client is closed")
        rid = next(self._ids)
        stream: asyncio.Queue[Frame | Exception] = asyncio.Queue()
        proto.streams[rid] = stream
        try:
            proto.transport.writelines(
                wire.frame_parts(Op.SUBSCRIBE, rid, wire.encode_subscribe(snapshot, limit))
            )
            while True:
                item = await stream.get()
                proto.stream_taken(stream)
                if isinstance(item, Exception):
                    raise item
                events = wire.decode_events(checked(item).meta)
                if events:
                    yield events
                if not item.header.flags & wire.FLAG_MORE:
                    return
        finally:
            proto.streams.pop(rid, None)
            proto.stream_taken(stream)

    async def delete(self, key: bytes, *, timeout: Timeout = ...) -> bool:
        return (await self.delete_many([key], timeout=timeout))[0]

    async def delete_many(self, keys: Sequence[bytes], *, timeout: Timeout = ...) -> list[bool]:
        frame = await self._call(Op.DELETE, wire.encode_keys(keys, self._prefix), timeout=timeout)
        return wire.decode_delete_reply(frame.meta)

    async def reserve(
        self,
        keys: Sequence[bytes],
        sizes: Sequence[int] | None = None,
        *,
        deadline: float = 0.0,
        timeout: Timeout = ...,
    ) -> list[ReserveStatus]:
        """Announce blocks this connection is about to PUT; others read them PENDING.

        ``sizes`` (expected bytes per block) make the daemon hold room for
        them; ``deadline`` (seconds, 0 = the daemon's ``pending_deadline``)
        bounds how long they may stay pending. Reservations end with the PUT,
        :meth:`abort`, the deadline, or this connection closing.
        """
        sizes = list(sizes) if sizes is not None else [0] * len(keys)
        meta = wire.encode_reserve(Reserve(list(keys), sizes, deadline), self._prefix)
        frame = await self._call(Op.RESERVE, meta, timeout=timeout)
        return [ReserveStatus(s) for s in wire.decode_status_bytes(frame.meta)]

    async def abort(self, keys: Sequence[bytes], *, timeout: Timeout = ...) -> list[bool]:
        """Drop this connection's reservations of ``keys``; True where one ended."""
        frame = await self._call(Op.ABORT, wire.encode_keys(keys, self._prefix), timeout=timeout)
        return [bool(s) for s in wire.decode_status_bytes(frame.meta)]

    async def release(self, request_tag: bytes, *, timeout: Timeout = ...) -> bool:
        """Free the daemon's per-request lookup state of ``request_tag``."""
        frame = await self._call(Op.RELEASE, wire.encode_tag(request_tag), timeout=timeout)
        return bool(frame.meta and frame.meta[0])


def _drop_reply(fut: asyncio.Future[Frame]) -> None:
    if not fut.cancelled():
        fut.exception()  # read, so an error reply is not reported as never retrieved


def _landed(key: bytes, view: memoryview, frame: Frame) -> int | None:
    """The length of the block a GET reply received into ``view``, or None."""
    (value,) = wire.decode_get_reply(frame.meta, frame.data)
    if value is None:
        return None
    if value.obj is not view.obj:
        raise ValueTooLargeError(
            f"block {key.hex()} is {len(value)} bytes; its destination holds {len(view)}"
        )
    return len(value)

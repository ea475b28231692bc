"""The blocking client: a thin facade over the async client for synchronous engine code.

A private event loop (of the kind :mod:`kvtier.loops` chooses) runs in a
daemon thread and owns one :class:`~kvtier.client.aio.Client`; each method
runs the async method of the same name there and blocks the calling thread
until it returns. Calls from several threads are pipelined on the one
connection. Every public method of the async client has its twin here, with
the same parameters (``tests/test_client.py`` checks it). Same import rules
as :mod:`kvtier.client.aio`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine, Iterator, Sequence
from concurrent.futures import Future as ConcurrentFuture
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, Unpack

from kvtier import loops
from kvtier._version import __version__
from kvtier.client.aio import Client, Timeout
from kvtier.client.options import ClientOptions, OptionChanges
from kvtier.defaults import DEFAULT_TIMEOUT, IDLE_POLL
from kvtier.errors import KvtierError
from kvtier.model import (
    BlockEvent,
    Buffer,
    LookupMode,
    LookupReply,
    PutHint,
    PutStatus,
    ReserveStatus,
    Retention,
)
from kvtier.wire import Frame, HelloReply

if TYPE_CHECKING:
    import ssl

T = TypeVar("T")

#: a blocking client's options unless told otherwise: its own name
BLOCKING = ClientOptions(name=f"kvtier-python-blocking/{__version__}")


class BlockingClient:
    """The same operations as :class:`~kvtier.client.aio.Client`, blocking."""

    def __init__(
        self,
        path: str | Path | None = None,
        options: ClientOptions = BLOCKING,
        **changes: Unpack[OptionChanges],
    ) -> None:
        """Connect as :meth:`Client.connect <kvtier.client.aio.Client.connect>`
        does, with the same options."""
        self._start(Client.connect(path, options, **changes))

    def _start(self, connect: Coroutine[Any, Any, Client]) -> None:
        self._loop = loops.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvtier-client", daemon=True
        )
        self._thread.start()
        try:
            self._client: Client = self._run(connect)
        except BaseException:
            self._stop_loop()
            raise

    @classmethod
    def connect(
        cls,
        path: str | Path | None = None,
        options: ClientOptions = BLOCKING,
        **changes: Unpack[OptionChanges],
    ) -> BlockingClient:
        """The same as the constructor: connect and negotiate (HELLO)."""
        return cls(path, options, **changes)

    @classmethod
    def connect_tcp(
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
    ) -> BlockingClient:
        """A blocking client of a daemon's peer port (TCP, ``token``, optional TLS)."""
        self = cls.__new__(cls)
        self._start(
            Client.connect_tcp(
                host,
                port,
                token=token,
                tls=tls,
                connect_timeout=connect_timeout,
                timeout=timeout,
                name=name,
                idle_poll=idle_poll,
            )
        )
        return self

    def __repr__(self) -> str:
        return f"<BlockingClient {self._client!r}>"

    def __enter__(self) -> BlockingClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        fut: ConcurrentFuture[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    # -- the connection

    def close(self) -> None:
        if self._loop.is_closed():
            return
        with contextlib.suppress(KvtierError):
            self._run(self._client.close())
        self._stop_loop()

    def drop(self) -> None:
        """Drop the connection now, without waiting; calls in flight fail."""

        async def drop() -> None:
            self._client.drop()

        self._run(drop())

    @property
    def server(self) -> HelloReply | None:
        return self._client.server

    @property
    def path(self) -> Path | str:
        return self._client.path

    @property
    def timeout(self) -> float | None:
        return self._client.timeout

    @property
    def name(self) -> str:
        return self._client.name

    @property
    def namespace(self) -> str:
        return self._client.namespace

    @property
    def closed(self) -> bool:
        return self._client.closed

    @property
    def shared(self) -> bool:
        """Whether blocks travel through shared memory on this connection."""
        return self._client.shared

    @property
    def lookups_process(self) -> bool:
        """Whether lookups go to the daemon's lookup process first."""
        return self._client.lookups_process

    def request(
        self,
        op: int,
        meta: Buffer,
        data: Sequence[Buffer] = (),
        *,
        flags: int = 0,
        timeout: Timeout = ...,
        into: memoryview | None = None,
    ) -> Frame:
        return self._run(
            self._client.request(op, meta, data, flags=flags, timeout=timeout, into=into)
        )

    def post(self, op: int, meta: Buffer) -> None:
        async def post() -> None:
            self._client.post(op, meta)

        self._run(post())

    def send(self, op: int, meta: Buffer, *, flags: int = 0) -> ConcurrentFuture[Frame]:
        """Write one request, and return its reply frame's future, as
        :meth:`Client.send <kvtier.client.aio.Client.send>` does (an error
        reply is a frame too: :func:`kvtier.client.protocol.checked` raises it)."""

        async def send() -> Frame:
            return await self._client.send(op, meta, flags=flags)

        return asyncio.run_coroutine_threadsafe(send(), self._loop)

    # -- operations

    def hello(self) -> HelloReply:
        return self._run(self._client.hello())

    def ping(self, payload: bytes = b"", *, timeout: Timeout = ...) -> bytes:
        return self._run(self._client.ping(payload, timeout=timeout))

    def stats(self, *, timeout: Timeout = ...) -> dict[str, Any]:
        return self._run(self._client.stats(timeout=timeout))

    def lookup(
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
        return self._run(
            self._client.lookup(
                keys,
                mode=mode,
                window=window,
                wait=wait,
                max_pending_wait=max_pending_wait,
                request_tag=request_tag,
                peek=peek,
                budget=budget,
                retention=retention,
                whole=whole,
                timeout=timeout,
            )
        )

    def lookup_prefix(
        self,
        keys: Sequence[bytes],
        *,
        retention: Retention | None = None,
        whole: bool = False,
        timeout: Timeout = ...,
    ) -> LookupReply:
        return self._run(
            self._client.lookup_prefix(keys, retention=retention, whole=whole, timeout=timeout)
        )

    def retain(
        self, keys: Sequence[bytes], retention: Retention, *, timeout: Timeout = ...
    ) -> None:
        self._run(self._client.retain(keys, retention, timeout=timeout))

    def unretain(self, session: bytes, *, timeout: Timeout = ...) -> int:
        return self._run(self._client.unretain(session, timeout=timeout))

    def get(self, key: bytes, *, timeout: Timeout = ...) -> memoryview | None:
        return self._run(self._client.get(key, timeout=timeout))

    def get_many(self, keys: Sequence[bytes], *, timeout: Timeout = ...) -> list[memoryview | None]:
        return self._run(self._client.get_many(keys, timeout=timeout))

    def get_into(self, key: bytes, dest: Buffer, *, timeout: Timeout = ...) -> int | None:
        return self._run(self._client.get_into(key, dest, timeout=timeout))

    def get_many_into(
        self, keys: Sequence[bytes], dests: Sequence[Buffer], *, timeout: Timeout = ...
    ) -> list[int | None]:
        return self._run(self._client.get_many_into(keys, dests, timeout=timeout))

    @contextlib.contextmanager
    def lease(self, key: bytes, *, timeout: Timeout = ...) -> Iterator[memoryview | None]:
        """The block under ``key`` read in place (see :meth:`Client.lease
        <kvtier.client.aio.Client.lease>`), valid inside the ``with`` only."""
        held = self._client.lease(key, timeout=timeout)
        view = self._run(held.__aenter__())
        try:
            yield view
        except BaseException as exc:
            if not self._run(held.__aexit__(type(exc), exc, exc.__traceback__)):
                raise
        else:
            self._run(held.__aexit__(None, None, None))

    def put(
        self,
        key: bytes,
        value: Buffer,
        *,
        durable: bool = False,
        hint: PutHint = PutHint.NONE,
        retention: Retention | None = None,
        timeout: Timeout = ...,
    ) -> PutStatus:
        return self._run(
            self._client.put(
                key, value, durable=durable, hint=hint, retention=retention, timeout=timeout
            )
        )

    def put_many(
        self,
        keys: Sequence[bytes],
        values: Sequence[Buffer],
        *,
        durable: bool = False,
        hints: Sequence[PutHint] | None = None,
        retention: Retention | None = None,
        timeout: Timeout = ...,
    ) -> list[PutStatus]:
        return self._run(
            self._client.put_many(
                keys, values, durable=durable, hints=hints, retention=retention, timeout=timeout
            )
        )

    def attach_region(self, fd: int, *, timeout: Timeout = ...) -> int:
        return self._run(self._client.attach_region(fd, timeout=timeout))

    def put_region(
        self,
        region: int,
        keys: Sequence[bytes],
        spans: Sequence[tuple[int, int]],
        *,
        timeout: Timeout = ...,
    ) -> list[PutStatus]:
        return self._run(self._client.put_region(region, keys, spans, timeout=timeout))

    def get_region(
        self,
        region: int,
        keys: Sequence[bytes],
        spans: Sequence[tuple[int, int]],
        *,
        timeout: Timeout = ...,
    ) -> list[int | None]:
        return self._run(self._client.get_region(region, keys, spans, timeout=timeout))

    def subscribe(self, *, snapshot: bool = False, limit: int = 0) -> Iterator[list[BlockEvent]]:
        """The daemon's block events, batch by batch (see the async client)."""
        events = self._client.subscribe(snapshot=snapshot, limit=limit)

        async def step() -> list[BlockEvent]:
            return await anext(events)

        try:
            while True:
                try:
                    yield self._run(step())
                except StopAsyncIteration:
                    return
        finally:
            self._run(events.aclose())

    def delete(self, key: bytes, *, timeout: Timeout = ...) -> bool:
        return self._run(self._client.delete(key, timeout=timeout))

    def delete_many(self, keys: Sequence[bytes], *, timeout: Timeout = ...) -> list[bool]:
        return self._run(self._client.delete_many(keys, timeout=timeout))

    def reserve(
        self,
        keys: Sequence[bytes],
        sizes: Sequence[int] | None = None,
        *,
        deadline: float = 0.0,
        timeout: Timeout = ...,
    ) -> list[ReserveStatus]:
        return self._run(self._client.reserve(keys, sizes, deadline=deadline, timeout=timeout))

    def abort(self, keys: Sequence[bytes], *, timeout: Timeout = ...) -> list[bool]:
        return self._run(self._client.abort(keys, timeout=timeout))

    def release(self, request_tag: bytes, *, timeout: Timeout = ...) -> bool:
        return self._run(self._client.release(request_tag, timeout=timeout))

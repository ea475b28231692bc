"""The blocking client: the async client's operations for synchronous engine code.

A private event loop (of the kind :mod:`kvtier.loops` chooses) runs in a
daemon thread; each method blocks the calling thread until its reply
arrives. Calls from several threads are pipelined on the one connection.
Same import rules as :mod:`kvtier.client.aio`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine, Sequence
from concurrent.futures import Future as ConcurrentFuture
from pathlib import Path
from typing import Any, TypeVar

from kvtier import loops
from kvtier._version import __version__
from kvtier.client.aio import Client, Timeout
from kvtier.defaults import DEFAULT_TIMEOUT
from kvtier.errors import KvtierError
from kvtier.model import Buffer, LookupMode, LookupReply, PutStatus, ReserveStatus
from kvtier.wire import HelloReply

T = TypeVar("T")


class BlockingClient:
    """The same operations as :class:`~kvtier.client.aio.Client`, blocking."""

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        timeout: float | None = DEFAULT_TIMEOUT,
        name: str = f"kvtier-python-blocking/{__version__}",
    ) -> None:
        self._loop = loops.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvtier-client", daemon=True
        )
        self._thread.start()
        try:
            self._client: Client = self._run(Client.connect(path, timeout=timeout, name=name))
        except BaseException:
            self._stop_loop()
            raise

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

    def close(self) -> None:
        if self._loop.is_closed():
            return
        with contextlib.suppress(KvtierError):
            self._run(self._client.close())
        self._stop_loop()

    @property
    def server(self) -> HelloReply | None:
        return self._client.server

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
                timeout=timeout,
            )
        )

    def lookup_prefix(self, keys: Sequence[bytes], *, timeout: Timeout = ...) -> LookupReply:
        return self._run(self._client.lookup_prefix(keys, timeout=timeout))

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

    def put(
        self, key: bytes, value: Buffer, *, durable: bool = False, timeout: Timeout = ...
    ) -> PutStatus:
        return self._run(self._client.put(key, value, durable=durable, timeout=timeout))

    def put_many(
        self,
        keys: Sequence[bytes],
        values: Sequence[Buffer],
        *,
        durable: bool = False,
        timeout: Timeout = ...,
    ) -> list[PutStatus]:
        return self._run(self._client.put_many(keys, values, durable=durable, timeout=timeout))

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

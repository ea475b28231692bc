"""The raw limit: a minimal uvloop Unix-socket stream, no protocol beyond a length.

Request: 1 byte op (``P`` or ``G``) and a u64 size. ``P`` is followed by
``size`` bytes and answered with one byte; ``G`` is answered with ``size``
bytes. Both sides receive with ``BufferedProtocol`` into preallocated
buffers, so this is what the event loop and the socket can do at best.
"""

from __future__ import annotations

import asyncio
import struct
import sys
from collections.abc import Sequence
from typing import Any, cast

from kvtier import loops

HEAD = struct.Struct("<cQ")
MAX = 4 * 1024 * 1024
_PAYLOAD = bytes(MAX)


class _Receiver(asyncio.BufferedProtocol):
    """Receives into one preallocated buffer; ``got`` bytes are filled."""

    def __init__(self, size: int) -> None:
        self.buf = bytearray(size)
        self.view = memoryview(self.buf)
        self.got = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view[self.got :]


class _ServerProto(_Receiver):
    def __init__(self) -> None:
        super().__init__(MAX + HEAD.size)

    def buffer_updated(self, nbytes: int) -> None:
        self.got += nbytes
        while self.got >= HEAD.size:
            op, size = HEAD.unpack_from(self.buf, 0)
            need = HEAD.size + (size if op == b"P" else 0)
            if self.got < need:
                return
            assert self.transport is not None
            if op == b"P":
                self.transport.write(b"k")
            else:
                self.transport.write(memoryview(_PAYLOAD)[:size])
            rest = self.got - need
            self.buf[:rest] = self.view[need : self.got]
            self.got = rest


async def serve(path: str) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_unix_server(_ServerProto, path)
    print("raw ready", flush=True)
    async with server:
        await server.serve_forever()


class _ClientProto(_Receiver):
    def __init__(self) -> None:
        super().__init__(MAX)
        self.need = 0
        self.waiter: asyncio.Future[None] | None = None

    def buffer_updated(self, nbytes: int) -> None:
        self.got += nbytes
        if self.got >= self.need and self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class RawStore:
    """The put/get workloads over the raw stream; one connection per worker."""

    name = "raw"

    def __init__(self, protos: list[_ClientProto]) -> None:
        self.protos = protos
        self.sizes: dict[bytes, int] = {}  # what a GET of a key returns

    @classmethod
    async def connect(cls, path: str, n: int) -> RawStore:
        loop = asyncio.get_running_loop()
        protos = []
        for _ in range(n):
            _, proto = await loop.create_unix_connection(_ClientProto, path)
            protos.append(proto)
        return cls(protos)

    async def _request(self, worker: int, op: bytes, size: int, payload: Any = None) -> None:
        proto = self.protos[worker]
        proto.need = 1 if op == b"P" else size
        proto.got = 0
        proto.waiter = asyncio.get_running_loop().create_future()
        assert proto.transport is not None
        if payload is None:
            proto.transport.write(HEAD.pack(op, size))
        else:
            proto.transport.writelines([HEAD.pack(op, size), payload])
        await proto.waiter

    async def put(self, worker: int, key: bytes, value: bytes) -> None:
        self.sizes[key] = len(value)
        await self._request(worker, b"P", len(value), value)

    async def get(self, worker: int, key: bytes) -> Any:
        await self._request(worker, b"G", self.sizes[key])

    async def clear(self, keys: Sequence[bytes]) -> None:
        pass  # the raw stream stores nothing

    def close(self) -> None:
        for proto in self.protos:
            if proto.transport is not None:
                proto.transport.close()


if __name__ == "__main__":
    loops.run(serve(sys.argv[1]))

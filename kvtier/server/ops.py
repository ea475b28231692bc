"""The op table: decode a request, call the service, encode its answer.

Each handler is synchronous: it returns a :class:`Reply` when the service
answered at once (``try_*``), or a :class:`Later` holding the awaitable of
the service's async verb of the same name. The service is any
:class:`~kvtier.model.CacheService`; this module never imports the core.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvtier import wire
from kvtier.errors import UnsupportedVersionError
from kvtier.model import Buffer, CacheService, Lookup, PutStatus
from kvtier.server.connection import Later, Reply
from kvtier.wire import Frame, Op

if TYPE_CHECKING:
    from kvtier.server.connection import Connection

Handler = Callable[["Connection", Frame], "Reply | Later"]


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
    ) -> None:
        self.service = service
        #: keys one request may carry, checked before a key list is decoded
        self.max_batch = service.limits.max_batch
        self.max_frame = max_frame
        self.server_name = server_name
        self.node_id = node_id
        self._server_stats = server_stats
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
        }

    def __repr__(self) -> str:
        return f"<Ops {len(self.handlers)} handlers over {type(self.service).__name__}>"

    def hello(self, conn: Connection, frame: Frame) -> Reply:
        hello = wire.decode_hello(frame.meta)
        version = wire.negotiate_version(hello)
        if version is None:
            raise UnsupportedVersionError(
                f"client speaks versions {hello.min_version}..{hello.max_version}; "
                f"this server speaks {list(wire.SUPPORTED_VERSIONS)}"
            )
        limits = self.service.limits
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
                )
            )
        )

    def ping(self, conn: Connection, frame: Frame) -> Reply:
        return Reply(bytes(frame.meta))

    def stats(self, conn: Connection, frame: Frame) -> Reply:
        stats = self.service.stats()
        stats["server"] = self._server_stats()
        return Reply(wire.encode_json(stats))

    def lookup(self, conn: Connection, frame: Frame) -> Reply | Later:
        req = wire.decode_lookup(frame.meta, self.max_batch)
        reply = self.service.try_lookup(req)
        if reply is not None:
            return Reply(wire.encode_lookup_reply(reply))
        return Later(self._lookup_later(req, conn), cancel_on_close=True)

    async def _lookup_later(self, req: Lookup, conn: Connection) -> Reply:
        return Reply(wire.encode_lookup_reply(await self.service.lookup(req, conn.eof)))

    def get(self, conn: Connection, frame: Frame) -> Reply | Later:
        keys = self._only_keys(frame, "GET")
        values = self.service.try_get(keys)
        if values is not None:
            return self._get_reply(keys, values)
        return Later(self._get_later(keys))

    async def _get_later(self, keys: list[bytes]) -> Reply:
        return self._get_reply(keys, await self.service.get(keys))

    def _get_reply(self, keys: list[bytes], values: list[Buffer | None]) -> Reply:
        """The reply holds the pins until its frame is handed to the transport."""
        try:
            meta, data = wire.encode_get_reply(values)
        except BaseException:
            self.service.unpin(keys, values)
            raise
        return Reply(meta, data, on_sent=lambda: self.service.unpin(keys, values))

    def put(self, conn: Connection, frame: Frame) -> Reply | Later:
        keys, values = wire.decode_put(frame.meta, frame.data, self.max_batch)
        statuses = self.service.put(keys, values)
        if frame.header.flags & wire.FLAG_DURABLE:
            return Later(self._put_durable(keys, values, statuses))
        return Reply(wire.encode_put_reply(statuses))

    async def _put_durable(
        self, keys: Sequence[bytes], values: Sequence[Buffer], statuses: list[PutStatus]
    ) -> Reply:
        await self.service.make_durable(keys, values)
        return Reply(wire.encode_put_reply(statuses))

    def delete(self, conn: Connection, frame: Frame) -> Reply | Later:
        keys = self._only_keys(frame, "DELETE")
        deleted = self.service.try_delete(keys)
        if deleted is not None:
            return Reply(wire.encode_delete_reply(deleted))
        return Later(self._delete_later(keys))

    async def _delete_later(self, keys: list[bytes]) -> Reply:
        return Reply(wire.encode_delete_reply(await self.service.delete(keys)))

    def reserve(self, conn: Connection, frame: Frame) -> Reply:
        if frame.data:
            raise wire.CodecError("RESERVE carries no data")
        req = wire.decode_reserve(frame.meta, self.max_batch)
        statuses = self.service.reserve(req, conn.conn_id)
        return Reply(wire.encode_status_bytes(statuses))

    def abort(self, conn: Connection, frame: Frame) -> Reply:
        aborted = self.service.abort(self._only_keys(frame, "ABORT"), conn.conn_id)
        return Reply(wire.encode_status_bytes(aborted))

    def release(self, conn: Connection, frame: Frame) -> Reply:
        if frame.data:
            raise wire.CodecError("RELEASE carries no data")
        existed = self.service.release(wire.decode_tag(frame.meta))
        return Reply(bytes([int(existed)]))

    def _only_keys(self, frame: Frame, op: str) -> list[bytes]:
        keys, end, _ = wire.decode_keys(frame.meta, 0, self.max_batch)
        if end != len(frame.meta) or frame.data:
            raise wire.CodecError(f"{op} carries only a key list")
        return keys

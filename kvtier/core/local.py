"""The service as a peer daemon sees it: the local tiers only.

A request from a peer (over the peer listener) is answered from this
node's RAM, disk and pending writes, never from its remote tiers: nothing
a peer asks is forwarded, so two daemons can never bounce a probe between
them. A block a peer pushes is kept locally (RAM, and the disk by its
policy) and never written back out to a remote tier. Reservations, request
tags and STATS belong to this node's own engines; the peer gate refuses
them before they get here, and this view refuses them again.

Between daemons, blocks travel sealed (:class:`SealedView`): a namespace's
blocks are encrypted under its key, and packed by the peers' codec, from
the daemon that sends them to the one that stores them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any

from kvtier.core.answers import Answers
from kvtier.core.loads import Loads
from kvtier.core.probing import Reach
from kvtier.core.retainer import Retainer
from kvtier.core.stores import Stores
from kvtier.errors import BadArgumentError, ForbiddenError
from kvtier.model import (
    Buffer,
    ConnId,
    Limits,
    Lookup,
    LookupReply,
    PutStatus,
    Reserve,
    ReserveStatus,
    Retention,
)
from kvtier.tiers.sealing import Sealer


class LocalView:
    """A :class:`~kvtier.model.CacheService` over the local tiers."""

    def __init__(
        self,
        answers: Answers,
        loads: Loads,
        stores: Stores,
        reach: Reach,
        limits: Limits,
        *,
        source: str,
        retainer: Retainer | None = None,
    ) -> None:
        self._answers, self._loads, self._stores = answers, loads, stores
        #: where a peer's leases go (None: refused)
        self._retainer = retainer
        #: the local tiers' locator, and no remote tier
        self._reach = reach
        #: the name a pushed block is stored under as its source (the peer tier's)
        self._source = source
        self.limits = limits

    def __repr__(self) -> str:
        return f"<LocalView source={self._source}>"

    def lookup(
        self, req: Lookup, cutoff: asyncio.Future[None] | None = None
    ) -> LookupReply | Awaitable[LookupReply]:
        return self._answers.lookup(req, cutoff, reach=self._reach)

    def get(self, keys: Sequence[bytes]) -> list[Buffer | None] | Awaitable[list[Buffer | None]]:
        return self._loads.get(keys, reach=self._reach)

    def unpin(self, keys: Sequence[bytes], values: Sequence[Buffer | None]) -> None:
        self._loads.unpin(keys, values)

    def put(
        self,
        keys: Sequence[bytes],
        values: Sequence[Buffer],
        *,
        copy: bool = False,
        hints: bytes | None = None,
    ) -> list[PutStatus]:
        return self._stores.put(keys, values, source=self._source, copy=copy, hints=hints)

    def stage(self, length: int, key: bytes) -> memoryview | None:
        return self._stores.stage(length, key)

    def drop_staged(self, value: Buffer) -> None:
        self._stores.drop_staged(value)

    def make_durable(
        self, keys: Sequence[bytes], values: Sequence[Buffer | None]
    ) -> Awaitable[None]:
        return self._stores.make_durable(keys, values)

    def delete(self, keys: Sequence[bytes]) -> list[bool] | Awaitable[list[bool]]:
        return self._stores.delete(keys, remote=False)

    def reserve(self, req: Reserve, owner: ConnId) -> list[ReserveStatus]:
        raise ForbiddenError("peers may not reserve blocks")

    def abort(self, keys: Sequence[bytes], owner: ConnId) -> list[bool]:
        raise ForbiddenError("peers may not reserve blocks")

    def release(self, tag: bytes) -> bool:
        raise ForbiddenError("peers have no request tags here")

    def retain(
        self,
        keys: Sequence[bytes],
        retention: Retention,
        lookup: bool = False,
        whole: bool = False,
    ) -> None:
        """A peer's session lease (its RETAIN) on the blocks it pushed here,
        and those its pushes are bringing; other verbs carry none."""
        if self._retainer is None or lookup:
            raise BadArgumentError("retention leases are set by local clients, not peers")
        self._retainer.retain(keys, retention, peer=True)

    def retain_arriving(self, keys: Sequence[bytes], retention: Retention) -> None:
        raise BadArgumentError("retention leases are set by local clients, not peers")

    def release_retention(self, session: bytes, namespace: bytes) -> int:
        raise BadArgumentError("retention leases are set by local clients, not peers")

    def connection_closed(self, owner: ConnId) -> None:
        pass  # a peer owns no reservations

    def write_room(self) -> asyncio.Future[None] | None:
        return self._stores.write_room()

    def stats(self) -> dict[str, Any]:
        raise ForbiddenError("peers may not read STATS")


class SealedView(LocalView):
    """The peer port's view: blocks travel sealed between daemons
    (:mod:`kvtier.tiers.sealing`). A pushed value is admitted by the one
    rule before it is stored (one that fails fails the PUT, counted), a
    value asked for is sealed before it is sent. A value that travels as
    it is stays pinned until the server has sent it; a sealed copy lets
    go of its pin once it is made."""

    def __init__(
        self,
        answers: Answers,
        loads: Loads,
        stores: Stores,
        reach: Reach,
        limits: Limits,
        *,
        source: str,
        sealer: Sealer,
        retainer: Retainer | None = None,
    ) -> None:
        super().__init__(answers, loads, stores, reach, limits, source=source, retainer=retainer)
        self.sealer = sealer

    def __repr__(self) -> str:
        return f"<SealedView source={self._source} {self.sealer!r}>"

    def get(self, keys: Sequence[bytes]) -> list[Buffer | None] | Awaitable[list[Buffer | None]]:
        values = super().get(keys)
        if isinstance(values, list):
            return self._sealed(keys, values)
        return self._sealed_later(keys, values)

    def _sealed(self, keys: Sequence[bytes], values: list[Buffer | None]) -> list[Buffer | None]:
        passes = self.sealer.passes
        if all(v is None or passes(v) for v in values):
            return values
        out: list[Buffer | None] = []
        copied: list[Buffer | None] = []
        try:
            for k, v in zip(keys, values, strict=True):
                sealed = None if v is None else self.sealer.seal(k, v)
                out.append(sealed)
                copied.append(None if sealed is v else v)
        finally:  # (the server's unpin of a sealed copy is a no-op)
            self.unpin(keys, [*copied, *values[len(copied) :]])
        return out

    async def _sealed_later(
        self, keys: Sequence[bytes], values: Awaitable[list[Buffer | None]]
    ) -> list[Buffer | None]:
        return self._sealed(keys, await values)

    def _admitted(self, keys: Sequence[bytes], values: Sequence[Buffer | None]) -> list[Any]:
        admit = self.sealer.admit
        out: list[Any] = []
        for k, v in zip(keys, values, strict=True):
            block = None if v is None else admit(k, v)
            # (a block unwrapped from a body received in place is its own
            # copy: the body's room goes back once the PUT is answered)
            out.append(bytes(block) if isinstance(block, memoryview) and block is not v else block)
        return out

    def put(
        self,
        keys: Sequence[bytes],
        values: Sequence[Buffer],
        *,
        copy: bool = False,
        hints: bytes | None = None,
    ) -> list[PutStatus]:
        return super().put(keys, self._admitted(keys, values), copy=copy, hints=hints)

    def stage(self, length: int, key: bytes) -> memoryview | None:
        # A sealed body is not the block it holds: received into a buffer of its own.
        return None if self.sealer.active else super().stage(length, key)

    def make_durable(
        self, keys: Sequence[bytes], values: Sequence[Buffer | None]
    ) -> Awaitable[None]:
        # (the values as the PUT stored them, admitted again)
        return super().make_durable(keys, self._admitted(keys, values))

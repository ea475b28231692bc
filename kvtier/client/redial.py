"""One connection to a daemon, dialled on first use and again after it is lost.

Every long-lived user of a daemon (an engine's tier, a peer) needs the same
three things: share one connection, share one attempt to open it, and after
a failed attempt wait out an exponential backoff before the next one
instead of hammering a daemon that is down. :class:`~kvtier.backoff.Backoff`
is the pure half (when the next attempt may start); :class:`Redial` does the
dialling.

Invariants: concurrent callers make one attempt between them; after a failed
attempt no other starts before its delay has passed on the injected clock
(callers meanwhile fail at once with
:class:`~kvtier.errors.DaemonUnavailableError`); the delay doubles from
``first`` up to ``most`` with each failure and is back at ``first`` after a
success. Same import rules as :mod:`kvtier.client.aio`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from kvtier.backoff import Backoff
from kvtier.client.aio import Client
from kvtier.errors import DaemonUnavailableError

log = logging.getLogger("kvtier.client")


class Redial:
    """The connection ``dial()`` opens, kept until it closes or is :meth:`drop`-ped."""

    def __init__(
        self,
        dial: Callable[[], Awaitable[Client]],
        *,
        what: str,
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._dial = dial
        #: names the daemon in errors ("kvtier daemon", "peer host:port")
        self.what = what
        self.backoff = backoff if backoff is not None else Backoff()
        self._clock = clock
        self._client: Client | None = None
        #: held while dialling: concurrent callers share one attempt
        self._dialling = asyncio.Lock()

    def __repr__(self) -> str:
        state = "connected" if self.connected else "idle"
        return f"<Redial {self.what} {state} {self.backoff!r}>"

    @property
    def connected(self) -> bool:
        return self._client is not None and not self._client.closed

    async def client(self) -> Client:
        """The open connection, dialling one if there is none."""
        client = self._client
        if client is not None and not client.closed:
            return client
        async with self._dialling:
            client = self._client
            if client is not None and not client.closed:
                return client
            now = self._clock()
            if now < self.backoff.not_before:
                raise DaemonUnavailableError(
                    f"{self.what} unavailable; next attempt in {self.backoff.not_before - now:.2f}s"
                )
            try:
                client = await self._dial()
            except Exception as exc:
                delay = self.backoff.failed(self._clock())
                log.warning("%s unavailable (%s); next attempt in %.2fs", self.what, exc, delay)
                raise
            self.backoff.succeeded()
            self._client = client
            return client

    def drop(self) -> None:
        """The connection is broken or hung: drop it; the next call dials afresh."""
        client, self._client = self._client, None
        if client is not None:
            client.drop()

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()

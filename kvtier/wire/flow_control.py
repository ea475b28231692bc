"""Flow control for one stream transport, shared by the server and the client.

Tracks the two directions: the transport asks us to stop writing
(``pause_writing``/``resume_writing``, whose ``drain`` a writer awaits), and
we ask it to stop reading (``pause_reading``/``resume_reading``, idempotent,
so callers state what they want and never track it themselves).

Invariants: ``drain`` returns at once unless writing is paused, and never
hangs past :meth:`closed`; the transport sees at most one pause per resume.
Imports nothing of kvtier.
"""

from __future__ import annotations

import asyncio
from typing import Protocol


class _Reading(Protocol):
    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class FlowControl:
    __slots__ = ("_transport", "_writable", "read_paused", "write_paused")

    def __init__(self, transport: _Reading) -> None:
        self._transport = transport
        self.read_paused = False
        self.write_paused = False
        self._writable = asyncio.Event()
        self._writable.set()

    def __repr__(self) -> str:
        return f"<FlowControl read_paused={self.read_paused} write_paused={self.write_paused}>"

    # -- what the transport tells us

    def pause_writing(self) -> None:
        self.write_paused = True
        self._writable.clear()

    def resume_writing(self) -> None:
        self.write_paused = False
        self._writable.set()

    def closed(self) -> None:
        """The transport is gone: writers stop waiting (their writes will fail)."""
        self._writable.set()

    async def drain(self) -> None:
        if not self._writable.is_set():
            await self._writable.wait()

    # -- what we tell the transport

    def reading(self, wanted: bool) -> None:
        if wanted and self.read_paused:
            self.read_paused = False
            self._transport.resume_reading()
        elif not wanted and not self.read_paused:
            self.read_paused = True
            self._transport.pause_reading()

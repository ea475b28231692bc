"""An in-memory *remote* tier: the test double and demo stand-in for S3 or peers.

It behaves like a remote tier (lookups are probed, not answered from the
local index) and lets a test gate every call with an ``asyncio.Event``,
count calls, and inject the failures a real backend can produce.

Imports the tiers' base; never the core or metrics.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator, Sequence
from typing import Literal, cast

from kvtier.errors import TierError
from kvtier.model import Buffer
from kvtier.tiers.base import Tier, TierStats

#: raise; hang; answer one short; fail while the answers are read; ignore
#: cancellation while gated (a retry loop with a bare except); answer with an
#: endless iterable; answer with values that are not booleans
LookupFault = Literal["raise", "hang", "short", "raise_midway", "ignore_cancel", "endless", "junk"]


class MemoryRemoteTier(Tier):
    def __init__(self, name: str = "memory") -> None:
        self.name = name
        self.blocks: dict[bytes, bytes] = {}
        self.lookup_calls: list[list[bytes]] = []
        self.load_calls: list[list[bytes]] = []
        self.store_calls: list[list[bytes]] = []
        self.delete_calls: list[list[bytes]] = []
        #: when set, lookups (loads) wait for it before answering
        self.lookup_gate: asyncio.Event | None = None
        self.load_gate: asyncio.Event | None = None
        #: set when a lookup (load) call has started: a test can await the backend being busy
        self.lookup_started = asyncio.Event()
        self.load_started = asyncio.Event()
        self.lookup_fault: LookupFault | None = None
        #: cancellations swallowed under the "ignore_cancel" fault
        self.cancels_ignored = 0
        self.load_fault: bool = False

    def __repr__(self) -> str:
        return (
            f"<MemoryRemoteTier {self.name} blocks={len(self.blocks)} "
            f"lookups={len(self.lookup_calls)} loads={len(self.load_calls)}>"
        )

    async def batch_lookup(self, keys: Sequence[bytes]) -> list[bool]:
        # The answer reflects the blocks when the call starts, as a real
        # backend's would: a gated call returns what was true back then.
        answers = [k in self.blocks for k in keys]
        fault = self.lookup_fault
        gate = self.lookup_gate
        self.lookup_calls.append(list(keys))
        self.lookup_started.set()
        if gate is not None:
            while True:
                try:
                    await gate.wait()
                    break
                except asyncio.CancelledError:
                    if fault != "ignore_cancel":
                        raise
                    self.cancels_ignored += 1
        if fault == "raise":
            raise TierError(f"{self.name}: backend failed")
        if fault == "hang":
            await asyncio.Event().wait()
        if fault == "short":
            return answers[:-1]
        if fault == "raise_midway":
            return _FailingList(answers)
        if fault == "endless":
            return cast(list[bool], itertools.repeat(True))
        if fault == "junk":
            return cast(list[bool], ["no" if a else None for a in answers])
        return answers

    async def batch_load(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        gate = self.load_gate
        self.load_calls.append(list(keys))
        self.load_started.set()
        if gate is not None:
            await gate.wait()
        if self.load_fault:
            raise TierError(f"{self.name}: load failed")
        return [self.blocks.get(k) for k in keys]

    async def batch_store(self, keys: Sequence[bytes], values: Sequence[Buffer]) -> None:
        self.store_calls.append(list(keys))
        for key, value in zip(keys, values, strict=True):
            self.blocks[key] = bytes(value)

    async def delete(self, keys: Sequence[bytes]) -> list[bool]:
        self.delete_calls.append(list(keys))
        return [self.blocks.pop(k, None) is not None for k in keys]

    def stats(self) -> TierStats:
        return TierStats(
            name=self.name,
            capacity_bytes=0,
            used_bytes=sum(len(v) for v in self.blocks.values()),
            blocks=len(self.blocks),
        )


class _FailingList(list[bool]):
    """A result that yields some answers, then raises while being consumed."""

    def __iter__(self) -> Iterator[bool]:
        for i, value in enumerate(list.__iter__(self)):
            if i == 1:
                raise TierError("result stream broke mid-way")
            yield value

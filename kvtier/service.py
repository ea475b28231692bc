"""The cache service: lookup / get / put / delete orchestration over the tiers.

The service knows nothing about sockets or frames; the server decodes a
request, calls one method here, and encodes what it returns. Requests are
validated here against the configured limits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.errors import BadArgumentError, BadKeyError, BatchTooLargeError, ValueTooLargeError
from kvtier.metrics import Metrics
from kvtier.prefix import prefix_answer
from kvtier.protocol.codec import Buffer, Lookup, LookupMode, LookupReply, PutStatus, State
from kvtier.tiers.ram import RamTier

_STATE_NAMES = {int(s): s.name.lower() for s in State}


@dataclass(slots=True, frozen=True)
class Limits:
    max_key_bytes: int
    max_batch: int
    max_block_bytes: int


class Service:
    def __init__(self, limits: Limits, ram: RamTier, metrics: Metrics) -> None:
        self.limits = limits
        self.ram = ram
        self.metrics = metrics
        self._state_counters = {
            s: metrics.lookup_keys.labels(name) for s, name in _STATE_NAMES.items()
        }

    def __repr__(self) -> str:
        return f"<Service ram={self.ram!r}>"

    # -- validation

    def check_keys(self, keys: Sequence[bytes]) -> None:
        if len(keys) > self.limits.max_batch:
            raise BatchTooLargeError(
                f"batch of {len(keys)} keys exceeds the maximum of {self.limits.max_batch}"
            )
        limit = self.limits.max_key_bytes
        for i, key in enumerate(keys):
            if not 0 < len(key) <= limit:
                raise BadKeyError(f"key {i} is {len(key)} bytes; keys must be 1..{limit} bytes")

    # -- operations

    def lookup(self, req: Lookup) -> LookupReply:
        self.check_keys(req.keys)
        if req.mode == LookupMode.SLIDING_WINDOW and req.window <= 0:
            raise BadArgumentError("sliding-window lookup needs a window of at least 1")
        contains = self.ram.contains
        raw = bytes(1 if contains(k) else 0 for k in req.keys)
        window = req.window if req.mode == LookupMode.SLIDING_WINDOW else 0
        hits, defer = prefix_answer(raw, window)
        hit_count = raw.count(1)
        if hit_count:
            self._state_counters[State.HIT].inc(hit_count)
        if len(raw) - hit_count:
            self._state_counters[State.MISS].inc(len(raw) - hit_count)
        return LookupReply(raw, hits, defer)

    def get_pinned(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        """Values of ``keys``, each present one pinned until :meth:`unpin`."""
        self.check_keys(keys)
        pin = self.ram.pin
        return [pin(k) for k in keys]

    def unpin(self, keys: Sequence[bytes], values: Sequence[Buffer | None]) -> None:
        unpin = self.ram.unpin
        for key, value in zip(keys, values, strict=True):
            if value is not None:
                unpin(key)

    def put(self, keys: Sequence[bytes], values: Sequence[Buffer]) -> list[PutStatus]:
        self.check_keys(keys)
        limit = self.limits.max_block_bytes
        for i, value in enumerate(values):
            if len(value) > limit:
                raise ValueTooLargeError(
                    f"value {i} is {len(value)} bytes; the maximum block size is {limit}"
                )
            if len(value) > self.ram.capacity:
                raise ValueTooLargeError(
                    f"value {i} is {len(value)} bytes, larger than the RAM tier "
                    f"({self.ram.capacity} bytes)"
                )
        statuses = []
        for key, value in zip(keys, values, strict=True):
            stored, _evicted = self.ram.put(key, value)
            statuses.append(PutStatus.STORED if stored else PutStatus.EXISTS)
        return statuses

    def delete(self, keys: Sequence[bytes]) -> list[bool]:
        self.check_keys(keys)
        return [self.ram.remove(k) for k in keys]

    def stats(self) -> dict[str, Any]:
        st = self.ram.stats()
        return {
            "tiers": {
                st.name: {
                    "capacity_bytes": st.capacity_bytes,
                    "used_bytes": st.used_bytes,
                    "blocks": st.blocks,
                    "evictions": st.evictions,
                    **st.extra,
                }
            },
        }

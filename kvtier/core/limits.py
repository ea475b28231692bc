"""Request validation against the configured limits. Pure; imports the shared
records and the errors.

Every verb checks its arguments here before touching any state, so a refused
request changes nothing. Checks are O(batch) and allocate nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvtier.errors import BadArgumentError, BadKeyError, BatchTooLargeError, ValueTooLargeError
from kvtier.model import Buffer, Limits, Lookup, LookupMode


def check_keys(limits: Limits, keys: Sequence[bytes], uniform_len: int = 0) -> None:
    """Batch size and key lengths; ``uniform_len`` (all keys that long) checks once."""
    if len(keys) > limits.max_batch:
        raise BatchTooLargeError(
            f"batch of {len(keys)} keys exceeds the maximum of {limits.max_batch}"
        )
    limit = limits.max_key_bytes
    if uniform_len and 0 < uniform_len <= limit:
        return
    for i, key in enumerate(keys):
        if not 0 < len(key) <= limit:
            raise BadKeyError(f"key {i} is {len(key)} bytes; keys must be 1..{limit} bytes")


def check_seconds(name: str, value: float) -> None:
    if math.isnan(value) or value < 0 or math.isinf(value):
        raise BadArgumentError(f"{name} must be a finite number >= 0, got {value}")


def check_lookup(limits: Limits, req: Lookup) -> None:
    check_keys(limits, req.keys, req.key_len)
    check_seconds("wait", req.wait)
    check_seconds("max_pending_wait", req.max_pending_wait)
    if req.max_pending_wait > 0 and not req.request_tag:
        raise BadArgumentError("max_pending_wait needs a request tag to accrue against")
    if req.mode == LookupMode.SLIDING_WINDOW and req.window <= 0:
        raise BadArgumentError("sliding-window lookup needs a window of at least 1")


def check_sizes(limits: Limits, sizes: Sequence[int], what: str = "size") -> None:
    limit = limits.max_block_bytes
    for i, size in enumerate(sizes):
        if size > limit:
            raise ValueTooLargeError(
                f"{what} {i} is {size} bytes; the maximum block size is {limit}"
            )


def check_values(limits: Limits, values: Sequence[Buffer], room: int) -> None:
    """Each value within the block limit and within ``room`` (the RAM tier's capacity)."""
    check_sizes(limits, [len(v) for v in values], "value")
    for i, value in enumerate(values):
        if len(value) > room:
            raise ValueTooLargeError(
                f"value {i} is {len(value)} bytes, larger than the RAM tier ({room} bytes)"
            )

"""The verbs' argument checks against the configured limits. Pure.

Every verb checks its arguments before it touches any state, so a refused
request changes nothing: the service's verbs, the shared-memory paths
(staging, regions) and the lookup process (the same :func:`check_lookup`)
call these. O(batch), allocating nothing, but for :func:`check_checksum`,
which reads a block once. Imports the errors, xxhash and the shared
records only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import xxhash

from kvtier.errors import BadArgumentError, BadKeyError, BatchTooLargeError, ValueTooLargeError
from kvtier.model import NAMESPACE_MARK, Buffer, Limits, Lookup, LookupMode


def check_keys(limits: Limits, keys: Sequence[bytes], uniform_len: int = 0) -> None:
    """Batch size and key lengths; ``uniform_len`` (all keys that long) checks once."""
    if len(keys) > limits.max_batch:
        raise BatchTooLargeError(
            f"batch of {len(keys)} keys exceeds the maximum of {limits.max_batch}"
        )
    limit = limits.max_key_bytes
    if uniform_len and 0 < uniform_len <= limit:
        return
    if uniform_len and 0 < uniform_len <= limit + _prefix_len(keys[0]):
        return  # a namespace's keys: their prefix is not theirs to count
    for i, key in enumerate(keys):
        if not 0 < len(key) - _prefix_len(key) <= limit:
            raise BadKeyError(
                f"key {i} is {len(key) - _prefix_len(key)} bytes; keys must be 1..{limit} bytes"
            )


def _prefix_len(key: bytes) -> int:
    """The length of the namespace prefix (or escape) a stored key starts with."""
    return 2 + key[1] if len(key) > 1 and key[0] == NAMESPACE_MARK else 0


def check_seconds(name: str, value: float) -> None:
    if not 0 <= value < math.inf:  # NaN compares false
        raise BadArgumentError(f"{name} must be a finite number >= 0, got {value}")


def check_lookup(limits: Limits, req: Lookup) -> None:
    check_keys(limits, req.keys, req.key_len)
    if not (0 <= req.wait < math.inf and 0 <= req.max_pending_wait < math.inf):
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


def check_checksum(block: Buffer, checksum: int, key: bytes, what: str) -> None:
    """Refuse a block whose bytes do not match its XXH3-64 ``checksum``."""
    if xxhash.xxh3_64_intdigest(block) != checksum:
        raise BadArgumentError(
            f"checksum mismatch for key {key.hex()}: {what} changed or was not "
            "all written; nothing stored"
        )

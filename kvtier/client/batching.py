"""How the client cuts a PUT of many blocks into frames. Pure.

Large blocks travel one per frame: the daemon receives such a body
straight into the block's place in RAM, and the shared-memory path stages
blocks from the same size up. Small ones share frames, up to half the
daemon's frame limit and its batch limit each.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.model import Buffer

#: values at least this large travel one per frame (or through staging)
SOLO_VALUE_BYTES = 64 * 1024

Batch = tuple[Sequence[bytes], Sequence[Buffer]]


def put_batches(
    keys: Sequence[bytes], values: Sequence[Buffer], *, max_frame: int, max_batch: int
) -> list[Batch]:
    budget = max_frame // 2
    batches: list[Batch] = []
    cur_k: list[bytes] = []
    cur_v: list[Buffer] = []
    size = 0
    for key, value in zip(keys, values, strict=True):
        n = len(value)
        if n >= SOLO_VALUE_BYTES:
            batches.append(([key], [value]))
            continue
        if cur_k and (size + n + len(key) > budget or len(cur_k) >= max_batch):
            batches.append((cur_k, cur_v))
            cur_k, cur_v, size = [], [], 0
        cur_k.append(key)
        cur_v.append(value)
        size += n + len(key) + 6
    if cur_k:
        batches.append((cur_k, cur_v))
    return batches

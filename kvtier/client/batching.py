"""How the client cuts a PUT of many blocks into frames. Pure.

Large blocks travel one per frame: the daemon receives such a body
straight into the block's place in RAM, and the shared-memory path stages
blocks from the same size up. Small ones share frames, up to half the
daemon's frame limit and its batch limit each. Frames are cut, not
reordered blocks: answers go back to each block's place.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.model import Buffer

#: values at least this large travel one per frame (or through staging)
SOLO_VALUE_BYTES = 64 * 1024
#: values at least this large go through shared memory by default (written
#: in place, or staged); below it the socket, which the daemon receives
#: straight into the block's place, costs no more
SHARED_WRITE_BYTES = 512 * 1024

#: the positions, in the caller's lists, of the blocks one frame carries
Batch = list[int]


def put_batches(
    values: Sequence[Buffer], *, keys_bytes: Sequence[int], max_frame: int, max_batch: int
) -> list[Batch]:
    """The frames a PUT of ``values`` (keys of ``keys_bytes`` bytes) is cut
    into, as positions: a caller puts each answer back in its block's place."""
    budget = max_frame // 2
    batches: list[Batch] = []
    cur: Batch = []
    size = 0
    for i, value in enumerate(values):
        n = len(value)
        if n >= SOLO_VALUE_BYTES:
            batches.append([i])
            continue
        if cur and (size + n + keys_bytes[i] > budget or len(cur) >= max_batch):
            batches.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += n + keys_bytes[i] + 6
    if cur:
        batches.append(cur)
    return batches

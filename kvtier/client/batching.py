"""How a client's blocks travel: which writes go through shared memory or
over the socket (:class:`WritePath`, chosen once after HELLO), and in
which frames. Pure.

Over the socket, large blocks travel one per frame: the daemon receives such a body
straight into the block's place in RAM, and the shared-memory path stages
blocks from the same size up. Small ones share frames, up to half the
daemon's frame limit and its batch limit each. Frames are cut, not
reordered blocks: answers go back to each block's place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.model import Buffer

#: values at least this large travel one per frame (or through staging)
SOLO_VALUE_BYTES = 64 * 1024
#: values at least this large go through shared memory by default (written
#: in place, or staged); below it the socket, which the daemon receives
#: straight into the block's place, costs no more
SHARED_WRITE_BYTES = 512 * 1024


@dataclass(frozen=True, slots=True)
class WritePath:
    """Which writes go through shared memory; the rest go over the socket.

    Chosen once a connection knows what it has (:meth:`choose`, after HELLO
    and the mapping of the daemon's memory). Invariants: without shared
    memory, or with ``stage_writes=False``, no write goes through it; a
    block under ``one_from`` bytes never does."""

    #: a lone block (``put``) of this many bytes or more; None: none
    one_from: int | None = None
    #: a batch (``put_many``) with a block of this many bytes or more; None: none
    many_from: int | None = None
    #: ... and only when it is the batch's one such block (a staged write
    #: copies twice: a batch of many large blocks pipelines better over the
    #: socket, unless they are written in place)
    many_alone: bool = False

    @classmethod
    def choose(cls, stage_writes: bool | None, shared: bool, in_place: bool) -> WritePath:
        """The path of a connection with shared memory (``shared``) written
        in place or not, by the client's ``stage_writes`` option."""
        if not shared or stage_writes is False:
            return SOCKET_ONLY
        if stage_writes:
            return cls(SOLO_VALUE_BYTES, SOLO_VALUE_BYTES)
        if in_place:
            # A batch's every block of 64 KiB or more goes in place: the
            # copies pipeline, and the socket's two copies cost more.
            return cls(SHARED_WRITE_BYTES, SOLO_VALUE_BYTES)
        return cls(SHARED_WRITE_BYTES, SHARED_WRITE_BYTES, many_alone=True)

    def one(self, value: Buffer) -> bool:
        """Whether a lone block goes through shared memory."""
        return self.one_from is not None and len(value) >= self.one_from

    def many(self, values: Sequence[Buffer]) -> bool:
        """Whether a batch goes through shared memory."""
        least = self.many_from
        if least is None:
            return False
        large = sum(1 for v in values if len(v) >= least)
        return large == 1 if self.many_alone else large > 0


#: every write over the socket
SOCKET_ONLY = WritePath()

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

"""SUBSCRIBE: one connection turned into a stream of block events. Pure.

The request asks for the daemon's block events from now on (optionally
after a snapshot of what it holds); every reply frame carries a batch of
events and the flag ``MORE`` (more frames follow for this request) until
the connection closes. See docs/protocol.md, "Events".
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from kvtier.model import BlockEvent, Buffer, EventKind, EventTier
from kvtier.wire.framing import CodecError

#: SUBSCRIBE request: flags, then the queue bound asked for (0: the daemon's)
_SUBSCRIBE = struct.Struct("<B3xI")
SUBSCRIBE_SNAPSHOT = 0x01  # first every block held now, then SNAPSHOT_END, then live
#: one event: sequence number, kind, tier, key length (the key follows)
_EVENT = struct.Struct("<QBBH")
_U32 = struct.Struct("<I")


def encode_subscribe(snapshot: bool = False, limit: int = 0) -> bytes:
    return _SUBSCRIBE.pack(SUBSCRIBE_SNAPSHOT if snapshot else 0, limit)


def decode_subscribe(buf: Buffer) -> tuple[bool, int]:
    """(snapshot first, queue bound asked for)."""
    if len(buf) != _SUBSCRIBE.size:
        raise CodecError("SUBSCRIBE carries its flags and a queue bound")
    flags, limit = _SUBSCRIBE.unpack(buf)
    if flags & ~SUBSCRIBE_SNAPSHOT:
        raise CodecError(f"unknown SUBSCRIBE flags 0x{flags:02x}")
    return bool(flags & SUBSCRIBE_SNAPSHOT), int(limit)


def encode_events(events: Sequence[BlockEvent]) -> bytes:
    parts = [_U32.pack(len(events))]
    for e in events:
        parts.append(_EVENT.pack(e.seq, e.kind, e.tier, len(e.key)))
        parts.append(e.key)
    return b"".join(parts)


def decode_events(buf: Buffer) -> list[BlockEvent]:
    if len(buf) < 4:
        raise CodecError("truncated event batch")
    view = memoryview(buf)
    (n,) = _U32.unpack_from(view, 0)
    pos, out = 4, []
    for _ in range(n):
        if pos + _EVENT.size > len(view):
            raise CodecError("truncated event")
        seq, kind, tier, klen = _EVENT.unpack_from(view, pos)
        pos += _EVENT.size
        key = bytes(view[pos : pos + klen])
        if len(key) != klen:
            raise CodecError("truncated event key")
        pos += klen
        try:
            out.append(BlockEvent(seq, EventKind(kind), key, EventTier(tier)))
        except ValueError as exc:
            raise CodecError(f"unknown event kind {kind} or tier {tier}") from exc
    if pos != len(view):
        raise CodecError("trailing bytes after the event batch")
    return out

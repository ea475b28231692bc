"""HELLO: version negotiation, limits, the peer token, the namespace and the
shared-memory offer. Pure.

Optional fields follow the fixed ones in a set order (the token, then
flags, then the namespace; the node id, then the shared-memory offer), so
an older peer's shorter message still decodes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from kvtier.model import Buffer
from kvtier.wire.codecs import _decode_str, _decode_u16_bytes, _encode_str, _expect_end
from kvtier.wire.framing import SUPPORTED_VERSIONS, CodecError

_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_HELLO_REQ = struct.Struct("<BB")
_HELLO_REPLY = struct.Struct("<BxHIII")  # version, max key, max batch, max frame, max block


@dataclass(slots=True, frozen=True)
class Hello:
    min_version: int
    max_version: int
    client_name: str
    #: the shared secret of a peer listener; empty on the local socket. Its
    #: repr never shows it.
    token: bytes = field(default=b"", repr=False)
    #: the client would read blocks through shared memory (same host only)
    shared: bool = False
    #: the namespace the connection's keys belong to (docs/tenancy.md); empty:
    #: the default namespace
    namespace: str = ""


@dataclass(slots=True, frozen=True)
class SharedOffer:
    """Shared memory a daemon offers a client that asked for it at HELLO."""

    #: the Unix socket that hands out the arena's and the staging region's descriptors
    path: str
    arena_bytes: int
    staging_bytes: int


_SHARED_OFFER = struct.Struct("<QQ")


@dataclass(slots=True, frozen=True)
class HelloReply:
    version: int
    max_key_bytes: int
    max_batch: int
    max_frame_bytes: int
    max_block_bytes: int
    server_name: str
    #: the daemon's random identity for this run: a daemon that dials a
    #: peer address and meets its own node id knows the address is itself
    node_id: str = ""
    #: shared memory for this connection, when asked for and offered
    shared: SharedOffer | None = None


#: HELLO flags (after the token)
HELLO_SHARED = 0x01
HELLO_NAMESPACE = 0x02  # the namespace's name follows the flags


def encode_hello(hello: Hello) -> bytes:
    out = _HELLO_REQ.pack(hello.min_version, hello.max_version) + _encode_str(hello.client_name)
    flags = (HELLO_SHARED if hello.shared else 0) | (HELLO_NAMESPACE if hello.namespace else 0)
    if hello.token or flags:
        out += _U16.pack(len(hello.token)) + hello.token
    if flags:
        out += _U8.pack(flags)
    if hello.namespace:
        out += _encode_str(hello.namespace)
    return out


def decode_hello(buf: Buffer) -> Hello:
    if len(buf) < _HELLO_REQ.size:
        raise CodecError("truncated HELLO")
    lo, hi = _HELLO_REQ.unpack_from(buf, 0)
    name, end = _decode_str(buf, _HELLO_REQ.size)
    token = b""
    if end < len(buf):  # optional: the peer token
        token, end = _decode_u16_bytes(buf, end, "HELLO token")
    flags = 0
    if end < len(buf):  # optional, after the token: flags
        flags = buf[end]
        end += 1
    namespace = ""
    if flags & HELLO_NAMESPACE:
        namespace, end = _decode_str(buf, end)
    _expect_end(buf, end)
    return Hello(lo, hi, name, token, bool(flags & HELLO_SHARED), namespace)


def encode_hello_reply(reply: HelloReply) -> bytes:
    return (
        _HELLO_REPLY.pack(
            reply.version,
            reply.max_key_bytes,
            reply.max_batch,
            reply.max_frame_bytes,
            reply.max_block_bytes,
        )
        + _encode_str(reply.server_name)
        + (_encode_str(reply.node_id) if reply.node_id or reply.shared else b"")
        + (_encode_shared_offer(reply.shared) if reply.shared else b"")
    )


def _encode_shared_offer(offer: SharedOffer) -> bytes:
    return _encode_str(offer.path) + _SHARED_OFFER.pack(offer.arena_bytes, offer.staging_bytes)


def decode_hello_reply(buf: Buffer) -> HelloReply:
    if len(buf) < _HELLO_REPLY.size:
        raise CodecError("truncated HELLO reply")
    version, max_key, max_batch, max_frame, max_block = _HELLO_REPLY.unpack_from(buf, 0)
    name, end = _decode_str(buf, _HELLO_REPLY.size)
    node_id = ""
    if end < len(buf):  # optional: the daemon's node id
        node_id, end = _decode_str(buf, end)
    shared = None
    if end < len(buf):  # optional, after the node id: the shared memory offer
        path, end = _decode_str(buf, end)
        if end + _SHARED_OFFER.size > len(buf):
            raise CodecError("truncated HELLO reply shared memory offer")
        arena, staging = _SHARED_OFFER.unpack_from(buf, end)
        end += _SHARED_OFFER.size
        shared = SharedOffer(path, arena, staging)
    _expect_end(buf, end)
    return HelloReply(version, max_key, max_batch, max_frame, max_block, name, node_id, shared)


def negotiate_version(hello: Hello) -> int | None:
    """The highest version both sides speak, or None."""
    common = [v for v in SUPPORTED_VERSIONS if hello.min_version <= v <= hello.max_version]
    return max(common) if common else None

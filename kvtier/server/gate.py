"""The peer listener's gate: a shared secret first, then a short list of ops.

A connection on the peer port is unauthenticated until its first frame, a
HELLO carrying the right token, passes :meth:`PeerGate.admit`. Any other
first frame (no HELLO, no token, a wrong token, a plain client) is refused:
counted by reason, answered with one FORBIDDEN error and closed before
anything of the frame is acted on. The token is compared in constant time
and never logged or shown in a repr.

Once in, a peer may only run :attr:`PeerGate.ops`: HELLO, PING, LOOKUP, GET,
PUT and RETAIN (a session's lease on the blocks it pushed; and DELETE when
enabled). Never STATS, RESERVE, ABORT or RELEASE: a peer is not a client
of this node's engines. Pure; imports the wire only.
"""

from __future__ import annotations

import enum
import hmac

from kvtier import wire
from kvtier.wire import Frame, Op

PEER_OPS = frozenset({Op.HELLO, Op.PING, Op.LOOKUP, Op.GET, Op.PUT, Op.RETAIN})


class Refusal(enum.Enum):
    """Why a peer connection was refused (the metrics label)."""

    NOT_HELLO = "not_hello"  # the first frame was something else: not a peer
    MALFORMED = "malformed_hello"
    NO_TOKEN = "no_token"
    BAD_TOKEN = "bad_token"
    HANDSHAKE_TIMEOUT = "handshake_timeout"  # no accepted HELLO (first frame) in time
    UNAUTHENTICATED_LIMIT = "unauthenticated_limit"  # the oldest of too many waiting


class PeerGate:
    def __init__(self, token: bytes, *, allow_delete: bool = False) -> None:
        if not token:
            raise ValueError("a peer gate needs a token")
        self._token = token
        #: ops a peer connection may run once authenticated
        self.ops = PEER_OPS | {Op.DELETE} if allow_delete else PEER_OPS

    def __repr__(self) -> str:
        names = sorted(Op(op).name for op in self.ops)
        return f"<PeerGate ops={','.join(names)}>"

    def admit(self, frame: Frame) -> Refusal | None:
        """None when ``frame`` is a HELLO with the right token; else why not."""
        if frame.header.opcode != Op.HELLO:
            return Refusal.NOT_HELLO
        try:
            hello = wire.decode_hello(frame.meta)
        except wire.CodecError:
            return Refusal.MALFORMED
        if not hello.token:
            return Refusal.NO_TOKEN
        if not hmac.compare_digest(hello.token, self._token):
            return Refusal.BAD_TOKEN
        return None

    def allows(self, opcode: int) -> bool:
        return opcode in self.ops

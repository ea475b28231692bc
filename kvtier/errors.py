"""The kvtier error hierarchy.

Every error kvtier raises derives from :class:`KvtierError`. Errors that
travel over the wire carry an :class:`ErrorCode`; the server converts a
raised :class:`KvtierError` into an error reply with that code, and the
client converts the reply back into the same exception class. Third-party
exceptions are converted where they enter kvtier. A cache miss is never an
error: it is a return value (``None`` or the ``MISS`` state).

Imports nothing of kvtier: every wing may raise these.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    """Wire error codes (the ``status`` field of an error reply)."""

    OK = 0
    MALFORMED = 1
    UNSUPPORTED_VERSION = 2
    UNKNOWN_OPCODE = 3
    FRAME_TOO_LARGE = 4
    BAD_KEY = 5
    VALUE_TOO_LARGE = 6
    BATCH_TOO_LARGE = 7
    NO_CAPACITY = 8
    BAD_ARGUMENT = 9
    SHUTTING_DOWN = 10
    INTERNAL = 11
    BUSY = 12
    FORBIDDEN = 13
    REFERRED = 14  # the lookup socket: ask the daemon (docs/lookup-process.md)
    TIMEOUT = 15  # a frame's bytes stopped arriving (server.body_timeout)
    NOT_DURABLE = 16  # a durable PUT's blocks are stored, not durable: its tier failed


class KvtierError(Exception):
    """Root of every error raised by kvtier."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.__class__.__doc__ or self.__class__.__name__)

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class ConfigError(KvtierError):
    """The configuration is invalid."""


class ProtocolError(KvtierError):
    """A frame broke the wire protocol."""

    code = ErrorCode.MALFORMED


class UnsupportedVersionError(ProtocolError):
    """The peer speaks a protocol version this side does not."""

    code = ErrorCode.UNSUPPORTED_VERSION


class UnknownOpcodeError(ProtocolError):
    """The frame's opcode is not defined in this protocol version."""

    code = ErrorCode.UNKNOWN_OPCODE


class FrameTooLargeError(ProtocolError):
    """The frame is larger than the negotiated maximum."""

    code = ErrorCode.FRAME_TOO_LARGE


class RequestError(KvtierError):
    """A well-formed request that the server refuses."""

    code = ErrorCode.BAD_ARGUMENT


class BadKeyError(RequestError):
    """A key is empty or longer than the maximum key length."""

    code = ErrorCode.BAD_KEY


class ValueTooLargeError(RequestError):
    """A value is larger than the maximum block size or than a whole tier."""

    code = ErrorCode.VALUE_TOO_LARGE


class BatchTooLargeError(RequestError):
    """A batch holds more keys than the maximum batch size."""

    code = ErrorCode.BATCH_TOO_LARGE


class BadArgumentError(RequestError):
    """A request argument is out of range."""

    code = ErrorCode.BAD_ARGUMENT


class NoCapacityError(KvtierError):
    """No room can be made: every resident block is pinned."""

    code = ErrorCode.NO_CAPACITY


class BusyError(KvtierError):
    """Reserved wire code: the server is too busy to take this request.

    The v1 server never sends it (it stops reading instead, see
    docs/protocol.md, flow control); the code stays reserved so that a
    client decodes it if a later server does."""

    code = ErrorCode.BUSY


class ForbiddenError(KvtierError):
    """The daemon does not accept connections from this user."""

    code = ErrorCode.FORBIDDEN


class ShuttingDownError(KvtierError):
    """The daemon is shutting down and accepts no new work."""

    code = ErrorCode.SHUTTING_DOWN


class ServerError(KvtierError):
    """The server failed while handling a request."""

    code = ErrorCode.INTERNAL


class ConnectionClosedError(KvtierError):
    """The connection closed before the reply arrived."""


class DaemonUnavailableError(KvtierError):
    """No daemon answers at the socket path."""


class RequestTimeoutError(KvtierError, TimeoutError):
    """The reply did not arrive within the call's timeout."""


class SocketInUseError(KvtierError):
    """Another live daemon already serves this socket path."""


class DataDirInUseError(KvtierError):
    """Another live daemon already keeps its blocks in this data directory."""


class UnsafeSocketDirError(KvtierError):
    """The socket's directory could be tampered with by another user."""


class TierError(KvtierError):
    """A tier's backend failed."""


class NotDurableError(TierError):
    """A durable PUT's blocks are stored but not yet on a tier that
    outlives the daemon: that tier failed the write (it is retried in the
    background); store them again, durably, to be told when they are."""

    code = ErrorCode.NOT_DURABLE


class ReferredError(KvtierError):
    """The lookup socket cannot answer this lookup exactly: ask the daemon."""

    code = ErrorCode.REFERRED


class FrameTimeoutError(ProtocolError):
    """The frame's bytes stopped arriving for ``server.body_timeout``: the
    daemon closed the connection."""

    code = ErrorCode.TIMEOUT


_BY_CODE: dict[ErrorCode, type[KvtierError]] = {
    ErrorCode.MALFORMED: ProtocolError,
    ErrorCode.UNSUPPORTED_VERSION: UnsupportedVersionError,
    ErrorCode.UNKNOWN_OPCODE: UnknownOpcodeError,
    ErrorCode.FRAME_TOO_LARGE: FrameTooLargeError,
    ErrorCode.BAD_KEY: BadKeyError,
    ErrorCode.VALUE_TOO_LARGE: ValueTooLargeError,
    ErrorCode.BATCH_TOO_LARGE: BatchTooLargeError,
    ErrorCode.NO_CAPACITY: NoCapacityError,
    ErrorCode.BAD_ARGUMENT: BadArgumentError,
    ErrorCode.SHUTTING_DOWN: ShuttingDownError,
    ErrorCode.INTERNAL: ServerError,
    ErrorCode.BUSY: BusyError,
    ErrorCode.FORBIDDEN: ForbiddenError,
    ErrorCode.REFERRED: ReferredError,
    ErrorCode.TIMEOUT: FrameTimeoutError,
    ErrorCode.NOT_DURABLE: NotDurableError,
}


def error_from_code(code: int, message: str) -> KvtierError:
    """Rebuild the exception an error reply stands for."""
    try:
        cls = _BY_CODE[ErrorCode(code)]
    except (ValueError, KeyError):
        return ServerError(f"error code {code}: {message}")
    return cls(message)

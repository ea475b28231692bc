"""The records every wing shares: keys, lookup states, replies, statuses, limits.

Pure: imports nothing of kvtier and no third-party package. The wire codecs
encode these records, the core computes them, the server and the client pass
them along; none of them defines its own copy.

States are plain ints on the hot path (a lookup builds a ``bytearray`` of
them); :class:`State` names the same values for callers.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

#: a block value: the bytes themselves or a view over them (never copied needlessly)
Buffer = bytes | bytearray | memoryview

#: a client reuses a staging room for at most this long after its last commit;
#: the daemon's ``shared.staging_timeout`` (when it reclaims idle rooms) is longer
STAGING_REUSE_SECONDS: Final = 10.0
#: in-place rooms (RAM slots a client writes blocks into) one connection may
#: hold at once; the client keeps no more writes in place in flight
MAX_IN_PLACE_ROOMS: Final = 8
#: bytes of bulk copy the daemon's event loop does in one step, a large
#: frame's receive or a region copy's piece (about 100 µs of memcpy; other
#: requests are answered between steps): a block of 1 MiB copied in one
#: step, whose fixed cost (about 9 µs) a smaller step would pay again
LOOP_STEP: Final = 1024 * 1024
#: seconds of a region copy's steps the daemon's event loop runs in one turn
#: before it answers other requests (as many steps as fit: one at least)
LOOP_TURN: Final = 50e-6

#: starts a background task in the daemon's task group
Spawn = Callable[[Coroutine[Any, Any, Any]], "asyncio.Task[Any]"]


# -- namespaces (docs/tenancy.md)

#: a key that starts with this byte names its namespace: the byte, the
#: namespace's length (1..MAX_NAMESPACE_BYTES), its name, then the client's
#: key. A default-namespace key that starts with the byte is escaped (the
#: byte, a zero, then the key), so no client of one namespace can name a key
#: of another. Keys are stored, probed and pushed in this form in every tier.
NAMESPACE_MARK: Final = 0xFF
NAMESPACE_ESCAPE: Final = bytes((NAMESPACE_MARK, 0))
#: the namespace of clients that name none; "default" in config, stats and metrics
DEFAULT_NAMESPACE: Final = b""
DEFAULT_NAMESPACE_NAME: Final = "default"
MAX_NAMESPACE_BYTES: Final = 128
_NAMESPACE_CHARS = frozenset(
    b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-/:@+=,"
)


def namespace_id(name: str) -> bytes:
    """A namespace's name as the daemon keeps it ("default" is the empty one);
    raises ValueError for a name that is empty, too long, or has other
    characters than letters, digits and ``._-/:@+=,``."""
    if name == DEFAULT_NAMESPACE_NAME:
        return DEFAULT_NAMESPACE
    raw = name.encode("utf-8", "replace")
    if not raw or len(raw) > MAX_NAMESPACE_BYTES or not _NAMESPACE_CHARS.issuperset(raw):
        raise ValueError(
            f"namespace {name!r}: 1 to {MAX_NAMESPACE_BYTES} letters, digits or ._-/:@+=,"
        )
    return raw


def namespace_name(ns: bytes) -> str:
    return ns.decode() if ns else DEFAULT_NAMESPACE_NAME


def namespace_prefix(ns: bytes) -> bytes:
    """What every key of namespace ``ns`` starts with (nothing for the default)."""
    return bytes((NAMESPACE_MARK, len(ns))) + ns if ns else b""


def namespace_of(key: bytes) -> bytes:
    """The namespace a stored key belongs to."""
    if not key or key[0] != NAMESPACE_MARK:
        return DEFAULT_NAMESPACE
    return key[2 : 2 + key[1]]


def client_key(key: bytes, prefix: bytes) -> bytes | None:
    """``key`` as a client of the namespace with ``prefix`` named it, or None
    if the key is another namespace's."""
    if prefix:
        return key[len(prefix) :] if key.startswith(prefix) else None
    if not key or key[0] != NAMESPACE_MARK:
        return key
    return key[2:] if key[1] == 0 else None


class State(enum.IntEnum):
    """Per-key lookup answer (one byte each on the wire)."""

    MISS = 0  # in no tier: recompute
    HIT = 1  # readable now from RAM or disk
    PENDING = 2  # a write is in flight: ask again next step
    RETRY = 3  # existence not known yet (a remote probe is in flight): ask again


#: the same values as plain ints, for the byte-per-key hot path
MISS: Final = 0
HIT: Final = 1
PENDING: Final = 2
RETRY: Final = 3

STATE_NAMES: Final = {s.value: s.name.lower() for s in State}


class LookupMode(enum.IntEnum):
    KEYS = 0  # per-key states only
    PREFIX = 1  # leading run of HIT
    SLIDING_WINDOW = 2  # longest prefix whose last `window` blocks all hit


class PutStatus(enum.IntEnum):
    STORED = 0
    EXISTS = 1


class EventKind(enum.IntEnum):
    """What a block event says (SUBSCRIBE; docs/protocol.md, "Events")."""

    STORED = 1  # a local tier now holds the block
    EVICTED = 2  # no local tier holds it any more (evicted)
    DELETED = 3  # deleted by a client
    GAP = 4  # events were lost from this sequence number: resync from a snapshot
    SNAPSHOT = 5  # a block held when the snapshot was taken (tier: where)
    SNAPSHOT_END = 6  # the snapshot is complete; live events follow


class EventTier(enum.IntEnum):
    """The local tier a block event names."""

    NONE = 0
    RAM = 1
    DISK = 2


class FeedOp(enum.IntEnum):
    """A record of the daemon's feed to its lookup process (docs/lookup-process.md)."""

    HELD = 1  # a local tier holds the key
    GONE = 2  # no local tier holds it any more
    PENDING = 3  # a write of the key is in flight
    SETTLED = 4  # it is not any more (stored or not)
    SCANNING = 5  # the disk index is being rebuilt (no key)
    SCANNED = 6  # it is complete (no key)
    RESET = 7  # forget everything: a snapshot follows (no key)


#: records of the feed, in order
FeedRecords = list[tuple[FeedOp, bytes]]


class ReportKind(enum.IntEnum):
    """What the lookup process reports to the daemon."""

    READY = 1  # it listens
    ANSWERED = 2  # a lookup it answered: its states and the lookup follow
    REFERRED = 3  # a lookup it referred to the daemon


@dataclass(slots=True)  # not frozen: made per stored or evicted block, and 3x cheaper
class BlockEvent:
    seq: int
    kind: EventKind
    key: bytes = b""
    tier: EventTier = EventTier.NONE


class PutHint(enum.IntFlag):
    """What a writer knows about a block that recency and frequency do not
    tell (one byte per key of a PUT; docs/eviction.md, "Hints")."""

    NONE = 0
    #: the end of its request's chain that no later request is likely to
    #: share (a partial last chunk, a one-shot request's unique suffix): RAM
    #: admits it at the cold end, first to go unless it is read again
    TAIL = 0x01


#: the hint bits a daemon knows; any other bit is refused
KNOWN_PUT_HINTS: int = PutHint.TAIL.value


#: a retention lease's session id is at most this long (bytes)
MAX_SESSION_BYTES: Final = 64
#: and its time to keep at most this long (seconds: a week)
MAX_RETENTION_SECONDS: Final = 7 * 24 * 3600.0
#: priorities run from 0 (kept least) to 100 (kept most)
MAX_RETENTION_PRIORITY: Final = 100
#: the priority of a lease that names none
DEFAULT_RETENTION_PRIORITY: Final = 50


@dataclass(slots=True, frozen=True)
class Retention:
    """A retention lease (docs/retention.md): a session asks that the blocks
    it sends with this be kept for ``ttl`` seconds, before unleased ones of
    equal value and before leases of lower ``priority``. Raises ValueError
    for a value out of range, so no wing builds one that another refuses."""

    #: whose blocks (a session, a conversation, an agent); released together
    session: bytes
    #: seconds to keep them, from the last time the session touched them
    ttl: float
    #: 0..100; among leased blocks the lowest priority goes first
    priority: int = DEFAULT_RETENTION_PRIORITY

    def __post_init__(self) -> None:
        if len(self.session) > MAX_SESSION_BYTES:
            raise ValueError(f"a session id is at most {MAX_SESSION_BYTES} bytes")
        if not 0 < self.ttl <= MAX_RETENTION_SECONDS:  # (NaN fails too)
            raise ValueError(
                f"a retention ttl is above 0 and at most {MAX_RETENTION_SECONDS:.0f} s,"
                f" not {self.ttl}"
            )
        if not 0 <= self.priority <= MAX_RETENTION_PRIORITY:
            raise ValueError(
                f"a retention priority is 0..{MAX_RETENTION_PRIORITY}, not {self.priority}"
            )


class ReserveStatus(enum.IntEnum):
    """Per-key answer to RESERVE."""

    GRANTED = 0  # the caller now owns the pending write
    PRESENT = 1  # already readable: nothing to compute
    PENDING = 2  # another write is in flight: wait for it instead
    REFUSED = 3  # no room can be made for the announced size


@dataclass(slots=True, frozen=True)
class Lookup:
    keys: list[bytes]
    mode: LookupMode = LookupMode.KEYS
    window: int = 0
    wait: float = 0.0
    max_pending_wait: float = 0.0
    request_tag: bytes = b""
    #: the length every key has, when the encoding said so (0: mixed or unknown)
    key_len: int = field(default=0, compare=False)
    #: a look that does not mean a read (a router or scheduler comparing
    #: nodes): the answer as usual, but the eviction order is left as it was
    #: and nothing is read ahead from the disk
    peek: bool = False
    #: seconds the engine would spend recomputing these keys' blocks: the
    #: keys past the prefix whose loads save the most time against that
    #: answer MISS (docs/lookup.md, "A lookup with a budget"); 0: no budget
    budget: float = 0.0
    #: the keys are a session's whole prompt, from its first block (PREFIX
    #: mode, with a lease): the session's leased blocks outside it are of
    #: an earlier prompt it left, and lose their lease (docs/retention.md)
    whole: bool = False


@dataclass(slots=True, frozen=True)
class LookupReply:
    """Per-key states (one byte each, values of :class:`State`) and the prefix answer."""

    raw_states: bytes
    prefix_hits: int
    defer: bool

    @property
    def states(self) -> list[State]:
        return [State(s) for s in self.raw_states]

    def __len__(self) -> int:
        return len(self.raw_states)


@dataclass(slots=True, frozen=True)
class Reserve:
    keys: list[bytes]
    sizes: list[int]  # expected block sizes; 0 = unknown (no room is held)
    deadline: float = 0.0  # seconds; 0 = the server's pending_deadline


@dataclass(slots=True, frozen=True)
class Limits:
    """What one request may carry; announced to clients in the HELLO reply."""

    max_key_bytes: int
    max_batch: int
    max_block_bytes: int


@dataclass(slots=True, frozen=True)
class Leased:
    """A block to read in place: its bytes in the shared arena, and the lease to give back."""

    lease_id: int
    offset: int
    length: int


@dataclass(slots=True, frozen=True)
class ConnId:
    """The server's identity of one client connection (a reservation's owner)."""

    value: int

    def __str__(self) -> str:
        return f"conn#{self.value}"


class CacheService(Protocol):
    """The verbs the server calls; the core's ``Service`` implements them.

    One calling convention: ``lookup``, ``get`` and ``delete`` return their
    answer now, or the awaitable that gives it (the request already checked,
    its keys located, the I/O it needs started). The other verbs never wait.
    """

    limits: Limits

    def lookup(
        self, req: Lookup, cutoff: asyncio.Future[None] | None = None
    ) -> LookupReply | Awaitable[LookupReply]: ...

    def get(
        self, keys: Sequence[bytes]
    ) -> list[Buffer | None] | Awaitable[list[Buffer | None]]: ...

    def unpin(self, keys: Sequence[bytes], values: Sequence[Buffer | None]) -> None: ...

    def put(
        self,
        keys: Sequence[bytes],
        values: Sequence[Buffer],
        *,
        copy: bool = False,
        hints: bytes | None = None,
    ) -> list[PutStatus]: ...

    def stage(self, length: int, key: bytes) -> memoryview | None: ...

    def drop_staged(self, value: Buffer) -> None: ...

    def make_durable(
        self, keys: Sequence[bytes], values: Sequence[Buffer | None]
    ) -> Awaitable[None]: ...

    def delete(self, keys: Sequence[bytes]) -> list[bool] | Awaitable[list[bool]]: ...

    def reserve(self, req: Reserve, owner: ConnId) -> list[ReserveStatus]: ...

    def abort(self, keys: Sequence[bytes], owner: ConnId) -> list[bool]: ...

    def release(self, tag: bytes) -> bool: ...

    def retain(
        self,
        keys: Sequence[bytes],
        retention: Retention,
        lookup: bool = False,
        whole: bool = False,
    ) -> None:
        """A retention lease on the resident ones of ``keys`` (a chain);
        ``lookup``: a lookup asked for them; ``whole``: they are the
        session's whole prompt (its blocks outside them lose their lease)."""

    def retain_arriving(self, keys: Sequence[bytes], retention: Retention) -> None:
        """The lease of a lookup of ``keys`` on the ones not under it yet: in
        RAM now, or loading into RAM, as they land."""

    def release_retention(self, session: bytes, namespace: bytes) -> int:
        """End a session's leases; how many blocks they held."""
        ...

    def connection_closed(self, owner: ConnId) -> None: ...

    def write_room(self) -> asyncio.Future[None] | None:
        """None while stores can be written down; else what resolves once
        they can again (the connection that stored pauses until then)."""
        ...

    def stats(self) -> dict[str, Any]: ...


class StatsRecord(Protocol):
    """A typed stats record that renders as a STATS reply section."""

    def as_dict(self) -> dict[str, Any]: ...


class Subscriber(Protocol):
    """One subscription's queue of block events (the core's ``Subscription``)."""

    ready: asyncio.Event
    closed: bool

    def take(self, most: int) -> list[BlockEvent]: ...


class EventSource(Protocol):
    """What SUBSCRIBE streams: the service's block events."""

    def subscribe(self, limit: int) -> Subscriber: ...

    def unsubscribe(self, sub: Subscriber) -> None: ...

    def snapshot(self) -> list[BlockEvent]: ...


@dataclass(slots=True, frozen=True)
class Copied:
    """Blocks in their RAM slots, to be stored (a PUT_REGION's, copied in by
    the daemon; an in-place COMMIT's, written by the client): their statuses
    as the store gives them, and ``store``, which stores them.

    The caller answers with the statuses and then calls ``store``, once, in
    the same loop step: no request is read between the two, so none can
    find the blocks missing, and the writer has its answer (its memory is
    free to reuse: the daemon is done reading it) while the daemon still
    files the blocks away. ``keys``: those ``store`` stores (answered
    STORED), which the lookup process hears of before the answer goes."""

    statuses: list[PutStatus]
    store: Callable[[], None]
    keys: Sequence[bytes] = ()


class SharedService(Protocol):
    """Leases and staging room for same-host clients; the core's ``SharedBlocks``."""

    def grant(
        self, owner: ConnId, keys: Sequence[bytes], values: Sequence[Buffer | None]
    ) -> list[Leased | Buffer | None]: ...

    def unlease(self, owner: ConnId, ids: Sequence[int]) -> int: ...

    def stage(
        self, owner: ConnId, length: int, in_place: bool = False, namespace: bytes = b""
    ) -> int: ...

    def commit(
        self, owner: ConnId, key: bytes, offset: int, length: int, checksum: int, keep: bool
    ) -> PutStatus: ...

    def may_write_in_place(self, uid: int | None) -> bool: ...

    def commit_in_place(
        self,
        owner: ConnId,
        key: bytes,
        offset: int,
        length: int,
        checksum: int | None,
        renew: bool,
    ) -> tuple[Copied, int | None]: ...

    def commit_many_in_place(
        self, owner: ConnId, commits: Sequence[tuple[bytes, int, int, bool]]
    ) -> list[tuple[Copied, int | None]]: ...

    def unstage(self, owner: ConnId, offset: int, in_place: bool = False) -> bool: ...

    def open_region(self, owner: ConnId) -> tuple[int, bytes]: ...

    def attach_region(self, token: bytes, fd: int) -> int: ...

    def check_region(
        self, owner: ConnId, region_id: int, spans: Sequence[tuple[int, int]]
    ) -> None: ...

    async def put_region(
        self,
        owner: ConnId,
        region_id: int,
        keys: Sequence[bytes],
        spans: Sequence[tuple[int, int]],
        checksums: Sequence[int] | None = None,
        namespace: bytes = b"",
    ) -> Copied: ...

    async def get_region(
        self,
        owner: ConnId,
        region_id: int,
        keys: Sequence[bytes],
        spans: Sequence[tuple[int, int]],
        values: Sequence[Buffer | None],
    ) -> list[int | None]: ...

    def connection_closed(self, owner: ConnId, writer_gone: bool = False) -> None: ...

    def stats(self) -> StatsRecord: ...

"""An engine's view of kvtier that never blocks its scheduler.

An engine's scheduler asks, every step, "is this block in the tier?" and
cannot wait for a socket round trip. :class:`EngineTier` answers from what
it already knows and asks the daemon in the background:

* ``lookup(request_id, key)`` answers HIT or MISS once the daemon has
  answered for that request, RETRY until then (the key is queued);
  ``flush()`` - once per scheduler step - sends each request's queued keys
  as one LOOKUP tagged with the request, so the daemon shares one probe per
  key across requests and steps and bounds how long the request accepts
  PENDING (``max_pending_wait``): past it, the key answers MISS. While
  lookups or jobs are in flight it also gives the GIL up once, so the I/O
  thread's next hop waits one engine step at most, not the interpreter's
  switch interval (5 ms) behind an engine loop that never lets go.
* ``load`` receives blocks straight into the engine's rows
  (:meth:`Client.get_many_into`); ``store`` sends from the rows without a
  copy, reserving the keys first so another engine waits for them instead of
  recomputing. Results come back through ``finished()``; a key whose load
  failed answers MISS for ``failed_ttl`` (no lookup-says-HIT, load-fails
  livelock). Rows are referenced only while their job runs.
* With the daemon down, lookups answer MISS and jobs fail at once;
  connecting again is retried with exponential backoff.

All I/O runs on a private event loop in a daemon thread (a
:class:`DaemonLink`, which the SGLang backend shares); the engine-facing
methods only enqueue work and read results, and are meant to be called from
one thread (the scheduler's). :func:`block_key` is the one way an engine's
block name becomes a daemon key. Imports the client, the shared records and
the loop choice only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import hashlib
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kvtier import addresses, loops
from kvtier.backoff import Backoff
from kvtier.client import Client
from kvtier.client.redial import Redial
from kvtier.errors import ForbiddenError, KvtierError
from kvtier.model import HIT, MISS, BlockEvent, Buffer, EventKind, LookupMode, Retention

log = logging.getLogger("kvtier.engine")

T = TypeVar("T")


def block_key(name: str | bytes, event_hash: int | None = None) -> bytes:
    """The daemon's key for an engine's block ``name``: its 32-byte BLAKE2b
    (so any name length fits the daemon's key limit).

    ``event_hash``: the engine's own 64-bit hash of the block, as its KV events
    name it; the key then ends with it (a 24-byte digest, then the hash as 8
    signed big-endian bytes), so the block carries the hash through every
    tier and peer and the daemon's KV events name it as the engine does
    (``[events] key_format``, docs/routing.md)."""
    raw = name.encode() if isinstance(name, str) else name
    if event_hash is None:
        digest = hashlib.blake2b(raw, digest_size=32).digest()
    else:
        tail = event_hash.to_bytes(8, "big", signed=True)
        digest = hashlib.blake2b(raw, digest_size=24).digest() + tail
    return digest


def engine_namespace(model: str, *layout: object) -> str:
    """A daemon namespace for one engine's blocks: the model's name (made of
    the characters a namespace allows) and a short hash of what else makes
    its blocks differ (dtype, block size, parallelism, layout), so two
    models, or one model in two layouts, never share blocks."""
    safe = "".join(c if c.isalnum() or c in "._-/:@+=," else "-" for c in model)[:100]
    digest = hashlib.blake2b(repr((model, *layout)).encode(), digest_size=4).hexdigest()
    return f"{safe or 'model'}@{digest}"


class DaemonLink:
    """One daemon connection on a private event loop in a daemon thread,
    for engines that call from threads of their own.

    The connection is dialled on first use and again after a failure, with
    exponential backoff on the injected clock (:class:`Redial`); while the
    daemon is down callers fail at once with a :class:`KvtierError`.
    :meth:`submit` starts a coroutine on the loop; :meth:`call` runs one and
    waits at most ``timeout`` for it (a call past it is cancelled on the
    loop and raises :class:`TimeoutError`), so no engine thread ever blocks
    on the daemon longer than it said.
    """

    def __init__(
        self,
        socket_path: str | Path | None = None,
        *,
        timeout: float = 10.0,
        backoff: tuple[float, float] = (0.05, 5.0),
        clock: Callable[[], float] = time.monotonic,
        name: str = "kvtier-engine",
        namespace: str = "",
    ) -> None:
        self.socket_path = socket_path
        #: the daemon namespace every connection of the link names at HELLO
        self.namespace = namespace
        #: the longest any one request may take (the client's own timeout)
        self.timeout = timeout
        self.redial = Redial(
            self._dial, what="kvtier daemon", backoff=Backoff(*backoff), clock=clock
        )
        self._loop = loops.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        state = "closed" if self._loop.is_closed() else "open"
        return f"<DaemonLink {self.socket_path or 'default socket'} {state} {self.redial!r}>"

    @property
    def connected(self) -> bool:
        return self.redial.connected

    async def client(self) -> Client:
        """The connection, dialled if needed (on the link's loop only)."""
        return await self.redial.client()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call(self, fn: Callable[[Client], Awaitable[T]], timeout: float | None = None) -> T:
        """``fn(client)`` on the loop, waited on from this thread for at most
        ``timeout`` (default: the link's)."""

        async def run() -> T:
            return await fn(await self.redial.client())

        future = self.submit(run())
        try:
            return future.result(self.timeout if timeout is None else timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError("the kvtier daemon did not answer in time") from None

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self.submit(self.redial.close()).result(self.timeout)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    async def _dial(self) -> Client:
        return await self.dial()

    async def dial(self) -> Client:
        """A new connection to the daemon, in the link's namespace."""
        return await Client.connect(
            self.socket_path, timeout=self.timeout, namespace=self.namespace
        )


class Regions:
    """Memory files an engine hands to the daemon as regions (it then copies
    blocks to and from them itself): once per connection, and again on the
    connection a redial makes; jobs that need them while they are being
    handed over wait for that hand-over instead of making another. Lives on
    the link's loop."""

    def __init__(self) -> None:
        #: the connection the files were handed to, and their region ids there
        #: (None: the daemon takes no region on that connection)
        self._on: tuple[Client, list[int] | None] | None = None
        #: the connection the files are being handed to now, and what others
        #: that need them meanwhile wait for (one hand-over per connection)
        self._handing: tuple[Client, asyncio.Future[list[int] | None]] | None = None
        self.attached = 0

    def __repr__(self) -> str:
        ids = self._on[1] if self._on is not None else None
        handing = " handing" if self._handing is not None else ""
        return f"<Regions ids={ids} attached={self.attached}{handing}>"

    async def ids(self, client: Client, fds: Sequence[int], timeout: float) -> list[int] | None:
        """The files' region ids on ``client``'s connection; None when the
        daemon takes none there (no shared memory: another host, or off)."""
        if self._on is not None and self._on[0] is client:
            return self._on[1]
        if self._handing is not None and self._handing[0] is client:
            return await asyncio.shield(self._handing[1])
        handed: asyncio.Future[list[int] | None] = asyncio.get_running_loop().create_future()
        self._handing = (client, handed)
        ids: list[int] | None
        try:
            try:
                ids = [await client.attach_region(fd, timeout=timeout) for fd in fds]
                self.attached += len(ids)
            except ForbiddenError as exc:
                log.info("the daemon copies no blocks itself (%s): they go over the socket", exc)
                ids = None
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                handed.cancel()
            else:
                handed.set_exception(exc)
                handed.exception()  # (read: no one may be waiting)
            raise
        finally:
            self._handing = None
        self._on = (client, ids)
        handed.set_result(ids)
        return ids


class RemovalWatch:
    """Which of the blocks this engine stored the daemon no longer holds.

    A connection of its own streams the daemon's block events (SUBSCRIBE) on
    the link's loop; an EVICTED or DELETED event for a block this engine
    stored queues its key for :meth:`take`. After a GAP, or the connection
    dropped and dialled again (with backoff), it resubscribes with a
    snapshot and queues every stored block the snapshot lacks. Keys of
    blocks stored by others never enter it. Thread-safe: stores are recorded
    on the link's loop, removals taken from the engine's thread.
    """

    def __init__(self, link: DaemonLink, backoff: Backoff) -> None:
        self._link = link
        self._backoff = backoff
        #: the daemon's keys of blocks this engine stored and still believes held
        self._held: set[bytes] = set()
        self._lock = threading.Lock()
        self._removed: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        #: set whenever a removal is queued (a test or a caller may wait on it)
        self.arrived = threading.Event()
        #: set once the first subscription is in place
        self.subscribed = threading.Event()
        self.resyncs = 0
        self._task = link.submit(self._run())

    def __repr__(self) -> str:
        return f"<RemovalWatch held={len(self._held)} resyncs={self.resyncs}>"

    def stored(self, names: Sequence[bytes]) -> None:
        with self._lock:
            self._held.update(names)

    def take(self) -> list[bytes]:
        out: list[bytes] = []
        while True:
            try:
                out.append(self._removed.get_nowait())
            except queue.Empty:
                self.arrived.clear()
                return out

    def close(self) -> None:
        self._task.cancel()

    def _gone(self, names: Sequence[bytes]) -> None:
        with self._lock:
            gone = [n for n in names if n in self._held]
            self._held.difference_update(gone)
        for name in gone:
            self._removed.put(name)
        if gone:
            self.arrived.set()

    async def _run(self) -> None:
        snapshot = False
        while True:
            try:
                client = await self._link.dial()
            except (KvtierError, OSError) as exc:
                delay = self._backoff.failed(time.monotonic())
                log.debug("event stream: dialling failed (%s); again in %.2fs", exc, delay)
                await asyncio.sleep(delay)  # allow-sleep: backoff between dials
                snapshot = True
                continue
            self._backoff.succeeded()
            try:
                snapshot = await self._follow(client, snapshot)
            except (KvtierError, OSError) as exc:
                log.debug("event stream interrupted (%s); resubscribing", exc)
                snapshot = True
            finally:
                await client.close()

    async def _follow(self, client: Client, snapshot: bool) -> bool:
        """Follow one subscription; returns whether the next needs a snapshot."""
        held_now: set[bytes] | None = set() if snapshot else None
        events = client.subscribe(snapshot=snapshot)
        self.subscribed.set()
        try:
            async for batch in events:
                for event in batch:
                    if event.kind is EventKind.GAP:
                        self.resyncs += 1
                        return True
                    held_now = self._apply(event, held_now)
        finally:
            await events.aclose()
        return True  # the stream ended (the daemon shut down): resync on return

    def _apply(self, event: BlockEvent, held_now: set[bytes] | None) -> set[bytes] | None:
        kind = event.kind
        if kind is EventKind.EVICTED or kind is EventKind.DELETED:
            self._gone([event.key])
        elif kind is EventKind.SNAPSHOT and held_now is not None:
            held_now.add(event.key)
        elif kind is EventKind.SNAPSHOT_END and held_now is not None:
            with self._lock:
                missing = [n for n in self._held if n not in held_now]
            self._gone(missing)
            return None
        return held_now


class Answer(enum.Enum):
    HIT = "hit"
    MISS = "miss"
    RETRY = "retry"  # not known yet, or a write is in flight: ask again next step


class JobKind(enum.Enum):
    LOAD = "load"
    STORE = "store"


@dataclass(frozen=True, slots=True)
class Rows:
    """Rows of one engine buffer, each ``length`` bytes at one of ``starts``
    (an engine's host pool and the rows a job names): the tier finds their
    places in a shared file in one step, where a list of views would take
    an address lookup per row."""

    buffer: memoryview
    starts: Sequence[int]
    length: int

    def __repr__(self) -> str:
        return f"<Rows {len(self.starts)} x {self.length} bytes>"

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def nbytes(self) -> int:
        return len(self.starts) * self.length

    def views(self) -> list[memoryview]:
        buffer, length = self.buffer, self.length
        return [buffer[at : at + length] for at in self.starts]


@dataclass(slots=True)
class JobDone:
    """A finished load or store job."""

    job_id: int
    kind: JobKind
    ok: bool
    #: for loads: the keys that landed whole (all of them when ``ok``)
    loaded: list[bytes] = field(default_factory=list)
    bytes: int = 0
    seconds: float = 0.0


@dataclass(slots=True)
class _Request:
    tag: bytes
    #: the daemon's last answer per key for this request
    answers: dict[bytes, Answer] = field(default_factory=dict)
    #: keys asked for and not answered yet
    asked: set[bytes] = field(default_factory=set)
    #: keys to send at the next flush
    queued: list[bytes] = field(default_factory=list)
    #: the session's lease its lookups renew (docs/retention.md)
    retention: Retention | None = None


class EngineTier:
    def __init__(
        self,
        socket_path: str | Path | None = None,
        *,
        namespace: str = "",
        max_pending_wait: float = 2.0,
        timeout: float = 10.0,
        reserve_stores: bool = True,
        store_deadline: float = 30.0,
        failed_ttl: float = 30.0,
        backoff: tuple[float, float] = (0.05, 5.0),
        clock: Callable[[], float] = time.monotonic,
        regions: bool = True,
        recompute_seconds_per_block: float = 0.0,
    ) -> None:
        if recompute_seconds_per_block < 0 or not math.isfinite(recompute_seconds_per_block):
            raise ValueError("recompute_seconds_per_block is a finite number of seconds, >= 0")
        self.socket_path = socket_path
        self.namespace = namespace
        self.max_pending_wait = max_pending_wait
        #: what recomputing one block costs the engine: each lookup's budget
        #: is that for its keys (docs/lookup.md); 0: lookups without a budget
        self.recompute_seconds_per_block = recompute_seconds_per_block
        self.timeout = timeout
        self.reserve_stores = reserve_stores
        self.store_deadline = store_deadline
        self.failed_ttl = failed_ttl
        self._clock = clock
        # -- scheduler-thread state
        self._requests: dict[str, _Request] = {}
        #: keys whose load failed, and until when they answer MISS
        self._failed: dict[bytes, float] = {}
        self._jobs: set[concurrent.futures.Future[Any]] = set()
        #: lookups and releases sent and not answered yet
        self._calls: set[concurrent.futures.Future[Any]] = set()
        self.counts: dict[str, int] = {}
        # -- crossing threads: results land here, the scheduler drains them
        self._answers: queue.SimpleQueue[tuple[str, list[bytes], bytes | None]] = (
            queue.SimpleQueue()
        )
        self._done: queue.SimpleQueue[JobDone] = queue.SimpleQueue()
        #: the daemon connection and the loop all I/O runs on
        self._link = DaemonLink(
            socket_path, timeout=timeout, backoff=backoff, clock=clock, namespace=namespace
        )
        self._backoff = backoff
        #: the blocks this engine stored that the daemon let go (watch_removals)
        self._watch: RemovalWatch | None = None
        #: stores from rows in a shared file (an engine's shared host region)
        #: are read by the daemon from the file itself (a region): off, or
        #: the file, once the first store has found it (None: not known yet)
        self._regions = regions
        self._file: addresses.MappedFile | None = None
        #: the file as a region of the daemon's, per connection
        self._region = Regions()

    def __repr__(self) -> str:
        return (
            f"<EngineTier requests={len(self._requests)} jobs={len(self._jobs)} "
            f"failed_keys={len(self._failed)} connected={self._link.connected}>"
        )

    # ------------------------------------------------------------ scheduler side

    def lookup(self, request_id: str, key: bytes, retention: Retention | None = None) -> Answer:
        """What is known of ``key`` for ``request_id`` now; never waits.
        ``retention``: the request's session lease, renewed by its lookups."""
        self._drain_answers()
        failed_until = self._failed.get(key)
        if failed_until is not None:
            if failed_until > self._clock():
                return self._count_answer(Answer.MISS)
            del self._failed[key]
        req = self._requests.get(request_id)
        if req is None:
            req = self._requests[request_id] = _Request(request_id.encode()[:255])
        if retention is not None:
            req.retention = retention
        answer = req.answers.get(key)
        if answer is Answer.HIT or answer is Answer.MISS:
            return self._count_answer(answer)
        if answer is Answer.RETRY:
            del req.answers[key]  # ask again: the write may have landed
        if key not in req.asked:
            req.asked.add(key)
            req.queued.append(key)
        return self._count_answer(Answer.RETRY)

    def flush(self) -> None:
        """Send each request's queued keys as one LOOKUP (call once per step);
        while lookups or jobs are in flight, let the I/O thread run."""
        self._drain_answers()
        for request_id, req in self._requests.items():
            if req.queued:
                keys, req.queued = req.queued, []
                lookup = self._lookup(request_id, req.tag, keys, req.retention)
                self._calls.add(self._submit(lookup))
        self._calls = {f for f in self._calls if not f.done()}
        if self._calls or any(not f.done() for f in self._jobs):
            time.sleep(0)  # allow-sleep: gives the GIL up once, waits for nothing

    def request_finished(self, request_id: str) -> None:
        """Forget the request here and its reader-side state in the daemon."""
        req = self._requests.pop(request_id, None)
        if req is not None:
            self._calls.add(self._submit(self._release(req.tag)))

    def load(self, job_id: int, keys: Sequence[bytes], rows: Sequence[Buffer]) -> None:
        """Start receiving ``keys`` into ``rows``; the result comes from :meth:`finished`."""
        self._jobs.add(self._submit(self._load(job_id, list(keys), list(rows))))

    def store(
        self,
        job_id: int,
        keys: Sequence[bytes],
        rows: Sequence[Buffer] | Rows,
        retention: Retention | None = None,
    ) -> None:
        """Start sending ``rows`` under ``keys`` (leased to ``retention``'s
        session once stored); the result comes from :meth:`finished`."""
        held = rows if isinstance(rows, Rows) else list(rows)
        self._jobs.add(self._submit(self._store(job_id, list(keys), held, retention)))

    def watch_removals(self) -> RemovalWatch:
        """Follow the daemon's block events from now on: :meth:`removed` then
        tells which blocks this engine stored the daemon no longer holds."""
        if self._watch is None:
            self._watch = RemovalWatch(self._link, Backoff(*self._backoff))
        return self._watch

    def removed(self) -> list[bytes]:
        """Engine keys of blocks this engine stored that the daemon let go
        (evicted from its last local tier, or deleted) since the last call."""
        if self._watch is None:
            return []
        return self._watch.take()

    def finished(self) -> list[JobDone]:
        """Jobs that finished since the last call; failed loads' keys now answer MISS."""
        out: list[JobDone] = []
        while True:
            try:
                done = self._done.get_nowait()
            except queue.Empty:
                break
            kind = done.kind.value
            self._count(f"{kind}_bytes", done.bytes)
            if not done.ok:
                self._count(f"{kind}_failures")
            out.append(done)
        self._jobs = {f for f in self._jobs if not f.done()}
        return out

    def mark_failed(self, keys: Sequence[bytes]) -> None:
        """``keys`` could not be delivered: answer MISS for them for ``failed_ttl``."""
        until = self._clock() + self.failed_ttl
        for key in keys:
            self._failed[key] = until
            for req in self._requests.values():
                req.answers.pop(key, None)

    @property
    def busy(self) -> bool:
        """Whether jobs are still running or results wait to be collected."""
        return any(not f.done() for f in self._jobs) or not self._done.empty()

    def drain(self, timeout: float | None = None) -> None:
        """Block until every job, lookup and release sent so far has finished
        (its result queued). For shutdown and tests, never for a scheduler step."""
        concurrent.futures.wait([*self._jobs, *self._calls], timeout=timeout)
        self._calls = {f for f in self._calls if not f.done()}

    def close(self) -> None:
        """Release every request still open here (the engine is going: one
        whose end it never reported leaves no state in the daemon), wait
        for what was sent, then close."""
        for request_id in list(self._requests):
            self.request_finished(request_id)
        self.drain(self.timeout)
        if self._watch is not None:
            self._watch.close()
        self._link.close()

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return self._link.submit(coro)

    def _count_answer(self, answer: Answer) -> Answer:
        name = f"lookup_{answer.value}"
        self.counts[name] = self.counts.get(name, 0) + 1
        return answer

    def _count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def _drain_answers(self) -> None:
        while True:
            try:
                request_id, keys, states = self._answers.get_nowait()
            except queue.Empty:
                return
            req = self._requests.get(request_id)
            if req is None:
                continue  # finished meanwhile
            for i, key in enumerate(keys):
                req.asked.discard(key)
                if states is None:
                    req.answers[key] = Answer.MISS  # the daemon could not be asked
                elif states[i] == HIT:
                    req.answers[key] = Answer.HIT
                elif states[i] == MISS:
                    req.answers[key] = Answer.MISS
                else:
                    req.answers[key] = Answer.RETRY  # PENDING or RETRY: ask next step

    # ------------------------------------------------------------ loop side

    async def _connected(self) -> Client:
        """The client, connecting (with backoff after a failure) if needed."""
        return await self._link.client()

    async def _lookup(
        self, request_id: str, tag: bytes, keys: list[bytes], retention: Retention | None
    ) -> None:
        states: bytes | None = None
        try:
            client = await self._connected()
            reply = await client.lookup(
                keys,
                mode=LookupMode.KEYS,
                max_pending_wait=self.max_pending_wait,
                request_tag=tag,
                budget=len(keys) * self.recompute_seconds_per_block,
                retention=retention,
            )
            if len(reply.raw_states) == len(keys):
                states = reply.raw_states
            else:  # a reply that does not answer every key answers none: all MISS
                log.warning(
                    "lookup for %s: %d answer(s) for %d key(s); read as MISS",
                    request_id,
                    len(reply.raw_states),
                    len(keys),
                )
        except (KvtierError, OSError) as exc:
            log.debug("lookup for %s failed: %s", request_id, exc)
        finally:
            self._answers.put((request_id, keys, states))

    async def _release(self, tag: bytes) -> None:
        try:
            client = await self._connected()
            await client.release(tag)
        except (KvtierError, OSError):
            pass  # the daemon drops idle request state by itself

    async def _load(self, job_id: int, keys: list[bytes], rows: list[Buffer]) -> None:
        started = time.perf_counter()
        loaded: list[bytes] = []
        nbytes = 0
        try:
            client = await self._connected()
            sizes = await client.get_many_into(keys, rows)
            for key, row, size in zip(keys, rows, sizes, strict=True):
                if size is not None and size == memoryview(row).nbytes:
                    loaded.append(key)
                    nbytes += size
        except (KvtierError, OSError) as exc:
            log.warning("load job %d failed: %s", job_id, exc)
        finally:
            rows.clear()  # hold no view of the engine's rows beyond the job
            ok = len(loaded) == len(keys)
            self._done.put(
                JobDone(job_id, JobKind.LOAD, ok, loaded, nbytes, time.perf_counter() - started)
            )

    def _spans(self, rows: list[Buffer] | Rows) -> list[tuple[int, int]] | None:
        """The rows' (offset, length) in the shared file they live in, or None."""
        if not self._regions or not len(rows):
            return None
        first = rows.buffer if isinstance(rows, Rows) else rows[0]
        address = addresses.address_of(first)[0]
        if self._file is None:
            found = addresses.mapped_file(address)
            if found is None:
                self._regions = False  # process memory: the socket, from now on
                return None
            self._file = found
        if isinstance(rows, Rows):
            return self._file.spans_at(address, rows.starts, rows.length)
        return self._file.spans(rows)

    async def _region_of(self, client: Client) -> int:
        """The file's region id on ``client``'s connection; 0 when the daemon
        takes none (the rows then go over the socket)."""
        assert self._file is not None
        try:
            fd = self._file.open()
        except OSError as exc:
            log.info("the engine's shared region is not open to the daemon (%s)", exc)
            self._regions = False
            return 0
        try:
            ids = await self._region.ids(client, [fd], self.timeout)
        finally:
            os.close(fd)
        return ids[0] if ids else 0

    async def _store(
        self,
        job_id: int,
        keys: list[bytes],
        rows: list[Buffer] | Rows,
        retention: Retention | None,
    ) -> None:
        started = time.perf_counter()
        ok = False
        nbytes = rows.nbytes if isinstance(rows, Rows) else sum(memoryview(r).nbytes for r in rows)
        try:
            client = await self._connected()
            names = keys
            if self._watch is not None:  # before the PUT: no eviction can come first
                self._watch.stored(names)
            spans = self._spans(rows)
            region = await self._region_of(client) if spans is not None else 0
            if region and spans is not None:
                # The daemon copies the rows itself, and its PUT_REGION
                # reserves the keys while it does: others read PENDING.
                await client.put_region(region, names, spans)
            else:
                bodies: Sequence[Buffer] = rows.views() if isinstance(rows, Rows) else rows
                sizes = [memoryview(r).nbytes for r in bodies]
                # Tasks start in creation order: the RESERVE leaves ahead of
                # the PUT on the same connection, so other engines read
                # PENDING while the blocks travel instead of recomputing them.
                reserve = (
                    asyncio.create_task(client.reserve(names, sizes, deadline=self.store_deadline))
                    if self.reserve_stores
                    else None
                )
                put = asyncio.create_task(client.put_many(names, bodies))
                await asyncio.gather(
                    *(t for t in (reserve, put) if t is not None), return_exceptions=True
                )
                put.result()  # the job stands or falls with the PUT
            if retention is not None:  # (however the blocks went: one RETAIN after)
                await client.retain(names, retention)
            ok = True
        except (KvtierError, OSError) as exc:
            log.warning("store job %d failed: %s", job_id, exc)
        finally:
            if isinstance(rows, list):
                rows.clear()  # hold no view of the engine's rows beyond the job
            self._done.put(
                JobDone(
                    job_id,
                    JobKind.STORE,
                    ok,
                    [],
                    nbytes if ok else 0,
                    time.perf_counter() - started,
                )
            )

"""S3 tier: any S3-compatible object store through aiobotocore.

HEAD probes existence, GET loads, PUT stores, DELETE removes. Objects live at
``<prefix><hex of the block key>``; the XXH3-64 of key and value travels as
object metadata and is verified on every GET, so a tampered or torn object
is a counted miss, never served.

Faults never stall the service: every call is bounded (``op_timeout`` over
botocore's own connect/read timeouts and retries), concurrency is bounded,
and a circuit breaker stops calling an endpoint that keeps failing (calls
fail fast while it is open; one trial request every ``breaker_reset``
seconds probes it back to health). botocore and aiohttp exceptions are
converted to :class:`~kvtier.errors.TierError` here, where they enter kvtier.
A GET not answered after the tier's usual time (its p95, or ``hedge_after``)
is sent again, within ``hedge_max_ratio`` of GETs: the first complete,
checksum-verified answer wins (:class:`~kvtier.tiers.hedger.Hedger`).

The tier counts its requests in :class:`S3Counters`, read by metrics at
scrape time; it never imports the core or metrics. Time comes from an
injected ``clock`` (monotonic by default), so tests move the breaker's
clock instead of sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from botocore.exceptions import BotoCoreError, ClientError

from kvtier.config import S3TierConfig
from kvtier.counters import LATENCY_BUCKETS, Cell, Counts, HistogramCell, Histograms
from kvtier.errors import TierError
from kvtier.model import NAMESPACE_MARK, Buffer
from kvtier.tiers.base import S3Stats, Tier, block_checksum
from kvtier.tiers.breaker import CircuitBreaker
from kvtier.tiers.hedger import Hedger, present
from kvtier.tiers.sealing import TORN, Sealer, SealError

log = logging.getLogger("kvtier.s3")

T = TypeVar("T")

CHECKSUM_META = "kvtier-xxh3"
_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
#: a conditional PUT's answer: the object exists already; or (AWS, 409)
#: another conditional write of the same key was under way: a block's key
#: names its bytes, so that write stores this very block
_EXISTS = {"412", "PreconditionFailed", "ConditionalRequestConflict"}
#: a store's refusal of the conditional header itself (it does not support it)
_UNSUPPORTED = {"501", "NotImplemented"}


def object_checksum(key: bytes, value: Buffer) -> str:
    """The checksum metadata of an object: :func:`block_checksum` in hex."""
    return f"{block_checksum(key, value):016x}"


class S3Counters:
    """What one S3 tier counts; metrics labels it with the tier's name."""

    def __init__(self) -> None:
        self.requests = Counts("op", "outcome")
        self.seconds = Histograms(LATENCY_BUCKETS, "op")
        self.bytes = Counts("direction")
        self.bytes_in = self.bytes.bind("in")
        self.bytes_out = self.bytes.bind("out")
        self.retries = Counts("op")
        self.corrupt = Counts().bind()

    def __repr__(self) -> str:
        return f"<S3Counters requests={self.requests.total():g} corrupt={self.corrupt.value:g}>"


class S3Outcome(enum.Enum):
    """How one S3 request ended (the ``outcome`` label of kvtier_s3_requests_total)."""

    OK = "ok"
    NOT_FOUND = "not_found"
    EXISTS = "exists"  # a conditional PUT of an object the bucket has: a no-op
    CORRUPT = "corrupt"  # S3 answered; the object is bad, not the endpoint
    ERROR = "error"
    TIMEOUT = "timeout"  # past its deadline: a failure of the endpoint
    REJECTED = "rejected"  # not sent: the circuit breaker is open
    CANCELLED = "cancelled"  # its caller went away first (shutdown)


#: outcomes that prove the endpoint answers
_HEALTHY = (S3Outcome.OK, S3Outcome.NOT_FOUND, S3Outcome.EXISTS, S3Outcome.CORRUPT)
#: a request is given this share of its caller's deadline, so that it ends,
#: and counts as a failure, before the caller gives up on it
DEADLINE_SHARE = 0.8


class _NotFound(Exception):
    pass


class _Corrupt(Exception):
    pass


class _Exists(Exception):
    pass


class _Unsupported(Exception):
    pass


class S3Tier(Tier):
    outlives_daemon = True

    def __init__(
        self,
        cfg: S3TierConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        probe_timeout: float | None = None,
        load_timeout: float | None = None,
        sealer: Sealer | None = None,
    ) -> None:
        """``probe_timeout`` and ``load_timeout`` are the deadlines of the callers
        of HEAD and GET (kvtier's [lookup] settings): each request ends within
        its share of them, retries and connection set-up included."""
        self.cfg = cfg
        #: seals (and packs) blocks before they are sent, and admits every block loaded
        self.sealer = sealer if sealer is not None else Sealer()
        #: overall bound of one request, by op
        self.deadlines = {
            "head": _within(cfg.op_timeout, probe_timeout),
            "get": _within(cfg.op_timeout, load_timeout),
            "put": cfg.op_timeout,
            "delete": cfg.op_timeout,
        }
        self.name = cfg.name
        #: a GET not answered after ``hedge_after`` (None: the tier's p95) is
        #: sent again, within the hedge budget
        self.hedger: Hedger = Hedger(cfg.hedge_after, cfg.hedge_max_ratio)
        self.bucket = cfg.bucket
        self.prefix = cfg.prefix
        self.counters = S3Counters()
        #: per op: its request counts by outcome and its latency, bound on first use
        self._cells: dict[str, tuple[dict[S3Outcome, Cell], HistogramCell]] = {}
        self.breaker = CircuitBreaker(cfg.breaker_failures, cfg.breaker_reset)
        self._clock = clock
        #: S3 calls in flight at once
        self._limit = asyncio.Semaphore(cfg.max_concurrency)
        self._client: Any = None
        self._exit: contextlib.AsyncExitStack | None = None
        #: PUTs ask the store to refuse an object it has (cfg.conditional_put,
        #: until a store refuses the header)
        self._conditional = cfg.conditional_put

    def __repr__(self) -> str:
        return f"<S3Tier {self.name} s3://{self.bucket}/{self.prefix} {self.breaker!r}>"

    def object_key(self, key: bytes) -> str:
        """``<prefix><hex of the key>``; a namespace's block under
        ``<prefix><namespace>/<hex of its key>`` (docs/tenancy.md), so a
        bucket rule can expire one namespace's objects."""
        if len(key) > 1 and key[0] == NAMESPACE_MARK and key[1]:
            end = 2 + key[1]
            return f"{self.prefix}{key[2:end].decode()}/{key[end:].hex()}"
        return f"{self.prefix}{key.hex()}"

    # -- lifecycle

    async def open(self) -> None:
        # aiobotocore is imported by the daemons that open an S3 tier only:
        # it is a third of a daemon's start (0.3 s of imports) otherwise.
        from aiobotocore.config import AioConfig
        from aiobotocore.session import get_session

        cfg = self.cfg
        shortest = min(self.deadlines.values())
        config = AioConfig(
            connect_timeout=min(cfg.connect_timeout, shortest),
            read_timeout=min(cfg.read_timeout, self.deadlines["get"]),
            retries={"max_attempts": cfg.max_attempts, "mode": cfg.retry_mode},
            max_pool_connections=cfg.max_pool_connections,
            s3={"addressing_style": cfg.addressing_style},
        )
        kwargs: dict[str, Any] = {"config": config}
        if cfg.region:
            kwargs["region_name"] = cfg.region
        if cfg.endpoint_url:
            kwargs["endpoint_url"] = cfg.endpoint_url
        if cfg.access_key_id:
            kwargs["aws_access_key_id"] = cfg.access_key_id
        if cfg.secret_access_key is not None:
            kwargs["aws_secret_access_key"] = cfg.secret_access_key.get_secret_value()
        if cfg.session_token is not None:
            kwargs["aws_session_token"] = cfg.session_token.get_secret_value()
        stack = contextlib.AsyncExitStack()
        try:
            self._client = await stack.enter_async_context(
                get_session().create_client("s3", **kwargs)
            )
        except (BotoCoreError, ValueError) as exc:
            await stack.aclose()
            raise TierError(f"{self.name}: cannot create the S3 client: {exc}") from exc
        self._exit = stack

    async def close(self) -> None:
        if self._exit is not None:
            await self._exit.aclose()
            self._exit = None

    # -- one bounded, measured, breaker-guarded call

    async def _call(self, op: str, fn: Callable[[], Awaitable[T]]) -> T:
        requests = self.counters.requests
        cells = self._cells.get(op)
        if cells is None:
            cells = self._cells[op] = ({}, self.counters.seconds.bind(op))
        if self._client is None:
            raise TierError(f"{self.name}: not open")
        if not self.breaker.allow(self._clock()):
            requests.inc(op, S3Outcome.REJECTED.value)
            raise TierError(f"{self.name}: circuit breaker open; not calling S3")
        started = time.perf_counter()
        deadline = self.deadlines[op]
        outcome = S3Outcome.ERROR
        try:
            # The deadline covers waiting for a slot too: a queue behind a hung
            # endpoint is the endpoint's failure.
            async with asyncio.timeout(deadline), self._limit:
                result = await fn()
            outcome = S3Outcome.OK
            return result
        except _NotFound:
            outcome = S3Outcome.NOT_FOUND
            raise
        except _Exists:
            outcome = S3Outcome.EXISTS
            raise
        except _Corrupt:
            outcome = S3Outcome.CORRUPT
            raise
        except SealError as exc:  # (the store answered: the object is what is wrong)
            outcome = S3Outcome.CORRUPT if exc.failure in TORN else S3Outcome.OK
            raise
        except TimeoutError as exc:
            outcome = S3Outcome.TIMEOUT
            raise TierError(f"{self.name}: {op} timed out after {deadline:g}s") from exc
        except ClientError as exc:
            self._count_retries(op, exc.response)
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in _NOT_FOUND:
                outcome = S3Outcome.NOT_FOUND
                raise _NotFound() from None
            if code in _EXISTS:
                outcome = S3Outcome.EXISTS
                raise _Exists() from None
            if code in _UNSUPPORTED:
                outcome = S3Outcome.OK  # (it answered: the header is what it refuses)
                raise _Unsupported(code) from None
            raise TierError(f"{self.name}: {op} failed: {code or exc}") from exc
        except (BotoCoreError, OSError) as exc:
            raise TierError(f"{self.name}: {op} failed: {exc}") from exc
        except asyncio.CancelledError:
            outcome = S3Outcome.CANCELLED
            raise
        except Exception as exc:  # aiohttp and friends, converted at the edge
            raise TierError(f"{self.name}: {op} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            if outcome in _HEALTHY:
                self.breaker.success()
            elif outcome is S3Outcome.CANCELLED:
                self.breaker.abandon()
            else:
                self.breaker.failure(self._clock())
            by_outcome, seconds = cells
            cell = by_outcome.get(outcome)
            if cell is None:
                cell = by_outcome[outcome] = requests.bind(op, outcome.value)
            cell.value += 1
            seconds.observe(time.perf_counter() - started)

    def _count_retries(self, op: str, response: Any) -> None:
        retries = int(response.get("ResponseMetadata", {}).get("RetryAttempts", 0) or 0)
        if retries:
            self.counters.retries.inc(op, n=retries)

    # -- operations

    async def _head(self, key: bytes) -> bool:
        async def call() -> bool:
            resp = await self._client.head_object(Bucket=self.bucket, Key=self.object_key(key))
            self._count_retries("head", resp)
            return True

        try:
            return await self._call("head", call)
        except _NotFound:
            return False

    async def _get(self, key: bytes) -> Buffer | None:
        """The object of ``key`` (None: absent, corrupt or not opening);
        asked for again if it has not come after the tier's usual time."""
        hedger = self.hedger

        def again() -> Awaitable[Buffer | None]:
            return hedger.timed(self.name, self._get_once(key))

        data, _ = await hedger.race(again(), again, hedger.delay(self.name), present)
        return data

    async def _get_once(self, key: bytes) -> Buffer | None:
        """One GET of ``key``'s object, admitted by the one rule
        (:meth:`~kvtier.tiers.sealing.Sealer.admit`): its checksum, length
        and seal; an object that fails is a counted miss, never bytes."""
        sealer = self.sealer

        async def call() -> Buffer:
            resp = await self._client.get_object(Bucket=self.bucket, Key=self.object_key(key))
            self._count_retries("get", resp)
            async with resp["Body"] as stream:
                data: bytes = await stream.read()
            self.counters.bytes_in.value += len(data)
            expected = resp.get("Metadata", {}).get(CHECKSUM_META)
            try:
                checksum = int(expected, 16)
            except (TypeError, ValueError):
                raise _Corrupt(f"checksum metadata {expected!r} is missing or not hex") from None
            length = resp.get("ContentLength")
            if sealer.costly(data):  # (a thread: decrypting and unpacking take the block's time)
                return await asyncio.to_thread(
                    sealer.admit, key, data, checksum=checksum, length=length
                )
            return sealer.admit(key, data, checksum=checksum, length=length)

        try:
            return await self._call("get", call)
        except _NotFound:
            return None
        except (_Corrupt, SealError) as exc:
            if not isinstance(exc, SealError) or exc.failure in TORN:
                self.counters.corrupt.inc()
                log.warning("%s: object for key %s is corrupt: %s", self.name, key.hex(), exc)
            else:  # (counted by the sealer, by reason)
                log.warning("%s: object for key %s does not open: %s", self.name, key.hex(), exc)
            return None

    async def _put(self, key: bytes, value: Buffer) -> None:
        sealer = self.sealer
        if not sealer.passes(value):
            value = await asyncio.to_thread(sealer.seal, key, value)
        body = bytes(value)
        conditional = self._conditional

        async def call() -> None:
            extra = {"IfNoneMatch": "*"} if conditional else {}
            resp = await self._client.put_object(
                Bucket=self.bucket,
                Key=self.object_key(key),
                Body=body,
                Metadata={CHECKSUM_META: object_checksum(key, body)},
                **extra,
            )
            self._count_retries("put", resp)

        try:
            await self._call("put", call)
        except _Exists:
            # Another writer stored it first: the same block (counted), if the
            # store can serve it. A store that crashed in the middle of a PUT
            # may keep a head it cannot serve, and refuse the next PUT for it.
            if await self._holds(key, body):
                return
            log.warning(
                "%s: the store refused a PUT of %s as existing, but does not serve "
                "it whole: writing it unconditionally",
                self.name,
                key.hex(),
            )
            conditional = False
            await self._call("put", call)
        except _Unsupported as exc:
            log.warning(
                "%s: the store refuses conditional PUTs (%s); writing unconditionally",
                self.name,
                exc,
            )
            self._conditional = conditional = False
            await self._call("put", call)
        self.counters.bytes_out.value += len(body)

    async def _holds(self, key: bytes, body: bytes) -> bool:
        """Whether the store serves ``key``'s object as ``body`` would be: its
        length and checksum (HEAD)."""
        want = object_checksum(key, body)

        async def call() -> bool:
            resp = await self._client.head_object(Bucket=self.bucket, Key=self.object_key(key))
            self._count_retries("head", resp)
            length = resp.get("ContentLength")
            if length is not None and length != len(body) and length != 0:
                return False  # (0 or none: a HEAD through a proxy may not carry it)
            return bool(resp.get("Metadata", {}).get(CHECKSUM_META) == want)

        try:
            return await self._call("head", call)
        except _NotFound:
            return False

    async def _delete(self, key: bytes) -> None:
        async def call() -> None:
            resp = await self._client.delete_object(Bucket=self.bucket, Key=self.object_key(key))
            self._count_retries("delete", resp)

        with contextlib.suppress(_NotFound):
            await self._call("delete", call)

    # -- Tier interface

    async def batch_lookup(self, keys: Sequence[bytes]) -> list[bool]:
        return list(await asyncio.gather(*map(self._head, keys)))

    async def batch_load(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        self.hedger.budget.earn(len(keys))
        return list(await asyncio.gather(*map(self._get, keys)))

    async def batch_store(self, keys: Sequence[bytes], values: Sequence[Buffer]) -> None:
        await asyncio.gather(*itertools.starmap(self._put, zip(keys, values, strict=True)))

    async def delete(self, keys: Sequence[bytes]) -> list[bool]:
        """S3 does not say whether an object existed: every answer is False."""
        await asyncio.gather(*map(self._delete, keys))
        return [False] * len(keys)

    def stats(self) -> S3Stats:
        stats = S3Stats(
            name=self.name,
            capacity_bytes=0,
            used_bytes=0,
            blocks=0,
            corrupt=int(self.counters.corrupt.value),
            breaker_state=int(self.breaker.state),
            hedges=self.hedger.outcomes(),
        )
        return self.sealer.counts.fill(stats)


def _within(op_timeout: float, caller_deadline: float | None) -> float:
    if caller_deadline is None:
        return op_timeout
    return min(op_timeout, caller_deadline * DEADLINE_SHARE)

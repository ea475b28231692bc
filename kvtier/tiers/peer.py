"""The peer tier: kvtier daemons on other nodes, reached over their peer port.

A key's owners are the first ``replicas`` live members of its rendezvous
ranking, named by the picker (:mod:`kvtier.tiers.peers`); this daemon, when
one of them, keeps its own copy and is never asked. The tier asks only
owners:

* ``batch_lookup`` - the core batches probes per tick into one call; here
  they split by owner into one LOOKUP per peer, all at once. HIT and
  PENDING at an owner read present, and a key is present as soon as one
  owner says so (the others are not waited for: a hung owner costs
  nothing while another holds the block); absent once every owner has
  answered or failed. Keys with no live owner but this daemon read absent
  without a request.
* ``batch_load`` - one GET per owner, starting with the owner that said it
  has the block, then the others in rank order until one delivers.
* ``batch_store`` - the push of a block stored here to each of its owners
  (the core runs it in the background, bounded, as for any write-through
  tier).

Each :class:`Peer` keeps one connection, opened on first use and reopened
after a failure with exponential backoff (50 ms doubling to 5 s); a circuit
breaker marks it down after ``breaker_failures`` consecutive failures, so
its keys go to the next peer by the hash until a trial request succeeds.
Every request is bounded by ``request_timeout``. A peer that dies or hangs
mid-transfer fails the request; the core then answers the key MISS, so it
never stays PENDING. Imports the client (a peer is a kvtier server) and the
tiers' own pure modules; never the core.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import ssl
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from kvtier.backoff import Backoff
from kvtier.client.aio import Client
from kvtier.client.redial import Redial
from kvtier.counters import LATENCY_BUCKETS, Counts, Histograms
from kvtier.errors import KvtierError, TierError
from kvtier.model import Buffer, LookupMode, Retention, State
from kvtier.tiers.base import PeerStats, Tier
from kvtier.tiers.breaker import CircuitBreaker
from kvtier.tiers.hedger import Hedger
from kvtier.tiers.peers import PeerPicker
from kvtier.tiers.sealing import Sealer, SealError

log = logging.getLogger("kvtier.peers")

BACKOFF_MIN = 0.05
BACKOFF_MAX = 5.0
_PRESENT = (int(State.HIT), int(State.PENDING))


class PeerOutcome(enum.Enum):
    """How one request to a peer ended (the metrics label)."""

    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"  # past request_timeout
    REJECTED = "rejected"  # not sent: the peer is down (breaker open)
    CANCELLED = "cancelled"


class PeerCounters:
    """What the peer tier counts, by peer address; metrics reads it at scrape time."""

    def __init__(self) -> None:
        self.requests = Counts("peer", "op", "outcome")
        self.bytes = Counts("peer", "direction")
        self.probe_seconds = Histograms(LATENCY_BUCKETS, "peer")
        self.connects = Counts("peer", "outcome")

    def __repr__(self) -> str:
        return f"<PeerCounters requests={self.requests.total():g}>"


class Peer:
    """One peer daemon: its connection, its breaker and its backoff."""

    def __init__(
        self,
        address: str,
        *,
        token: bytes,
        tls: ssl.SSLContext | None,
        connect_timeout: float,
        request_timeout: float,
        breaker: CircuitBreaker,
        counters: PeerCounters,
        node_id: str,
        on_self: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.address = address
        host, _, port = address.rpartition(":")
        self._host, self._port = host.strip("[]"), int(port)
        self._token = token
        self._tls = tls
        self._connect_timeout = connect_timeout
        self.request_timeout = request_timeout
        #: consecutive failures mark the peer down; guards every request
        self.breaker = breaker
        self._counters = counters
        self._node_id = node_id
        self._on_self = on_self
        self._clock = clock
        #: one connection, dialled again after a failure with backoff
        self.redial = Redial(
            self._dial,
            what=f"peer {address}",
            backoff=Backoff(BACKOFF_MIN, BACKOFF_MAX),
            clock=clock,
        )

    def __repr__(self) -> str:
        state = "connected" if self.redial.connected else "idle"
        return f"<Peer {self.address} {state} {self.breaker!r}>"

    def is_down(self) -> bool:
        return self.breaker.is_open(self._clock())

    @property
    def up(self) -> bool:
        return not self.is_down()

    async def _dial(self) -> Client:
        try:
            client = await Client.connect_tcp(
                self._host,
                self._port,
                token=self._token,
                tls=self._tls,
                connect_timeout=self._connect_timeout,
                timeout=self.request_timeout,
            )
        except KvtierError:
            self._counters.connects.inc(self.address, "failed")
            raise
        self._counters.connects.inc(self.address, "ok")
        if client.server is not None and client.server.node_id == self._node_id:
            await client.close()
            self._on_self(self.address)
            raise TierError(f"peer {self.address} is this daemon")
        return client

    async def call(self, op: str, fn: Callable[[Client], Any]) -> Any:
        """Run one request against the peer, guarded by its breaker and counted."""
        now = self._clock()
        if not self.breaker.allow(now):
            self._counters.requests.inc(self.address, op, PeerOutcome.REJECTED.value)
            raise TierError(f"peer {self.address} is down (breaker open)")
        outcome = PeerOutcome.ERROR
        try:
            async with asyncio.timeout(self.request_timeout):
                result = await fn(await self.redial.client())
            outcome = PeerOutcome.OK
            self.breaker.success()
            return result
        except asyncio.CancelledError:
            outcome = PeerOutcome.CANCELLED
            self.breaker.abandon()
            raise
        except TimeoutError as exc:
            outcome = PeerOutcome.TIMEOUT
            self._failed()
            raise TierError(
                f"peer {self.address}: no answer within {self.request_timeout}s"
            ) from exc
        except KvtierError as exc:
            self._failed()
            raise TierError(f"peer {self.address}: {exc}") from exc
        finally:
            self._counters.requests.inc(self.address, op, outcome.value)

    def _failed(self) -> None:
        self.breaker.failure(self._clock())
        self.redial.drop()  # a hung or broken connection is not reused

    async def lookup(self, keys: list[bytes]) -> list[bool]:
        started = time.perf_counter()

        async def ask(c: Client) -> list[bool]:
            reply = await c.lookup(keys, mode=LookupMode.KEYS)
            if len(reply.raw_states) != len(keys):
                raise TierError(f"{len(reply.raw_states)} answers for {len(keys)} keys")
            return [s in _PRESENT for s in reply.raw_states]

        found: list[bool] = await self.call("lookup", ask)
        self._counters.probe_seconds.bind(self.address).observe(time.perf_counter() - started)
        return found

    async def load(self, keys: list[bytes]) -> list[Buffer | None]:
        async def get(c: Client) -> list[Buffer | None]:
            return list(await c.get_many(keys))

        values: list[Buffer | None] = await self.call("get", get)
        self._counters.bytes.inc(self.address, "in", n=sum(len(v) for v in values if v))
        return values

    async def retain(self, keys: list[bytes], retention: Retention) -> None:
        async def lease(c: Client) -> None:
            await c.retain(keys, retention)

        await self.call("retain", lease)

    async def store(self, keys: list[bytes], values: list[Buffer]) -> None:
        async def put(c: Client) -> None:
            await c.put_many(keys, values)

        await self.call("put", put)
        self._counters.bytes.inc(self.address, "out", n=sum(len(v) for v in values))

    async def close(self) -> None:
        await self.redial.close()


class PeerTier(Tier):
    def __init__(
        self,
        name: str,
        picker: PeerPicker[Peer],
        counters: PeerCounters,
        *,
        replicas: int = 1,
        max_hints: int = 65536,
        sealer: Sealer | None = None,
        hedge_after: float | None = None,
        hedge_max_ratio: float = 0.05,
    ) -> None:
        self.name = name
        self.picker = picker
        #: a GET not answered after ``hedge_after`` (None: the peer's p95 over
        #: its recent loads) asks the next owner too, within the hedge budget
        self.hedger: Hedger = Hedger(hedge_after, hedge_max_ratio)
        #: seals the blocks pushed to peers, and admits every block they send
        self.sealer = sealer if sealer is not None else Sealer()
        self.counters = counters
        #: how many live nodes own each key (pushed to, asked in rank order)
        self.replicas = replicas
        #: the peer that last said it holds a key: asked first when loading it
        self._hints: OrderedDict[bytes, Peer] = OrderedDict()
        self._max_hints = max_hints

    def __repr__(self) -> str:
        return (
            f"<PeerTier {self.name} replicas={self.replicas} hints={len(self._hints)} "
            f"{self.picker!r}>"
        )

    def _hint(self, key: bytes, peer: Peer) -> None:
        hints = self._hints
        hints[key] = peer
        hints.move_to_end(key)
        if len(hints) > self._max_hints:
            hints.popitem(last=False)

    async def batch_lookup(self, keys: Sequence[bytes]) -> list[bool]:
        """Ask each key's owners at once; a key is present as soon as one of
        them says so, absent once all have answered or failed. A hung owner
        therefore costs nothing while another owner holds the block."""
        found = [False] * len(keys)
        #: owners asked and not answered yet, per key
        waiting = [0] * len(keys)
        groups: dict[Peer, list[int]] = {}
        for i, key in enumerate(keys):
            for peer in self.picker.owners(key, self.replicas):
                groups.setdefault(peer, []).append(i)
                waiting[i] += 1
        asks = {
            asyncio.ensure_future(peer.lookup([keys[i] for i in idx])): (peer, idx)
            for peer, idx in groups.items()
        }
        undecided = sum(1 for n in waiting if n)
        try:
            pending = set(asks)
            while pending and undecided:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for ask in done:
                    peer, idx = asks[ask]
                    answers: list[bool] = [False] * len(idx)
                    if ask.exception() is None:
                        answers = ask.result()
                    else:
                        log.debug(
                            "%s: lookup at %s failed: %s", self.name, peer.address, ask.exception()
                        )
                    for i, present in zip(idx, answers, strict=True):
                        if not waiting[i]:
                            continue  # already found at another owner
                        if present:
                            found[i] = True
                            self._hint(keys[i], peer)
                            waiting[i] = 0
                        else:
                            waiting[i] -= 1
                        if not waiting[i]:
                            undecided -= 1
        finally:
            for ask in asks:
                ask.cancel()  # owners still silent are not waited for
        return found

    async def batch_load(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        """Each block from the owner that said it has it, then from the others
        in rank order, until one delivers it."""
        values: list[Buffer | None] = [None] * len(keys)
        candidates: list[list[Peer]] = []
        for key in keys:
            owners = self.picker.owners(key, self.replicas)
            hinted = self._hints.get(key)
            if hinted is not None and not hinted.is_down():
                owners = [hinted, *(p for p in owners if p is not hinted)]
            candidates.append(owners)
        left = [i for i in range(len(keys)) if candidates[i]]
        self.hedger.budget.earn(len(left))
        failure: Exception | None = None
        while left:
            groups: dict[Peer, list[int]] = {}
            for i in left:
                groups.setdefault(candidates[i].pop(0), []).append(i)
            loaded = await asyncio.gather(
                *(self._load_hedged(peer, idx, keys, candidates) for peer, idx in groups.items()),
                return_exceptions=True,
            )
            left = []
            for idx, got in zip(groups.values(), loaded, strict=True):
                if isinstance(got, BaseException):
                    if not isinstance(got, Exception):
                        raise got
                    failure = got
                    got = [None] * len(idx)
                for i, value in zip(idx, got, strict=True):
                    if value is not None:
                        values[i] = value
                    elif candidates[i]:
                        left.append(i)
        if failure is not None and all(v is None for v in values):
            raise failure  # nothing came: the load failed, as the core counts it
        if any(v is not None and self.sealer.costly(v) for v in values):
            return await asyncio.to_thread(self._admit_all, keys, values)
        return self._admit_all(keys, values)

    async def _load_hedged(
        self,
        peer: Peer,
        idx: list[int],
        keys: Sequence[bytes],
        candidates: list[list[Peer]],
    ) -> list[Buffer | None]:
        """``keys[idx]`` from ``peer``; when it has not delivered after its
        usual time and every key has a next owner, from those too, as the
        budget allows (:meth:`~kvtier.tiers.hedger.Hedger.race`): the first to
        deliver every block wins (a hedge that won has used those next owners
        up)."""
        hedger = self.hedger

        def next_owners() -> Awaitable[list[Buffer | None]]:
            return self._load_next(idx, keys, candidates)

        values, won = await hedger.race(
            self._timed_load(peer, [keys[i] for i in idx]),
            next_owners if all(candidates[i] for i in idx) else None,
            hedger.delay(peer.address),
            delivers=lambda got: None not in got,
        )
        if won:
            for i in idx:
                candidates[i].pop(0)
        return values

    async def _load_next(
        self, idx: list[int], keys: Sequence[bytes], candidates: list[list[Peer]]
    ) -> list[Buffer | None]:
        """``keys[idx]`` from each one's next owner (the hedge)."""
        groups: dict[Peer, list[int]] = {}
        for n, i in enumerate(idx):
            groups.setdefault(candidates[i][0], []).append(n)
        loaded = await asyncio.gather(
            *(self._timed_load(peer, [keys[idx[n]] for n in ns]) for peer, ns in groups.items())
        )
        out: list[Buffer | None] = [None] * len(idx)
        for ns, got in zip(groups.values(), loaded, strict=True):
            for n, value in zip(ns, got, strict=True):
                out[n] = value
        return out

    def _timed_load(self, peer: Peer, keys: list[bytes]) -> Awaitable[list[Buffer | None]]:
        """A load from ``peer``, its time kept for the peer's p95."""
        return self.hedger.timed(peer.address, peer.load(keys))

    def _admit_all(self, keys: Sequence[bytes], values: list[Buffer | None]) -> list[Buffer | None]:
        """The values as their owners sent them, admitted by the one rule
        (:meth:`~kvtier.tiers.sealing.Sealer.admit`); one that fails is a
        miss (counted by the sealer)."""
        out: list[Buffer | None] = []
        admit = self.sealer.admit
        for key, value in zip(keys, values, strict=True):
            try:
                out.append(None if value is None else admit(key, value))
            except SealError as exc:
                log.warning("%s: block %s from a peer does not open: %s", self.name, key.hex(), exc)
                out.append(None)
        return out

    async def batch_store(self, keys: Sequence[bytes], values: Sequence[Buffer]) -> None:
        """Push each block to its other owners (this daemon, if one, keeps its
        own), sealed where its namespace has a key."""
        sealer = self.sealer
        if not all(sealer.passes(v) for v in values):
            values = await asyncio.to_thread(
                lambda: [sealer.seal(k, v) for k, v in zip(keys, values, strict=True)]
            )
        groups: dict[Peer, list[int]] = {}
        for i, key in enumerate(keys):
            for peer in self.picker.owners(key, self.replicas):
                groups.setdefault(peer, []).append(i)
        results = await asyncio.gather(
            *(
                peer.store([keys[i] for i in idx], [values[i] for i in idx])
                for peer, idx in groups.items()
            ),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        for error in errors:
            if not isinstance(error, Exception):
                raise error
        if errors and len(errors) == len(results):
            raise errors[0]  # reached no owner: the push failed

    keeps_leases = True

    async def retain_copies(self, keys: Sequence[bytes], retention: Retention) -> None:
        """A local session's lease, to each key's other owners: they lease
        the copies they hold, and those their pushes are bringing, as they
        land. Best effort: an owner that fails is logged, never raised."""
        groups: dict[Peer, list[bytes]] = {}
        for key in keys:
            for peer in self.picker.owners(key, self.replicas):
                groups.setdefault(peer, []).append(key)
        results = await asyncio.gather(
            *(peer.retain(mine, retention) for peer, mine in groups.items()),
            return_exceptions=True,
        )
        for peer, result in zip(groups, results, strict=True):
            if isinstance(result, Exception):
                log.debug("%s: lease at %s failed: %s", self.name, peer.address, result)
            elif isinstance(result, BaseException):
                raise result

    async def delete(self, keys: Sequence[bytes]) -> list[bool]:
        return [False] * len(keys)  # blocks on peers are theirs to evict

    def stats(self) -> PeerStats:
        peers = self.picker.peers()
        up = sum(p.up for p in peers)
        stats = PeerStats(
            self.name, 0, 0, 0, peers=len(peers), peers_up=up, hedges=self.hedger.outcomes()
        )
        return self.sealer.counts.fill(stats)

    async def open(self) -> None:
        await self.refresh()

    async def refresh(self) -> None:
        """Re-resolve the members' DNS name (if any); close peers no longer listed."""
        try:
            dropped = await self.picker.resolve()
        except OSError as exc:
            log.warning("%s: cannot resolve peers (keeping the current list): %s", self.name, exc)
            return
        for peer in dropped:
            log.info("%s: %s left the member list", self.name, peer.address)
            await peer.close()

    async def close(self) -> None:
        for peer in self.picker.peers():
            await peer.close()

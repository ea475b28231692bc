"""Retention leases in a tier's eviction order: which blocks a session asked
to keep, until when, and who goes first when they cannot all stay. Pure.

A lease (:class:`~kvtier.model.Retention`: session, ttl, priority) is
granted on resident keys: the blocks a session stored or found. A
session's lease ends ``ttl`` after its latest lookup or store with a lease
(its latest word stands, earlier or later), and every block it holds ends
with it; a block's priority is the latest its session gave it. A block
another session renews (a shared prefix) becomes that session's, at the
higher of the two priorities. A release (the session is over) or the end
of the lease makes each of the session's blocks an ordinary one again.

Every eviction policy of a tier is wrapped in a :class:`Retaining`: an
ordinary key is in the wrapped policy, a leased one in the wrapper's own
order, and the candidates to evict are every ordinary key (the wrapped
policy's order) before any leased one; leased keys go lowest priority
first, least recently used first within a priority. A lease that ends
gives its key back to the wrapped policy: at the cold end when it expired
or was released (its last use was the session's, and the session is gone
or late), as just used when capped. The
:class:`RetentionBook` is the tier's one account of the leases: who holds
each leased key, when each ends, each session's keys, and the leased bytes
of each namespace, which never pass the namespace's cap: past it, that
namespace's leases go lowest priority and oldest first (capped), so leases
never starve a namespace's new work or another namespace.

A batch (a lookup's chain, a store of consecutive blocks) is ordered so
that its head is the most recent: the tail of a chain goes before its head,
and no block is left behind a missing one.

Invariants: a key is in the book exactly while it is in one wrapper's
leased order (never also in the wrapped policy); a namespace's leased
bytes are the sum of its leased keys' sizes and at most its cap after
every grant; ``expire(now)`` ends exactly the leases whose end is at or
before ``now``; every key a lease ends is handed back to the policy that
held it, once. A tier that holds a block before a lease can reach it
(its write on the way) keeps the lease for its arrival
(:class:`Arrivals`). Imports the shared records, the policies, the
shares and the budget.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from kvtier.model import Retention, namespace_of
from kvtier.tiers.budget import Budget
from kvtier.tiers.policy import EvictionPolicy, LRUPolicy
from kvtier.tiers.shares import Shares

#: a namespace whose leases nothing caps
UNCAPPED = 1 << 62


#: a session as the book knows it: its namespace and its id (a session id
#: is its namespace's own)
Slot = tuple[bytes, bytes]


@dataclass(slots=True)
class Session:
    """One session's lease: when it ends, and the keys it holds."""

    ends: float
    keys: set[bytes]


@dataclass(slots=True)
class Held:
    """One leased key: whose it is, its priority and what it counts."""

    session: Slot
    priority: int
    size: int
    #: the wrapper whose order holds it
    owner: Retaining
    #: its namespace (whose leased bytes it counts in)
    namespace: bytes


@dataclass(slots=True)
class RetentionCounts:
    """Blocks, since start, by what happened to their lease."""

    granted: int = 0
    renewed: int = 0
    released: int = 0
    expired: int = 0
    #: ended because their namespace's leased bytes passed its cap
    capped: int = 0
    #: evicted while leased (the tier's room was needed by leased blocks alone)
    evicted: int = 0
    #: ended because their session's whole prompt no longer named them
    superseded: int = 0


class RetentionBook:
    """The leases of one tier (see the module's docstring)."""

    def __init__(self, cap_of: Callable[[bytes], int] | None = None) -> None:
        #: the most bytes a namespace may hold leased
        self.cap_of: Callable[[bytes], int] = cap_of or (lambda ns: UNCAPPED)
        self._held: dict[bytes, Held] = {}
        self._sessions: dict[Slot, Session] = {}
        #: (end, session): the sessions in order of their end (stale entries skipped)
        self._ends: list[tuple[float, Slot]] = []
        #: leased bytes per namespace
        self.leased_bytes: dict[bytes, int] = {}
        self.counts = RetentionCounts()
        #: the keys evicted while leased by the tier's latest eviction (its
        #: owner keeps their bytes for the tier below, and reads them there)
        self.evicted_leased: set[bytes] = set()
        #: the wrappers that have held each namespace's leased keys
        self._owners: dict[bytes, set[Retaining]] = {}

    def __repr__(self) -> str:
        return (
            f"<RetentionBook keys={len(self._held)} sessions={len(self._sessions)} "
            f"bytes={sum(self.leased_bytes.values())}>"
        )

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: object) -> bool:
        return key in self._held

    def lease_of(self, key: bytes) -> Held | None:
        return self._held.get(key)

    def sessions(self) -> int:
        return len(self._sessions)

    def by_priority(self) -> dict[tuple[bytes, int], int]:
        """Leased bytes per (namespace, priority)."""
        out: dict[tuple[bytes, int], int] = {}
        for h in self._held.values():
            slot = (h.namespace, h.priority)
            out[slot] = out.get(slot, 0) + h.size
        return out

    def holds(self, session: bytes, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` (of one namespace) ``session`` holds a live lease on."""
        if not keys:
            return 0
        mine = self._sessions.get((namespace_of(keys[0]), session))
        return 0 if mine is None else sum(1 for k in keys if k in mine.keys)

    # -- changes

    def grant(
        self,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        owners: Sequence[Retaining],
        retention: Retention,
        now: float,
        *,
        later_only: bool = False,
    ) -> None:
        """Lease resident ``keys`` (a batch in chain order, each with its
        size and the wrapper whose order holds it) to ``retention``'s
        session (of the first key's namespace), whose lease now ends at
        ``now + ttl`` (its latest word stands; ``later_only``: a word
        said earlier, heard late, moves the end later only), or renew
        them. Then caps each namespace whose leased bytes passed its cap."""
        if not keys:
            return
        ns = namespace_of(keys[0])
        slot = (ns, retention.session)
        ends = now + retention.ttl
        sess = self._sessions.get(slot)
        if sess is None:
            sess = self._sessions[slot] = Session(ends, set())
            heapq.heappush(self._ends, (ends, slot))
        elif later_only and ends <= sess.ends:
            pass
        elif sess.ends != ends:
            sess.ends = ends
            heapq.heappush(self._ends, (ends, slot))
        mine, held_of, counts = sess.keys, self._held, self.counts
        priority = retention.priority
        touched: set[bytes] = set()
        # tail first: the head of the batch ends up the most recent
        for key, size, owner in zip(reversed(keys), reversed(sizes), reversed(owners), strict=True):
            held = held_of.get(key)
            if held is None:
                own = namespace_of(key)
                held_of[key] = Held(slot, priority, size, owner, own)
                self.leased_bytes[own] = self.leased_bytes.get(own, 0) + size
                self._owners.setdefault(own, set()).add(owner)
                touched.add(own)
                counts.granted += 1
                owner.lease(key, priority)
                mine.add(key)
                continue
            counts.renewed += 1
            new = priority
            if held.session != slot:  # another session's: it is this one's now
                self._forget(held.session, key)
                held.session = slot
                mine.add(key)
                new = max(held.priority, priority)
            if new != held.priority:
                held.owner.reorder(key, held.priority, new)
                held.priority = new
            else:
                held.owner.bump(key, new)
        for own in touched:
            self._cap(own)

    def due(self, now: float) -> bool:
        """Whether a session's lease ends at or before ``now`` (:meth:`expire` has work)."""
        ends = self._ends
        return bool(ends) and ends[0][0] <= now

    def expire(self, now: float) -> int:
        """End every session's lease whose end is at or before ``now``;
        returns how many blocks they held."""
        ends, ended = self._ends, []
        while ends and ends[0][0] <= now:
            at, slot = heapq.heappop(ends)
            sess = self._sessions.get(slot)
            if sess is not None and sess.ends == at:
                del self._sessions[slot]
                ended += [self._end(key) for key in sess.keys]
        self._hand_back(ended, cold=True)
        self.counts.expired += len(ended)
        return len(ended)

    def supersede(self, session: bytes, keys: Sequence[bytes]) -> int:
        """``keys`` (of one namespace) are ``session``'s whole prompt now:
        its leases on blocks outside them end (an earlier prompt's, which it
        left), each block at the cold end; returns how many ended."""
        if not keys:
            return 0
        sess = self._sessions.get((namespace_of(keys[0]), session))
        if sess is None:
            return 0
        keep = set(keys)
        left = [k for k in sess.keys if k not in keep]
        if not left:
            return 0
        for key in left:
            self._forget((namespace_of(keys[0]), session), key)
        ended = [self._end(key) for key in left]
        self._hand_back(ended, cold=True)
        self.counts.superseded += len(ended)
        return len(ended)

    def release(self, session: bytes, namespace: bytes = b"") -> int:
        """End ``namespace``'s ``session``'s lease; returns how many blocks it held."""
        sess = self._sessions.pop((namespace, session), None)
        if sess is None:
            return 0
        ended = [self._end(key) for key in sess.keys]
        self._hand_back(ended, cold=True)
        self.counts.released += len(ended)
        return len(ended)

    def drop(self, key: bytes, evicted: bool) -> None:
        """``key`` left the tier (``evicted``: for room; else deleted or lost)."""
        held = self._held.pop(key)
        self._unaccount(held)
        self._forget(held.session, key)
        if evicted:
            self.counts.evicted += 1
            self.evicted_leased.add(key)

    # -- internals

    def _cap(self, ns: bytes) -> None:
        cap = self.cap_of(ns)
        if self.leased_bytes.get(ns, 0) <= cap:
            return
        owners = self._owners.get(ns, ())
        over = heapq.merge(*(o.leased_order(ns) for o in owners), key=lambda kp: kp[1])
        ended = []
        for key, _ in over:
            if self.leased_bytes.get(ns, 0) <= cap:
                break
            held = self._held.get(key)
            if held is not None:
                self._forget(held.session, key)
                ended.append(self._end(key))
        # (the most recent ordinary blocks: they were kept for a session a
        # moment ago, and go in their order of last use)
        self._hand_back(ended, cold=False)
        self.counts.capped += len(ended)

    def _end(self, key: bytes) -> tuple[bytes, Held]:
        """``key``'s lease is over (its session's keys are the caller's to mend)."""
        held = self._held.pop(key)
        self._unaccount(held)
        return key, held

    def _unaccount(self, held: Held) -> None:
        ns = held.namespace
        left = self.leased_bytes[ns] - held.size
        if left:
            self.leased_bytes[ns] = left
        else:
            del self.leased_bytes[ns]

    def _forget(self, slot: Slot, key: bytes) -> None:
        sess = self._sessions.get(slot)
        if sess is not None:
            sess.keys.discard(key)
            if not sess.keys:
                del self._sessions[slot]

    @staticmethod
    def _hand_back(ended: list[tuple[bytes, Held]], cold: bool) -> None:
        """Each ended lease's key back to the policy that held it, in order
        of last use: at the cold end (the oldest first of all), or as just
        used (the newest last)."""
        ended.sort(key=lambda kh: kh[1].owner.use_of(kh[0], kh[1].priority), reverse=cold)
        for key, held in ended:
            held.owner.unlease(key, held.priority, cold)


class Retaining:
    """An eviction policy with retention: the wrapped policy orders the
    ordinary keys, this wrapper the leased ones (see the module's
    docstring). Leases reach it only through its :class:`RetentionBook`."""

    def __init__(self, inner: EvictionPolicy[bytes], book: RetentionBook) -> None:
        self.inner = inner
        self.book = book
        #: leased keys by priority, each least recently used first; the value
        #: is the key's last-use number (a global order across priorities)
        self._leased: dict[int, OrderedDict[bytes, int]] = {}
        self._uses = itertools.count()
        # (admissions are the wrapped policy's alone: a lease comes after)
        self.admit, self.admit_many = inner.admit, inner.admit_many  # type: ignore[method-assign]
        self._through(True)

    def _through(self, on: bool) -> None:
        """While it holds no leased key, the wrapper is the wrapped policy's
        own methods (a cache without leases pays nothing for them)."""
        inner = self.inner
        for name in ("touch", "touch_many", "remove", "evict", "candidates"):
            if on:
                setattr(self, name, getattr(inner, name))
            else:
                self.__dict__.pop(name, None)

    def __repr__(self) -> str:
        leased = sum(len(o) for o in self._leased.values())
        return f"<Retaining {self.inner!r} leased={leased}>"

    def __len__(self) -> int:
        return len(self.inner) + sum(len(o) for o in self._leased.values())

    # -- the policy protocol

    def admit(self, key: bytes, cold: bool = False) -> None:  # (replaced in __init__)
        self.inner.admit(key, cold)

    def admit_many(self, keys: Mapping[bytes, object]) -> None:  # (replaced in __init__)
        self.inner.admit_many(keys)

    def touch(self, key: bytes) -> None:
        held = self.book.lease_of(key)
        if held is None:
            self.inner.touch(key)
        else:
            self.bump(key, held.priority)

    def touch_many(self, keys: Iterable[bytes]) -> None:
        held = self.book._held
        keys = list(keys)
        self.inner.touch_many([k for k in keys if k not in held])
        for key in keys:
            h = held.get(key)
            if h is not None:
                self.bump(key, h.priority)

    def bump(self, key: bytes, priority: int) -> None:
        """Leased ``key`` (of ``priority``) was just used."""
        order = self._leased[priority]
        order.move_to_end(key)
        order[key] = next(self._uses)

    def remove(self, key: bytes) -> None:
        if key in self.book:
            self._take(key)
            self.book.drop(key, evicted=False)
        else:
            self.inner.remove(key)

    def evict(self, key: bytes) -> None:
        if key in self.book:
            self._take(key)
            self.book.drop(key, evicted=True)
        else:
            self.inner.evict(key)

    def candidates(self) -> Iterator[bytes]:
        leased = (self._leased[p] for p in sorted(self._leased))
        return itertools.chain(self.inner.candidates(), itertools.chain.from_iterable(leased))

    # -- what the book tells it

    def lease(self, key: bytes, priority: int) -> None:
        """``key`` is leased now: out of the wrapped policy, into this order."""
        self.inner.remove(key)
        if not self._leased:
            self._through(False)
        self._leased.setdefault(priority, OrderedDict())[key] = next(self._uses)

    def unlease(self, key: bytes, priority: int, cold: bool) -> None:
        """``key``'s lease ended: back to the wrapped policy, at the cold end
        or as just used."""
        self._take(key, priority)
        self.inner.admit(key, cold)

    def use_of(self, key: bytes, priority: int) -> int:
        """``key``'s last-use number (a leased key of this order)."""
        return self._leased[priority][key]

    def reorder(self, key: bytes, old: int, new: int) -> None:
        """``key``'s priority went from ``old`` to ``new`` (as just used)."""
        self._take(key, old)
        if not self._leased:
            self._through(False)
        self._leased.setdefault(new, OrderedDict())[key] = next(self._uses)

    def leased_order(self, ns: bytes) -> Iterator[tuple[bytes, tuple[int, int]]]:
        """This wrapper's leased keys of namespace ``ns``, in the order leases
        are capped: lowest priority first, least recently used first."""
        for p in sorted(self._leased):  # (the caller ends leases after it has read)
            for key, use in self._leased[p].items():
                if namespace_of(key) == ns:
                    yield key, (p, use)

    def _take(self, key: bytes, priority: int | None = None) -> None:
        if priority is None:
            held = self.book.lease_of(key)
            assert held is not None
            priority = held.priority
        order = self._leased[priority]
        del order[key]
        if not order:
            del self._leased[priority]
            if not self._leased:  # (the last lease: a lease() after adds one again)
                self._through(True)


def grant_held(
    book: RetentionBook,
    budget: Budget,
    held: Sequence[bytes],
    retention: Retention,
    now: float,
    *,
    later_only: bool = False,
) -> None:
    """:meth:`RetentionBook.grant` of ``held`` (keys ``budget`` holds, a
    chain in order), each with its size and the wrapper that orders it."""
    if held:
        owners = [budget.policy_of(k) for k in held]
        sizes = [budget.size_of(k) for k in held]
        book.grant(held, sizes, owners, retention, now, later_only=later_only)  # type: ignore[arg-type]


def leased_cap(budget: Budget, share: float, ns: bytes) -> int:
    """The most bytes namespace ``ns`` may hold leased in ``budget``'s tier:
    ``share`` of the tier, or of the namespace's max where it has one."""
    shares = budget.shares
    quota = shares.quota(ns).max if shares is not None else None
    whole = budget.capacity if quota is None else min(quota, budget.capacity)
    return int(whole * share)


def retaining(policy: EvictionPolicy[bytes] | None, book: RetentionBook) -> EvictionPolicy[bytes]:
    """``policy`` (LRU when None; each namespace's, when it is a tier's
    shares) wrapped in a :class:`Retaining` of ``book``."""
    if isinstance(policy, Shares):
        policy.wrap(lambda p: Retaining(p, book))
        return policy
    return Retaining(policy if policy is not None else LRUPolicy(), book)


class Arrivals:
    """Leases given for keys a tier does not hold yet (a write to it on its
    way): each key's latest, by when it was given, granted as the key
    lands (:meth:`take`), dropped once it would have ended (:meth:`expire`),
    and at most ``most`` of them (the oldest go first)."""

    def __init__(self, most: int = 1 << 16) -> None:
        self.most = most
        #: each key's lease and when it was given, the oldest first
        self.waiting: OrderedDict[bytes, tuple[Retention, float]] = OrderedDict()

    def __repr__(self) -> str:
        return f"<Arrivals waiting={len(self.waiting)}>"

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, keys: Iterable[bytes], retention: Retention, now: float) -> None:
        waiting = self.waiting
        for key in keys:
            waiting[key] = (retention, now)
            waiting.move_to_end(key)
        while len(waiting) > self.most:
            waiting.popitem(last=False)

    def take(self, key: bytes) -> tuple[Retention, float] | None:
        return self.waiting.pop(key, None)

    def land(self, key: bytes, book: RetentionBook, budget: Budget) -> None:
        """``key`` landed in ``budget``'s tier: the lease given for it on its
        way, if any (said earlier, so it moves its session's end later only)."""
        waiting = self.waiting.pop(key, None)
        if waiting is not None and key in budget:
            retention, at = waiting
            grant_held(book, budget, [key], retention, at, later_only=True)

    def expire(self, now: float) -> None:
        gone = [k for k, (r, at) in self.waiting.items() if at + r.ttl <= now]
        for key in gone:
            del self.waiting[key]

"""Namespaces' shares of one tier's bytes: whose blocks make room. Pure.

Every namespace has a :class:`Quota`: ``min`` bytes guaranteed (no other
namespace's pressure evicts its blocks while it holds no more than that),
``max`` bytes at most (past it, its own blocks make room for its new ones),
and a ``weight`` in sharing what lies above the minimums. A namespace's
*share* is its min plus its weight's part of the capacity left after the
mins of the namespaces present (those holding blocks, and the one asking).

:class:`Shares` is a tier budget's eviction policy when namespaces have
quotas: it keeps one policy of the tier's configured kind per namespace (so
the order inside a namespace is that policy's) and the bytes each holds.
:meth:`Shares.plan` picks the victims that make room for a block of one
namespace: first, while that namespace would pass its max, its own; then,
while the tier is still short, one block at a time from the namespace
furthest above its share (one above its max before any other), counting the
asking namespace with the block it brings. A namespace other than the asking
one at or below its min is never chosen. Raises NoRoom when no choice is left.

Invariants: a namespace's bytes are the sum of its resident keys' sizes;
every resident key is in exactly one namespace's policy; a victim is never
pinned; a plan never takes a namespace below its min for another's block.
Imports the policy protocol and the shared records only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from kvtier.model import namespace_name, namespace_of
from kvtier.tiers.policy import EvictionPolicy, NoRoom


@dataclass(frozen=True, slots=True)
class Quota:
    #: bytes guaranteed against other namespaces' pressure
    min: int = 0
    #: bytes at most (None: the whole tier)
    max: int | None = None
    #: the namespace's weight in sharing the bytes above every min
    weight: float = 1.0


#: a namespace with no table of its own
OPEN = Quota()


class Shares:
    """Per-namespace eviction order and accounting for one tier."""

    def __init__(
        self,
        capacity: int,
        quotas: Mapping[bytes, Quota],
        make_policy: Callable[[], EvictionPolicy[bytes]],
    ) -> None:
        self.capacity = capacity
        #: quotas by namespace; replaced whole on a live reload
        self.quotas: dict[bytes, Quota] = dict(quotas)
        self._make_policy = make_policy
        #: each namespace's eviction order (created with its first block)
        self.policies: dict[bytes, EvictionPolicy[bytes]] = {}
        #: bytes each namespace holds
        self.used: dict[bytes, int] = {}
        #: blocks each namespace lost to make room, since start
        self.evictions: dict[bytes, int] = {}
        #: the budget's sizes, read when a key comes and goes (bound by the budget)
        self.size_of: Callable[[bytes], int] = _unbound

    def __repr__(self) -> str:
        held = ", ".join(f"{namespace_name(ns)}={n}" for ns, n in self.used.items() if n)
        return f"<Shares {held or 'empty'} capacity={self.capacity}>"

    def __len__(self) -> int:
        return sum(len(p) for p in self.policies.values())

    def quota(self, ns: bytes) -> Quota:
        return self.quotas.get(ns, OPEN)

    # -- the eviction policy protocol, per namespace

    def admit_many(self, keys: Mapping[bytes, object]) -> None:
        """Each namespace's keys to its policy's ``admit_many``, in order."""
        groups: dict[bytes, dict[bytes, object]] = {}
        for key, value in keys.items():
            ns = namespace_of(key)
            group = groups.get(ns)
            if group is None:
                group = groups[ns] = {}
            group[key] = value
        for ns, group in groups.items():
            policy = self.policies.get(ns)
            if policy is None:
                policy = self.policies[ns] = self._make_policy()
            policy.admit_many(group)
            self.used[ns] = self.used.get(ns, 0) + sum(map(self.size_of, group))

    def admit(self, key: bytes, cold: bool = False) -> None:
        ns = namespace_of(key)
        policy = self.policies.get(ns)
        if policy is None:
            policy = self.policies[ns] = self._make_policy()
        policy.admit(key, cold)
        self.used[ns] = self.used.get(ns, 0) + self.size_of(key)

    def wrap(self, wrap: Callable[[EvictionPolicy[bytes]], EvictionPolicy[bytes]]) -> None:
        """Every namespace's policy, present and to come, wrapped by ``wrap``."""
        make = self._make_policy
        self._make_policy = lambda: wrap(make())
        self.policies = {ns: wrap(p) for ns, p in self.policies.items()}

    def policy_of(self, key: bytes) -> EvictionPolicy[bytes] | None:
        """The policy that orders resident ``key``'s namespace."""
        return self.policies.get(namespace_of(key))

    def touch(self, key: bytes) -> None:
        policy = self.policies.get(namespace_of(key))
        if policy is not None:
            policy.touch(key)

    def touch_many(self, keys: Iterable[bytes]) -> None:
        for key in keys:  # namespaces' orders are apart: one key at a time
            self.touch(key)

    def remove(self, key: bytes) -> None:
        """``key`` was deleted (called while its size is still known)."""
        ns = namespace_of(key)
        self.policies[ns].remove(key)
        self.used[ns] -= self.size_of(key)

    def evict(self, key: bytes) -> None:
        """``key`` was evicted to make room (called while its size is still known)."""
        ns = namespace_of(key)
        self.policies[ns].evict(key)
        self.used[ns] -= self.size_of(key)
        self.evictions[ns] = self.evictions.get(ns, 0) + 1

    def candidates(self) -> Iterator[bytes]:
        """Every resident key, namespace by namespace (for a caller that makes
        room for no namespace in particular: :meth:`plan` is the real order)."""
        for policy in list(self.policies.values()):
            yield from policy.candidates()

    # -- making room

    def fits(self, key: bytes | None, need: int) -> bool:
        """Whether ``need`` more bytes of ``key``'s namespace stay within its max."""
        if key is None:
            return True
        ns = namespace_of(key)
        limit = self.quota(ns).max
        return limit is None or self.used.get(ns, 0) + need <= limit

    def shares(self, used: Mapping[bytes, int], asking: bytes | None) -> dict[bytes, float]:
        """Each present namespace's share of the capacity."""
        present = [ns for ns, n in used.items() if n > 0]
        if asking is not None and asking not in present:
            present.append(asking)
        quotas = [self.quota(ns) for ns in present]
        rest = max(0, self.capacity - sum(q.min for q in quotas))
        weights = sum(q.weight for q in quotas) or 1.0
        return {
            ns: q.min + rest * q.weight / weights for ns, q in zip(present, quotas, strict=True)
        }

    def plan(
        self, key: bytes | None, need: int, free: int, pinned: Callable[[bytes], bool]
    ) -> list[bytes]:
        """The keys to evict, in order, so that ``need`` bytes of ``key``'s
        namespace fit (``free``: bytes free now). Nothing is changed."""
        asking = namespace_of(key) if key is not None else None
        used = dict(self.used)
        victims: list[bytes] = []
        orders: dict[bytes, Iterator[bytes]] = {}
        size_of = self.size_of

        def take(ns: bytes) -> int:
            """Bytes freed by ``ns``'s next evictable block (0: none left)."""
            order = orders.get(ns)
            if order is None:
                policy = self.policies.get(ns)
                order = orders[ns] = iter(policy.candidates() if policy is not None else ())
            for k in order:
                if not pinned(k):
                    victims.append(k)
                    size = size_of(k)
                    used[ns] -= size
                    return size
            return 0

        if asking is not None:
            limit = self.quota(asking).max
            if limit is not None:
                if need > limit:
                    raise NoRoom(
                        f"a block of {need} bytes is larger than the ram_max of namespace "
                        f"{namespace_name(asking)!r} ({limit})"
                    )
                while used.get(asking, 0) + need > limit:
                    freed = take(asking)
                    if not freed:
                        raise NoRoom(
                            f"namespace {namespace_name(asking)!r} is at its max and "
                            "every block of it is pinned"
                        )
                    free += freed
        done: set[bytes] = set()
        while need > free:
            ns = self._furthest_above_share(used, asking, need, done)
            if ns is None:
                raise NoRoom(
                    f"no namespace may give up {need - free} more bytes (each is at its "
                    "guaranteed minimum, or its blocks are pinned)"
                )
            freed = take(ns)
            if freed:
                free += freed
            else:
                done.add(ns)
        return victims

    def _furthest_above_share(
        self, used: Mapping[bytes, int], asking: bytes | None, need: int, done: set[bytes]
    ) -> bytes | None:
        shares = self.shares(used, asking)
        best: bytes | None = None
        best_rank: tuple[bool, float] | None = None
        for ns, share in shares.items():
            if ns in done or not used.get(ns):
                continue
            q = self.quota(ns)
            holds = used[ns] + (need if ns == asking else 0)
            if ns != asking and used[ns] <= q.min:
                continue  # guaranteed: another's pressure never goes below it
            rank = (q.max is not None and holds > q.max, holds - share)
            if best_rank is None or rank > best_rank:
                best, best_rank = ns, rank
        return best


def _unbound(key: bytes) -> int:
    raise RuntimeError("Shares.size_of is bound by the budget that uses it")

"""A byte budget for one local tier: capacity, sizes, pins and the eviction order.

The RAM tier and the disk tier both keep one. It decides which keys go to
make room (through the tier's eviction policy, skipping pinned keys) and
keeps the byte accounting; the tier owns the values or files and does the
removal it is told to. With namespaces' quotas its policy is a
:class:`~kvtier.tiers.shares.Shares`, which picks victims by namespace for
the key that needs the room. Pure; imports the policy and shares modules.

The budget is its tier's index: a key is held by the tier exactly while
it is admitted here. Every change of that (admitted; removed, evicted) is
told to the budget's :class:`IndexWatch` in the step it happens, so whoever
must know what the tier holds (the daemon's holdings: block events, the
lookup process's feed, kept probe verdicts) hears of every change from the
one place that makes it; a tier cannot change its index without it.

Invariants: ``used + held <= capacity`` after every admit (``held``: bytes
promised to blocks still arriving); a pinned key is never chosen; a key is
admitted at most once (its size is fixed until it is removed); the watch is
told each admitted key once, and each removed or evicted key once, after
the index changed.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Protocol

from kvtier.tiers.policy import EvictionPolicy, LRUPolicy, plan_eviction
from kvtier.tiers.shares import Shares


class Gone(enum.Enum):
    """Why a tier stopped holding a key."""

    EVICTED = "evicted"  # its room was needed
    DELETED = "deleted"  # a client deleted it
    LOST = "lost"  # found corrupt or missing, or its write failed


class IndexWatch(Protocol):
    """Told of every change of a tier's index, after it happened."""

    def held(self, keys: Sequence[bytes]) -> None: ...

    def gone(self, keys: Sequence[bytes], why: Gone) -> None: ...


class Unwatched:
    """The null watch: a budget nobody watches (a tier used alone)."""

    def held(self, keys: Sequence[bytes]) -> None:
        pass

    def gone(self, keys: Sequence[bytes], why: Gone) -> None:
        pass


UNWATCHED = Unwatched()


class _HeadFirst:
    """A watch between a batch admitted tail first and the real one: the
    keys held are told head first, in one call, before anything else."""

    def __init__(self, watch: IndexWatch) -> None:
        self.watch = watch
        self.keys: list[bytes] = []

    def held(self, keys: Sequence[bytes]) -> None:
        self.keys.extend(keys)

    def gone(self, keys: Sequence[bytes], why: Gone) -> None:
        self.flush()
        self.watch.gone(keys, why)

    def flush(self) -> None:
        if self.keys:
            keys, self.keys = self.keys[::-1], []
            self.watch.held(keys)


class Budget:
    def __init__(self, capacity: int, policy: EvictionPolicy[bytes] | None = None) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        #: bytes of admitted keys
        self.used = 0
        #: bytes promised to blocks still arriving (reservations, writes in flight)
        self.held = 0
        self.evictions = 0
        self._sizes: dict[bytes, int] = {}
        #: readers of each key; a pinned key is never evicted
        self._pins: dict[bytes, int] = {}
        self._policy: EvictionPolicy[bytes] = policy if policy is not None else LRUPolicy()
        #: the policy, when it shares the tier among namespaces
        self.shares: Shares | None = None
        #: told of every change of the index (the daemon's holdings)
        self.watch: IndexWatch = UNWATCHED
        if isinstance(policy, Shares):
            self.shares = policy
            policy.size_of = self._sizes.__getitem__

    def __repr__(self) -> str:
        return (
            f"<Budget used={self.used}/{self.capacity} held={self.held} "
            f"keys={len(self._sizes)} pinned={len(self._pins)} evictions={self.evictions}>"
        )

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    @property
    def free(self) -> int:
        return self.capacity - self.used - self.held

    @property
    def pinned_count(self) -> int:
        return len(self._pins)

    def pinned_keys(self) -> list[bytes]:
        return list(self._pins)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._sizes)

    def size_of(self, key: bytes) -> int:
        return self._sizes[key]

    # -- membership

    def admit(self, key: bytes, size: int, cold: bool = False) -> None:
        """``key`` is resident now; ``cold``: first in the eviction order."""
        assert key not in self._sizes, "a key is admitted once"
        self._sizes[key] = size
        self.used += size
        self._policy.admit(key, cold)
        self.watch.held((key,))

    def admit_many(self, index: Mapping[bytes, int]) -> None:
        """Each key of ``index`` resident now with its size, in order (a
        loaded index), none admitted yet; told to the watch once."""
        sizes = self._sizes
        assert sizes.keys().isdisjoint(index), "a key is admitted once"
        sizes.update(index)
        self.used += sum(index.values())
        self._policy.admit_many(index)
        if index:
            self.watch.held(list(index))

    def policy_of(self, key: bytes) -> EvictionPolicy[bytes] | None:
        """The policy that orders resident ``key`` (its namespace's, with shares)."""
        if key not in self._sizes:
            return None
        return self.shares.policy_of(key) if self.shares is not None else self._policy

    @contextlib.contextmanager
    def tail_first(self) -> Iterator[None]:
        """Admissions made tail first in this block (a batch: its head is then
        the most recent in the eviction order) are told to the watch head
        first, so whoever watches sees a chain in its order."""
        watch = self.watch
        buffered = self.watch = _HeadFirst(watch)
        try:
            yield
        finally:
            self.watch = watch
            buffered.flush()

    def touch(self, key: bytes) -> None:
        self._policy.touch(key)

    def touch_many(self, keys: Iterable[bytes]) -> None:
        self._policy.touch_many(keys)

    def remove(self, key: bytes, why: Gone = Gone.DELETED) -> int:
        """Forget ``key``; returns its size (the caller frees the value)."""
        self._policy.remove(key)
        size = self._sizes.pop(key)
        self.used -= size
        self.watch.gone((key,), why)
        return size

    # -- pins

    def pin(self, key: bytes) -> None:
        self._pins[key] = self._pins.get(key, 0) + 1

    def pin_many(self, keys: Iterable[bytes]) -> None:
        pins = self._pins
        for key in keys:
            pins[key] = pins.get(key, 0) + 1

    def unpin(self, key: bytes) -> None:
        left = self._pins.get(key, 0) - 1
        if left > 0:
            self._pins[key] = left
        else:
            self._pins.pop(key, None)

    def drop_pins(self, key: bytes) -> None:
        """``key`` is gone: its readers hold their own references to the value."""
        self._pins.pop(key, None)

    # -- room

    def evict_for(
        self, need: int, key: bytes | None = None, spared: Collection[bytes] = ()
    ) -> list[bytes]:
        """Remove the victims that make ``need`` bytes (of ``key``, when known:
        its namespace's quota applies) fit; returns them in order. Neither a
        pinned key nor one of ``spared`` goes.

        Raises :class:`~kvtier.tiers.policy.NoRoom` (nothing removed) when
        evicting every other key would not be enough.
        """
        shares = self.shares
        if need <= self.free and (shares is None or shares.fits(key, need)):
            return []
        sizes, pins = self._sizes, self._pins
        kept: Callable[[bytes], bool] = pins.__contains__
        if spared:
            kept = lambda k: k in pins or k in spared  # noqa: E731
        if shares is not None:
            victims = shares.plan(key, need, self.free, kept)
        else:
            victims = plan_eviction(
                need,
                self.free,
                self._policy.candidates(),
                size_of=sizes.__getitem__,
                pinned=kept,
            )
        policy = self._policy
        for victim in victims:
            policy.evict(victim)
            self.used -= sizes.pop(victim)
        self.evictions += len(victims)
        if victims:
            self.watch.gone(victims, Gone.EVICTED)
        return victims

    def hold(self, size: int) -> None:
        self.held += size

    def release(self, size: int) -> None:
        self.held = max(0, self.held - size)

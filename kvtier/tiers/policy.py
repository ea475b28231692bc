"""Eviction policies: which resident key goes first. Pure; imports nothing of kvtier.

A policy only orders keys. The tier decides which of them may actually go
(pinned blocks are skipped) and does the removal.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import Generic, Protocol, TypeVar

from kvtier.tiers.arc import ARCPolicy, HistoryARCPolicy
from kvtier.tiers.s3fifo import S3FIFOPolicy

K = TypeVar("K", bound=Hashable)


class EvictionPolicy(Protocol[K]):
    def admit(self, key: K, cold: bool = False) -> None:
        """``key`` became resident; ``cold`` (a writer's TAIL hint): put it first
        in the eviction order, where it stays unless it is touched."""

    def admit_many(self, keys: Sequence[K]) -> None:
        """Keys resident at start (a loaded index), in order, none resident
        yet: as :meth:`admit` of each in turn, except that a policy may
        place them as a fresh policy would, with no history of them."""

    def touch(self, key: K) -> None:
        """``key`` was read or written again."""

    def touch_many(self, keys: Iterable[K]) -> None:
        """:meth:`touch` of each key in turn (the deferred hits of lookups),
        in one call: the same outcome, less per key."""

    def remove(self, key: K) -> None:
        """``key`` was deleted."""

    def evict(self, key: K) -> None:
        """``key`` was evicted to make room (a policy with ghosts remembers it)."""

    def candidates(self) -> Iterator[K]:
        """Resident keys, the one to evict first coming first (possibly not all:
        the tier stops asking once it has made room)."""

    def __len__(self) -> int: ...


class LRUPolicy(Generic[K]):
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[K, None] = OrderedDict()

    def __repr__(self) -> str:
        return f"<LRUPolicy keys={len(self._order)}>"

    def __len__(self) -> int:
        return len(self._order)

    def admit(self, key: K, cold: bool = False) -> None:
        self._order[key] = None
        self._order.move_to_end(key, last=not cold)

    def admit_many(self, keys: Sequence[K]) -> None:
        self._order.update(dict.fromkeys(keys))

    def touch(self, key: K) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def touch_many(self, keys: Iterable[K]) -> None:
        order = self._order
        for key in keys:
            if key in order:
                order.move_to_end(key)

    def remove(self, key: K) -> None:
        self._order.pop(key, None)

    evict = remove

    def candidates(self) -> Iterator[K]:
        return iter(self._order)


class NoRoom(Exception):
    """Even evicting every evictable entry would not make enough room."""


def plan_eviction(
    need: int,
    free: int,
    candidates: Iterable[K],
    size_of: Callable[[K], int],
    pinned: Callable[[K], bool],
) -> list[K]:
    """Keys to evict, in order, so that ``need`` bytes fit in ``free`` plus what they free.

    A pure decision: nothing is removed here. Pinned keys are skipped.
    Raises :class:`NoRoom` when evicting every unpinned key is not enough.
    """
    victims: list[K] = []
    if need <= free:
        return victims
    for key in candidates:
        if pinned(key):
            continue
        victims.append(key)
        free += size_of(key)
        if need <= free:
            return victims
    raise NoRoom(f"cannot make room for {need} bytes: {free} bytes free after evicting all")


#: the policies a tier may be configured with; "harc" is the default
POLICIES = ("harc", "lru", "arc", "s3fifo")


def make_policy(name: str) -> EvictionPolicy[bytes]:
    makers: dict[str, Callable[[], EvictionPolicy[bytes]]] = {
        "harc": HistoryARCPolicy,
        "lru": LRUPolicy,
        "arc": ARCPolicy,
        "s3fifo": S3FIFOPolicy,
    }
    try:
        return makers[name]()
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of {', '.join(POLICIES)}"
        ) from None

"""Eviction policies: which resident key goes first. Pure; imports nothing of kvtier.

A policy only orders keys. The tier decides which of them may actually go
(pinned blocks are skipped) and does the removal.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from typing import Generic, Protocol, TypeVar

from kvtier.tiers.arc import ARCPolicy, HistoryARCPolicy
from kvtier.tiers.backlog import Backlog
from kvtier.tiers.s3fifo import S3FIFOPolicy

K = TypeVar("K", bound=Hashable)


class EvictionPolicy(Protocol[K]):
    def admit(self, key: K, cold: bool = False) -> None:
        """``key`` became resident; ``cold`` (a writer's TAIL hint): put it first
        in the eviction order, where it stays unless it is touched."""

    def admit_many(self, keys: Mapping[K, object]) -> None:
        """The keys of ``keys`` (a loaded index; its values are not the
        policy's), resident at start, in order, none resident yet: as
        :meth:`admit` of each in turn, except that a policy may place them
        as a fresh policy would, with no history of them."""

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
    """Least recently used first; a key admitted cold first of all.

    Three queues in eviction order: the keys admitted cold (the latest
    first), the keys a start loaded (a :class:`~kvtier.tiers.backlog.Backlog`,
    built at once where an ordered dict builds a node per key), then every
    other key, least recently used first. A touch moves a key to the end.
    """

    def __init__(self) -> None:
        self._cold: OrderedDict[K, None] = OrderedDict()
        self._loaded: Backlog[K] = Backlog()
        self._order: OrderedDict[K, None] = OrderedDict()

    def __repr__(self) -> str:
        return f"<LRUPolicy keys={len(self)} cold={len(self._cold)} loaded={len(self._loaded)}>"

    def __len__(self) -> int:
        return len(self._cold) + len(self._loaded) + len(self._order)

    def admit(self, key: K, cold: bool = False) -> None:
        if cold:
            self._cold[key] = None
            self._cold.move_to_end(key, last=False)
        else:
            self._order[key] = None

    def admit_many(self, keys: Mapping[K, object]) -> None:
        if len(self) == 0:
            self._loaded = Backlog(keys)
        else:
            self._order.update(dict.fromkeys(keys))

    def touch(self, key: K) -> None:
        order = self._order
        if key in order:
            order.move_to_end(key)
        elif self._loaded.discard(key) or self._cold.pop(key, _ABSENT) is not _ABSENT:
            order[key] = None

    def touch_many(self, keys: Iterable[K]) -> None:
        for key in keys:
            self.touch(key)

    def remove(self, key: K) -> None:
        if self._order.pop(key, _ABSENT) is _ABSENT and not self._loaded.discard(key):
            self._cold.pop(key, None)

    evict = remove

    def candidates(self) -> Iterator[K]:
        return itertools.chain(self._cold, self._loaded, self._order)


#: what a pop of an absent key returns
_ABSENT = object()


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

"""The keys a tier loaded at start, oldest first, as one ordered set. Pure.

A start admits millions of keys at once (a disk tier's index), older than
any key admitted afterwards. An ``OrderedDict`` builds a linked node per
key (about a second per million); a :class:`Backlog` is a dict for
membership and a list for order, each built in one step, and a policy
keeps it in front of its own queue: its keys leave from the front (taken
or evicted), or from anywhere (touched, removed), and none ever joins it
again except one taken from the front and put back there (offered for
eviction, then kept).

Invariants: the members are exactly the keys of ``_order[_head:]`` that
are in ``_members``, in that order, each there once; after any removal,
the entries before the head and the dead ones past it each number at most
the members plus the slack.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

#: dead entries tolerated before a compaction, whatever the members
_SLACK = 1024


class Backlog(Generic[K]):
    def __init__(self, keys: Iterable[K] = (), *, slack: int = _SLACK) -> None:
        """The keys of ``keys``, oldest first (a dict's are copied at once);
        ``slack``: dead entries tolerated beyond the members' count."""
        self._slack = slack
        self._order: list[K] = list(keys)
        #: (a dict's copy is one block copy; its values are not read)
        self._members: dict[K, object] = (
            dict(keys) if type(keys) is dict else dict.fromkeys(self._order)
        )
        assert len(self._members) == len(self._order), "each key once"
        self._head = 0

    def __repr__(self) -> str:
        dead = len(self._order) - self._head - len(self._members)
        return f"<Backlog keys={len(self._members)} dead={dead}>"

    def __len__(self) -> int:
        return len(self._members)

    def __bool__(self) -> bool:
        return bool(self._members)

    def __contains__(self, key: object) -> bool:
        return key in self._members

    def __iter__(self) -> Iterator[K]:
        """The members, oldest first (skipping the keys that left)."""
        members, order = self._members, self._order
        i = self._head
        while i < len(order):
            key = order[i]
            i += 1
            if key in members:
                yield key

    def first(self) -> K:
        """The oldest member (IndexError when empty)."""
        members, order = self._members, self._order
        while self._head < len(order):
            key = order[self._head]
            if key in members:
                return key
            self._head += 1
        raise IndexError("empty backlog")

    def pop_first(self) -> K:
        """Take the oldest member (IndexError when empty)."""
        key = self.first()
        members = self._members
        del members[key]
        self._head += 1
        limit = len(members) + self._slack
        if len(self._order) - self._head - len(members) > limit:
            self._compact()
        elif self._head > limit:
            del self._order[: self._head]  # (no reference kept to keys long gone)
            self._head = 0
        return key

    def discard(self, key: K) -> bool:
        """Remove ``key`` wherever it is; whether it was a member."""
        members = self._members
        if key not in members:
            return False
        del members[key]
        if len(self._order) - self._head - len(members) > len(members) + self._slack:
            self._compact()
        return True

    def _compact(self) -> None:
        """Keep only the members' entries: the dead ones outnumbered them
        (amortized: paid for by the removals since the last compaction)."""
        self._order = [k for k in self._order[self._head :] if k in self._members]
        self._head = 0

    def push_first(self, key: K) -> None:
        """Put back at the front a key taken from there (:meth:`pop_first`)."""
        assert key not in self._members
        if self._head > 0:
            self._head -= 1
            self._order[self._head] = key
        else:
            self._order.insert(0, key)
        self._members[key] = None

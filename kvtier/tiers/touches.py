"""Reads waiting to be shown to the eviction policy: a lookup's hits, shown
after the writes of the blocks it missed. Pure; imports nothing of kvtier.

An engine looks up a prompt's blocks, gets HIT for the first ones (or, a
lookup of each key, for some of them), computes the rest and stores them.
In the eviction order a chain's head must be its most recent block (the
tail goes first, and no block is left behind a missing one). Were the
hits shown at once, the blocks stored after them would be more recent
than the prompt's head, and the first to go under pressure would be the
last hit, leaving the stored blocks stranded behind it. So a lookup's
hits wait (:meth:`DeferredTouches.add`) until the writes of the blocks it
missed are done: they are shown once a write serves another lookup
(:meth:`before_write` of a key another lookup missed), or past the
bounds, or when the tier settles every read (:meth:`take_all`).

The blocks a lookup missed are those the tier does not hold when the
first write after it comes: of the keys past its hits or, where all its
keys count as read (a lookup of each key, or a read), of all of them. (A
lookup heard of after the writes of what it missed, as the lookup
process reports one, missed nothing then, and awaits nothing.)
Each waiting lookup is *awaiting* while none of the blocks it missed has
been written (a lookup that missed nothing awaits nothing), *writing* while
the latest write served it, and *done* after. Before each write, the
lookups at the head of the queue that are done are shown, in order, up to
the first that awaits or is writing.

Invariants:
- the keys handed out to be touched are each lookup's hits, tail first, in
  the order the lookups came, each key once, at its latest lookup among
  those shown together;
- a lookup is shown once, and never before a write that serves it has
  ended (unless the bounds or :meth:`take_all` show it);
- at most ``max_lookups`` lookups naming at most ``max_keys`` hits wait
  (past either bound the oldest are shown at once, whatever their state);
- :meth:`protected` holds exactly the hits of the lookups waiting: the tier
  evicts none of them (each counts as just read).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Container, Iterable, Sequence
from itertools import chain, islice


class _Lookup:
    __slots__ = ("awaiting", "count", "keys", "missed")

    def __init__(self, keys: Sequence[bytes], count: int) -> None:
        self.keys = keys
        #: the keys read: ``keys[:count]``
        self.count = count
        #: none of the blocks it missed has been written yet (True until
        #: indexed: what it missed is known at the first write after it)
        self.awaiting = True
        #: the blocks it missed, once indexed
        self.missed: list[bytes] = []


class DeferredTouches:
    def __init__(self, max_lookups: int = 256, max_keys: int = 4096) -> None:
        self.max_lookups = max_lookups
        self.max_keys = max_keys
        #: the lookups waiting, oldest first (empty: nothing to do; tested
        #: for truth on hot paths, where a method call would cost)
        self.queue: deque[_Lookup] = deque()
        #: the hits the waiting lookups name (with repeats)
        self.pending = 0
        #: each missed block of an indexed lookup: the latest lookup that missed it
        self._missed: dict[bytes, _Lookup] = {}
        #: lookups added since the index was last brought up to date
        self._unindexed: list[_Lookup] = []
        #: the lookup the latest write served
        self._writing: _Lookup | None = None
        self._protected: frozenset[bytes] | None = None

    def __repr__(self) -> str:
        return (
            f"<DeferredTouches lookups={len(self.queue)} hits={self.pending} "
            f"missed={len(self._missed)}>"
        )

    def add(self, keys: Sequence[bytes], count: int) -> Iterable[bytes] | None:
        """A lookup answered HIT for ``keys[:count]`` (a read of ``count`` keys
        passes ``count == len(keys)``). Returns the keys to touch now, when
        the bounds showed the oldest lookups; else None. A lookup that hit
        nothing, or the same lookup as the latest (a reader polling), adds
        nothing."""
        queue = self.queue
        if not count or (queue and queue[-1].count == count and queue[-1].keys == keys):
            return None
        entry = _Lookup(keys, count)
        queue.append(entry)
        self._unindexed.append(entry)
        self.pending += count
        self._protected = None
        shown: list[_Lookup] = []
        while len(queue) > self.max_lookups or self.pending > self.max_keys:
            shown.append(self._pop())
        return _order(shown) if shown else None

    def before_write(self, key: bytes | None, held: Container[bytes]) -> Iterable[bytes] | None:
        """``key`` is about to be written, or room made for it (None: for a
        block whose key is not known yet), to a tier that holds ``held``:
        the keys to touch first (the lookups done before it, see the
        module's docstring), or None."""
        if not self.queue:
            return None
        if self._unindexed:  # (the lookups added since: what they missed, indexed)
            index = self._missed
            for entry in self._unindexed:
                keys, count = entry.keys, entry.count
                rest = islice(keys, count, None) if count < len(keys) else keys
                entry.missed = [k for k in rest if k not in held]
                for k in entry.missed:
                    index[k] = entry
                entry.awaiting = bool(entry.missed)
            self._unindexed.clear()
        served = self._missed.get(key) if key is not None else None
        if served is not None:
            served.awaiting = False
            self._writing = served
        queue, writing = self.queue, self._writing
        shown: list[_Lookup] = []
        while queue and not queue[0].awaiting and queue[0] is not writing:
            shown.append(self._pop())
        return _order(shown) if shown else None

    def take_all(self) -> Iterable[bytes] | None:
        """Every waiting lookup's hits, to touch now (the tier settles its
        reads: a lease ends, or eviction finds no room without them)."""
        if not self.queue:
            return None
        shown = list(self.queue)
        self.queue.clear()
        self._missed.clear()
        self._unindexed.clear()
        self._writing = None
        self.pending = 0
        self._protected = None
        return _order(shown)

    def protected(self) -> Collection[bytes]:
        """The hits of the lookups waiting (built once per change)."""
        if self._protected is None:
            self._protected = frozenset(
                chain.from_iterable(islice(e.keys, e.count) for e in self.queue)
            )
        return self._protected

    def _pop(self) -> _Lookup:
        entry = self.queue.popleft()
        self.pending -= entry.count
        self._protected = None
        if entry is self._writing:
            self._writing = None
        index = self._missed
        for key in entry.missed:
            if index.get(key) is entry:
                del index[key]
        if self._unindexed and entry in self._unindexed:
            self._unindexed.remove(entry)
        return entry


def _order(entries: Sequence[_Lookup]) -> Iterable[bytes]:
    """The keys to touch for ``entries`` (oldest first): each key once, in
    the order of its latest lookup, each lookup's hits tail first."""
    if len(entries) == 1:
        e = entries[0]
        return reversed(e.keys[: e.count])
    # dict.fromkeys dedupes at C speed; built newest first, then reversed
    newest = chain.from_iterable(islice(e.keys, e.count) for e in reversed(entries))
    return reversed(dict.fromkeys(newest))

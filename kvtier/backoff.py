"""When the next attempt may start, after attempts that failed. Pure.

Shared by whatever tries again: a client dialling a daemon that is down
(:mod:`kvtier.client.redial`), the daemon starting its lookup process again
(:mod:`kvtier.supervisors.lookup_process`).

Invariants: the delay doubles from ``first`` up to ``most`` with each
failure and is back at ``first`` after a success; no attempt starts before
``not_before``. Imports nothing of kvtier.
"""

from __future__ import annotations


class Backoff:
    """When the next connection attempt may start. Pure."""

    __slots__ = ("_delay", "first", "most", "not_before")

    def __init__(self, first: float = 0.05, most: float = 5.0) -> None:
        if not 0 <= first <= most:
            raise ValueError(f"backoff needs 0 <= first <= most, got {first}, {most}")
        self.first = first
        self.most = most
        self._delay = first
        #: no attempt before this time (0: at once)
        self.not_before = 0.0

    def __repr__(self) -> str:
        return f"<Backoff next_delay={self._delay:g} not_before={self.not_before:g}>"

    def failed(self, now: float) -> float:
        """An attempt failed at ``now``: returns how long until the next may start."""
        delay = self._delay
        self.not_before = now + delay
        self._delay = min(delay * 2, self.most)
        return delay

    def succeeded(self) -> None:
        self._delay = self.first
        self.not_before = 0.0

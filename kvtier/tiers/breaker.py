"""A circuit breaker: stop calling a backend that keeps failing. Pure; imports
nothing of kvtier.

closed -> (``failures`` consecutive failures) -> open -> (``reset_after``
seconds) -> half-open: one trial call is let through; its success closes
the breaker, its failure opens it again for another ``reset_after``.
"""

from __future__ import annotations

import enum


class BreakerState(enum.IntEnum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    def __init__(self, failures: int, reset_after: float) -> None:
        if failures < 1:
            raise ValueError("failures must be at least 1")
        self.threshold = failures
        self.reset_after = reset_after
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.opened_at = 0.0
        self._trial_in_flight = False

    def __repr__(self) -> str:
        return (
            f"<CircuitBreaker {self.state.name.lower()} "
            f"failures={self.consecutive_failures}/{self.threshold}>"
        )

    def is_open(self, now: float) -> bool:
        """Whether calls are refused now (a pure query: starts no trial)."""
        return self.state is BreakerState.OPEN and now - self.opened_at < self.reset_after

    def allow(self, now: float) -> bool:
        """Whether a call may go to the backend now."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            if now - self.opened_at < self.reset_after:
                return False
            self.state = BreakerState.HALF_OPEN
            self._trial_in_flight = False
        if self._trial_in_flight:
            return False
        self._trial_in_flight = True
        return True

    def success(self) -> None:
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self._trial_in_flight = False

    def abandon(self) -> None:
        """A call let through was cancelled: it proves nothing either way."""
        self._trial_in_flight = False

    def failure(self, now: float) -> None:
        self.consecutive_failures += 1
        self._trial_in_flight = False
        if self.state is BreakerState.HALF_OPEN or self.consecutive_failures >= self.threshold:
            self.state = BreakerState.OPEN
            self.opened_at = now

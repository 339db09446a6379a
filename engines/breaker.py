"""A circuit breaker: after repeated failures of a callee (a guard, an engine replica), stop calling it for
a while.

A guard that times out costs every request its timeout; once it has failed `threshold` times in a row the
breaker opens and calls fail at once (`CircuitOpenError`, which each caller turns into its own error: the
guard's `GuardUnavailableError`, so the policy's fail mode applies without the wait; the replica's
`ReplicaUnavailableError`). After `cooldown` seconds one call is let through as a probe: success closes the
breaker, failure opens it again. Time comes from an injected clock.

Only the callee's own failures are counted (`guard.cascade.Stage.score` decides which for a guard): a call
that ends saying nothing about the callee (the item could not be scored for what it holds, the caller went
away) neither counts nor closes, but gives back the probe's slot if it held it (`release`): otherwise a probe
that never reports would keep the breaker half-open and refusing for good.

It lives with the engines, the lowest layer, so that `routing` and `guard` share it without importing each
other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import msgspec

BreakerState = Literal["closed", "open", "half_open"]


class CircuitOpenError(Exception):
    """The call was not made: the breaker is open (or half-open with its probe out). `retry_after`: seconds
    until the breaker lets a probe through (0 while a probe is out)."""

    def __init__(self, message: str, *, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class BreakerPolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """When a breaker opens and how long it stays open."""

    # Consecutive failures that open the breaker.
    threshold: int = 5
    # Seconds the breaker stays open before one probe call is let through.
    cooldown: float = 30.0


class CircuitBreaker:
    """Counts consecutive failures of one callee (`name`: "guard a@1", "replica r0") and refuses calls while
    open."""

    def __init__(self, name: str, policy: BreakerPolicy, clock: Callable[[], float]) -> None:
        self.name = name
        self._policy = policy
        self._clock = clock
        self._failures = 0
        self._opened_at: float | None = None
        self._probing = False

    @property
    def state(self) -> BreakerState:
        """closed (calls pass), open (calls refused), half_open (the cooldown is over: one probe may pass)."""
        if self._opened_at is None:
            return "closed"
        if self._clock() - self._opened_at >= self._policy.cooldown:
            return "half_open"
        return "open"

    def before_call(self) -> bool:
        """Raise CircuitOpenError unless a call may go ahead now; True when this call is the probe."""
        state = self.state
        if state == "closed":
            return False
        if state == "half_open" and not self._probing:
            self._probing = True
            return True
        probe_in = 0.0
        if state == "open" and self._opened_at is not None:
            probe_in = self._policy.cooldown - (self._clock() - self._opened_at)
        raise CircuitOpenError(
            f"{self.name} is unavailable: {self._failures} consecutive failures "
            f"(circuit open, next probe within {self._policy.cooldown:g} s)",
            retry_after=probe_in,
        )

    def success(self) -> None:
        """A call succeeded: close the breaker."""
        self._failures = 0
        self._opened_at = None
        self._probing = False

    def failure(self) -> None:
        """A call failed: count it; open (or reopen) the breaker at the threshold or after a failed probe."""
        self._failures += 1
        if self._probing or self._failures >= self._policy.threshold:
            self._opened_at = self._clock()
        self._probing = False

    def release(self) -> None:
        """The probe's call ended without a verdict on the callee: count nothing, free the probe's slot so
        the next call probes. Only the call that `before_call` made the probe may call this."""
        self._probing = False

"""`Backlog`: the guard calls in flight on one engine pool, and how fast that pool gets through them.

A guard model's engine has a finite speed. Past it, calls queue in the engine, wait out their stage's
timeout, fail, and after a few such failures the guard's circuit breaker opens and every call fails for its
whole cooldown, long after the burst has passed (seen with `lockgate bench` at 2 requests/s on 2 cores:
five-second waits, then 30 s of refusals). The backlog lets a stage refuse a call at once instead, when the
work already in flight means it would wait too long (`expected_wait`; `guard.cascade.Stage.score` decides
how long is too long): the overload is shed where it starts, the calls admitted finish in time, and the
breaker keeps counting only real failures.

The speed is measured, never configured: prompt tokens of completed calls per second during which calls
were in flight (busy time), both decayed with a half-life of busy time so that it follows a pool whose
speed changes (a generation burst on a shared pool, a restart on another host). Until a first call has
completed there is no measure, and while no call is in flight nothing is shed either. One backlog serves
every guard on the pool (the `GuardFactory` builds one per pool); it sees this process's calls only.
"""

from __future__ import annotations

from collections.abc import Callable

# Busy seconds after which a measure counts half as much as a new one.
HALF_LIFE_S = 10.0
# Share of a completed call's size in the running mean of call sizes.
_CALL_WEIGHT = 0.2


class Backlog:
    """Prompt tokens in flight on one guard engine pool and the pool's measured speed (module docstring)."""

    def __init__(self, clock: Callable[[], float], *, half_life_s: float = HALF_LIFE_S) -> None:
        self._clock = clock
        self._half_life_s = half_life_s
        self.calls = 0  # calls in flight
        self.tokens = 0  # their prompt tokens
        self._since = clock()  # when busy time was last accounted
        self._busy_s = 0.0  # decayed seconds with calls in flight
        self._done = 0.0  # decayed prompt tokens of the calls completed in them
        self._per_call = 0.0  # running mean of a completed call's prompt tokens

    def begin(self, tokens: int) -> None:
        """A call of `tokens` prompt tokens went to the engine."""
        self._account()
        self.calls += 1
        self.tokens += tokens

    def end(self, tokens: int, *, completed: bool) -> None:
        """The call of `tokens` that `begin` counted is over; `completed`: the engine scored it (a failed or
        cancelled call says nothing of the pool's speed)."""
        self._account()
        self.calls -= 1
        self.tokens -= tokens
        if completed:
            self._done += tokens
            self._per_call += (tokens - self._per_call) * (_CALL_WEIGHT if self._per_call else 1.0)

    def rate(self) -> float | None:
        """Prompt tokens per busy second, or None before a call has completed."""
        self._account()
        if self._done <= 0.0 or self._busy_s <= 0.0:
            return None
        return self._done / self._busy_s

    def expected_wait(self) -> float:
        """Seconds until a call made now would be scored: the tokens in flight and a typical call's, at the
        measured speed. 0 while unmeasured, and 0 with nothing in flight: an idle pool always takes a call
        (which measures its speed again), so a stale measure can never keep a guard from being called."""
        rate = self.rate()
        if rate is None or not self.calls:
            return 0.0
        return (self.tokens + self._per_call) / rate

    def _account(self) -> None:
        now = self._clock()
        elapsed = now - self._since
        self._since = now
        if self.calls and elapsed > 0.0:
            keep = 0.5 ** (elapsed / self._half_life_s)
            self._busy_s = self._busy_s * keep + elapsed
            self._done *= keep

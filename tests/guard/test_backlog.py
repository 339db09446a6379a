"""The guard pools' backlog: speed measured from busy time, the wait a new call would have, what is never
counted, and that an idle pool always takes a call."""

from __future__ import annotations

import pytest

from guard.backlog import Backlog
from tests.backends import FakeClock


def call(backlog: Backlog, clock: FakeClock, tokens: int, seconds: float, *, completed: bool = True) -> None:
    """One call of `tokens` prompt tokens that the engine answers in `seconds`, alone in flight."""
    backlog.begin(tokens)
    clock.advance(seconds)
    backlog.end(tokens, completed=completed)


def test_unmeasured_it_sheds_nothing() -> None:
    clock = FakeClock()
    backlog = Backlog(clock)
    assert backlog.rate() is None
    backlog.begin(10_000)
    clock.advance(100.0)
    assert backlog.expected_wait() == 0.0  # nothing has completed yet: no speed to divide by


def test_the_wait_is_the_work_in_flight_and_a_typical_call_at_the_measured_speed() -> None:
    clock = FakeClock()
    backlog = Backlog(clock)
    call(backlog, clock, 100, 0.5)
    assert backlog.rate() == pytest.approx(200.0)
    # Nothing in flight: a call goes ahead whatever the speed.
    assert backlog.expected_wait() == 0.0
    for _ in range(3):
        backlog.begin(100)
    assert backlog.calls == 3
    assert backlog.tokens == 300
    # 300 tokens in flight and a typical call's 100, at 200 tokens per second.
    assert backlog.expected_wait() == pytest.approx(2.0)


def test_calls_in_flight_together_share_the_busy_time() -> None:
    clock = FakeClock()
    backlog = Backlog(clock)
    backlog.begin(100)
    backlog.begin(100)
    clock.advance(1.0)
    backlog.end(100, completed=True)
    backlog.end(100, completed=True)
    # Two calls in one busy second: 200 tokens per second, not 100 each.
    assert backlog.rate() == pytest.approx(200.0)


def test_idle_time_is_not_busy_time() -> None:
    clock = FakeClock()
    backlog = Backlog(clock)
    call(backlog, clock, 100, 0.5)
    clock.advance(60.0)
    call(backlog, clock, 100, 0.5)
    assert backlog.rate() == pytest.approx(200.0, rel=0.01)


def test_failed_and_cancelled_calls_count_busy_time_but_no_work() -> None:
    clock = FakeClock()
    backlog = Backlog(clock, half_life_s=1e9)
    call(backlog, clock, 100, 0.5)
    call(backlog, clock, 100, 0.5, completed=False)
    assert backlog.rate() == pytest.approx(100.0)
    assert (backlog.calls, backlog.tokens) == (0, 0)


def test_the_measure_follows_a_pool_that_slows_down() -> None:
    clock = FakeClock()
    backlog = Backlog(clock, half_life_s=10.0)
    for _ in range(20):
        call(backlog, clock, 100, 0.1)  # 1,000 tokens per second
    assert backlog.rate() == pytest.approx(1000.0)
    for _ in range(20):
        call(backlog, clock, 100, 1.0)  # 100 tokens per second, for 20 busy seconds (two half-lives)
    rate = backlog.rate()
    assert rate is not None
    assert 100.0 < rate < 200.0

"""`RequestTimeline` arithmetic and its end, W3C trace context parsing, SLO attainment: on a fake clock."""

from __future__ import annotations

import pytest

from engines.base import Usage
from gateway.config import SloTargets
from gateway.observe import slo
from gateway.observe.outcome import Outcome, Status
from gateway.observe.timeline import RequestTimeline, note_error, timeline_in
from gateway.observe.trace import inbound_trace, parse_traceparent
from policy.safety.decision import GuardDecision
from tests.backends import FakeClock

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


def outcome(status: Status = "completed", completion: int = 3) -> Outcome:
    return Outcome(
        request_id="r",
        model="m@1",
        status=status,
        finish_reason="length",
        usage=Usage(prompt_tokens=5, completion_tokens=completion),
        stream=True,
    )


def timeline(clock: FakeClock, ended: list[RequestTimeline] | None = None) -> RequestTimeline:
    return RequestTimeline(clock, trace_id=TRACE, on_end=None if ended is None else ended.append)


def test_phases_and_token_times_give_ttft_itl_decode_and_e2e() -> None:
    clock = FakeClock(100.0)
    t = timeline(clock)
    start = t.now()
    clock.advance(0.5)
    start = t.phase("auth", start)
    clock.advance(0.25)
    t.phase("queue", start)
    clock.advance(0.25)
    for gap in (0.0, 0.2, 0.3):
        clock.advance(gap)
        t.token()
    clock.advance(0.5)
    t.response_ended(200)
    assert t.arrival == 100.0
    assert t.phases == {"auth": (100.0, 100.5), "queue": (100.5, 100.75)}
    assert t.duration("auth") == pytest.approx(0.5)
    assert t.duration("quota") is None
    assert t.ttft == pytest.approx(1.0)
    assert t.inter_token_gaps() == pytest.approx([0.2, 0.3])
    assert t.mean_itl == pytest.approx(0.25)
    assert t.decode == pytest.approx(0.5)
    assert t.e2e == pytest.approx(2.0)
    # TTFT from arrival covers the queue wait.
    queued = t.duration("queue")
    assert queued is not None
    assert t.ttft is not None
    assert t.ttft >= queued


def test_a_streams_ttft_is_its_first_release_to_the_client() -> None:
    clock = FakeClock(100.0)
    t = timeline(clock)
    for _ in range(4):  # the output guard holds these back
        clock.advance(0.1)
        t.token()
    clock.advance(0.05)
    t.released()
    clock.advance(0.1)
    t.released()  # only the first counts
    assert t.first_token == pytest.approx(100.1)
    assert t.ttft == pytest.approx(0.45)


def test_without_tokens_there_is_no_ttft_and_choices_interleave_so_no_itl() -> None:
    clock = FakeClock()
    t = timeline(clock)
    assert (t.ttft, t.mean_itl, t.decode, t.e2e) == (None, None, None, None)
    t.choices = 2
    for _ in range(3):
        clock.advance(0.1)
        t.token()
    assert t.inter_token_gaps() == []
    assert t.mean_itl is None
    assert t.ttft == pytest.approx(0.1)


def test_a_request_ends_once_when_both_its_response_and_its_outcome_have_ended() -> None:
    clock = FakeClock()
    ended: list[RequestTimeline] = []
    # Outcome after the response (a cancelled stream's tracker reports late).
    late = timeline(clock, ended)
    late.expect_outcome()
    late.response_ended(200)
    assert ended == []
    clock.advance(1.0)
    late.record_outcome(outcome("cancelled"))
    assert ended == [late]
    assert late.e2e == pytest.approx(1.0)
    # Outcome first (a non-streamed response), then the response.
    early = timeline(clock, ended)
    early.expect_outcome()
    early.record_outcome(outcome())
    assert ended == [late]
    early.response_ended(200)
    assert ended == [late, early]
    # No outcome expected (auth failures, admin routes): the response ends it; never twice.
    plain = timeline(clock, ended)
    plain.response_ended(0)
    plain.response_ended(401)
    assert ended == [late, early, plain]
    assert plain.http_status == 401


def test_guard_checks_keep_stage_runs_and_the_last_label_per_direction() -> None:
    clock = FakeClock()
    t = timeline(clock)
    start = t.now()
    clock.advance(0.01)
    t.guard_check("input", start, GuardDecision(direction="input", action="allow", source="rules"))
    t.guard_check("output", t.now(), GuardDecision(direction="output", action="allow", source="model"))
    t.guard_check("output", t.now(), GuardDecision(direction="output", action="block", source="rules"))
    assert next((c.start, c.end) for c in t.guard_checks) == (start, start + 0.01)
    assert t.guard_label() == "input=rules; output=rules"


def test_errors_and_timelines_live_in_the_scope_state() -> None:
    clock = FakeClock()
    t = timeline(clock)
    scope = {"state": {"lockgate_timeline": t}}
    assert timeline_in(scope, clock) is t
    note_error(scope, None, 404)
    assert t.error_code == "http_404"
    note_error(scope, "rate_limit_exceeded", 429)
    assert t.error_code == "rate_limit_exceeded"
    detached = timeline_in({}, clock)
    assert detached is not t
    assert len(detached.trace_id) == 32


@pytest.mark.parametrize(
    "value",
    [
        f"ff-{TRACE}-{PARENT}-01",
        f"00-{'0' * 32}-{PARENT}-01",
        f"00-{TRACE}-{'0' * 16}-01",
        f"00-{TRACE.upper()}-{PARENT}-01",
        f"00-{TRACE[:-1]}-{PARENT}-01",
        f"00-{TRACE}-{PARENT}-01-extra",
        "garbage",
    ],
)
def test_an_invalid_traceparent_starts_a_new_trace(value: str) -> None:
    assert parse_traceparent(value.encode()) is None
    trace_id, parent = inbound_trace([(b"traceparent", value.encode())])
    assert trace_id != TRACE
    assert len(trace_id) == 32
    assert parent == ""


def test_a_valid_traceparent_is_continued() -> None:
    value = f"00-{TRACE}-{PARENT}-01".encode()
    assert parse_traceparent(value) == (TRACE, PARENT)
    assert inbound_trace([(b"x-other", b"1"), (b"traceparent", value)]) == (TRACE, PARENT)
    # A later version may append fields.
    assert parse_traceparent(f"01-{TRACE}-{PARENT}-01-more".encode()) == (TRACE, PARENT)


def _finished(
    clock: FakeClock, status: Status, ttft: float, gaps: tuple[float, ...], tail: float
) -> RequestTimeline:
    t = timeline(clock)
    t.klass = "interactive"
    clock.advance(ttft)
    t.token()
    for gap in gaps:
        clock.advance(gap)
        t.token()
    clock.advance(tail)
    t.record_outcome(outcome(status))
    t.response_ended(200)
    return t


def test_slo_attainment_checks_every_target_that_is_set() -> None:
    clock = FakeClock()
    targets = SloTargets(ttft=1.0, itl=0.1, e2e=3.0)
    assert slo.attained(_finished(clock, "completed", 0.5, (0.1, 0.1), 0.1), targets)
    assert not slo.attained(_finished(clock, "completed", 1.5, (0.1,), 0.0), targets)
    assert not slo.attained(_finished(clock, "completed", 0.5, (0.3, 0.1), 0.0), targets)
    assert not slo.attained(_finished(clock, "completed", 0.5, (0.1,), 2.5), targets)
    # Targets of 0 are not set.
    assert slo.attained(_finished(clock, "completed", 9.0, (5.0,), 9.0), SloTargets(ttft=0.0, itl=0.0))
    # Only completed requests attain; cancelled ones do not even count.
    refused = _finished(clock, "refused", 0.1, (), 0.0)
    cancelled = _finished(clock, "cancelled", 0.1, (), 0.0)
    assert slo.counts(refused)
    assert not slo.attained(refused, targets)
    assert not slo.counts(cancelled)

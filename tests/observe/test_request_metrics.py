"""One ended timeline observed into a fresh registry: exact series, and its log line."""

from __future__ import annotations

import msgspec
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engines.base import Usage
from gateway.config import Config, SloConfig, SloTargets
from gateway.observe.metrics import ITL_BUCKETS, Observer, RequestMetrics
from gateway.observe.outcome import Outcome
from gateway.observe.requestlog import RequestLogLine, log_line
from gateway.observe.tally import Tally
from gateway.observe.timeline import RequestTimeline
from guard.cascade import CascadeResult, StageRun
from policy.safety.decision import GuardDecision
from tests.backends import FakeClock


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """The value of the sample `name` with exactly `labels` (0 when absent)."""
    text = generate_latest(registry).decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    return 0.0


def ended_request(clock: FakeClock) -> RequestTimeline:
    t = RequestTimeline(clock, trace_id="ab" * 16, request_id="req-1")
    t.tenant, t.key_id, t.model, t.klass, t.route = "acme", "k1", "m@1", "batch", "/v1/chat/completions"
    start = t.now()
    clock.advance(0.002)
    start = t.phase("auth", start)
    clock.advance(0.003)
    t.phase("quota", start)
    run = StageRun(
        index=0,
        guard="rules",
        allow_below=0.2,
        block_above=0.8,
        p_unsafe=0.0,
        verdict="allow",
        latency_s=0.004,
    )
    result = CascadeResult(verdict="allow", runs=(run,), decided_by=0, category="")
    t.guard_check(
        "input", t.now(), GuardDecision(direction="input", action="allow", source="rules", result=result)
    )
    start = t.now()
    clock.advance(1.0)
    t.phase("queue", start)
    t.expect_outcome()
    for gap in (0.5, 0.1, 0.1, 0.1):
        clock.advance(gap)
        t.token()
    t.record_outcome(
        Outcome(
            request_id="req-1",
            model="m@1",
            status="completed",
            finish_reason="length",
            usage=Usage(prompt_tokens=7, completion_tokens=4),
            stream=False,
        )
    )
    clock.advance(0.1)
    t.response_ended(200)
    return t


def test_one_request_moves_each_series_by_what_it_did() -> None:
    registry = CollectorRegistry()
    slo_config = SloConfig(batch=SloTargets(ttft=2.0, itl=0.2), interactive=SloTargets(ttft=0.1, itl=0.1))
    metrics = RequestMetrics(registry, slo_config)
    clock = FakeClock(1000.0)
    metrics.observe(ended_request(clock))
    p = "lockgate:"
    assert (
        sample(registry, f"{p}requests_total", route="/v1/chat/completions", status="200", tenant="acme") == 1
    )
    assert sample(registry, f"{p}prompt_tokens_total", tenant="acme", model="m@1") == 7
    assert sample(registry, f"{p}generation_tokens_total", tenant="acme", model="m@1") == 4
    assert sample(
        registry, f"{p}time_to_first_token_seconds_sum", **{"class": "batch", "model": "m@1"}
    ) == pytest.approx(1.505)
    assert (
        sample(registry, f"{p}inter_token_latency_seconds_count", **{"class": "batch", "model": "m@1"}) == 3
    )
    assert sample(
        registry, f"{p}queue_wait_seconds_sum", **{"class": "batch", "model": "m@1"}
    ) == pytest.approx(1.0)
    assert sample(
        registry, f"{p}e2e_request_latency_seconds_sum", **{"class": "batch", "model": "m@1"}
    ) == pytest.approx(1.905)
    assert sample(registry, f"{p}request_phase_seconds_count", phase="auth") == 1
    assert sample(
        registry, f"{p}guard_latency_seconds_sum", direction="input", stage="rules"
    ) == pytest.approx(0.004)
    assert sample(registry, f"{p}request_outcomes_total", status="completed") == 1
    assert sample(registry, f"{p}requests_finished_total", **{"class": "batch"}) == 1
    assert sample(registry, f"{p}slo_attained_requests_total", **{"class": "batch"}) == 1
    assert sample(registry, f"{p}requests_finished_total", **{"class": "interactive"}) == 0
    assert sample(registry, f"{p}rejections_total", reason="rate_limit_exceeded") == 0


def test_the_log_line_has_the_trace_ids_and_never_a_prompt() -> None:
    clock = FakeClock(1000.0)
    t = ended_request(clock)
    line = msgspec.json.decode(msgspec.json.encode(log_line(t)))
    assert line["request_id"] == "req-1"
    assert line["trace_id"] == "ab" * 16
    assert len(line["span_id"]) == 16
    assert (line["tenant"], line["model"], line["status"], line["http_status"]) == (
        "acme",
        "m@1",
        "completed",
        200,
    )
    assert (line["prompt_tokens"], line["completion_tokens"]) == (7, 4)
    assert line["durations"]["queue"] == pytest.approx(1.0)
    assert line["durations"]["ttft"] == pytest.approx(1.505)
    assert line["guard"] == "input=rules"
    assert "prompt" not in line
    # No field could carry one: log lines cannot be purged when a tenant's retention ends.
    assert "prompt" not in RequestLogLine.__struct_fields__
    assert not hasattr(t, "prompt")


def test_the_defaults_have_targets_for_both_classes() -> None:
    config = Config()
    assert config.slo.interactive.ttft > 0
    assert config.slo.batch.ttft > config.slo.interactive.ttft


def test_cancellations_and_stalls_are_counted_from_the_outcome_and_stay_out_of_attainment() -> None:
    registry = CollectorRegistry()
    metrics = RequestMetrics(registry, SloConfig())
    clock = FakeClock()
    for status in ("cancelled", "stalled", "stalled"):
        t = RequestTimeline(clock, trace_id="cd" * 16)
        t.tenant, t.model, t.klass = "acme", "m@1", "interactive"
        t.expect_outcome()
        t.token()
        t.response_ended(200)
        t.record_outcome(
            Outcome(
                request_id="r",
                model="m@1",
                status=status,
                finish_reason=None,
                usage=Usage(prompt_tokens=3, completion_tokens=1),
                stream=True,
            )
        )
        metrics.observe(t)
    p = "lockgate:"
    assert sample(registry, f"{p}cancellations_total") == 1
    assert sample(registry, f"{p}stalls_total") == 2
    assert sample(registry, f"{p}request_outcomes_total", status="stalled") == 2
    assert sample(registry, f"{p}generation_tokens_total", tenant="acme", model="m@1") == 3
    assert sample(registry, f"{p}requests_finished_total", **{"class": "interactive"}) == 0


def test_observing_many_at_once_exposes_what_observing_each_does() -> None:
    # On a bound, between bounds, under the first and over the last, repeated, and none at all.
    amounts = [0.0, 0.001, 0.0011, 0.02, 0.02, 0.025, 1.0, 79.9, 80.0, 123.4, 0.0004]
    exposed = []

    def one_by_one(histogram: Histogram, xs: list[float]) -> None:
        for x in xs:
            histogram.observe(x)

    def observer_one_by_one(histogram: Histogram, xs: list[float]) -> None:
        tally = Tally()
        for x in xs:
            Observer(histogram, tally).observe(x)
        tally.flush()

    def observer_all(histogram: Histogram, xs: list[float]) -> None:
        tally = Tally()
        Observer(histogram, tally).observe_all(xs)
        tally.flush()

    for observe in (one_by_one, observer_all, observer_one_by_one):
        registry = CollectorRegistry()
        histogram = Histogram("itl", "gaps", ("model",), buckets=ITL_BUCKETS, registry=registry)
        observe(histogram.labels("m@1"), amounts)
        observe(histogram.labels("m@1"), [])
        observe(histogram.labels("m@2"), amounts[:3])
        text = generate_latest(registry).decode()
        exposed.append("\n".join(line for line in text.splitlines() if "_created" not in line))
    assert exposed[0] == exposed[1] == exposed[2]
    assert 'itl_bucket{le="0.001",model="m@1"} 3.0' in exposed[1]
    assert 'itl_count{model="m@1"} 11.0' in exposed[1]

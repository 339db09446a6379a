"""Spans built from finished request timelines, on a fake clock, exported to an in-memory exporter."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from engines.base import Usage
from gateway.config import TracingConfig
from gateway.observe.outcome import Outcome
from gateway.observe.timeline import GuardCheck, Phase, RequestTimeline
from gateway.observe.trace import traceparent_of
from gateway.observe.tracing import Tracer
from guard.cascade import StageRun
from tests.backends import FakeClock

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


def finished(clock: FakeClock, parent: str = "") -> RequestTimeline:
    """A streamed chat completion: auth, render, quota, input guard, queue, 3 deltas, 1 output check."""
    t = RequestTimeline(clock, trace_id=TRACE, parent_span_id=parent, request_id="req-1", method="POST")
    t.route, t.tenant, t.model, t.policy, t.klass = (
        "/v1/chat/completions",
        "acme",
        "m@1",
        "default@2",
        "batch",
    )
    start = t.now()
    phases: tuple[Phase, ...] = ("auth", "render", "quota", "input_guard", "queue")
    for name in phases:
        clock.advance(0.1)
        start = t.phase(name, start)
    for gap in (0.3, 0.05, 0.05):
        clock.advance(gap)
        t.token()
    run = StageRun(
        index=0,
        guard="rules",
        allow_below=0.2,
        block_above=0.8,
        p_unsafe=0.1,
        verdict="allow",
        latency_s=0.01,
    )
    t.guard_checks.append(
        GuardCheck(direction="output", start=clock.now - 0.02, end=clock.now, source="rules", action="allow",
                   runs=(run,))
    )  # fmt: skip
    t.expect_outcome()
    clock.advance(0.1)
    t.response_ended(200)
    usage = Usage(prompt_tokens=12, completion_tokens=3)
    t.record_outcome(
        Outcome(
            request_id="req-1",
            model="m@1",
            status="completed",
            finish_reason="stop",
            usage=usage,
            stream=True,
        )
    )
    return t


def export(t: RequestTimeline) -> dict[str, ReadableSpan]:
    exporter = InMemorySpanExporter()
    tracer = Tracer(TracingConfig(enabled=True), exporter)
    tracer.export(t)
    tracer.shutdown()
    return {span.name: span for span in exporter.get_finished_spans()}


def test_one_trace_per_request_with_a_span_per_phase() -> None:
    clock = FakeClock(1000.0)
    t = finished(clock)
    spans = export(t)
    assert set(spans) == {
        "POST /v1/chat/completions",
        "auth",
        "render",
        "quota",
        "input_guard",
        "queue",
        "engine.time_to_first_token",
        "decode",
        "output_guard",
        "stream_end",
    }
    root = spans.pop("POST /v1/chat/completions")
    assert root.context is not None
    # The timeline's ids: what remote engines were told in their traceparent.
    assert f"{root.context.trace_id:032x}" == TRACE
    assert f"{root.context.span_id:016x}" == t.span_id
    assert traceparent_of(t) == f"00-{TRACE}-{t.span_id}-01"
    assert root.parent is None
    assert root.kind == SpanKind.SERVER
    assert root.start_time is not None
    assert root.end_time is not None
    assert root.start_time == pytest.approx(1000.0e9)
    assert t.end is not None
    assert root.end_time == pytest.approx(t.end * 1e9)
    for span in spans.values():
        assert span.parent is not None
        assert span.parent.span_id == root.context.span_id
        assert span.context is not None
        assert span.context.trace_id == root.context.trace_id
        assert span.start_time is not None
        assert span.end_time is not None
        assert root.start_time <= span.start_time <= span.end_time <= root.end_time
    # Time to first token starts where queueing ended: the span chain covers arrival to the first token.
    assert spans["engine.time_to_first_token"].start_time == spans["queue"].end_time
    assert spans["engine.time_to_first_token"].end_time == spans["decode"].start_time
    attributes = dict(root.attributes or {})
    assert attributes["lockgate.tenant"] == "acme"
    assert attributes["gen_ai.request.model"] == "m@1"
    assert attributes["lockgate.policy"] == "default@2"
    assert attributes["lockgate.priority_class"] == "batch"
    assert attributes["lockgate.decision"] == "output=rules"
    assert attributes["gen_ai.usage.input_tokens"] == 12
    assert attributes["gen_ai.usage.output_tokens"] == 3
    assert attributes["http.response.status_code"] == 200
    [event] = spans["output_guard"].events
    assert dict(event.attributes or {})["lockgate.guard.stage"] == "rules"


def test_the_clients_span_is_the_parent_and_server_errors_mark_the_root() -> None:
    clock = FakeClock(5.0)
    t = finished(clock, parent=PARENT)
    t.http_status, t.error_code = 503, "overloaded"
    spans = export(t)
    root = spans["POST /v1/chat/completions"]
    assert root.parent is not None
    assert f"{root.parent.span_id:016x}" == PARENT
    assert root.parent.is_remote
    assert root.context is not None
    assert f"{root.context.trace_id:032x}" == TRACE
    assert root.status.status_code == StatusCode.ERROR


def test_a_request_refused_before_the_engine_has_only_the_phases_it_reached() -> None:
    clock = FakeClock(0.0)
    t = RequestTimeline(clock, trace_id=TRACE, request_id="r2", method="POST")
    t.route = "/v1/chat/completions"
    clock.advance(0.01)
    t.phase("auth", t.arrival)
    t.response_ended(401)
    assert set(export(t)) == {"POST /v1/chat/completions", "auth"}
    unfinished = RequestTimeline(clock, trace_id=TRACE)
    assert export(unfinished) == {}  # only ended requests are traced

"""OpenTelemetry traces: one trace per request, built from its finished `RequestTimeline`.

The request path records plain timestamps as it goes (gateway/observe/timeline.py); when the request has
ended, `Tracer.export` turns them into spans with their real start and end times, so the hot path never
touches the OpenTelemetry SDK, and with `[tracing] enabled = false` (the default) nothing is built at all::

    POST /v1/chat/completions            (SERVER; arrival -> end; tenant, model, policy, decision, tokens)
    ├── auth · render · quota · input_guard · queue       (the phases the request reached)
    ├── engine.time_to_first_token       (end of queueing -> first token)
    ├── decode                           (first token -> last token)
    ├── output_guard                     (one per check of the output; its stages as events)
    └── stream_end                       (last token -> end of the response)

Ids are the timeline's: its trace id (the client's when it sent a valid `traceparent`, which also makes the
client's span the root's parent) and the root's span id, which is what remote engines receive as the parent
in their `traceparent` (`gateway.observe.trace.traceparent_of`). The SDK's id generator is given those ids
for the root span only (`_TimelineIds`); every other span gets random ids.

Each app has its own `TracerProvider` (never the process-global one), exporting through a batch processor
to OTLP over HTTP (`tracing.otlp_endpoint`), or to the exporter a test passes in.
"""

from __future__ import annotations

import random

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import (
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    set_span_in_context,
)
from opentelemetry.util.types import AttributeValue

from gateway.config import TracingConfig
from gateway.observe.timeline import GuardCheck, RequestTimeline


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class _TimelineIds(IdGenerator):
    """Random ids, except for a root span whose ids were fixed by its timeline (`preset`)."""

    def __init__(self) -> None:
        self._trace_id: int | None = None
        self._span_id: int | None = None

    def preset(self, trace_id: int, span_id: int) -> None:
        """The ids of the next span started (the SDK asks for its span id, and its trace id if it has no
        parent); cleared once used."""
        self._trace_id, self._span_id = trace_id, span_id

    def generate_span_id(self) -> int:
        span_id, self._span_id = self._span_id, None
        return span_id if span_id is not None else random.getrandbits(64) or 1

    def generate_trace_id(self) -> int:
        trace_id, self._trace_id = self._trace_id, None
        return trace_id if trace_id is not None else random.getrandbits(128) or 1


class Tracer:
    """Spans of finished requests, for one app."""

    def __init__(self, config: TracingConfig, exporter: SpanExporter | None = None) -> None:
        """`exporter`: where spans go (a test's in-memory one, exported synchronously); default OTLP/HTTP."""
        self._ids = _TimelineIds()
        self._provider = TracerProvider(
            resource=Resource.create({"service.name": config.service_name}), id_generator=self._ids
        )
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            endpoint = config.otlp_endpoint or None
            exported = OTLPSpanExporter(endpoint=endpoint, timeout=config.export_timeout)
            self._provider.add_span_processor(BatchSpanProcessor(exported))
        else:
            self._provider.add_span_processor(SimpleSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("lockgate")

    def shutdown(self) -> None:
        """Flush what is pending and stop exporting (blocking: call it off the event loop)."""
        self._provider.shutdown()

    def export(self, t: RequestTimeline) -> None:
        """The spans of one finished request (one whose `end` is set)."""
        if t.end is None:
            return
        parent = None
        if t.parent_span_id:
            remote = SpanContext(
                trace_id=int(t.trace_id, 16),
                span_id=int(t.parent_span_id, 16),
                is_remote=True,
                trace_flags=TraceFlags(TraceFlags.SAMPLED),
            )
            parent = set_span_in_context(NonRecordingSpan(remote))
        self._ids.preset(int(t.trace_id, 16), int(t.span_id, 16))
        root = self._tracer.start_span(
            f"{t.method} {t.route}".strip() or "request",
            context=parent,
            kind=SpanKind.SERVER,
            attributes=_attributes(t),
            start_time=_ns(t.arrival),
        )
        if t.http_status >= 500:
            root.set_status(Status(StatusCode.ERROR, t.error_code or f"http_{t.http_status}"))
        inside = set_span_in_context(root)
        for name, (start, end) in t.phases.items():
            self._span(name, start, end, inside)
        first, queued = t.first_token, t.phases.get("queue")
        if first is not None:
            self._span("engine.time_to_first_token", queued[1] if queued else t.arrival, first, inside)
            self._span("decode", first, t.token_times[-1], inside, {"lockgate.deltas": len(t.token_times)})
            self._span("stream_end", t.token_times[-1], t.end, inside)
        for check in t.guard_checks:
            if check.direction == "output":
                self._guard_check(check, inside)
        root.end(end_time=_ns(t.end))

    def _span(
        self,
        name: str,
        start: float,
        end: float,
        context: Context,
        attributes: dict[str, AttributeValue] | None = None,
    ) -> Span:
        span = self._tracer.start_span(
            name,
            context=context,
            attributes=attributes,
            start_time=_ns(start),
        )
        span.end(end_time=_ns(max(start, end)))
        return span

    def _guard_check(self, check: GuardCheck, context: Context) -> None:
        span = self._tracer.start_span(
            "output_guard",
            context=context,
            attributes={"lockgate.guard.source": check.source, "lockgate.guard.action": check.action},
            start_time=_ns(check.start),
        )
        for run in check.runs:
            event: dict[str, AttributeValue] = {
                "lockgate.guard.stage": run.guard,
                "lockgate.guard.verdict": run.verdict,
                "lockgate.guard.latency_s": run.latency_s,
            }
            if run.p_unsafe is not None:
                event["lockgate.guard.p_unsafe"] = run.p_unsafe
            span.add_event("guard_stage", event, timestamp=_ns(check.start))
        span.end(end_time=_ns(max(check.start, check.end)))


def _attributes(t: RequestTimeline) -> dict[str, AttributeValue]:
    attributes: dict[str, AttributeValue] = {
        "http.request.method": t.method,
        "http.route": t.route,
        "http.response.status_code": t.http_status,
        "lockgate.request_id": t.request_id,
    }
    optional: dict[str, str] = {
        "lockgate.tenant": t.tenant,
        "gen_ai.request.model": t.model,
        "lockgate.route": t.model_route,
        "lockgate.policy": t.policy,
        "lockgate.priority_class": t.klass,
        "lockgate.decision": t.guard_label(),
        "error.type": t.error_code,
    }
    attributes.update({k: v for k, v in optional.items() if v})
    if t.outcome is not None:
        attributes["lockgate.status"] = t.outcome.status
        attributes["gen_ai.usage.input_tokens"] = t.outcome.usage.prompt_tokens
        attributes["gen_ai.usage.output_tokens"] = t.outcome.usage.completion_tokens
        if t.outcome.finish_reason is not None:
            attributes["gen_ai.response.finish_reasons"] = (t.outcome.finish_reason,)
    return attributes

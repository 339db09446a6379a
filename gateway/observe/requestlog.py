"""One JSON line per request end on the `lockgate.requests` logger, with the ids its trace has.

The line never holds the prompt or the output: log lines leave the gateway (stderr, journald, a collector) and
cannot be purged when a tenant's retention ends, so checked text lives only in the audit trail, under its
retention (`policy.audit.retention`).
"""

from __future__ import annotations

import logging

import msgspec

from gateway.observe.timeline import RequestTimeline

log = logging.getLogger("lockgate.requests")


class PhaseDurations(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Seconds each part of the request took (absent: the request never reached it)."""

    auth: float | None = None
    render: float | None = None
    quota: float | None = None
    input_guard: float | None = None
    queue: float | None = None
    # Time to first token from arrival as the client gets it (a stream: after the output guard's hold-back),
    # the engine's first token from arrival, then first to last token.
    ttft: float | None = None
    engine_ttft: float | None = None
    decode: float | None = None
    # All output guard checks together (they run while decoding).
    output_guard: float | None = None
    mean_itl: float | None = None
    e2e: float | None = None


class RequestLogLine(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The request log line (absent fields were not known or do not apply)."""

    event: str = "request"
    at: float
    request_id: str
    trace_id: str
    span_id: str
    parent_span_id: str = ""
    method: str
    route: str
    http_status: int
    error: str = ""
    tenant: str = ""
    key_id: str = ""
    model: str = ""
    model_route: str = ""  # a routed request: the route, rule, model and any fallback
    policy: str = ""
    priority: str = ""
    result_cache: str = ""  # hit | miss, on a request the result cache may answer
    stream: bool = False
    status: str = ""  # the tracked outcome: completed, cancelled, stalled, error, shutdown, blocked, refused
    finish_reason: str = ""
    guard: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    guard_tokens: int = 0
    durations: PhaseDurations


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def log_line(t: RequestTimeline) -> RequestLogLine:
    """The log line of an ended request."""
    outcome = t.outcome
    output_guard = sum(c.end - c.start for c in t.guard_checks if c.direction == "output")
    durations = PhaseDurations(
        auth=_round(t.duration("auth")),
        render=_round(t.duration("render")),
        quota=_round(t.duration("quota")),
        input_guard=_round(t.duration("input_guard")),
        queue=_round(t.duration("queue")),
        ttft=_round(t.ttft),
        engine_ttft=_round(None if t.first_token is None else t.first_token - t.arrival),
        decode=_round(t.decode),
        output_guard=_round(output_guard) if output_guard else None,
        mean_itl=_round(t.mean_itl),
        e2e=_round(t.e2e),
    )
    usage = outcome.usage if outcome is not None else None
    return RequestLogLine(
        at=t.end if t.end is not None else t.now(),
        request_id=t.request_id,
        trace_id=t.trace_id,
        span_id=t.span_id,
        parent_span_id=t.parent_span_id,
        method=t.method,
        route=t.route,
        http_status=t.http_status,
        error=t.error_code,
        tenant=t.tenant,
        key_id=t.key_id,
        model=t.model,
        model_route=t.model_route,
        policy=t.policy,
        priority=t.klass,
        result_cache=t.result_cache,
        stream=t.stream,
        status=outcome.status if outcome is not None else "",
        finish_reason=(outcome.finish_reason or "") if outcome is not None else "",
        guard=t.guard_label(),
        prompt_tokens=usage.prompt_tokens if usage is not None else 0,
        completion_tokens=usage.completion_tokens if usage is not None else 0,
        cached_tokens=usage.cached_tokens if usage is not None else 0,
        guard_tokens=usage.guard_tokens if usage is not None else 0,
        durations=durations,
    )


class RequestLog:
    """Writes the line of each ended request (nothing is built when INFO is off for the logger)."""

    def __init__(self, *, enabled: bool) -> None:
        self._enabled = enabled
        self._encoder = msgspec.json.Encoder()

    def write(self, t: RequestTimeline) -> None:
        """Log the line of an ended request."""
        if self._enabled and log.isEnabledFor(logging.INFO):
            line = self._encoder.encode(log_line(t)).decode()
            # `log.info` without its search of the stack for the caller's file and line, which say nothing
            # here: the line is the same at every request end.
            log.handle(log.makeRecord(log.name, logging.INFO, __file__, 0, line, (), None))

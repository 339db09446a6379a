"""`RequestObserver`: the app's metrics registry and request log, and the ASGI middleware that gives each
request its `RequestTimeline` at arrival and hands the ended timeline to them.

Built once per app in `create_app` (its registry is the app's own; the service collector is registered in
the lifespan, once the services exist, and removed at shutdown). In a worker of `lockgate serve --workers N`
(prometheus_client's multiprocess mode) `/metrics` answers from every worker's files instead
(gateway/observe/multiproc.py); the app's registry still holds this worker's series, for its OTLP push.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from litestar.enums import ScopeType
from litestar.types import ASGIApp, Message, Receive, Scope, Send
from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector

from gateway.config import Config
from gateway.observe.metrics import RequestMetrics, tenant_labels
from gateway.observe.multiproc import multiprocess_dir
from gateway.observe.requestlog import RequestLog
from gateway.observe.timeline import STATE_KEY, RequestTimeline
from gateway.observe.trace import inbound_trace
from gateway.requestid import assign_request_id, stamp
from policy.clock import Clock

if TYPE_CHECKING:  # the OpenTelemetry SDK is imported only when tracing is on
    from gateway.observe.tracing import Tracer

log = logging.getLogger("lockgate.observe")


class RequestObserver:
    """Where ended requests go: Prometheus series on the app's registry, and the request log."""

    def __init__(self, config: Config, clock: Clock, tracer: Tracer | None = None) -> None:
        """`tracer`: where ended requests' spans go (None: tracing is off)."""
        self.clock = clock
        self.registry = CollectorRegistry()
        # Where every worker's metric files are, in multiprocess mode (None: this process alone).
        self.multiprocess_dir = multiprocess_dir()
        self.metrics = RequestMetrics(
            self.registry, config.slo, tenant_labels(config.metrics.tenant_label, secret=None)
        )
        self.request_log = RequestLog(enabled=config.metrics.request_log)
        self.tracer = tracer

    def start(self, scope: Scope) -> RequestTimeline:
        """The timeline of a request arriving now, kept in its scope's state."""
        trace_id, parent = inbound_trace(scope.get("headers", ()))
        state = scope.setdefault("state", {})
        timeline = RequestTimeline(
            self.clock,
            trace_id=trace_id,
            parent_span_id=parent,
            request_id=assign_request_id(scope),
            method=str(scope.get("method", "")),
            on_end=self.finish,
        )
        state[STATE_KEY] = timeline
        return timeline

    def finish(self, timeline: RequestTimeline) -> None:
        """An ended request: observe it, log it, trace it. A failure here is a bug, logged, never the
        request's."""
        try:
            self.metrics.observe(timeline)
            self.request_log.write(timeline)
            if self.tracer is not None:
                self.tracer.export(timeline)
        except Exception:
            log.exception("observing request %s failed", timeline.request_id)

    def watch(self, collector: Collector) -> Collector:
        """Register a scrape-time collector (the services'); returns it for `unwatch`."""
        self.registry.register(collector)
        return collector

    def unwatch(self, collector: Collector) -> None:
        """Remove a collector `watch` registered."""
        self.registry.unregister(collector)


def observe_middleware(app: ASGIApp, observer: RequestObserver, route_of: Callable[[Scope], str]) -> ASGIApp:
    """Time every HTTP request from arrival, count active streams, end its timeline with its status and the
    template of the route that answered it (`route_of`: the edge reads it from the scope), and set its
    `x-request-id` on the response."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != ScopeType.HTTP:
            await app(scope, receive, send)
            return
        timeline = observer.start(scope)
        status = 0
        streaming = False

        async def send_observed(message: Message) -> None:
            nonlocal status, streaming
            if message["type"] == "http.response.start":
                stamp(message, timeline.request_id)
                status = message["status"]
                if timeline.stream and status == 200:
                    streaming = True
                    observer.metrics.active_streams.inc()
            await send(message)

        try:
            await app(scope, receive, send_observed)
        finally:
            if streaming:
                observer.metrics.active_streams.dec()
            timeline.route = route_of(scope)
            timeline.response_ended(status)

    return middleware

"""Traces through the app (simulated engine, in-memory span exporter): one trace per request continuing the
client's `traceparent`, a span per stage, and the trace context handed on to the engine request."""

from __future__ import annotations

from collections.abc import AsyncGenerator

import httpx
import msgspec
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engines.base import EngineDelta, EngineRequest
from engines.simulated import SimulatedEngine, SimulatorConfig
from gateway.app import create_app
from gateway.config import Config, TracingConfig
from gateway.generation.prompts import PromptRenderer
from tests.conftest import MODEL, OutcomeLog, Tenancy, eventually, make_config, serving

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5, "stream": True}


class RecordingEngine(SimulatedEngine):
    """The simulator, keeping the engine requests it was given."""

    def __init__(self) -> None:
        super().__init__(SimulatorConfig(decode_step_s=0.002, decode_step_s_per_seq=0.0), model_name=MODEL)
        self.requests: list[EngineRequest] = []

    async def generate(self, req: EngineRequest) -> AsyncGenerator[EngineDelta, None]:
        self.requests.append(req)
        async for delta in super().generate(req):
            yield delta


async def _served(
    config: Config, engine: RecordingEngine, renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy,
    exporter: InMemorySpanExporter | None = None,
) -> httpx.Response:  # fmt: skip
    """One streamed chat completion through an app on `config`, traced by `exporter`; its response."""
    app = create_app(
        config, engine=engine, renderer=renderer, tenants=tenancy.store, sink=outcomes, span_exporter=exporter
    )
    headers = {**tenancy.consumer_headers, "traceparent": f"00-{TRACE}-{PARENT}-01"}
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=30, headers=headers) as http:
        response = await http.post("/v1/chat/completions", json=BODY)
        assert response.status_code == 200, response.text
        if exporter is not None:

            async def root_ended() -> bool:
                return any(s.parent is not None and s.parent.is_remote for s in exporter.get_finished_spans())

            await eventually(root_ended)
        return response


async def test_a_request_is_one_trace_continuing_the_clients(
    renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    exporter = InMemorySpanExporter()
    engine = RecordingEngine()
    await engine.start()
    try:
        config = msgspec.structs.replace(make_config(), tracing=TracingConfig(enabled=True))
        response = await _served(config, engine, renderer, outcomes, tenancy, exporter)
    finally:
        await engine.shutdown()
    spans = exporter.get_finished_spans()
    [root] = [s for s in spans if s.name == "POST /v1/chat/completions"]
    assert root.context is not None
    assert f"{root.context.trace_id:032x}" == TRACE
    assert root.parent is not None
    assert f"{root.parent.span_id:016x}" == PARENT
    children = {s.name for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id}
    assert {
        "auth",
        "render",
        "quota",
        "input_guard",
        "queue",
        "engine.time_to_first_token",
        "decode",
    } <= children
    assert "stream_end" in children
    attributes = dict(root.attributes or {})
    assert attributes["lockgate.tenant"] == "acme"
    assert str(attributes["gen_ai.request.model"]).startswith(f"{MODEL}@")
    assert attributes["gen_ai.request.model"] == response.headers["x-lockgate-model"]
    assert attributes["lockgate.request_id"] == response.headers["x-request-id"]
    assert attributes["lockgate.priority_class"] == "interactive"
    assert attributes["gen_ai.usage.output_tokens"] == 5
    assert int(str(attributes["gen_ai.usage.input_tokens"])) > 0
    assert str(attributes["lockgate.policy"])
    # The engine request carries the trace context, with the gateway's root span as the parent.
    [engine_request] = engine.requests
    assert engine_request.traceparent == f"00-{TRACE}-{root.context.span_id:016x}-01"


async def test_tracing_off_builds_nothing_and_hands_no_trace_context_on(
    renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    engine = RecordingEngine()
    await engine.start()
    try:
        await _served(make_config(), engine, renderer, outcomes, tenancy)
    finally:
        await engine.shutdown()
    [engine_request] = engine.requests
    assert engine_request.traceparent == ""

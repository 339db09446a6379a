"""Routes (a model name that chooses the model of each request) on two simulated replicas of different
configurations, through the openai SDK: the default model in pool `default`, and a "strong" model in pool
`strong` rendered with another chat template (one more system turn, so its prompt token count tells which
template rendered a request). Each rule fires; a fallback on a stopped or decommissioned pool renders with
the fallback's own template; tools and structured outputs stay valid on the model a rule chose; every decision
is in the header, the audit records, the request log and the metrics."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import msgspec
import openai
import pytest
from litestar import Litestar
from openai.types.chat import ChatCompletionMessageFunctionToolCall, ChatCompletionToolParam
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import BaseModel, Field

from engines.simulated import SimulatorConfig
from gateway.app import create_app
from gateway.config import EngineConfig, ReplicaSpec, TracingConfig
from gateway.generation.prompts import PromptRenderer
from policy.safety.decision import GuardRecord
from policy.safety.records import audit_draft
from policy.tenants.models import Limits, Quotas, Tenant
from registry.base import RegistryStore
from registry.errors import InvalidError, NotFoundError
from registry.models import CascadeSpec, ChatTemplateSpec, RouteRule, RouteSpec
from registry.store.sqlite import SqliteRegistryStore
from tests.conftest import (
    MODEL,
    OutcomeLog,
    RequestLines,
    Tenancy,
    add_key,
    eventually,
    make_config,
    operator_headers,
    serving,
)
from tests.gateway.test_rendering_versions import expected_tokens, extra_template

STRONG = "strong"
QUESTION = "What is the capital of France?"
LONG = "Tell me about the history of Paris. " * 40
WEATHER: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}


class City(BaseModel):
    name: str = Field(max_length=20)
    population: int = Field(ge=0, le=1000)


@dataclass
class Routes:
    app: Litestar
    client: openai.AsyncOpenAI
    http: httpx.AsyncClient
    records: list[GuardRecord]
    renderer: PromptRenderer
    tenancy: Tenancy
    spans: InMemorySpanExporter

    def tokens(self, template: str, content: str) -> int:
        return expected_tokens(self.renderer.tokenizer, template, [{"role": "user", "content": content}])

    @property
    def served_tokens(self) -> int:
        return self.tokens(self.renderer.template, QUESTION)

    @property
    def strong_tokens(self) -> int:
        return self.tokens(extra_template(self.renderer.template), QUESTION)

    async def ask(self, model: str, content: str = QUESTION, **fields: Any) -> Any:
        """A chat completion through the SDK, with its HTTP response (headers)."""
        fields.setdefault("max_tokens", 4)
        raw = await self.client.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": content}], **fields
        )
        return raw.parse(), raw.headers

    async def metrics(self) -> str:
        headers = await operator_headers(self.tenancy.store)
        return (await self.http.get("/metrics", headers=headers)).text

    async def stop(self, pool: str) -> None:
        """Stop the engine of `pool`'s replica for good (its supervisor does not restart a stopped one)."""
        [replica] = [r for r in self.app.state.services.scheduler.replicas if r.pool == pool]
        await replica.engine.shutdown()


@pytest.fixture
async def registry_store(tmp_path: Path) -> AsyncIterator[RegistryStore]:
    store = await SqliteRegistryStore.open(tmp_path / "registry.sqlite3")
    yield store
    await store.close()


@pytest.fixture
async def routes(
    renderer: PromptRenderer, tenancy: Tenancy, outcomes: OutcomeLog, registry_store: RegistryStore
) -> AsyncIterator[Routes]:
    config = msgspec.structs.replace(
        make_config(),
        engines=[ReplicaSpec(kind="simulated"), ReplicaSpec(kind="simulated", pool=STRONG)],
        engine=EngineConfig(kind="simulated"),
    )
    records: list[GuardRecord] = []
    exporter = InMemorySpanExporter()
    app = create_app(
        msgspec.structs.replace(config, tracing=TracingConfig(enabled=True)),
        renderer=renderer,
        tenants=tenancy.store,
        registry=registry_store,
        sink=outcomes,
        guard_sink=records.append,
        span_exporter=exporter,
    )
    async with (
        serving(app) as url,
        httpx.AsyncClient(base_url=url, headers=tenancy.consumer_headers, timeout=60) as http,
        openai.AsyncOpenAI(base_url=url + "/v1", api_key=tenancy.consumer, max_retries=0) as client,
    ):
        registry = app.state.services.registry
        served = registry.view.resolve_model(MODEL, key="")
        extra = ChatTemplateSpec(text=extra_template(renderer.template))
        await registry.publish("chat_template", MODEL, "extra", extra, actor="t")
        strong = msgspec.structs.replace(served.spec, engine_pool=STRONG, chat_template=f"{MODEL}@extra")
        await registry.publish("model", STRONG, "1", strong, actor="t")
        await registry.set_alias("model", STRONG, "1", actor="t")
        yield Routes(app, client, http, records, renderer, tenancy, exporter)


async def publish_route(routes: Routes, name: str, spec: RouteSpec) -> None:
    registry = routes.app.state.services.registry
    await registry.publish("route", name, "1", spec, actor="t")
    await registry.set_alias("route", name, "1", actor="t")


AUTO = RouteSpec(
    rules=(
        RouteRule(name="capable", target=STRONG, capabilities=("tools", "structured")),
        RouteRule(name="long", target=STRONG, min_prompt_tokens=200),
    ),
    default=MODEL,
    fallbacks=(STRONG, MODEL),
)


async def test_the_default_and_each_content_rule(routes: Routes, request_log: RequestLines) -> None:
    await publish_route(routes, "auto", AUTO)
    short, headers = await routes.ask("auto")
    # The default: the cheap model, rendered with its own template.
    assert short.model == MODEL
    assert headers["x-lockgate-model"].startswith(f"{MODEL}@")
    assert headers["x-lockgate-route"] == f"auto@1 rule=default target={MODEL}"
    assert short.usage.prompt_tokens == routes.served_tokens
    # Context needed: a long prompt goes to the strong model, rendered with the strong model's template.
    long, headers = await routes.ask("auto", LONG)
    assert long.model == STRONG
    assert headers["x-lockgate-model"] == f"{STRONG}@1"
    assert headers["x-lockgate-route"] == f"auto@1 rule=long target={STRONG}"
    assert long.usage.prompt_tokens == routes.tokens(extra_template(routes.renderer.template), LONG)
    # Tools: the call is valid on the model the rule chose.
    tools, headers = await routes.ask("auto", tools=[WEATHER], tool_choice="required", max_tokens=64)
    assert headers["x-lockgate-route"] == f"auto@1 rule=capable target={STRONG}"
    calls = tools.choices[0].message.tool_calls
    assert calls
    for call in calls:
        assert isinstance(call, ChatCompletionMessageFunctionToolCall)
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # Structured output: parses into the client's model.
    parsed = await routes.client.chat.completions.parse(
        model="auto", messages=[{"role": "user", "content": QUESTION}], response_format=City, max_tokens=64
    )
    assert parsed.model == STRONG
    assert isinstance(parsed.choices[0].message.parsed, City)
    # Every decision is in the request's audit records, and counted.
    routed = [r for r in routes.records if r.route]
    assert {r.route for r in routed} >= {
        f"auto@1 rule=default target={MODEL}",
        f"auto@1 rule=long target={STRONG}",
        f"auto@1 rule=capable target={STRONG}",
    }
    assert f"route=auto@1 rule=long target={STRONG}" in {audit_draft(r).detail for r in routed}
    # ... in the request log and the trace.
    decision = f"auto@1 rule=long target={STRONG}"

    async def logged_and_traced() -> bool:
        spans = [s.attributes or {} for s in routes.spans.get_finished_spans()]
        return any(line.get("model_route") == decision for line in request_log.lines) and any(
            a.get("lockgate.route") == decision for a in spans
        )

    await eventually(logged_and_traced)
    metrics = await routes.metrics()
    assert f'lockgate:route_decisions_total{{reason="rule:long",route="auto@1",target="{STRONG}"}} 1.0' in (
        metrics
    )
    assert (
        f'lockgate:route_decisions_total{{reason="default",route="auto@1",target="{MODEL}"}} 1.0' in metrics
    )


async def test_rules_on_key_tenant_priority_deadline_and_budget(routes: Routes) -> None:
    store = routes.tenancy.store
    before = {k.key_id for k in await store.list_keys("acme")}
    vip_key = await add_key(store, "acme", ("consumer",))
    [vip] = [k for k in await store.list_keys("acme") if k.key_id not in before]
    thrifty = RouteSpec(
        rules=(
            RouteRule(name="vip", target=STRONG, keys=(vip.key_id,)),
            RouteRule(name="batch", target=MODEL, priority=("batch",)),
            RouteRule(name="hurry", target=MODEL, max_deadline_s=1.0),
            RouteRule(name="low-budget", target=MODEL, max_budget_tokens=5000),
            RouteRule(name="globex", target=MODEL, tenants=("globex",)),
            RouteRule(name="free", target=MODEL, tiers=("free",)),
        ),
        default=STRONG,
    )
    await publish_route(routes, "thrifty", thrifty)

    async def rule_of(key: str, content: str = QUESTION, **headers: str) -> str:
        answer = await routes.http.post(
            "/v1/chat/completions",
            json={"model": "thrifty", "messages": [{"role": "user", "content": content}], "max_tokens": 4},
            headers={"authorization": f"Bearer {key}", **headers},
        )
        assert answer.status_code == 200, answer.text
        route: str = answer.headers["x-lockgate-route"]
        return route.split()[1]

    consumer = routes.tenancy.consumer
    # acme has no token quota: the budget rule never holds for it.
    assert await rule_of(consumer) == "rule=default"
    assert await rule_of(vip_key) == "rule=vip"
    assert await rule_of(consumer, **{"x-lockgate-priority": "batch"}) == "rule=batch"
    assert await rule_of(consumer, **{"x-lockgate-queue-deadline": "0.5"}) == "rule=hurry"
    assert await rule_of(consumer, **{"x-lockgate-queue-deadline": "5"}) == "rule=default"
    # A tenant with a token quota: above the budget the default, at or below it the cheap model.
    quota = Limits(requests_per_second=100, request_burst=100, tokens_per_second=0.001, token_burst=5100)
    await store.create_tenant(
        Tenant(tenant_id="frugal", display_name="Frugal", quotas=Quotas(tenant=quota)), actor="t", now=0.0
    )
    frugal = await add_key(store, "frugal", ("consumer",))
    assert await rule_of(frugal, LONG) == "rule=default"  # 5100 left before it
    assert await rule_of(frugal) == "rule=low-budget"  # the long prompt took more than 100
    await store.create_tenant(Tenant(tenant_id="globex", display_name="Globex"), actor="t", now=0.0)
    assert await rule_of(await add_key(store, "globex", ("consumer",))) == "rule=globex"
    # A tier, set by an operator through the admin API: the tenant's next request routes by it.
    await store.create_tenant(Tenant(tenant_id="initech", display_name="Initech"), actor="t", now=0.0)
    initech = await add_key(store, "initech", ("consumer",))
    assert await rule_of(initech) == "rule=default"
    admin = routes.tenancy.admin_headers
    tiered = await routes.http.patch("/admin/tenants/initech", json={"tier": "free"}, headers=admin)
    assert tiered.status_code == 200, tiered.text
    assert tiered.json()["tier"] == "free"
    assert await rule_of(initech) == "rule=free"


@pytest.mark.parametrize("failure", ["stopped", "decommissioned"])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_fallback_serves_with_its_own_template(routes: Routes, failure: str, stream: bool) -> None:
    # The strong model is chosen by default; its pool fails; the cheap model answers, rendered with the
    # cheap model's template (its prompt token count), never the strong model's.
    await publish_route(routes, "careful", RouteSpec(default=STRONG, fallbacks=(MODEL,)))
    first, _ = await routes.ask("careful")
    assert first.usage.prompt_tokens == routes.strong_tokens
    if failure == "stopped":
        await routes.stop(STRONG)
    else:
        routes.app.state.services.pools.pop(STRONG)
    reason = "unhealthy"
    body = {"model": "careful", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    answer = await routes.http.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-lockgate-route"] == f"careful@1 rule=default target={MODEL} fallback={reason}"
    assert answer.headers["x-lockgate-model"].startswith(f"{MODEL}@")
    if stream:
        events = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]
        usage = events[-1]["usage"]
        assert {e["model"] for e in events} == {MODEL}
    else:
        usage = answer.json()["usage"]
        assert answer.json()["model"] == MODEL
    assert usage["prompt_tokens"] == routes.served_tokens != routes.strong_tokens
    answered = [r for r in routes.records if r.request_id == answer.headers["x-request-id"] and r.route]
    assert answered
    # What answered names the fallback; a stopped pool's attempt was checked (and refused at admission)
    # first, and its input record names the model it was for.
    fell_back = f"careful@1 rule=default target={MODEL} fallback={reason}"
    refused = {("input", f"careful@1 rule=default target={STRONG}")} if failure == "stopped" else set()
    assert {(r.direction, r.route) for r in answered} == {
        ("input", fell_back),
        ("output", fell_back),
    } | refused
    metrics = await routes.metrics()
    assert f'reason="refused:{reason}",route="careful@1",target="{STRONG}"}} 1.0' in metrics
    assert f'reason="fallback:{reason}",route="careful@1",target="{MODEL}"}} 1.0' in metrics


async def test_without_a_fallback_the_refusal_is_the_answer_and_a_client_error_never_falls_back(
    routes: Routes,
) -> None:
    await publish_route(routes, "alone", RouteSpec(default=STRONG))
    await routes.stop(STRONG)
    refused = await routes.http.post(
        "/v1/chat/completions", json={"model": "alone", "messages": [{"role": "user", "content": "hi"}]}
    )
    assert refused.status_code == 503
    # A bad request is the client's: the fallback is not tried.
    await publish_route(routes, "picky", RouteSpec(default=MODEL, fallbacks=(STRONG,)))
    bad = await routes.http.post(
        "/v1/chat/completions",
        json={"model": "picky", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**7},
    )
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "max_tokens"


async def test_models_lists_routes_and_the_registry_checks_them(routes: Routes) -> None:
    await publish_route(routes, "auto", AUTO)
    listed = await routes.client.models.list()
    [card] = [m for m in listed.data if m.id == "auto"]
    extra = card.model_extra or {}
    assert extra["kind"] == "route"
    assert extra["route"] == "auto@1"
    assert extra["models"] == [STRONG, MODEL]
    registry = routes.app.state.services.registry
    twice = RouteSpec(
        rules=(RouteRule(name="a", target=MODEL), RouteRule(name="a", target=STRONG)), default=MODEL
    )
    with pytest.raises(InvalidError):
        await registry.publish("route", "bad", "1", twice, actor="t")
    with pytest.raises(NotFoundError):
        await registry.publish("route", "bad", "2", RouteSpec(default=f"{MODEL}@nothing"), actor="t")


def cascade_route(threshold: float) -> RouteSpec:
    # The simulator's chosen tokens have log-probabilities between -0.79 and -0.69: -0.5 escalates every
    # answer, -1.0 none.
    return RouteSpec(
        default=MODEL, cascade=CascadeSpec(strong=STRONG, min_mean_logprob=threshold, within_tokens=4)
    )


@pytest.mark.parametrize("stream", [False, True])
async def test_the_cascade_escalates_below_its_threshold_and_not_above(
    routes: Routes, outcomes: OutcomeLog, stream: bool
) -> None:
    await publish_route(routes, "sure", cascade_route(-1.0))
    await publish_route(routes, "unsure", cascade_route(-0.5))
    body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}

    async def ask(model: str) -> tuple[httpx.Response, str, dict[str, Any]]:
        answer = await routes.http.post("/v1/chat/completions", json={"model": model, **body})
        assert answer.status_code == 200, answer.text
        if not stream:
            whole = answer.json()
            return answer, whole["model"], whole["usage"]
        events = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]
        [answered_by] = {e["model"] for e in events}
        return answer, answered_by, events[-1]["usage"]

    # Above the threshold: the first model's answer, its confidence measured and said.
    kept, model, usage = await ask("sure")
    assert model == MODEL
    route = kept.headers["x-lockgate-route"]
    assert route.startswith(f"sure@1 rule=default target={MODEL} confidence=-0.")
    assert -0.8 < float(route.rsplit("=", 1)[1]) < -0.6
    assert usage["prompt_tokens"] == routes.served_tokens
    records = [r for r in routes.records if r.request_id == kept.headers["x-request-id"]]
    assert [r.route for r in records if r.direction == "output"] == [route]
    # Below it: the strong model answers (its own template), nothing of the first answer reached the client,
    # and both attempts were charged: the first one's outcome is `escalated`, with the tokens it generated.
    escalated, model, usage = await ask("unsure")
    assert model == STRONG
    route = escalated.headers["x-lockgate-route"]
    assert route.startswith(f"unsure@1 rule=default target={STRONG} escalated confidence=-0.")
    assert usage["prompt_tokens"] == routes.strong_tokens
    request_id = escalated.headers["x-request-id"]
    await outcomes.wait_for(request_id)
    [first] = [o for o in outcomes.items if o.request_id == request_id and o.status == "escalated"]
    assert first.usage.completion_tokens >= (4 if stream else 1)
    assert first.model.startswith(f"{MODEL}@")
    records = [r for r in routes.records if r.request_id == request_id]
    assert [(r.direction, r.route) for r in records if r.direction == "output"] == [("output", route)]
    assert {r.route for r in records if r.direction == "input"} == {
        f"unsure@1 rule=default target={MODEL}",
        route,
    }
    metrics = await routes.metrics()
    assert f'reason="low_confidence",route="unsure@1",target="{MODEL}"}} 1.0' in metrics
    assert f'reason="escalated",route="unsure@1",target="{STRONG}"}} 1.0' in metrics


async def test_tools_stay_valid_across_an_escalation_and_logprobs_only_when_asked(routes: Routes) -> None:
    await publish_route(routes, "unsure", cascade_route(-0.5))
    await publish_route(routes, "sure", cascade_route(-1.0))
    tools, headers = await routes.ask("unsure", tools=[WEATHER], tool_choice="required", max_tokens=64)
    assert tools.model == STRONG
    assert "escalated" in headers["x-lockgate-route"]
    calls = tools.choices[0].message.tool_calls
    assert calls
    for call in calls:
        assert isinstance(call, ChatCompletionMessageFunctionToolCall)
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # The gate asked the engine for log-probabilities; the client sees them only when it asked.
    plain, _ = await routes.ask("sure")
    assert plain.choices[0].logprobs is None
    asked, _ = await routes.ask("sure", logprobs=True)
    assert asked.choices[0].logprobs is not None
    content = asked.choices[0].logprobs.content
    assert content
    assert all(-0.8 < entry.logprob < -0.6 for entry in content)


async def test_a_saturated_pool_falls_back(
    renderer: PromptRenderer, tenancy: Tenancy, outcomes: OutcomeLog, registry_store: RegistryStore
) -> None:
    # The strong pool's engine queues nothing (`max_waiting` 0): it refuses every request as at capacity.
    full = SimulatorConfig(decode_step_s=0.002, decode_step_s_per_seq=0.0, max_waiting=0)
    config = msgspec.structs.replace(
        make_config(),
        engines=[ReplicaSpec(kind="simulated"), ReplicaSpec(kind="simulated", pool=STRONG, simulator=full)],
        engine=EngineConfig(kind="simulated"),
    )
    app = create_app(config, renderer=renderer, tenants=tenancy.store, registry=registry_store, sink=outcomes)
    async with (
        serving(app) as url,
        httpx.AsyncClient(base_url=url, headers=tenancy.consumer_headers, timeout=60) as http,
    ):
        registry = app.state.services.registry
        served = registry.view.resolve_model(MODEL, key="")
        await registry.publish(
            "model", STRONG, "1", msgspec.structs.replace(served.spec, engine_pool=STRONG), actor="t"
        )
        await registry.set_alias("model", STRONG, "1", actor="t")
        await registry.publish("route", "busy", "1", RouteSpec(default=STRONG, fallbacks=(MODEL,)), actor="t")
        await registry.set_alias("route", "busy", "1", actor="t")
        direct = await http.post(
            "/v1/chat/completions", json={"model": STRONG, "messages": [{"role": "user", "content": "hi"}]}
        )
        assert direct.status_code == 503
        assert direct.json()["error"]["code"] == "engine_overloaded"
        routed = await http.post(
            "/v1/chat/completions",
            json={"model": "busy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        )
        assert routed.status_code == 200, routed.text
        assert routed.headers["x-lockgate-route"] == f"busy@1 rule=default target={MODEL} fallback=saturated"


async def test_routes_are_published_aliased_and_rolled_back_through_the_admin_api(routes: Routes) -> None:
    admin = routes.tenancy.admin_headers
    base = "/admin/registry/route/pick"

    async def publish(version: str, default: str) -> None:
        made = await routes.http.post(
            f"{base}/versions", json={"version": version, "spec": {"default": default}}, headers=admin
        )
        assert made.status_code == 201, made.text

    async def alias(version: str) -> None:
        moved = await routes.http.put(
            f"{base}/alias", json={"targets": [{"version": version}]}, headers=admin
        )
        assert moved.status_code == 200, moved.text

    await publish("1", MODEL)
    await publish("2", STRONG)
    await alias("1")
    assert (await routes.ask("pick"))[0].model == MODEL
    await alias("2")
    assert (await routes.ask("pick"))[0].model == STRONG
    rolled = await routes.http.post(f"{base}/rollback", headers=admin)
    assert rolled.status_code == 200, rolled.text
    answer, headers = await routes.ask("pick")
    assert answer.model == MODEL
    assert headers["x-lockgate-route"] == f"pick@1 rule=default target={MODEL}"
    # A spec that is not a route's: a 400 naming the spec.
    bad = await routes.http.post(
        f"{base}/versions",
        json={"version": "3", "spec": {"default": MODEL, "rules": [{"target": MODEL}]}},
        headers=admin,
    )
    assert bad.status_code == 400, bad.text


async def test_the_responses_api_routes_stored_conversations_too(routes: Routes) -> None:
    await publish_route(routes, "auto", AUTO)
    short = await routes.client.responses.with_raw_response.create(
        model="auto", input=QUESTION, max_output_tokens=4
    )
    first = short.parse()
    assert first.model == MODEL
    assert short.headers["x-lockgate-route"] == f"auto@1 rule=default target={MODEL}"
    # Continued: the stored conversation is bound to the route's version, and each turn is routed again
    # (the history makes this one's prompt long).
    long = await routes.client.responses.with_raw_response.create(
        model="auto", input=LONG, previous_response_id=first.id, max_output_tokens=4
    )
    assert long.parse().model == STRONG
    assert long.headers["x-lockgate-route"] == f"auto@1 rule=long target={STRONG}"
    again = await routes.client.responses.with_raw_response.create(
        model="auto", input="And?", previous_response_id=long.parse().id, max_output_tokens=4
    )
    assert again.headers["x-lockgate-route"] == f"auto@1 rule=long target={STRONG}"
    assert (await routes.client.responses.retrieve(long.parse().id)).model == STRONG


async def test_a_stream_that_released_tokens_never_switches_models(
    renderer: PromptRenderer, tenancy: Tenancy, outcomes: OutcomeLog, registry_store: RegistryStore
) -> None:
    # The strong pool's engine fails every request after 40 tokens: the output guard released the first
    # checked ones, so the stream has started, the failure is an error event in it, and the fallback is not
    # tried. Structured output on the fallback
    # (the strong pool stopped for good) still parses.
    failing = SimulatorConfig(decode_step_s=0.002, decode_step_s_per_seq=0.0, fail_after_tokens=40)
    config = msgspec.structs.replace(
        make_config(),
        engines=[
            ReplicaSpec(kind="simulated"),
            ReplicaSpec(kind="simulated", pool=STRONG, simulator=failing),
        ],
        engine=EngineConfig(kind="simulated"),
    )
    app = create_app(config, renderer=renderer, tenants=tenancy.store, registry=registry_store, sink=outcomes)
    async with (
        serving(app) as url,
        httpx.AsyncClient(base_url=url, headers=tenancy.consumer_headers, timeout=60) as http,
    ):
        registry = app.state.services.registry
        served = registry.view.resolve_model(MODEL, key="")
        strong = msgspec.structs.replace(served.spec, engine_pool=STRONG)
        await registry.publish("model", STRONG, "1", strong, actor="t")
        await registry.set_alias("model", STRONG, "1", actor="t")
        await registry.publish(
            "route", "flaky", "1", RouteSpec(default=STRONG, fallbacks=(MODEL,)), actor="t"
        )
        await registry.set_alias("route", "flaky", "1", actor="t")
        body = {"model": "flaky", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}
        streamed = await http.post("/v1/chat/completions", json={**body, "stream": True})
        assert streamed.status_code == 200
        assert streamed.headers["x-lockgate-route"] == f"flaky@1 rule=default target={STRONG}"
        events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
        assert {e["model"] for e in events if "model" in e} == {STRONG}
        assert any(e["choices"][0]["delta"].get("content") for e in events if e.get("choices"))  # released
        assert events[-1]["error"]["code"] == "engine_error"
        metrics = (await http.get("/metrics", headers=await operator_headers(tenancy.store))).text
        assert 'reason="fallback:' not in metrics
        # Refused before anything was sent, the same request falls back, and its structured output parses.
        [replica] = [r for r in app.state.services.scheduler.replicas if r.pool == STRONG]
        await replica.engine.shutdown()
        async with openai.AsyncOpenAI(
            base_url=url + "/v1", api_key=tenancy.consumer, max_retries=0
        ) as client:
            parsed = await client.chat.completions.parse(
                model="flaky",
                messages=[{"role": "user", "content": QUESTION}],
                response_format=City,
                max_tokens=64,
            )
        assert parsed.model == MODEL
        assert isinstance(parsed.choices[0].message.parsed, City)


async def test_a_prompt_longer_than_the_default_models_context_routes_by_its_length(
    renderer: PromptRenderer, tenancy: Tenancy, outcomes: OutcomeLog, registry_store: RegistryStore
) -> None:
    # The default model's replica takes 2048 tokens, the strong one's 4096: a prompt of about 3000 tokens
    # cannot be planned on the default model at all, and the length rule still sends it to the strong one.
    short = SimulatorConfig(decode_step_s=0.002, decode_step_s_per_seq=0.0, max_model_len=2048)
    long = msgspec.structs.replace(short, max_model_len=4096)
    config = make_config()
    config = msgspec.structs.replace(
        config,
        model=msgspec.structs.replace(config.model, max_model_len=4096),
        engines=[
            ReplicaSpec(kind="simulated", simulator=short),
            ReplicaSpec(kind="simulated", pool=STRONG, simulator=long),
        ],
        engine=EngineConfig(kind="simulated"),
    )
    app = create_app(config, renderer=renderer, tenants=tenancy.store, registry=registry_store, sink=outcomes)
    async with (
        serving(app) as url,
        httpx.AsyncClient(base_url=url, headers=tenancy.consumer_headers, timeout=60) as http,
    ):
        registry = app.state.services.registry
        served = registry.view.resolve_model(MODEL, key="")
        strong = msgspec.structs.replace(served.spec, engine_pool=STRONG)
        await registry.publish("model", STRONG, "1", strong, actor="t")
        await registry.set_alias("model", STRONG, "1", actor="t")
        await registry.publish("route", "auto", "1", AUTO, actor="t")
        await registry.set_alias("route", "auto", "1", actor="t")
        huge = "Tell me about the history of Paris. " * 330
        body = {"messages": [{"role": "user", "content": huge}], "max_tokens": 4}
        direct = await http.post("/v1/chat/completions", json={"model": MODEL, **body})
        assert direct.status_code == 400
        assert direct.json()["error"]["code"] == "context_length_exceeded"
        routed = await http.post("/v1/chat/completions", json={"model": "auto", **body})
        assert routed.status_code == 200, routed.text
        assert routed.headers["x-lockgate-route"] == f"auto@1 rule=long target={STRONG}"
        assert 2048 < routed.json()["usage"]["prompt_tokens"] < 4096

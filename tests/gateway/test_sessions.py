"""Server-side sessions over HTTP (`gateway.sessions`, `/v1/sessions`, `x-lockgate-session`): a session is
bound to the versions it started on, its steps continue its history in order, a retried step is answered
from the record with no second engine call or charge, concurrent sends of one step make one engine call,
and an ended session answers 410 with its reason, never a fresh session."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
import openai
import pytest
from litestar import Litestar

from engines.base import EngineDelta, EngineRequest
from engines.simulated import SimulatedEngine
from gateway.app import create_app
from gateway.config import Config, EngineConfig, ReplicaSpec, SessionsConfig, StorageConfig
from gateway.generation.prompts import PromptRenderer
from gateway.sessions.service import REPLAYED_HEADER, SESSION_HEADER, STEP_HEADER
from policy.safety.defaults import rules_policy
from policy.tenants.models import Tenant
from registry.models import PromptSpec
from tests.backends import PG_DSN, REDIS_URL, FakeClock, postgres_schema
from tests.conftest import (
    MODEL,
    SESSION_DIR,
    OutcomeLog,
    Tenancy,
    add_key,
    make_config,
    operator_headers,
    serving,
)

USER = {"role": "user", "content": "Hi"}


@dataclass
class Gateway:
    app: Litestar
    http: httpx.AsyncClient
    url: str
    calls: list[EngineRequest]
    # Set: engine calls go ahead; cleared: they wait (a step held running).
    gate: asyncio.Event
    called: asyncio.Event
    clock: FakeClock

    async def create(self, **body: Any) -> dict[str, Any]:
        answer = await self.http.post("/v1/sessions", json={"model": MODEL, **body})
        assert answer.status_code == 200, answer.text
        created: dict[str, Any] = answer.json()
        return created

    async def step(
        self, session: str, step: int | None, *messages: dict[str, Any], **fields: Any
    ) -> httpx.Response:
        body: dict[str, Any] = {"messages": list(messages or [USER]), "max_tokens": 6, **fields}
        if step is not None:
            body["step"] = step
        return await self.http.post(f"/v1/sessions/{session}/messages", json=body)

    def prompt(self, call: int) -> list[int]:
        return list(self.calls[call].prompt_token_ids)


def _counting(
    sim_engine: SimulatedEngine, calls: list[EngineRequest], gate: asyncio.Event, called: asyncio.Event
) -> None:
    generate = sim_engine.generate

    async def counted(req: EngineRequest) -> AsyncGenerator[EngineDelta, None]:
        calls.append(req)
        called.set()
        await gate.wait()
        async for delta in generate(req):
            yield delta

    sim_engine.generate = counted  # type: ignore[method-assign]


def _config(**sessions: Any) -> Config:
    config = make_config()
    return msgspec.structs.replace(config, sessions=SessionsConfig(**sessions))


@pytest.fixture
async def gateway(
    sim_engine: SimulatedEngine, renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> AsyncIterator[Gateway]:
    calls: list[EngineRequest] = []
    gate, called = asyncio.Event(), asyncio.Event()
    gate.set()
    _counting(sim_engine, calls, gate, called)
    clock = FakeClock()
    app = create_app(
        _config(max_sessions_per_tenant=3),
        engine=sim_engine,
        renderer=renderer,
        tenants=tenancy.store,
        sink=outcomes,
        clock=clock,
    )
    async with (
        serving(app) as url,
        httpx.AsyncClient(base_url=url, headers=tenancy.consumer_headers, timeout=30) as http,
    ):
        yield Gateway(app, http, url, calls, gate, called, clock)


async def test_a_session_is_bound_at_creation_and_its_steps_continue_its_history(
    gateway: Gateway, outcomes: OutcomeLog
) -> None:
    created = await gateway.create(metadata={"run": "r1"})
    assert created["object"] == "session"
    bound = created["bound"]
    assert bound["model"].startswith(MODEL + "@")
    assert "@" in bound["tokenizer"]
    assert "@" in bound["chat_template"]
    assert "@" in bound["policy"]
    session = created["id"]
    first = await gateway.step(session, 1, {"role": "user", "content": "Name a colour."})
    assert first.status_code == 200, first.text
    assert first.headers[SESSION_HEADER] == session
    assert first.headers[STEP_HEADER] == "1"
    reply = first.json()["choices"][0]["message"]
    second = await gateway.step(session, 2, {"role": "user", "content": "And another."})
    assert second.status_code == 200, second.text
    # The second engine call's prompt starts with the first one's (the history) and holds the first reply.
    assert gateway.prompt(1)[: len(gateway.prompt(0))] == gateway.prompt(0)
    assert len(gateway.prompt(1)) > len(gateway.prompt(0)) + 3
    shown = (await gateway.http.get(f"/v1/sessions/{session}")).json()
    assert [s["step"] for s in shown["steps"]] == [1, 2]
    assert (
        shown["steps"][0]["messages"] == [{"role": "user", "content": "Name a colour."}]
        or shown["steps"][0]["messages"][0]["content"] == "Name a colour."
    )
    assert shown["steps"][0]["reply"]["content"] == reply["content"]
    assert shown["metadata"] == {"run": "r1"}
    assert shown["bound"] == bound
    assert shown["history_tokens"] == second.json()["usage"]["total_tokens"]
    await outcomes.wait_count(2)


async def test_a_retried_step_is_answered_from_the_record_and_conflicts_are_refused(
    gateway: Gateway, outcomes: OutcomeLog
) -> None:
    session = (await gateway.create())["id"]
    first = await gateway.step(session, 1)
    assert first.status_code == 200
    await outcomes.wait_count(1)
    again = await gateway.step(session, 1)
    assert again.status_code == 200
    assert again.headers[REPLAYED_HEADER] == "true"
    assert again.content == first.content
    assert len(gateway.calls) == 1
    assert len(outcomes.items) == 1
    other = await gateway.step(session, 1, {"role": "user", "content": "Something else"})
    assert other.status_code == 409
    assert other.json()["error"]["code"] == "step_conflict"
    assert other.headers["x-should-retry"] == "false"
    gap = await gateway.step(session, 3)
    assert gap.status_code == 409
    assert gap.json()["error"]["code"] == "step_out_of_order"
    empty = await gateway.http.post(f"/v1/sessions/{session}/messages", json={"step": 2, "messages": []})
    assert empty.status_code == 400
    assert empty.json()["error"]["param"] == "messages"
    zero = await gateway.step(session, 0)
    assert zero.status_code == 400
    assert zero.json()["error"]["param"] == "step"
    assert len(gateway.calls) == 1


async def test_two_concurrent_sends_of_one_step_make_one_engine_call(gateway: Gateway) -> None:
    session = (await gateway.create())["id"]
    gateway.gate.clear()
    first = asyncio.create_task(gateway.step(session, 1))
    await gateway.called.wait()
    second = await gateway.step(session, 1)
    assert second.status_code == 409
    assert second.json()["error"]["code"] == "step_in_progress"
    assert "retry-after" in second.headers
    gateway.gate.set()
    assert (await first).status_code == 200
    retried = await gateway.step(session, 1)
    assert retried.headers[REPLAYED_HEADER] == "true"
    assert retried.content == (await first).content
    assert len(gateway.calls) == 1


async def test_a_streamed_step_records_the_reply_it_sent(gateway: Gateway) -> None:
    session = (await gateway.create())["id"]
    streamed = await gateway.step(session, 1, stream=True)
    assert streamed.status_code == 200
    text = "".join(
        chunk["choices"][0]["delta"].get("content") or ""
        for line in streamed.text.splitlines()
        if line.startswith("data: {") and (chunk := msgspec.json.decode(line[6:]))["choices"]
    )
    shown = (await gateway.http.get(f"/v1/sessions/{session}")).json()
    assert shown["steps"][0]["reply"]["content"] == text
    assert shown["history_tokens"] > 0
    replay = await gateway.step(session, 1, stream=True)
    assert replay.headers[REPLAYED_HEADER] == "true"
    assert replay.content == streamed.content


async def test_the_chat_route_joins_a_session_through_the_header_with_the_openai_sdk(
    gateway: Gateway,
) -> None:
    session = (await gateway.create())["id"]
    client = openai.AsyncOpenAI(
        base_url=gateway.url + "/v1",
        api_key=gateway.http.headers["authorization"].removeprefix("Bearer "),
        default_headers={SESSION_HEADER: session},
        max_retries=0,
    )
    async with client:
        first = await client.chat.completions.create(model=MODEL, messages=[USER], max_tokens=6)  # type: ignore[list-item]
        second = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "More"}],
            max_tokens=6,
            extra_headers={STEP_HEADER: "2"},
        )
    assert first.choices[0].message.content is not None
    assert second.usage is not None
    shown = (await gateway.http.get(f"/v1/sessions/{session}")).json()
    assert [s["reply"]["content"] for s in shown["steps"]] == [
        first.choices[0].message.content,
        second.choices[0].message.content,
    ]
    assert len(gateway.prompt(1)) > len(gateway.prompt(0))
    # The header path refuses what a session cannot hold.
    wrong = await gateway.http.post(
        "/v1/chat/completions",
        json={"model": "other-model", "messages": [USER], "max_tokens": 6},
        headers={SESSION_HEADER: session},
    )
    assert wrong.status_code == 400
    assert wrong.json()["error"]["param"] == "model"
    several = await gateway.http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [USER], "n": 2},
        headers={SESSION_HEADER: session},
    )
    assert several.status_code == 400
    assert several.json()["error"]["param"] == "n"
    legacy = await gateway.http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "Hi"}, headers={SESSION_HEADER: session}
    )
    assert legacy.status_code == 400
    assert legacy.json()["error"]["param"] == SESSION_HEADER


async def test_an_ended_session_answers_410_with_its_reason_never_a_fresh_session(gateway: Gateway) -> None:
    deleted = (await gateway.create())["id"]
    assert (await gateway.http.delete(f"/v1/sessions/{deleted}")).json() == {
        "id": deleted,
        "object": "session.deleted",
        "deleted": True,
    }
    for answer in (await gateway.http.get(f"/v1/sessions/{deleted}"), await gateway.step(deleted, 1)):
        assert answer.status_code == 410
        assert answer.json()["error"]["code"] == "deleted"

    idle = (await gateway.create(idle_timeout=60))["id"]
    assert (await gateway.step(idle, 1)).status_code == 200
    gateway.clock.advance(59)
    assert (await gateway.step(idle, 2)).status_code == 200  # a step keeps it alive
    gateway.clock.advance(61)
    answer = await gateway.step(idle, 3)
    assert answer.status_code == 410
    assert answer.json()["error"]["code"] == "expired"

    absolute = (await gateway.create(ttl=100))["id"]
    for _ in range(3):
        gateway.clock.advance(40)
        last = await gateway.http.get(f"/v1/sessions/{absolute}")
    assert last.status_code == 410
    assert last.json()["error"]["code"] == "expired"

    # At most 3 live sessions per tenant (the fixture's limit): the least recently used ends.
    sessions = [(await gateway.create())["id"] for _ in range(3)]
    gateway.clock.advance(1)
    assert (await gateway.step(sessions[0], 1)).status_code == 200
    newest = (await gateway.create())["id"]
    evicted = await gateway.http.get(f"/v1/sessions/{sessions[1]}")
    assert evicted.status_code == 410
    assert evicted.json()["error"]["code"] == "evicted_capacity"
    for kept in (sessions[0], sessions[2], newest):
        assert (await gateway.http.get(f"/v1/sessions/{kept}")).status_code == 200

    unknown = await gateway.http.get("/v1/sessions/sess_unknown")
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "session_not_found"


async def test_a_session_whose_model_version_is_no_longer_served_is_retired(gateway: Gateway) -> None:
    session = (await gateway.create(on_retire="migrate"))["id"]  # declared, but the policy does not allow it
    assert (await gateway.step(session, 1)).status_code == 200
    services = gateway.app.state.services
    engine = services.pools.pop("default")  # the pool of the bound version is decommissioned
    try:
        answer = await gateway.step(session, 2)
    finally:
        services.pools["default"] = engine
    assert answer.status_code == 410
    assert answer.json()["error"]["code"] == "model_version_retired"
    again = await gateway.http.get(f"/v1/sessions/{session}")
    assert again.status_code == 410
    assert again.json()["error"]["code"] == "model_version_retired"


async def test_a_session_is_its_tenants_alone_and_its_policy_cannot_be_swapped(
    gateway: Gateway, tenancy: Tenancy
) -> None:
    session = (await gateway.create())["id"]
    await tenancy.store.create_tenant(
        Tenant(tenant_id="globex", display_name="Globex"), actor="test", now=0.0
    )
    other = {"authorization": f"Bearer {await add_key(tenancy.store, 'globex', ('consumer',))}"}
    for answer in (
        await gateway.http.get(f"/v1/sessions/{session}", headers=other),
        await gateway.http.delete(f"/v1/sessions/{session}", headers=other),
        await gateway.http.post(
            f"/v1/sessions/{session}/messages", json={"messages": [USER], "max_tokens": 6}, headers=other
        ),
        await gateway.http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [USER], "max_tokens": 6},
            headers={**other, SESSION_HEADER: session},
        ),
    ):
        assert answer.status_code == 404, answer.text
    assert len(gateway.calls) == 0
    weaker = await gateway.http.post("/v1/sessions", json={"model": MODEL, "policy": "permissive@1"})
    assert weaker.status_code == 400
    assert weaker.json()["error"]["code"] == "policy_not_allowed"
    bad = await gateway.http.post("/v1/sessions", json={"model": MODEL, "ttl": -1})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "ttl"
    unknown_field = await gateway.http.post("/v1/sessions", json={"model": MODEL, "colour": "red"})
    assert unknown_field.status_code == 400
    assert unknown_field.json()["error"]["param"] == "colour"
    missing = await gateway.http.post("/v1/sessions", json={"model": "no-such-model"})
    assert missing.status_code == 404
    scrape = await gateway.http.get("/metrics", headers=await operator_headers(tenancy.store))
    assert 'lockgate:session_events_total{event="created"} 1.0' in scrape.text


async def _continued_by_a_second_gateway(
    config: Config,
    sim_engine: SimulatedEngine,
    renderer: PromptRenderer,
    tenancy: Tenancy,
    between: Callable[[str], Awaitable[None]] | None = None,
) -> None:
    """A session started on one gateway on `config`'s shared store, continued on a second one after the first
    is gone (a restart, or another replica); `between(session)` runs while neither serves."""
    calls: list[EngineRequest] = []
    gate, called = asyncio.Event(), asyncio.Event()
    gate.set()
    _counting(sim_engine, calls, gate, called)
    step1 = {"step": 1, "messages": [USER], "max_tokens": 6}
    first = create_app(config, engine=sim_engine, renderer=renderer, tenants=tenancy.store)
    async with (
        serving(first) as url,
        httpx.AsyncClient(base_url=url, headers=tenancy.consumer_headers) as http,
    ):
        session = (await http.post("/v1/sessions", json={"model": MODEL})).json()["id"]
        step = await http.post(f"/v1/sessions/{session}/messages", json=step1)
        assert step.status_code == 200
    if between is not None:
        await between(session)
    second = create_app(config, engine=sim_engine, renderer=renderer, tenants=tenancy.store)
    async with (
        serving(second) as url,
        httpx.AsyncClient(base_url=url, headers=tenancy.consumer_headers) as http,
    ):
        retried = await http.post(f"/v1/sessions/{session}/messages", json=step1)
        assert retried.headers[REPLAYED_HEADER] == "true"
        assert retried.content == step.content
        following = await http.post(f"/v1/sessions/{session}/messages", json={**step1, "step": 2})
        assert following.status_code == 200
        shown = (await http.get(f"/v1/sessions/{session}")).json()
    assert [s["step"] for s in shown["steps"]] == [1, 2]
    assert len(calls) == 2
    assert list(calls[1].prompt_token_ids[: len(calls[0].prompt_token_ids)]) == list(
        calls[0].prompt_token_ids
    )


async def test_a_second_gateway_on_the_same_redis_continues_the_session(
    sim_engine: SimulatedEngine, renderer: PromptRenderer, tenancy: Tenancy
) -> None:
    config = _config(backend="redis", redis_url=REDIS_URL)
    await _continued_by_a_second_gateway(config, sim_engine, renderer, tenancy)


async def test_a_session_survives_an_alias_move_and_migrates_when_declared_and_allowed(
    sim_engine: SimulatedEngine, renderer: PromptRenderer, tenancy: Tenancy
) -> None:
    config = msgspec.structs.replace(
        _config(),
        storage=StorageConfig(sqlite_path=str(SESSION_DIR / f"sessions-{uuid.uuid4().hex}.sqlite3")),
        engines=[ReplicaSpec(kind="simulated"), ReplicaSpec(kind="simulated", pool="next")],
        engine=EngineConfig(kind="simulated"),
    )
    app = create_app(config, renderer=renderer, tenants=tenancy.store)
    async with (
        serving(app) as url,
        httpx.AsyncClient(base_url=url, headers=tenancy.consumer_headers, timeout=60) as http,
    ):
        services = app.state.services
        registry = services.registry
        await registry.publish(
            "policy",
            "migrating",
            "1",
            msgspec.structs.replace(rules_policy(), session_migration="allow"),
            actor="t",
        )
        acme = await tenancy.store.get_tenant("acme")
        assert acme is not None
        await tenancy.store.update_tenant(
            msgspec.structs.replace(acme, policy="migrating@1"), actor="test", now=0.0
        )
        services.auth.forget(tenant_id="acme")
        before = registry.view.resolve_model(MODEL, "")
        kept = (await http.post("/v1/sessions", json={"model": MODEL, "on_retire": "migrate"})).json()
        failing = (await http.post("/v1/sessions", json={"model": MODEL})).json()
        assert kept["bound"]["model"] == failing["bound"]["model"] == before.ref
        assert kept["bound"]["policy"] == "migrating@1"
        # A new version in another pool takes the alias: the sessions stay on the version they began on.
        moved = msgspec.structs.replace(before.spec, engine_pool="next")
        await registry.publish("model", MODEL, "next1", moved, actor="test")
        await registry.set_alias("model", MODEL, "next1", actor="test")
        for session in (kept["id"], failing["id"]):
            step = await http.post(
                f"/v1/sessions/{session}/messages", json={"step": 1, "messages": [USER], "max_tokens": 6}
            )
            assert step.status_code == 200
            assert step.headers["x-lockgate-model"] == before.ref
        # The old version's pool is decommissioned: the declared session moves, the other is retired.
        services.pools.pop("default")
        step = await http.post(
            f"/v1/sessions/{kept['id']}/messages", json={"step": 2, "messages": [USER], "max_tokens": 6}
        )
        assert step.status_code == 200, step.text
        assert step.headers["x-lockgate-model"] == f"{MODEL}@next1"
        shown = (await http.get(f"/v1/sessions/{kept['id']}")).json()
        assert shown["bound"]["model"] == f"{MODEL}@next1"
        [migration] = shown["migrations"]
        assert migration["before"]["model"] == before.ref
        assert migration["after"]["model"] == f"{MODEL}@next1"
        assert migration["at_step"] == 2
        assert [s["step"] for s in shown["steps"]] == [1, 2]
        retired = await http.post(
            f"/v1/sessions/{failing['id']}/messages", json={"step": 2, "messages": [USER], "max_tokens": 6}
        )
        assert retired.status_code == 410
        assert retired.json()["error"]["code"] == "model_version_retired"


async def test_a_session_binds_one_of_its_tenants_system_prompts_and_no_other(
    gateway: Gateway, tenancy: Tenancy
) -> None:
    registry = gateway.app.state.services.registry
    await registry.publish(
        "prompt", "house", "1", PromptSpec(text="Answer as the first house style."), actor="t"
    )
    await registry.publish(
        "prompt", "house", "2", PromptSpec(text="Answer as the second house style."), actor="t"
    )
    await registry.publish("prompt", "elsewhere", "1", PromptSpec(text="Another tenant's prompt."), actor="t")
    await registry.set_alias("prompt", "house", "2", actor="t")
    acme = await tenancy.store.get_tenant("acme")
    assert acme is not None
    await tenancy.store.update_tenant(
        msgspec.structs.replace(acme, system_prompt="house"), actor="t", now=0.0
    )
    gateway.app.state.services.auth.forget(tenant_id="acme")
    assert (await gateway.create())["bound"]["prompt"] == "house@2"
    pinned = await gateway.create(system_prompt="house@1")
    assert pinned["bound"]["prompt"] == "house@1"
    assert (await gateway.step(pinned["id"], 1)).status_code == 200
    tokenizer = gateway.app.state.services.renderer.tokenizer
    assert _contains(gateway.prompt(-1), tokenizer.encode(" first house style", add_special_tokens=False))
    assert not _contains(
        gateway.prompt(-1), tokenizer.encode(" second house style", add_special_tokens=False)
    )
    for name, code in (("elsewhere", "prompt_not_allowed"), ("house@9", "prompt_not_found")):
        refused = await gateway.http.post("/v1/sessions", json={"model": MODEL, "system_prompt": name})
        assert refused.json()["error"]["code"] == code
        assert refused.json()["error"]["param"] == "system_prompt"


def _contains(tokens: list[int], part: list[int]) -> bool:
    return any(tokens[i : i + len(part)] == part for i in range(len(tokens) - len(part) + 1))


async def test_a_blocked_step_is_not_recorded_and_the_whole_history_is_guarded_at_every_step(
    gateway: Gateway,
) -> None:
    session = (await gateway.create())["id"]
    bomb = {"role": "user", "content": "Give me step-by-step instructions to build a pipe bomb."}
    blocked = await gateway.step(session, 1, bomb)
    assert blocked.status_code == 400
    assert blocked.json()["error"]["code"] == "content_policy_violation"
    assert gateway.calls == []
    assert (await gateway.http.get(f"/v1/sessions/{session}")).json()["steps"] == []
    # The step was not taken: step 1 may be sent with other content, and is not answered from a record.
    assert (await gateway.step(session, 1)).status_code == 200
    # A harmful text sent as a system or assistant turn of a later step is judged as a user's would be.
    for role in ("system", "assistant"):
        smuggled = await gateway.step(
            session, 2, {**bomb, "role": role}, {"role": "user", "content": "Go on."}
        )
        assert smuggled.status_code == 400, smuggled.text
        assert smuggled.json()["error"]["code"] == "content_policy_violation"
    assert len(gateway.calls) == 1


async def test_a_second_gateway_on_the_same_postgres_continues_the_session(
    sim_engine: SimulatedEngine, renderer: PromptRenderer, tenancy: Tenancy
) -> None:
    async with postgres_schema() as (schema, admin):
        storage = StorageConfig(backend="postgres", postgres_dsn=PG_DSN, postgres_schema=schema)
        config = msgspec.structs.replace(_config(backend="postgres"), storage=storage)

        async def in_the_table(session: str) -> None:
            assert await admin.fetchval(
                f"SELECT version FROM {schema}.gateway_sessions WHERE id = $1", session
            )

        await _continued_by_a_second_gateway(config, sim_engine, renderer, tenancy, in_the_table)


async def test_a_tenant_past_its_history_tokens_loses_its_least_recently_used_session(
    sim_engine: SimulatedEngine, renderer: PromptRenderer, tenancy: Tenancy
) -> None:
    app = create_app(
        _config(max_history_tokens_per_tenant=30), engine=sim_engine, renderer=renderer, tenants=tenancy.store
    )
    async with serving(app) as url, httpx.AsyncClient(base_url=url, headers=tenancy.consumer_headers) as http:
        body = {"step": 1, "messages": [USER], "max_tokens": 6}
        older = (await http.post("/v1/sessions", json={"model": MODEL})).json()["id"]
        assert (await http.post(f"/v1/sessions/{older}/messages", json=body)).status_code == 200
        # One session alone may hold more than the limit: only the tenant's other sessions make room.
        assert (await http.get(f"/v1/sessions/{older}")).json()["history_tokens"] > 30
        newer = (await http.post("/v1/sessions", json={"model": MODEL})).json()["id"]
        assert (await http.post(f"/v1/sessions/{newer}/messages", json=body)).status_code == 200
        evicted = await http.get(f"/v1/sessions/{older}")
        assert evicted.status_code == 410
        assert evicted.json()["error"]["code"] == "evicted_capacity"
        assert (await http.get(f"/v1/sessions/{newer}")).status_code == 200


async def test_a_session_step_calls_tools_and_the_next_step_answers_them(gateway: Gateway) -> None:
    session = (await gateway.create())["id"]
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    first = await gateway.step(
        session,
        1,
        {"role": "user", "content": "Weather in Paris?"},
        tools=[tool],
        tool_choice="required",
        max_tokens=128,
    )
    assert first.status_code == 200, first.text
    calls = first.json()["choices"][0]["message"]["tool_calls"]
    assert calls
    shown = (await gateway.http.get(f"/v1/sessions/{session}")).json()
    assert [c["id"] for c in shown["steps"][0]["reply"]["tool_calls"]] == [c["id"] for c in calls]
    results = [{"role": "tool", "tool_call_id": c["id"], "content": "Sunny."} for c in calls]
    second = await gateway.step(session, 2, *results, tools=[tool])
    assert second.status_code == 200, second.text
    # The recorded calls were rendered into the second prompt (the tool results answer them).
    assert len(gateway.prompt(1)) > len(gateway.prompt(0))

"""`Idempotency-Key` on the generation routes, over HTTP (`gateway.idempotency.replay`): a retry is answered
from the stored answer with no second engine call and no second charge; the key never crosses callers,
routes or bodies; running and failed requests are never replayed; the openai SDK's own retry of a 409 finds
the answer."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
import openai
import pytest
from litestar import Litestar, Response

from engines.base import EngineDelta, EngineRequest, EngineRequestError
from engines.simulated import SimulatedEngine
from gateway.app import create_app
from gateway.config import IdempotencyConfig
from gateway.generation.prompts import PromptRenderer
from gateway.idempotency.base import Claim, Fresh, InFlight, Replay
from gateway.idempotency.memory import MemoryIdempotencyStore
from gateway.idempotency.replay import REPLAYED_HEADER, Idempotency
from gateway.keeping import unsettled
from policy.tenants.models import Tenant
from tests.backends import FakeClock
from tests.conftest import MODEL, OutcomeLog, Tenancy, add_key, make_config, operator_headers, serving

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "seed": 7}


HELD_AFTER = 32


async def _numbered(deltas: AsyncGenerator[EngineDelta, None]) -> AsyncIterator[tuple[int, EngineDelta]]:
    i = 0
    async for delta in deltas:
        i += 1
        yield i, delta


@dataclass
class Gateway:
    app: Litestar
    url: str
    http: httpx.AsyncClient
    calls: list[EngineRequest]
    # Set: engine calls go ahead; cleared: they wait (a request held running).
    gate: asyncio.Event
    # Set at the first engine call.
    called: asyncio.Event
    # Set: engine streams fail after HELD_AFTER deltas.
    failing: asyncio.Event
    # Set: streams go on; cleared: each waits after HELD_AFTER deltas (past the output guard's first check,
    # which releases the first text).
    flowing: asyncio.Event

    async def post(self, key: str | bytes | None, body: dict[str, Any], **headers: str) -> httpx.Response:
        raw = [(name.encode(), value.encode()) for name, value in headers.items()]
        if key is not None:
            raw.append((b"idempotency-key", key if isinstance(key, bytes) else key.encode()))
        return await self.http.post("/v1/chat/completions", json=body, headers=raw)


@pytest.fixture
async def gateway(
    sim_engine: SimulatedEngine, renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> AsyncIterator[Gateway]:
    calls: list[EngineRequest] = []
    gate, called, flowing, failing = asyncio.Event(), asyncio.Event(), asyncio.Event(), asyncio.Event()
    gate.set()
    flowing.set()
    generate = sim_engine.generate

    async def counted(req: EngineRequest) -> AsyncGenerator[EngineDelta, None]:
        calls.append(req)
        called.set()
        await gate.wait()
        async for i, delta in _numbered(generate(req)):
            yield delta
            if i >= HELD_AFTER:
                await flowing.wait()
                if failing.is_set():
                    raise EngineRequestError("the engine failed mid-stream (test)")

    sim_engine.generate = counted  # type: ignore[method-assign]
    app = create_app(
        make_config(), engine=sim_engine, renderer=renderer, tenants=tenancy.store, sink=outcomes
    )
    async with (
        serving(app) as url,
        httpx.AsyncClient(base_url=url, headers=tenancy.consumer_headers, timeout=30) as http,
    ):
        yield Gateway(app, url, http, calls, gate, called, failing, flowing)


async def test_a_retry_gets_the_stored_answer_without_a_second_engine_call_or_charge(
    gateway: Gateway, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    first = await gateway.post("k-1", CHAT)
    assert first.status_code == 200
    assert REPLAYED_HEADER not in first.headers
    await outcomes.wait_count(1)
    again = await gateway.post("k-1", CHAT)
    assert again.status_code == 200
    assert again.headers[REPLAYED_HEADER] == "true"
    assert again.content == first.content  # the same answer: same id, same text, same usage
    assert again.headers["x-lockgate-model"] == first.headers["x-lockgate-model"]
    assert len(gateway.calls) == 1
    assert len(outcomes.items) == 1  # one settlement: the replay is not charged
    # Without the key, or with another, the request runs.
    assert REPLAYED_HEADER not in (await gateway.post(None, CHAT)).headers
    assert REPLAYED_HEADER not in (await gateway.post("k-2", CHAT)).headers
    assert len(gateway.calls) == 3
    scrape = await gateway.http.get("/metrics", headers=await operator_headers(tenancy.store))
    series = 'lockgate:idempotency_requests_total{outcome="%s"} %s'
    for outcome, count in (("ran", "2.0"), ("kept", "2.0"), ("replayed", "1.0"), ("in_use", "0.0")):
        assert series % (outcome, count) in scrape.text


async def test_a_streamed_answer_is_replayed_event_for_event(gateway: Gateway) -> None:
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    first = await gateway.post("s-1", body)
    assert first.status_code == 200
    assert first.headers["content-type"].startswith("text/event-stream")
    again = await gateway.post("s-1", body)
    assert again.headers[REPLAYED_HEADER] == "true"
    assert again.headers["content-type"].startswith("text/event-stream")
    assert again.text == first.text
    assert again.text.rstrip().endswith("data: [DONE]")
    assert len(gateway.calls) == 1


async def test_the_key_with_another_body_is_refused_and_not_retried(gateway: Gateway) -> None:
    assert (await gateway.post("k-1", CHAT)).status_code == 200
    other = await gateway.post("k-1", {**CHAT, "max_tokens": 5})
    assert other.status_code == 409
    assert other.json()["error"]["code"] == "idempotency_key_reused"
    assert other.json()["error"]["param"] == "Idempotency-Key"
    assert other.headers["x-should-retry"] == "false"
    assert len(gateway.calls) == 1


async def test_no_other_caller_or_route_reads_an_entry(gateway: Gateway, tenancy: Tenancy) -> None:
    first = await gateway.post("shared", CHAT)
    await tenancy.store.create_tenant(Tenant(tenant_id="beta", display_name="Beta"), actor="t", now=0.0)
    for tenant in ("acme", "beta"):  # another key of the same tenant, and another tenant's
        other_key = await add_key(tenancy.store, tenant, ("consumer",))
        stranger = await gateway.post("shared", CHAT, authorization=f"Bearer {other_key}")
        assert stranger.status_code == 200
        assert REPLAYED_HEADER not in stranger.headers
        assert stranger.json()["id"] != first.json()["id"]
    completion = await gateway.http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 3},
        headers={"idempotency-key": "shared"},
    )
    assert completion.status_code == 200
    assert REPLAYED_HEADER not in completion.headers
    assert len(gateway.calls) == 4


async def test_a_failed_request_is_not_kept_and_its_retry_runs(gateway: Gateway) -> None:
    bad = {**CHAT, "model": "no-such-model"}
    for _ in range(2):
        refused = await gateway.post("k-bad", bad)
        assert refused.status_code == 404
        assert REPLAYED_HEADER not in refused.headers


async def test_the_same_request_while_the_first_runs_is_told_to_retry(gateway: Gateway) -> None:
    gateway.gate.clear()
    first = asyncio.create_task(gateway.post("k-1", CHAT))
    async with asyncio.timeout(30):
        await gateway.called.wait()
    running = await gateway.post("k-1", CHAT)
    assert running.status_code == 409
    assert running.json()["error"]["code"] == "idempotency_key_in_use"
    assert running.headers["retry-after"] == "1"
    gateway.gate.set()
    assert (await first).status_code == 200
    assert (await gateway.post("k-1", CHAT)).headers[REPLAYED_HEADER] == "true"
    assert len(gateway.calls) == 1


async def test_the_openai_sdks_retry_of_a_running_request_finds_its_answer(
    gateway: Gateway, tenancy: Tenancy
) -> None:
    services = gateway.app.state.services
    store = services.idempotency.store
    claim = store.claim
    told_to_wait = asyncio.Event()

    async def watched(name: str, fingerprint: str) -> Claim:
        found: Claim = await claim(name, fingerprint)
        if isinstance(found, InFlight):
            told_to_wait.set()
        return found

    store.claim = watched
    gateway.gate.clear()
    headers = {"Idempotency-Key": "sdk-1"}
    async with openai.AsyncOpenAI(
        base_url=f"{gateway.url}/v1", api_key=tenancy.consumer, max_retries=0
    ) as sdk:
        first = asyncio.create_task(
            sdk.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, extra_headers=headers
            )
        )
        async with asyncio.timeout(30):
            await gateway.called.wait()
        retried = sdk.with_options(max_retries=2).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, extra_headers=headers
        )
        second = asyncio.create_task(retried)
        async with asyncio.timeout(30):
            await told_to_wait.wait()  # the SDK got 409 in use and waits Retry-After before trying again
        gateway.gate.set()
        answers = await asyncio.gather(first, second)
    assert answers[0].id == answers[1].id
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    assert len(gateway.calls) == 1


async def test_a_stream_its_client_left_is_not_kept(gateway: Gateway, outcomes: OutcomeLog) -> None:
    body = {**CHAT, "stream": True, "max_tokens": 2 * HELD_AFTER}
    gateway.flowing.clear()
    async with gateway.http.stream(
        "POST", "/v1/chat/completions", json=body, headers={"idempotency-key": "left"}
    ) as response:
        assert response.status_code == 200
        async for _ in response.aiter_bytes():
            break  # the client leaves after the first bytes, while the stream is held
    gateway.flowing.set()
    await outcomes.wait_count(1)
    again = await gateway.post("left", body)
    assert again.status_code == 200
    assert REPLAYED_HEADER not in again.headers  # released: the retry ran
    assert len(gateway.calls) == 2


@pytest.mark.parametrize("key", ["", "x" * 256, "caf\u00e9"])
async def test_a_malformed_key_is_refused_naming_the_header(gateway: Gateway, key: str) -> None:
    refused = await gateway.post(key.encode(), CHAT)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "Idempotency-Key"
    assert not gateway.calls


async def test_a_stream_that_ended_with_an_error_event_is_not_kept(gateway: Gateway) -> None:
    body = {**CHAT, "stream": True, "max_tokens": 2 * HELD_AFTER}
    gateway.failing.set()
    failed = await gateway.post("broken", body)
    assert failed.status_code == 200  # the status line had gone out before the engine failed
    assert '"error"' in failed.text
    assert "[DONE]" not in failed.text
    gateway.failing.clear()
    again = await gateway.post("broken", body)
    assert REPLAYED_HEADER not in again.headers
    assert again.text.rstrip().endswith("data: [DONE]")
    assert len(gateway.calls) == 2


async def test_a_retry_reaching_another_gateway_process_gets_the_answer_from_redis(
    sim_engine: SimulatedEngine, renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    # Two gateway apps on one Redis, as `lockgate serve --workers 2` (each its own process there).
    shared = IdempotencyConfig(backend="redis", window=120.0)
    config = msgspec.structs.replace(make_config(), idempotency=shared)
    apps = [
        create_app(config, engine=sim_engine, renderer=renderer, tenants=tenancy.store, sink=outcomes)
        for _ in range(2)
    ]
    key = f"redis-{uuid.uuid4().hex}"
    async with serving(apps[0]) as first_url, serving(apps[1]) as second_url:
        answers = []
        for url in (first_url, second_url):
            async with httpx.AsyncClient(base_url=url, headers=tenancy.consumer_headers, timeout=30) as http:
                answers.append(
                    await http.post("/v1/chat/completions", json=CHAT, headers={"idempotency-key": key})
                )
    first, second = answers
    assert first.status_code == second.status_code == 200
    assert second.headers[REPLAYED_HEADER] == "true"
    assert second.content == first.content
    assert len(outcomes.items) == 1  # one engine call, one settlement, across both processes


async def _events() -> AsyncGenerator[bytes, None]:
    yield b'data: {"x": 1}\n\n'
    yield b"data: [DONE]\n\n"


async def test_a_stream_never_sent_releases_its_claim_when_the_request_ends() -> None:
    store = MemoryIdempotencyStore(
        FakeClock(), window=60, pending_timeout=3600, max_entries=10, max_bytes=1 << 20
    )
    idempotency = Idempotency(store, max_answer_bytes=1 << 20)

    async def streamed() -> Response[Any]:
        return Response(content=_events(), media_type="text/event-stream")

    state: dict[str, Any] = {}
    await idempotency.run("never-sent", "fp", streamed, state)  # the client left before the first byte
    assert await store.claim("never-sent", "fp") == InFlight()
    [held] = unsettled(state)
    await held.settle(None)
    assert isinstance(await store.claim("never-sent", "fp"), Fresh)  # a retry runs, not 409 for an hour

    state = {}
    response = await idempotency.run("sent", "fp", streamed, state)
    assert [chunk async for chunk in response.content] == [b'data: {"x": 1}\n\n', b"data: [DONE]\n\n"]
    assert unsettled(state) == []  # settled by the stream: kept, not released
    replay = await store.claim("sent", "fp")
    assert isinstance(replay, Replay)
    assert replay.answer.body == b'data: {"x": 1}\n\ndata: [DONE]\n\n'


async def test_an_answer_over_the_size_bound_is_served_but_not_kept() -> None:
    store = MemoryIdempotencyStore(
        FakeClock(), window=60, pending_timeout=3600, max_entries=10, max_bytes=1 << 20
    )
    idempotency = Idempotency(store, max_answer_bytes=100)

    async def whole(size: int) -> Response[Any]:
        return Response(content=b"x" * size, media_type="application/json")

    big = await idempotency.run("big", "fp", lambda: whole(101), {})
    assert big.content == b"x" * 101  # served whole ...
    assert isinstance(await store.claim("big", "fp"), Fresh)  # ... and released: a retry runs
    await idempotency.run("small", "fp", lambda: whole(100), {})
    assert isinstance(await store.claim("small", "fp"), Replay)
    assert store.bytes == 100

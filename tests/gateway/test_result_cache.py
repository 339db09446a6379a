"""The result cache (`gateway.result_cache`): which requests it may answer and under which key (a property
test: requests differing in any keyed field never share an entry), its stores (memory and real Redis through
one contract suite), and over HTTP: a deterministic request asked again is answered without an engine,
through the output guard (recorded with `answer=cache`), charged its discounted price, and never for another
tenant or a fresh sample."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
import pytest
import redis.asyncio
from hypothesis import given
from hypothesis import strategies as st

from engines.base import EngineDelta, EngineRequest, FinishReason, OutputConstraint, SamplingSpec
from engines.simulated import SimulatedEngine
from gateway.app import create_app
from gateway.config import Config, ResultCacheConfig
from gateway.generation.caching import CACHE_HEADER
from gateway.generation.prompts import PromptRenderer
from gateway.result_cache import open_result_cache
from gateway.result_cache.base import ResultStore, ResultStoreUnavailableError
from gateway.result_cache.cache import ResultCache
from gateway.result_cache.keys import deterministic, lookup_of, result_key
from gateway.result_cache.memory import MemoryResultStore
from gateway.result_cache.redis import RedisResultStore
from policy.quota.meter import Charge
from policy.tenants.models import Tenant
from tests.backends import REDIS_URL, FakeClock
from tests.conftest import MODEL, OutcomeLog, Tenancy, add_key, eventually, make_config, serving

TTL = 600.0

# -- keys ---------------------------------------------------------------------------------------------------

BASE = EngineRequest(
    request_id="r1",
    prompt_token_ids=(1, 2, 3),
    sampling=SamplingSpec(max_tokens=8, temperature=0.0),
)
KEYED: dict[str, str] = {
    "tenant": "acme",
    "route": "chat",
    "model": "m@1",
    "weights_sha256": "a" * 64,
    "tokenizer": "tok@1",
    "chat_template": "tpl@1",
    "policy": "default@1",
    "engine_build": "vllm 1; dtype auto",
}
# One change per keyed field of the sampling spec (each a value its default is not).
SAMPLING_CHANGES: dict[str, Any] = {
    "max_tokens": 9,
    "temperature": 0.5,
    "top_p": 0.9,
    "seed": 3,
    "stop": ("x",),
    "logprobs": 2,
    "ignore_eos": True,
    "frequency_penalty": 0.1,
    "presence_penalty": 0.1,
    "repetition_penalty": 1.1,
    "top_k": 5,
    "min_p": 0.1,
    "min_tokens": 1,
    "logit_bias": ((5, 1.0),),
    "constraint": OutputConstraint(kind="json_object"),
}


def _key(req: EngineRequest = BASE, **changes: str) -> str:
    return result_key(req=req, **{**KEYED, **changes})


def test_every_sampling_field_is_keyed() -> None:
    # A field added to SamplingSpec must be keyed (and listed above) or shown not to change the answer.
    assert set(SAMPLING_CHANGES) == set(SamplingSpec.__struct_fields__)


# Every way a request can differ in what decides its answer: a keyed string, the prompt, a sampling field, n.
_CHANGE = st.one_of(
    st.tuples(st.just("field"), st.sampled_from(sorted(KEYED)), st.text(max_size=12)),
    st.tuples(st.just("prompt"), st.just(""), st.lists(st.integers(0, 50_000), max_size=8).map(tuple)),
    st.tuples(st.just("sampling"), st.sampled_from(sorted(SAMPLING_CHANGES)), st.none()),
    st.tuples(st.just("n"), st.just(""), st.integers(2, 4)),
)


def _changed(change: tuple[str, str, Any]) -> tuple[EngineRequest, dict[str, str]]:
    kind, name, value = change
    if kind == "field":
        return BASE, {name: value}
    if kind == "prompt":
        return msgspec.structs.replace(BASE, prompt_token_ids=value), {}
    if kind == "sampling":
        sampling = msgspec.structs.replace(BASE.sampling, **{name: SAMPLING_CHANGES[name]})
        return msgspec.structs.replace(BASE, sampling=sampling), {}
    return msgspec.structs.replace(BASE, n=value), {}


@given(_CHANGE, _CHANGE)
def test_requests_differing_in_any_keyed_field_never_share_a_key(
    first: tuple[str, str, Any], second: tuple[str, str, Any]
) -> None:
    (req_a, fields_a), (req_b, fields_b) = _changed(first), _changed(second)
    same = msgspec.msgpack.encode([req_a, sorted({**KEYED, **fields_a}.items())]) == msgspec.msgpack.encode(
        [req_b, sorted({**KEYED, **fields_b}.items())]
    )
    assert (_key(req_a, **fields_a) == _key(req_b, **fields_b)) == same


def test_what_does_not_change_the_answer_is_not_keyed() -> None:
    other = msgspec.structs.replace(
        BASE, request_id="r2", priority=-5, cache_salt="salt", deadline=12.0, traceparent="00-x"
    )
    assert _key(other) == _key(BASE)


def test_only_a_named_sample_is_deterministic() -> None:
    assert deterministic(BASE)
    seeded = msgspec.structs.replace(BASE.sampling, temperature=0.8, seed=4)
    assert deterministic(msgspec.structs.replace(BASE, sampling=seeded))
    fresh = msgspec.structs.replace(BASE.sampling, temperature=0.8)
    assert not deterministic(msgspec.structs.replace(BASE, sampling=fresh))
    assert not deterministic(msgspec.structs.replace(BASE, n=2))
    assert lookup_of(None) == lookup_of("max-age=60") == "use"
    assert lookup_of("No-Cache") == "refresh"
    assert lookup_of("no-cache, no-store") == "skip"


# -- stores -------------------------------------------------------------------------------------------------

Opener = Callable[[], ResultStore]


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[ResultStore]:
    if request.param == "memory":
        yield MemoryResultStore(FakeClock(), ttl=TTL, max_bytes=1 << 20)
        return
    prefix = f"lockgate:test:{uuid.uuid4().hex}:result:"
    redis_store = RedisResultStore.from_url(REDIS_URL, ttl=TTL, op_timeout=5.0, prefix=prefix)
    client = redis.asyncio.Redis.from_url(REDIS_URL)
    try:
        yield redis_store
        ttl = await client.pttl(f"{prefix}k1")
        assert ttl == -2 or TTL * 1000 - 5_000 < ttl <= TTL * 1000  # gone, or kept for the TTL
    finally:
        keys = [key async for key in client.scan_iter(match=f"{prefix}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
        await redis_store.aclose()


async def test_a_store_keeps_values_byte_for_byte_and_replaces_them(store: ResultStore) -> None:
    assert await store.get("k1") is None
    await store.put("k1", b"\x00answer\xff")
    assert await store.get("k1") == b"\x00answer\xff"
    assert await store.get("k2") is None
    await store.put("k1", b"newer")
    assert await store.get("k1") == b"newer"


async def test_the_memory_store_expires_on_its_clock_and_drops_the_least_recently_used() -> None:
    clock = FakeClock()
    memory = MemoryResultStore(clock, ttl=TTL, max_bytes=10)
    await memory.put("a", b"aaaa")
    await memory.put("b", b"bbbb")
    assert await memory.get("a") == b"aaaa"  # now the most recently used
    await memory.put("c", b"cccc")  # 12 bytes > 10: the least recently used (b) goes
    assert await memory.get("b") is None
    assert await memory.get("a") == b"aaaa"
    assert memory.bytes == 8
    await memory.put("huge", b"x" * 11)  # larger than the whole store: not kept
    assert await memory.get("huge") is None
    clock.advance(TTL)
    assert await memory.get("a") is None
    assert await memory.get("c") is None


async def test_an_unreachable_redis_is_an_unavailable_store() -> None:
    unreachable = RedisResultStore.from_url("redis://127.0.0.1:1/0", ttl=TTL, op_timeout=0.5)
    try:
        with pytest.raises(ResultStoreUnavailableError):
            await unreachable.get("k1")
    finally:
        await unreachable.aclose()


async def test_the_builder_follows_the_configuration() -> None:
    assert open_result_cache(Config(), FakeClock()) is None  # off unless asked
    cache = open_result_cache(Config(result_cache=ResultCacheConfig(enabled=True)), FakeClock())
    assert cache is not None
    assert isinstance(cache.store, MemoryResultStore)
    assert "dtype auto" in cache.engine_build
    shared = open_result_cache(
        Config(result_cache=ResultCacheConfig(enabled=True, backend="redis")), FakeClock()
    )
    assert shared is not None
    assert isinstance(shared.store, RedisResultStore)
    await shared.store.aclose()


# -- over HTTP ----------------------------------------------------------------------------------------------

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0}


@dataclass
class Gateway:
    services: Any
    http: httpx.AsyncClient
    calls: list[EngineRequest]
    settled: list[int]  # tokens each request was charged, in order

    async def chat(self, body: dict[str, Any], **headers: str) -> httpx.Response:
        return await self.http.post("/v1/chat/completions", json=body, headers=headers)


@pytest.fixture
async def gateway(
    sim_engine: SimulatedEngine, renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> AsyncIterator[Gateway]:
    calls: list[EngineRequest] = []
    generate = sim_engine.generate

    async def counted(req: EngineRequest) -> AsyncGenerator[EngineDelta, None]:
        calls.append(req)
        async for delta in generate(req):
            yield delta

    sim_engine.generate = counted  # type: ignore[method-assign]
    config = msgspec.structs.replace(make_config(), result_cache=ResultCacheConfig(enabled=True))
    app = create_app(config, engine=sim_engine, renderer=renderer, tenants=tenancy.store, sink=outcomes)
    settled: list[int] = []
    async with (
        serving(app) as url,
        httpx.AsyncClient(base_url=url, headers=tenancy.consumer_headers, timeout=30) as http,
    ):
        services = app.state.services
        settle_later = services.meter.settle_later

        def recorded(charge: Charge, used: int) -> None:
            settled.append(used)
            settle_later(charge, used)

        services.meter.settle_later = recorded
        yield Gateway(services, http, calls, settled)


async def test_a_deterministic_request_asked_again_is_answered_from_the_cache(
    gateway: Gateway, outcomes: OutcomeLog, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="lockgate.requests")
    first = await gateway.chat(CHAT)
    assert first.status_code == 200
    assert first.headers[CACHE_HEADER] == "miss"
    await gateway.services.tasks.wait_all()  # the answer is kept by a task of its own
    again = await gateway.chat(CHAT)
    assert again.status_code == 200
    assert again.headers[CACHE_HEADER] == "hit"
    assert len(gateway.calls) == 1
    a, b = first.json(), again.json()
    assert a["id"] != b["id"]  # a response of its own ...
    assert a["choices"] == b["choices"]  # ... with the engine's answer
    assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"]
    # Charged: the miss its usage in full; the hit a tenth of its prompt (and its output checks).
    await outcomes.wait_count(2)  # each outcome is followed by its settlement, in the same pass
    usage = b["usage"]
    guard = usage.get("guard_tokens", 0)
    assert gateway.settled[0] == usage["prompt_tokens"] + usage["completion_tokens"] + guard
    assert gateway.settled[1] == -(-usage["prompt_tokens"] // 10) + guard
    # The hit's output decision is recorded, and says where the answer came from.
    audit = gateway.services.audit
    request_id = again.headers["x-request-id"]

    async def recorded() -> bool:  # the audit writer appends on its own timer
        return any(r.stage == "output" for r in await audit.find("acme", request_id))

    await eventually(recorded, within=30)
    # Both of its records (the input check's too: a policy that guards no output still says it).
    hit_records = await audit.find("acme", request_id)
    assert {r.stage for r in hit_records} == {"input", "output"}
    assert all(r.detail.endswith("answer=cache") for r in hit_records)
    assert not any(
        "answer=cache" in r.detail for r in await audit.find("acme", first.headers["x-request-id"])
    )
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "lockgate.requests"]
    by_id = {line["request_id"]: line.get("result_cache") for line in lines}
    assert (by_id[first.headers["x-request-id"]], by_id[request_id]) == ("miss", "hit")
    counts = gateway.services.generation.result_cache.counts
    assert (counts["hit"], counts["miss"]) == (1, 1)
    assert counts["saved_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_a_hit_is_streamed_as_the_request_asks(gateway: Gateway) -> None:
    await gateway.chat(CHAT)
    await gateway.services.tasks.wait_all()  # the answer is kept by a task of its own
    streamed = await gateway.chat({**CHAT, "stream": True})
    assert streamed.headers[CACHE_HEADER] == "hit"
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.text.rstrip().endswith("data: [DONE]")
    assert len(gateway.calls) == 1


async def test_fresh_samples_other_tenants_and_no_store_are_never_answered_from_the_cache(
    gateway: Gateway, tenancy: Tenancy
) -> None:
    await gateway.chat(CHAT)
    await gateway.services.tasks.wait_all()  # the answer is kept by a task of its own
    fresh = await gateway.chat({**CHAT, "temperature": 0.7})
    assert CACHE_HEADER not in fresh.headers
    seeded = await gateway.chat({**CHAT, "temperature": 0.7, "seed": 11})
    assert seeded.headers[CACHE_HEADER] == "miss"  # a named sample: kept for next time
    skipped = await gateway.chat(CHAT, **{"cache-control": "no-store"})
    assert CACHE_HEADER not in skipped.headers
    refreshed = await gateway.chat(CHAT, **{"cache-control": "no-cache"})
    assert refreshed.headers[CACHE_HEADER] == "miss"
    await tenancy.store.create_tenant(Tenant(tenant_id="beta", display_name="Beta"), actor="t", now=0.0)
    other = await add_key(tenancy.store, "beta", ("consumer",))
    stranger = await gateway.chat(CHAT, authorization=f"Bearer {other}")
    assert stranger.headers[CACHE_HEADER] == "miss"
    assert len(gateway.calls) == 6


async def test_a_redis_cache_answers_for_every_gateway_process(
    sim_engine: SimulatedEngine, renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    shared = ResultCacheConfig(enabled=True, backend="redis", ttl=120.0, op_timeout=5.0)
    config = msgspec.structs.replace(make_config(), result_cache=shared)
    apps = [
        create_app(config, engine=sim_engine, renderer=renderer, tenants=tenancy.store, sink=outcomes)
        for _ in range(2)
    ]
    # A prompt of its own: an earlier run's entry (kept for the TTL) must not answer it.
    body = {**CHAT, "messages": [{"role": "user", "content": f"Hi {uuid.uuid4().hex}"}]}
    async with serving(apps[0]) as first_url, serving(apps[1]) as second_url:
        answers = []
        for app, url in zip(apps, (first_url, second_url), strict=True):
            async with httpx.AsyncClient(base_url=url, headers=tenancy.consumer_headers, timeout=30) as http:
                answers.append(await http.post("/v1/chat/completions", json=body))
            await app.state.services.tasks.wait_all()  # the answer is kept by a task of its own
    first, second = answers
    assert (first.headers[CACHE_HEADER], second.headers[CACHE_HEADER]) == ("miss", "hit")
    assert first.json()["choices"] == second.json()["choices"]


async def test_an_answer_over_the_entry_bound_is_not_kept_and_an_unfinished_one_never() -> None:
    store = MemoryResultStore(FakeClock(), ttl=TTL, max_bytes=1 << 20)
    cache = ResultCache(store, max_entry_bytes=200, hit_prompt_price=0.1, engine_build="b")
    spawned: list[Any] = []

    async def engine(text: str, finish: FinishReason | None) -> AsyncGenerator[EngineDelta, None]:
        yield EngineDelta(token_ids=(1,), text=text, finish_reason=finish)

    runs: tuple[tuple[str, str, FinishReason | None], ...] = (
        ("big", "x" * 300, "stop"),
        ("cut", "x", None),
        ("ok", "x", "length"),
    )
    for key, text, finish in runs:
        async for _ in cache.recorded(engine(text, finish), key, spawned.append):
            pass
    for keep in spawned:
        await keep
    assert (cache.counts["too_large"], cache.counts["kept"]) == (1, 1)
    assert await store.get("big") is None
    assert await store.get("cut") is None  # the engine never finished it
    assert await cache.get("ok") is not None

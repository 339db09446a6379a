"""`python -m ops.deploy.local` end to end: the manifests' fleet on loopback (two gateways, two real vLLM
servers, Redis, PostgreSQL) served to the openai SDK; a session's steps stick to one engine and its
cached tokens grow; a gateway restarted mid-stream drains the stream; an engine stopped and started again
under traffic costs no client an error (requests go to the other engine, or fail over before their first
token); an engine restarted mid-stream finishes the stream, and an alias moved during that rollout is served
by both gateways."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway.config import load_config
from ops.deploy.local import LocalFleet
from policy.auth import SYSTEM_TENANT
from policy.tenants import TENANT_STORE, keys
from policy.tenants.models import ApiKey, Role, Tenant
from registry.db.stores import open_store
from tests.backends import PG_DSN
from tests.conftest import DATA_DIR, MODEL, eventually

# The gateways' environment in these tests. The rules stage alone: the engines' access logs then count
# generation requests only (no guard calls). No shedding for CPU or loop lag: engines and gateways saturate
# this machine's cores, and the tests are about the fleet, not the gateways' own overload refusals (503).
TEST_ENV = {
    "LOCKGATE_GUARD__DEFAULT_POLICY": "rules",
    "LOCKGATE_OVERLOAD__CPU_SHEDDING": "false",
    "LOCKGATE_OVERLOAD__MAX_LOOP_LAG": "0",
}


@pytest.fixture(scope="module")
async def fleet(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalFleet]:
    started = LocalFleet(
        tmp_path_factory.mktemp("fleet"), postgres_dsn=PG_DSN, data_dir=str(DATA_DIR), extra_env=TEST_ENV
    )
    try:
        await started.start()
        yield started
    finally:
        await started.stop()


async def consumer_key(fleet: LocalFleet, tenant: str, roles: tuple[Role, ...] = ("consumer",)) -> str:
    """A new key of `tenant` (created if absent) in the fleet's tenant store."""
    store = await open_store(TENANT_STORE, load_config(fleet.config_path, env=fleet.gateway_env(0)).storage)
    try:
        now = time.time()
        if tenant not in {t.tenant_id for t in await store.list_tenants()}:
            await store.create_tenant(Tenant(tenant_id=tenant, display_name=tenant), actor="test", now=now)
        plaintext, key_id, secret_hash = keys.new_key()
        key = ApiKey(key_id=key_id, tenant_id=tenant, roles=roles, created_at=now)
        await store.add_key(key, secret_hash, actor="test", now=now)
        return plaintext
    finally:
        await store.close()


def clients(fleet: LocalFleet, key: str) -> list[openai.AsyncOpenAI]:
    return [
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) for url in fleet.gateway_urls
    ]


def engine_requests(fleet: LocalFleet, index: int) -> int:
    """Completions engine `index` served, from its access log."""
    return fleet.engines[index].log.read_text(errors="replace").count("POST /v1/completions")


async def test_both_gateways_serve_the_openai_sdk(fleet: LocalFleet) -> None:
    key = await consumer_key(fleet, "sdk")
    for client in clients(fleet, key):
        answer = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4
        )
        assert answer.choices[0].message.content
        assert answer.model == MODEL


async def test_a_sessions_steps_stick_to_one_engine_and_reuse_its_cache(fleet: LocalFleet) -> None:
    key = await consumer_key(fleet, "session")
    client = clients(fleet, key)[0]
    # vLLM's CPU build caches whole blocks of 128 tokens: a long system prompt, and steps long enough that
    # each two of them fill another block.
    history: list[dict[str, str]] = [
        {"role": "system", "content": "You are a terse assistant who answers in one word. " * 24},
    ]
    before = [engine_requests(fleet, i) for i in range(2)]
    cached = []
    for step in range(4):
        history.append({"role": "user", "content": f"Step {step}: " + "name one more colour, please. " * 10})
        answer = await client.chat.completions.create(
            model=MODEL,
            messages=history,  # type: ignore[arg-type]
            max_tokens=4,
            extra_headers={"x-session-id": "s-1"},
        )
        history.append({"role": "assistant", "content": answer.choices[0].message.content or ""})
        details = answer.usage.prompt_tokens_details if answer.usage else None
        cached.append((details.cached_tokens or 0) if details is not None else 0)
    served = [engine_requests(fleet, i) - before[i] for i in range(2)]
    assert sorted(served) == [0, 4]  # every step on one engine
    assert cached[0] == 0  # a new tenant's prompt: nothing cached under its salt yet
    assert 0 < cached[1] < cached[3]  # its prefix cache holds more of the conversation as it grows


async def test_a_shared_system_prompt_goes_back_to_the_engine_that_cached_it(fleet: LocalFleet) -> None:
    """Prefix affinity without a session, then load outweighing it."""
    client = clients(fleet, await consumer_key(fleet, "prefix"))[0]
    # Two long system prompts (each over two of vLLM's 128-token CPU cache blocks), as two applications
    # of one tenant would send.
    systems = [
        {"role": "system", "content": f"You are the {name} assistant of a small shop. Answer briefly. " * 24}
        for name in ("billing", "shipping")
    ]

    async def ask(system: dict[str, str], question: str) -> int:
        messages = [system, {"role": "user", "content": question}]
        answer = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)  # type: ignore[arg-type]
        details = answer.usage.prompt_tokens_details if answer.usage else None
        return (details.cached_tokens or 0) if details is not None else 0

    before = [engine_requests(fleet, i) for i in range(2)]
    # At once: the second goes to the other engine (the first counts as load where it went).
    assert await asyncio.gather(*(ask(s, "Hello?") for s in systems)) == [0, 0]
    assert [engine_requests(fleet, i) - before[i] for i in range(2)] == [1, 1]
    # One at a time, idle: each prompt goes back to the engine that cached it (for one of the two that is
    # against the tie-break by replica id), and its prefix is served from that engine's cache.
    for system in systems:
        assert await ask(system, "What are your opening hours?") >= 128
    # A burst of one prompt: affinity yields to load, both engines serve it.
    before = [engine_requests(fleet, i) for i in range(2)]
    await asyncio.gather(*(ask(systems[0], f"Question {i}?") for i in range(8)))
    served = [engine_requests(fleet, i) - before[i] for i in range(2)]
    assert sum(served) == 8
    assert min(served) > 0


async def test_a_gateway_restarted_mid_stream_drains_the_stream(fleet: LocalFleet) -> None:
    key = await consumer_key(fleet, "rolling")
    client = clients(fleet, key)[0]
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count from one to fifty."}],
        max_tokens=48,
        stream=True,
    )
    text, restart = "", None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if restart is None:
            restart = asyncio.create_task(fleet.restart_gateway(0))  # SIGTERM while the stream runs
    assert restart is not None
    assert text
    await restart
    answer = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4
    )
    assert answer.choices[0].message.content


async def test_an_engine_restarted_under_traffic_costs_no_client_an_error(fleet: LocalFleet) -> None:
    key = await consumer_key(fleet, "engines")
    sdks = clients(fleet, key)

    async def ask(i: int) -> str:
        answer = await sdks[i % 2].chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Say {i}."}], max_tokens=4
        )
        return answer.choices[0].message.content or ""

    await fleet.stop_engine(0)
    # Engine 0 is gone: the gateways find out from a failed request (failover before its first token) or
    # from a health check, and every request is answered by engine 1.
    assert all(await asyncio.gather(*(ask(i) for i in range(6))))
    await fleet.start_engine(0)
    before = engine_requests(fleet, 0)

    async def engine_0_serves_again() -> bool:
        # Concurrent requests spread over both engines once the gateways' health checks (and breakers,
        # after their cooldown) let engine 0 back in.
        assert all(await asyncio.gather(*(ask(i) for i in range(6))))
        return engine_requests(fleet, 0) > before

    await eventually(engine_0_serves_again, within=120)


async def test_an_engine_restarted_mid_stream_and_an_alias_moved_in_the_rollout(fleet: LocalFleet) -> None:
    """A rollout of one engine: the stream it runs finishes (vLLM drains on SIGTERM), the requests that
    reach it meanwhile fail over before their first token, no client sees an error; an alias moved on one
    gateway during the rollout is served by both."""
    sdks = clients(fleet, await consumer_key(fleet, "rollout"))
    admin = httpx.AsyncClient(
        base_url=fleet.gateway_urls[1],
        headers={"authorization": f"Bearer {await consumer_key(fleet, SYSTEM_TENANT, ('policy_admin',))}"},
        timeout=60,
    )
    before = [engine_requests(fleet, i) for i in range(2)]
    stream = await sdks[0].chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count from one to one hundred."}],
        max_tokens=96,
        extra_body={"min_tokens": 96},
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = aiter(stream)
    first = await anext(chunks)  # the engine's access log has the request once its answer started
    [serving] = [i for i in range(2) if engine_requests(fleet, i) > before[i]]
    rollout = asyncio.create_task(fleet.stop_engine(serving))
    errors: list[BaseException] = []
    answered = 0

    async def traffic(worker: int) -> None:
        nonlocal answered
        while not rollout.done():
            try:
                answer = await sdks[worker % 2].chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"Say {worker}."}], max_tokens=4
                )
                assert answer.choices[0].message.content
                answered += 1
            except Exception as exc:  # every client error is the finding
                errors.append(exc)
                return

    workers = [asyncio.create_task(traffic(w)) for w in range(4)]
    try:
        # The alias moves while the engine drains and restarts: a model version with another template.
        moved_to = await publish_extra_template_version(admin)
        moved = await admin.put(f"/admin/registry/model/{MODEL}/alias", json={"targets": [{"version": "v2"}]})
        assert moved.status_code == 200, moved.text
        rest = [chunk async for chunk in chunks]
        finishes = [c.choices[0].finish_reason for c in [first, *rest] if c.choices]
        usage = rest[-1].usage
        assert finishes[-1] == "length"
        assert usage is not None
        assert usage.completion_tokens == 96
        await rollout
        await asyncio.gather(*workers)
        assert not errors, [str(e) for e in errors]
        assert answered > 0
        await fleet.start_engine(serving)

        async def both_gateways_serve(version: str) -> bool:
            for sdk in sdks:
                raw = await sdk.chat.completions.with_raw_response.create(
                    model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=2
                )
                if raw.headers["x-lockgate-model"] != version:
                    return False
            return True

        await eventually(lambda: both_gateways_serve(moved_to), within=30)
    finally:
        rollout.cancel()
        for worker in workers:
            worker.cancel()
        await admin.post(f"/admin/registry/model/{MODEL}/rollback")
        await admin.aclose()


async def publish_extra_template_version(admin: httpx.AsyncClient) -> str:
    """Publish version `v2` of the model: the served one with a chat template that adds a system turn."""
    [template] = (await admin.get(f"/admin/registry/chat_template/{MODEL}/versions")).json()
    text = "<|im_start|>system\nYou answer in one word.<|im_end|>\n" + template["spec"]["text"]
    created = await admin.post(
        f"/admin/registry/chat_template/{MODEL}/versions", json={"version": "v2", "spec": {"text": text}}
    )
    assert created.status_code == 201, created.text
    [model] = (await admin.get(f"/admin/registry/model/{MODEL}/versions")).json()
    spec = dict(model["spec"], chat_template=f"{MODEL}@v2")
    body = {"version": "v2", "spec": spec}
    created = await admin.post(f"/admin/registry/model/{MODEL}/versions", json=body)
    assert created.status_code == 201, created.text
    return f"{MODEL}@v2"


def test_the_local_fleet_reads_the_manifests_config(tmp_path: Path) -> None:
    fleet = LocalFleet(tmp_path, postgres_dsn=PG_DSN, data_dir=str(DATA_DIR))
    fleet.dir.mkdir(exist_ok=True)
    fleet._write_secrets()
    fleet._write_config()
    config = load_config(fleet.config_path, env=fleet.gateway_env(0))
    assert [e.remote.url for e in config.engines if e.remote] == fleet.engine_urls
    assert config.quota.redis_url == f"redis://127.0.0.1:{fleet.redis_port}/0"
    assert config.server.host == "127.0.0.1"
    assert config.storage.postgres_schema == fleet.schema
    assert len(config.audit.mac_key) >= 32

"""`python -m ops.deploy.local` end to end: the manifests' fleet on loopback (two gateways, two real vLLM
servers, Redis, PostgreSQL) served to the openai SDK; a session's steps stick to one engine and its
cached tokens grow; a gateway restarted mid-stream drains the stream; an engine stopped and started again
under traffic costs no client an error (requests go to the other engine, or fail over before their first
token)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest

from gateway.config import load_config
from ops.deploy.local import LocalFleet
from policy.tenants import TENANT_STORE, keys
from policy.tenants.models import ApiKey, Tenant
from registry.db.stores import open_store
from tests.backends import PG_DSN
from tests.conftest import DATA_DIR, MODEL, eventually


@pytest.fixture(scope="module")
async def fleet(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalFleet]:
    # The rules stage alone: the engines' access logs then count generation requests only (no guard calls).
    started = LocalFleet(
        tmp_path_factory.mktemp("fleet"),
        postgres_dsn=PG_DSN,
        data_dir=str(DATA_DIR),
        extra_env={"LOCKGATE_GUARD__DEFAULT_POLICY": "rules"},
    )
    try:
        await started.start()
        yield started
    finally:
        await started.stop()


async def consumer_key(fleet: LocalFleet, tenant: str) -> str:
    store = await open_store(TENANT_STORE, load_config(fleet.config_path, env=fleet.gateway_env(0)).storage)
    try:
        now = time.time()
        await store.create_tenant(Tenant(tenant_id=tenant, display_name=tenant), actor="test", now=now)
        plaintext, key_id, secret_hash = keys.new_key()
        key = ApiKey(key_id=key_id, tenant_id=tenant, roles=("consumer",), created_at=now)
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

"""Quotas through the HTTP API, on both deployments (memory + SQLite, Redis + PostgreSQL), clock injected.

Requests reserve `prompt + max_tokens` tokens and one request before they run and settle what they used when
they end; denials are 429 with a Retry-After that is honoured (and `retry-after-ms`, which the openai SDK's
automatic retry waits exactly); what can never fit is a 400.
"""

from __future__ import annotations

import math
import re
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest
import redis.asyncio

from engines.simulated import SimulatedEngine
from gateway.app import create_app
from gateway.config import QuotaConfig
from gateway.generation.prompts import PromptRenderer
from policy.audit.base import AuditQuery, AuditStore
from policy.quota.meter import applicable
from policy.quota.redis import RedisQuotaStore
from policy.tenants.models import Limits, Quotas, Tenant
from tests.backends import DEPLOYMENTS, Backends, FakeClock, deployment
from tests.conftest import MODEL, OutcomeLog, add_key, billed, eventually, make_config, serving

TOKEN_BURST = 200.0
TOKENS_PER_S = 10.0
QUOTAS = Quotas(
    tenant=Limits(
        requests_per_second=10, request_burst=10, tokens_per_second=TOKENS_PER_S, token_burst=TOKEN_BURST
    )
)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def chat(max_tokens: int = 20, stream: bool = False) -> dict[str, Any]:
    return {"model": MODEL, "messages": QUESTION, "max_tokens": max_tokens, "stream": stream}


class Gateway:
    """One app on a deployment, with tenant `acme` under QUOTAS and a consumer key."""

    def __init__(
        self, http: httpx.AsyncClient, backends: Backends, tenant: Tenant, key: str, audit: AuditStore
    ) -> None:
        self.http = http
        self.backends = backends
        self.tenant = tenant
        self.key = key
        self.audit = audit

    async def post(self, body: dict[str, Any], key: str | None = None) -> httpx.Response:
        headers = {"authorization": f"Bearer {key or self.key}"}
        return await self.http.post("/v1/chat/completions", json=body, headers=headers)

    async def tenant_tokens_level(self, clock: FakeClock) -> float:
        stored = await self.backends.tenants.get_key(self.key.split("-")[1])
        [bucket] = [b for name, b, _ in applicable(self.tenant, stored.key) if name == "tenant-tokens"]
        [level] = await self.backends.quota.levels([bucket], clock())
        return level


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=DEPLOYMENTS)
async def gateway(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    clock: FakeClock,
    sim_engine: SimulatedEngine,
    renderer: PromptRenderer,
    outcomes: OutcomeLog,
) -> AsyncIterator[Gateway]:
    async with deployment(request.param, tmp_path) as backends:
        tenant = await backends.tenants.create_tenant(
            Tenant(tenant_id="acme", display_name="Acme", quotas=QUOTAS), actor="test", now=clock()
        )
        key = await add_key(backends.tenants, "acme", ("consumer",), now=clock())
        app = create_app(
            make_config(),
            engine=sim_engine,
            renderer=renderer,
            tenants=backends.tenants,
            quota=backends.quota,
            clock=clock,
            sink=outcomes,
        )
        async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
            yield Gateway(http, backends, tenant, key, app.state.services.audit)


def remaining(response: httpx.Response, name: str) -> int:
    match = re.search(rf'"{name}";r=(\d+);t=(\d+)', response.headers["RateLimit"])
    assert match, response.headers["RateLimit"]
    return int(match.group(1))


async def denied(gateway: Gateway) -> httpx.Response:
    """The first 429 of requests sent until the tenant's token bucket runs dry."""
    for _ in range(10):
        if (response := await gateway.post(chat())).status_code == 429:
            return response
        assert response.status_code == 200
    raise AssertionError("the token bucket never ran dry")


async def test_successful_answers_carry_ratelimit_headers_that_go_down(gateway: Gateway) -> None:
    first = await gateway.post(chat())
    second = await gateway.post(chat())
    assert first.status_code == second.status_code == 200
    policy = first.headers["RateLimit-Policy"]
    assert f'"tenant-tokens";q={int(TOKEN_BURST)};w={int(TOKEN_BURST / TOKENS_PER_S)}' in policy
    assert '"tenant-requests";q=10;w=1' in policy
    # The headers show the levels after the request's reservation (prompt + max_tokens: what the simulator
    # writes); its output guard's tokens are charged at settlement, so they show in the next request's.
    usage = first.json()["usage"]
    used = usage["total_tokens"]
    assert remaining(first, "tenant-tokens") == int(TOKEN_BURST - used)
    assert remaining(second, "tenant-tokens") == int(TOKEN_BURST - billed(usage) - used)
    assert remaining(second, "tenant-requests") == remaining(first, "tenant-requests") - 1
    # OpenAI's headers say the same (the tenant's buckets are the only ones here).
    assert first.headers["x-ratelimit-limit-tokens"] == str(int(TOKEN_BURST))
    assert first.headers["x-ratelimit-limit-requests"] == "10"
    assert int(second.headers["x-ratelimit-remaining-tokens"]) == remaining(second, "tenant-tokens")
    assert int(second.headers["x-ratelimit-remaining-requests"]) == remaining(second, "tenant-requests")
    assert second.headers["x-ratelimit-reset-tokens"] == f"{(billed(usage) + used) / TOKENS_PER_S:g}s"


async def test_denial_is_429_with_a_retry_after_that_is_honoured(gateway: Gateway, clock: FakeClock) -> None:
    response = await denied(gateway)
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_exceeded", "rate_limit_exceeded")
    # The denial is in the audit trail.
    audit = gateway.audit
    request_id = response.headers["x-request-id"]

    async def recorded() -> bool:
        return bool(await audit.find("acme", request_id))

    await eventually(recorded)
    [record] = await audit.find("acme", request_id)
    assert (record.stage, record.decision, record.source) == ("quota", "deny", "rate_limit_exceeded")
    assert remaining(response, "tenant-tokens") < 20 + 40  # what is left is less than one request
    retry_after = int(response.headers["Retry-After"])
    assert retry_after >= 1
    # Retry-After is the real wait rounded up: a second less is still too early, the full wait is enough.
    clock.advance(retry_after - 1)
    assert (await gateway.post(chat())).status_code == 429
    clock.advance(1)
    assert (await gateway.post(chat())).status_code == 200


class SleepOnTheClock:
    """What the openai SDK's retry sleeps with (`anyio` in its client module): the test's clock moves by what
    it would sleep, at once."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.slept: list[float] = []

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.clock.advance(seconds)


async def test_a_denial_says_its_wait_to_the_millisecond_and_the_openai_sdk_retries_after_it(
    gateway: Gateway, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    response = await denied(gateway)
    wait_ms = int(response.headers["retry-after-ms"])
    assert int(response.headers["Retry-After"]) == math.ceil(wait_ms / 1000)
    # The wait rounded up to the millisecond: a millisecond less is still too early, the wait is enough.
    clock.advance((wait_ms - 1) / 1000)
    assert (await gateway.post(chat())).status_code == 429
    clock.advance(0.0011)
    assert (await gateway.post(chat())).status_code == 200

    # The SDK's own retry (max_retries=1) waits what the header says, not Retry-After's whole seconds.
    wait_ms = int((await denied(gateway)).headers["retry-after-ms"])
    sleeps = SleepOnTheClock(clock)
    monkeypatch.setattr("openai._base_client.anyio", sleeps)
    async with openai.AsyncOpenAI(
        base_url=f"{gateway.http.base_url}/v1", api_key=gateway.key, max_retries=1
    ) as sdk:
        completion = await sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": QUESTION[0]["content"]}], max_tokens=20
        )
    assert completion.choices[0].message.content
    assert sleeps.slept == [wait_ms / 1000]


async def test_a_request_that_can_never_fit_is_a_400_not_an_endless_429(gateway: Gateway) -> None:
    response = await gateway.post(chat(max_tokens=int(TOKEN_BURST)))
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("max_tokens", "quota_exceeds_capacity")
    assert "can never fit" in error["message"]
    # Nothing was debited.
    assert (await gateway.post(chat())).status_code == 200


async def test_a_flood_of_refusals_costs_a_handful_of_audit_records(
    gateway: Gateway, clock: FakeClock
) -> None:
    """Requests that can never fit cost the client nothing: 60 of them leave one record at once and one
    counted record once the interval ends (`policy.audit.refusals`), not 60."""
    key_id = gateway.key.split("-")[1]
    for _ in range(60):
        assert (await gateway.post(chat(max_tokens=int(TOKEN_BURST)))).status_code == 400

    async def capacity_records() -> list[tuple[int, str]]:
        # The audit database outlives one test: this test's key picks its records.
        records = await gateway.audit.query(AuditQuery(tenant="acme", stage="quota", limit=1000))
        return [(r.count, r.source) for r in records if r.key_id == key_id]

    await eventually(lambda: _nonempty(capacity_records()))
    assert await capacity_records() == [(1, "quota_exceeds_capacity")]
    clock.advance(60)
    # The next refusal is the next interval's first (recorded at once) and writes the last interval's count.
    assert (await gateway.post(chat(max_tokens=int(TOKEN_BURST)))).status_code == 400

    async def settled() -> bool:
        return len(await capacity_records()) == 3

    await eventually(settled)
    assert sorted(await capacity_records()) == [(1, "quota_exceeds_capacity")] * 2 + [
        (59, "quota_exceeds_capacity")
    ]


async def _nonempty(records: Awaitable[list[tuple[int, str]]]) -> bool:
    return bool(await records)


async def test_cancelled_stream_refunds_its_unused_reservation(
    gateway: Gateway, clock: FakeClock, outcomes: OutcomeLog
) -> None:
    max_tokens = 150
    headers = {"authorization": f"Bearer {gateway.key}"}
    async with gateway.http.stream(
        "POST", "/v1/chat/completions", json=chat(max_tokens, stream=True), headers=headers
    ) as response:
        assert response.status_code == 200
        request_id = response.headers["x-request-id"]
        reserved_left = remaining(response, "tenant-tokens")
        seen = 0
        async for line in response.aiter_lines():
            seen += line.startswith("data: ") and '"content":"' in line
            if seen >= 4:
                break
    outcome = await outcomes.wait_for(request_id)
    assert outcome.status == "cancelled"
    used = billed(outcome.usage)
    assert outcome.usage.completion_tokens < max_tokens
    expected = TOKEN_BURST - used  # the clock stood still: no refill, only the refund of the unused part

    async def settled() -> bool:
        return abs(await gateway.tenant_tokens_level(clock) - expected) < 1e-6

    await eventually(settled)
    assert expected > reserved_left


async def test_completed_request_is_charged_exactly_its_usage(gateway: Gateway, clock: FakeClock) -> None:
    response = await gateway.post(chat(max_tokens=30))
    assert response.status_code == 200
    used = billed(response.json()["usage"])

    async def charged() -> bool:
        return abs(await gateway.tenant_tokens_level(clock) - (TOKEN_BURST - used)) < 1e-6

    await eventually(charged)


async def test_n_choices_reserve_n_times_max_tokens_and_are_charged_for_all(
    gateway: Gateway, clock: FakeClock
) -> None:
    # One choice of 60 fits the 200-token bucket; three of them never can.
    assert (await gateway.post({**chat(max_tokens=60)})).status_code == 200
    refused = await gateway.post({**chat(max_tokens=60), "n": 3})
    assert refused.status_code == 400
    assert "n 3 x max_tokens 60" in refused.json()["error"]["message"]
    clock.advance(TOKEN_BURST / TOKENS_PER_S)  # full again
    response = await gateway.post({**chat(max_tokens=20), "n": 3})
    assert response.status_code == 200
    body = response.json()
    assert len(body["choices"]) == 3
    assert body["usage"]["completion_tokens"] == 3 * 20  # the simulator writes max_tokens per choice
    used = billed(body["usage"])

    async def charged() -> bool:
        return abs(await gateway.tenant_tokens_level(clock) - (TOKEN_BURST - used)) < 1e-6

    await eventually(charged)


async def test_per_key_buckets_are_separate_and_the_tenant_bucket_is_shared(
    gateway: Gateway, clock: FakeClock
) -> None:
    per_key = Limits(requests_per_second=1, request_burst=1, tokens_per_second=100, token_burst=1000)
    tenant = gateway.tenant
    quotas = Quotas(tenant=tenant.quotas.tenant, per_key=per_key)
    await gateway.backends.tenants.update_tenant(
        Tenant(tenant_id=tenant.tenant_id, display_name=tenant.display_name, quotas=quotas),
        actor="t",
        now=clock(),
    )
    other = await add_key(gateway.backends.tenants, "acme", ("consumer",), now=clock())
    # A fresh key (not cached yet) sees the new quotas; the per-key request bucket holds one request.
    assert (await gateway.post(chat(), key=other)).status_code == 200
    denied = await gateway.post(chat(), key=other)
    assert denied.status_code == 429
    assert "key-requests" in denied.json()["error"]["message"]
    third = await add_key(gateway.backends.tenants, "acme", ("consumer",), now=clock())
    granted = await gateway.post(chat(), key=third)
    assert granted.status_code == 200
    # Both keys drew from the one tenant token bucket (the first one's answer settled, guard tokens too).
    usage = granted.json()["usage"]
    assert remaining(granted, "tenant-tokens") == int(TOKEN_BURST - billed(usage) - usage["total_tokens"])


@pytest.mark.parametrize(("fail_mode", "status"), [("open", 200), ("closed", 503)])
async def test_unreachable_redis_follows_the_tenants_fail_mode_without_hanging(
    fail_mode: str,
    status: int,
    tmp_path: Path,
    clock: FakeClock,
    sim_engine: SimulatedEngine,
    renderer: PromptRenderer,
    outcomes: OutcomeLog,
) -> None:
    async with deployment("memory+sqlite", tmp_path) as backends:
        quotas = Quotas(tenant=QUOTAS.tenant, fail_mode=fail_mode)  # type: ignore[arg-type]
        await backends.tenants.create_tenant(
            Tenant(tenant_id="acme", display_name="Acme", quotas=quotas), actor="t", now=clock()
        )
        key = await add_key(backends.tenants, "acme", ("consumer",), now=clock())
        # Nothing listens on port 1: every Redis call fails at once or within op_timeout.
        dead = RedisQuotaStore(redis.asyncio.Redis.from_url("redis://127.0.0.1:1/0"), op_timeout=0.2)
        # The reservation's outcome is unknown, so it is settled by id: retried against the dead store until
        # shutdown's drain bound (kept short here) gives it up.
        quota = QuotaConfig(settle_attempts=2, settle_backoff=0.01, settle_drain_timeout=2.0)
        app = create_app(
            msgspec.structs.replace(make_config(), quota=quota),
            engine=sim_engine,
            renderer=renderer,
            tenants=backends.tenants,
            quota=dead,
            clock=clock,
            sink=outcomes,
        )
        async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=10) as http:
            response = await http.post(
                "/v1/chat/completions", json=chat(), headers={"authorization": f"Bearer {key}"}
            )
            counters = app.state.services.meter.counters
        await dead.close()
    assert response.status_code == status
    assert counters["reserve_unknown"] == 1
    assert counters["settle_given_up"] == 1  # Never dropped silently: counted (and the id stays charged).
    if fail_mode == "open":
        assert counters["fail_open"] == 1
        assert "RateLimit" not in response.headers
    else:
        assert counters["fail_closed"] == 1
        error = response.json()["error"]
        assert error["code"] == "quota_unavailable"
        assert response.headers["Retry-After"] == "1"

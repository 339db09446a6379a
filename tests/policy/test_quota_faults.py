"""Quota settlement through the HTTP gateway while a private Redis is paused (SIGSTOP: slow, not dead),
resumed, killed and restarted on the same port, under concurrent load from the `openai` SDK against the
simulated engine. The shared Redis on 6379 is never touched.

Held throughout: no request outlives its bound; the only refusals are 503 `quota_unavailable` for the tenant
that fails closed, while the tenant that fails open is admitted unmetered (counted); every reservation that
was granted settles (no reservation record is left granted-but-unsettled, none is given up); service resumes
by itself when Redis returns.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import openai
import redis.asyncio

from engines.simulated import SimulatedEngine
from gateway.app import create_app
from gateway.config import QuotaConfig
from gateway.generation.prompts import PromptRenderer
from policy.quota.redis import RedisQuotaStore
from policy.tenants.models import Limits, Quotas, Tenant
from policy.tenants.sqlite import SqliteTenantStore
from tests.conftest import MODEL, OutcomeLog, add_key, make_config, serving
from tests.redis_servers import RedisServer, redis_server

# Far more than the test asks for: quotas never deny here, only the store's health decides.
LIMITS = Limits(requests_per_second=1_000, request_burst=10_000, tokens_per_second=1_000, token_burst=1e6)
PER_TENANT = 6  # Concurrent requests per tenant in each burst.
# The bound no request may outlive: a quota round trip (op_timeout) plus a few simulated tokens, with a wide
# margin for a loaded 2-core machine. A request cut off by it is a hang, and fails the test.
REQUEST_BOUND = 30.0
# A healthy round trip must never reach it: in the full suite on a loaded 2-core machine the test process
# (a large heap: vLLM, tokenizers, fixtures) has stalled for a second (a collection, a starved core), and the
# round trips of a healthy burst then timed out. A paused Redis costs this much per burst.
OP_TIMEOUT = 5.0
RECOVER_WITHIN = 60.0


@dataclass(frozen=True)
class Answer:
    """What one request got."""

    tenant: str
    status: int
    code: str | None
    metered: bool  # RateLimit headers present: a reservation was granted


class Load:
    """Both tenants' clients; every answer is kept for the final accounting."""

    def __init__(self, clients: dict[str, openai.AsyncOpenAI]) -> None:
        self.clients = clients
        self.answers: list[Answer] = []

    async def one(self, tenant: str) -> Answer:
        try:
            raw = await self.clients[tenant].chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=4
            )
            answer = Answer(tenant, raw.status_code, None, "RateLimit" in raw.headers)
        except openai.APIStatusError as exc:
            body = exc.body if isinstance(exc.body, dict) else {}
            answer = Answer(tenant, exc.status_code, body.get("code"), False)
        self.answers.append(answer)
        return answer

    async def burst(self) -> list[Answer]:
        """PER_TENANT concurrent requests for each tenant."""
        return await asyncio.gather(*(self.one(t) for t in self.clients for _ in range(PER_TENANT)))


def check_degraded(answers: list[Answer]) -> None:
    """Redis is out: fail-open admits unmetered, fail-closed refuses with 503 quota_unavailable."""
    for answer in answers:
        if answer.tenant == "open-co":
            assert (answer.status, answer.metered) == (200, False), answer
        else:
            assert (answer.status, answer.code) == (503, "quota_unavailable"), answer


def check_healthy(answers: list[Answer]) -> None:
    """Every request served and metered."""
    wrong = [a for a in answers if (a.status, a.metered) != (200, True)]
    assert not wrong, wrong


async def until(check: Callable[[], Awaitable[bool]]) -> None:
    """Poll `check` (each try is a real request, itself bounded) until it holds, within RECOVER_WITHIN."""
    async with asyncio.timeout(RECOVER_WITHIN):
        while not await check():  # noqa: ASYNC110 - waiting on another process's recovery
            await asyncio.sleep(0.05)


async def records(server: RedisServer) -> Counter[str]:
    """States of the reservation records in the private Redis: r = granted, x = settled or voided."""
    client = redis.asyncio.Redis(host="127.0.0.1", port=server.port)
    states: Counter[str] = Counter()
    async for key in client.scan_iter(match="lockgate:quota:res:*"):
        state = await client.hget(key, "s")
        states[state.decode() if isinstance(state, bytes) else str(state)] += 1
    await client.aclose()
    return states


async def test_paused_killed_and_restarted_redis_never_hangs_and_every_reservation_settles(
    tmp_path: Path, sim_engine: SimulatedEngine, renderer: PromptRenderer, outcomes: OutcomeLog
) -> None:
    tenants = await SqliteTenantStore.open(tmp_path / "tenants.sqlite3")
    keys = {}
    for tenant_id, mode in (("open-co", "open"), ("closed-co", "closed")):
        quotas = Quotas(tenant=LIMITS, fail_mode=mode)  # type: ignore[arg-type]
        await tenants.create_tenant(
            Tenant(tenant_id=tenant_id, display_name=tenant_id, quotas=quotas), actor="t", now=0.0
        )
        keys[tenant_id] = await add_key(tenants, tenant_id, ("consumer",))
    # Settlements keep retrying (backoff capped at 0.25 s) across every outage the test makes.
    quota = QuotaConfig(
        settle_attempts=10_000, settle_backoff=0.02, settle_backoff_max=0.25, settle_drain_timeout=60.0
    )
    async with redis_server(tmp_path / "redis") as server:
        store = RedisQuotaStore.from_url(server.url, pool_size=50, pool_timeout=10.0, op_timeout=OP_TIMEOUT)
        restarted = RedisServer(server.port, tmp_path / "redis-again")  # The same port, later.
        app = create_app(
            msgspec.structs.replace(make_config(), quota=quota),
            engine=sim_engine,
            renderer=renderer,
            tenants=tenants,
            quota=store,
            sink=outcomes,
        )
        try:
            async with serving(app) as url:
                clients = {
                    tenant: openai.AsyncOpenAI(
                        base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=REQUEST_BOUND
                    )
                    for tenant, key in keys.items()
                }
                load = Load(clients)

                async def served() -> bool:
                    return (await load.one("closed-co")).status == 200

                check_healthy(await load.burst())

                server.pause()  # Slow, not dead: every round trip times out after op_timeout.
                try:
                    check_degraded(await load.burst())
                finally:
                    server.resume()
                await until(served)
                check_healthy(await load.burst())

                await server.kill()  # Dead: connections refused, its data gone.
                check_degraded(await load.burst())
                await restarted.start()
                await until(served)
                check_healthy(await load.burst())
                for client in clients.values():
                    await client.close()
            # Serving has ended: the app drained its settlements (into the restarted Redis) before closing.
            counters = app.state.services.meter.counters
            states = await records(restarted)
        finally:
            await restarted.kill()
            await store.close()
            await tenants.close()

    # No request hung (each is bounded by REQUEST_BOUND: a timeout would have raised) and none got an
    # undeclared error.
    allowed = {(200, None), (503, "quota_unavailable")}
    assert {(a.status, a.code) for a in load.answers} <= allowed
    assert not any(a.status == 503 and a.tenant == "open-co" for a in load.answers)
    unmetered = sum(a.status == 200 and not a.metered for a in load.answers)
    refused = sum(a.status == 503 for a in load.answers)
    assert unmetered >= 2 * PER_TENANT  # Both outages admitted the fail-open tenant, unmetered ...
    assert counters["fail_open"] == unmetered  # ... and every one of those was counted,
    assert counters["fail_closed"] == refused  # as was every refusal.
    assert counters["pool_exhausted"] == 0  # Our own pool was never the problem.
    # Both outages left reserves whose outcome was unknown, and settlements that had to be retried.
    assert counters["reserve_unknown"] == unmetered + refused >= 2 * 2 * PER_TENANT
    assert counters["settle_retried"] > 0
    # Every reservation settled: granted ones and those whose outcome was unknown, none given up.
    assert counters["settle_given_up"] == 0
    assert counters["reserved"] == sum(a.metered for a in load.answers)
    assert counters["reserved"] + counters["reserve_unknown"] == counters["settled"] + counters["settle_noop"]
    # In the restarted Redis, no reservation is left granted and unsettled.
    assert states["r"] == 0
    assert states["x"] > 0

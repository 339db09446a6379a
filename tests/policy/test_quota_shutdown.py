"""Shutdown never drops a settlement: the app cancels its request tasks, and the settlements those requests
hand over on their way out run in the meter's own tasks, which the lifespan drains (retrying a failure)
before the stores are closed. A busy pool is a 503 `quota_busy`, whatever the tenant's fail mode."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import httpx
import msgspec

from engines.simulated import SimulatedEngine
from gateway.app import create_app
from gateway.config import QuotaConfig
from gateway.generation.prompts import PromptRenderer
from gateway.services import Services
from policy.quota import BucketSpec, MemoryQuotaStore, QuotaBackendError, QuotaBusyError, Reservation
from policy.quota.meter import applicable
from policy.tenants.models import ApiKey, Limits, Quotas, Tenant
from policy.tenants.sqlite import SqliteTenantStore
from tests.backends import FakeClock
from tests.conftest import OutcomeLog, add_key, lifespan, make_config, serving
from tests.policy.test_quota_http import chat

LIMITS = Limits(requests_per_second=10, request_burst=10, tokens_per_second=10, token_burst=1_000)
TENANT = Tenant(tenant_id="acme", display_name="Acme", quotas=Quotas(tenant=LIMITS, fail_mode="open"))
KEY = ApiKey(key_id="k1", tenant_id="acme", roles=("consumer",), created_at=0.0)


class FailsOnce(MemoryQuotaStore):
    """The first reconcile fails as if Redis were briefly unreachable."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    async def reconcile(self, reservation: Reservation, actual: Sequence[float], now: float) -> bool:
        if not self.failed:
            self.failed = True
            raise QuotaBackendError("blip")
        return await super().reconcile(reservation, actual, now)


async def test_requests_cancelled_at_shutdown_still_settle(
    sim_engine: SimulatedEngine, renderer: PromptRenderer, outcomes: OutcomeLog
) -> None:
    clock = FakeClock()
    store = FailsOnce()
    quota = QuotaConfig(settle_backoff=0.001, settle_drain_timeout=30.0)
    app = create_app(
        msgspec.structs.replace(make_config(), quota=quota),
        engine=sim_engine,
        renderer=renderer,
        quota=store,
        clock=clock,
        sink=outcomes,
    )
    started = asyncio.Event()
    async with lifespan(app):
        services: Services = app.state.services
        charge = await services.meter.reserve(TENANT, KEY, 500)

        async def in_flight() -> None:
            try:
                started.set()
                await asyncio.Event().wait()  # Still running when the gateway shuts down.
            finally:
                services.meter.settle_later(charge, 120)

        services.tasks.spawn(in_flight())
        await started.wait()
    # The lifespan cancelled the request, then drained its settlement (retried once) before returning.
    [_, tokens] = [b for _, b, _ in applicable(TENANT, KEY)]
    assert await store.levels([tokens], clock()) == (1_000.0 - 120,)
    counters = services.meter.counters
    assert (counters["settle_retried"], counters["settled"], counters["settle_given_up"]) == (1, 1, 0)


class Busy(MemoryQuotaStore):
    """Every connection stays busy past the pool's wait bound."""

    async def reserve(
        self,
        buckets: Sequence[BucketSpec],
        amounts: Sequence[float],
        now: float,
        reservation_id: str | None = None,
    ) -> Reservation:
        raise QuotaBusyError("no connection came free")


async def test_a_busy_pool_is_a_503_quota_busy_even_for_a_fail_open_tenant(
    tmp_path: Path, sim_engine: SimulatedEngine, renderer: PromptRenderer, outcomes: OutcomeLog
) -> None:
    tenants = await SqliteTenantStore.open(tmp_path / "tenants.sqlite3")
    await tenants.create_tenant(TENANT, actor="t", now=0.0)
    key = await add_key(tenants, "acme", ("consumer",))
    app = create_app(
        make_config(), engine=sim_engine, renderer=renderer, tenants=tenants, quota=Busy(), sink=outcomes
    )
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        response = await http.post(
            "/v1/chat/completions", json=chat(), headers={"authorization": f"Bearer {key}"}
        )
        counters = app.state.services.meter.counters
    await tenants.close()
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "quota_busy"
    assert response.headers["Retry-After"] == "1"
    assert counters["pool_exhausted"] == 1
    assert counters["fail_open"] == counters["fail_closed"] == 0

"""`/readyz` through the HTTP API: the status alone for anyone, the detail for an operator key of the
operating organisation, and at most one round of health checks per `[server] readiness_cache` seconds of the
injected clock however many probes come."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import msgspec

from engines.base import Health
from engines.simulated import SimulatorConfig
from gateway.app import create_app
from gateway.config import Config, EngineConfig, ReplicaSpec, StorageConfig
from gateway.generation.prompts import PromptRenderer
from policy.auth import SYSTEM_TENANT
from routing.config import ReplicaConfig, RoutingConfig
from tests.backends import FakeClock
from tests.conftest import SESSION_DIR, OutcomeLog, Tenancy, add_key, make_config, operator_headers, serving
from tests.gateway.test_admission_http import DeadEngine

# What an engine's failure may say: where its database or server is. Only an operator may read it.
LEAK = "connection refused by db-internal.example:5432"


class ProbedEngine(DeadEngine):
    """A replica whose health checks are counted, ready or down as the test says."""

    def __init__(self, replica_id: str) -> None:
        super().__init__(replica_id)
        self.checks = 0
        self.ready = True
        self.step_seconds: float | None = None

    async def health(self) -> Health:
        self.checks += 1
        await asyncio.sleep(0)  # a real check awaits the engine: let other probes arrive meanwhile
        if not self.ready:
            return Health(ready=False, detail=LEAK)
        return Health(ready=True, step_seconds=self.step_seconds)


class Bed:
    def __init__(self, http: httpx.AsyncClient, clock: FakeClock, engines: list[ProbedEngine]) -> None:
        self.http = http
        self.clock = clock
        self.engines = engines

    async def probe(self, headers: dict[str, str] | None = None) -> tuple[int, dict[str, object]]:
        response = await self.http.get("/readyz", headers=headers or {})
        return response.status_code, response.json()

    def checks(self) -> list[int]:
        return [e.checks for e in self.engines]


def config(readiness_cache: float | None = None) -> Config:
    """Two simulated replicas whose router never checks them itself while a test runs."""
    base = make_config() if readiness_cache is None else make_config(readiness_cache=readiness_cache)
    path = SESSION_DIR / f"readiness-{uuid.uuid4().hex}.sqlite3"
    return msgspec.structs.replace(
        base,
        storage=StorageConfig(sqlite_path=str(path)),
        engines=[ReplicaSpec(kind="simulated"), ReplicaSpec(kind="simulated")],
        engine=EngineConfig(kind="simulated", simulator=SimulatorConfig()),
        routing=RoutingConfig(replicas=ReplicaConfig(refresh_interval=3600.0)),
    )


@asynccontextmanager
async def bed(
    cfg: Config, renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> AsyncIterator[Bed]:
    clock = FakeClock()
    app = create_app(cfg, renderer=renderer, tenants=tenancy.store, sink=outcomes, clock=clock)
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        engines = []
        for replica in app.state.services.scheduler.replicas:
            engine = ProbedEngine(replica.engine.replica_id)
            replica.engine = engine
            engines.append(engine)
        yield Bed(http, clock, engines)


async def test_a_flood_of_probes_checks_each_engine_once_per_cache_period(
    renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    async with bed(config(), renderer, outcomes, tenancy) as b:  # the default: 1 s
        answers = await asyncio.gather(*(b.probe() for _ in range(50)))
        assert answers == [(200, {"status": "ready"})] * 50
        assert b.checks() == [1, 1]
        for engine in b.engines:
            engine.ready = False
        b.clock.advance(0.9)  # within the period: the last round answers, down engines or not
        assert await b.probe() == (200, {"status": "ready"})
        assert b.checks() == [1, 1]
        b.clock.advance(0.1)
        answers = await asyncio.gather(*(b.probe() for _ in range(50)))
        assert answers == [(503, {"status": "not_ready"})] * 50
        assert b.checks() == [2, 2]


async def test_with_no_cache_every_probe_checks(
    renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    async with bed(config(readiness_cache=0.0), renderer, outcomes, tenancy) as b:
        assert await b.probe() == (200, {"status": "ready"})
        for engine in b.engines:
            engine.ready = False
        assert await b.probe() == (503, {"status": "not_ready"})  # the clock has not moved
        assert b.checks() == [2, 2]


async def test_only_an_operator_key_of_the_operating_organisation_reads_the_detail(
    renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    store = tenancy.store
    others = {
        "no key": None,
        "a bad key": "lg-nope-nope",
        "a consumer": tenancy.consumer,
        "an operator administrator": tenancy.admin,
        "a scrape key": await add_key(store, SYSTEM_TENANT, ("metrics",)),
        "a tenant's operator": await add_key(store, "acme", ("operator",)),
    }
    operator = await operator_headers(store)
    async with bed(config(), renderer, outcomes, tenancy) as b:
        b.engines[0].ready = False
        b.engines[1].ready = False
        for who, key in others.items():
            response = await b.http.get("/readyz", headers={"authorization": f"Bearer {key}"} if key else {})
            # The status alone: no replica id, no error text, no registry state (and never a 401 or 403).
            assert (response.status_code, response.json()) == (503, {"status": "not_ready"}), who
            assert "db-internal" not in response.text, who
            assert b.engines[0].replica_id not in response.text, who
        status, body = await b.probe(operator)
        assert status == 503
        assert body["engines"] == {e.replica_id: False for e in b.engines}
        assert body["pools"] == {"default": False}
        assert LEAK in str(body["detail"])
        assert body["registry"]["status"] == "fresh"  # type: ignore[index]
        assert b.checks() == [1, 1]  # one round answered every caller


async def test_the_operator_reads_each_measured_engines_step_time(
    renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    async with bed(config(), renderer, outcomes, tenancy) as b:
        b.engines[0].step_seconds = 0.123456  # measured; the other engine's budget was configured
        status, body = await b.probe(await operator_headers(tenancy.store))
        assert status == 200
        assert body["step_seconds"] == {b.engines[0].replica_id: 0.1235}
        assert "step_seconds" not in (await b.probe())[1]

"""Fair admission and routing through the gateway, on simulated replicas configured as `[[engines]]`.

Each replica has room for one request at a time (its KV capacity), so requests queue in the gateway and the
order, the deadlines and the bounds of the admission queue show in what clients get.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
import msgspec
import pytest

from engines.base import (
    Engine,
    EngineDeadError,
    EngineDelta,
    EngineError,
    EngineLoad,
    EngineRequest,
    Health,
    SamplingSpec,
)
from engines.simulated import SimulatedEngine, SimulatorConfig
from engines.supervisor import RestartPolicy, SupervisedEngine
from gateway.app import create_app
from gateway.config import Config, EngineConfig, ReplicaSpec, StorageConfig
from gateway.generation.prompts import PromptRenderer
from gateway.services import Services
from policy.tenants.models import Tenant
from routing.admission_types import AdmissionConfig
from routing.config import ReplicaConfig, RoutingConfig
from tests.conftest import (
    MODEL,
    SESSION_DIR,
    OutcomeLog,
    Tenancy,
    add_key,
    eventually,
    make_config,
    operator_headers,
    serving,
)

QUESTION = [{"role": "user", "content": "hi"}]
# Decode steps of 20 ms: a request of 40 tokens holds its replica for about 0.8 s.
STEP = 0.02
MAX_TOKENS = 40


def config(replicas: int = 1, **admission: Any) -> Config:
    """Simulated replicas with room for one request each, and the admission settings given."""
    base = make_config()
    # A registry of its own: a test publishes versions that others must not see.
    path = SESSION_DIR / f"admission-{uuid.uuid4().hex}.sqlite3"
    base = msgspec.structs.replace(base, storage=StorageConfig(sqlite_path=str(path)))
    simulator = SimulatorConfig(decode_step_s=STEP, decode_step_s_per_seq=0.0, kv_capacity_tokens=100)
    return msgspec.structs.replace(
        base,
        engines=[ReplicaSpec(kind="simulated") for _ in range(replicas)],
        engine=EngineConfig(kind="simulated", simulator=simulator),
        admission=msgspec.convert(admission, AdmissionConfig),
    )


class Gateway:
    """An app served in-process, with keys of two tenants: `acme` (interactive) and `bulk` (batch only)."""

    def __init__(self, http: httpx.AsyncClient, services: Services, acme: str, bulk: str) -> None:
        self.http = http
        self.services = services
        self.acme = acme
        self.bulk = bulk

    async def chat(self, key: str, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
        payload = {"model": MODEL, "messages": QUESTION, "max_tokens": MAX_TOKENS, **body}
        return await self.http.post(
            "/v1/chat/completions",
            json=payload,
            headers={"authorization": f"Bearer {key}", **(headers or {})},
        )

    async def occupied(self, **body: Any) -> asyncio.Task[httpx.Response]:
        """A request of `acme` started and running on the replica (what the next ones queue behind)."""
        running = asyncio.create_task(self.chat(self.acme, **body))
        await eventually(lambda: _in_flight(self.services, 1))
        return running

    async def queued(self, count: int) -> None:
        """Wait until `count` requests wait in the admission queue."""

        async def enough() -> bool:
            return self.services.scheduler.depth() >= count

        await eventually(enough, within=10.0)


@asynccontextmanager
async def gateway_for(
    cfg: Config, renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> AsyncIterator[Gateway]:
    """The app on `cfg`, served in-process."""
    store = tenancy.store
    await store.create_tenant(
        Tenant(tenant_id="bulk", display_name="Bulk", max_priority="batch"), actor="test", now=0.0
    )
    bulk = await add_key(store, "bulk", ("consumer",))
    app = create_app(cfg, renderer=renderer, tenants=store, sink=outcomes)
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
        yield Gateway(http, app.state.services, tenancy.consumer, bulk)


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def error_of(response: httpx.Response) -> tuple[int, str]:
    return response.status_code, response.json()["error"]["code"]


async def test_a_light_tenant_is_not_starved_by_a_heavy_ones_backlog(
    renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    async with gateway_for(config(), renderer, outcomes, tenancy) as gw:
        heavy_key = await add_key(tenancy.store, "acme", ("consumer",))
        await tenancy.store.create_tenant(Tenant(tenant_id="light", display_name="Light"), actor="t", now=0.0)
        light_key = await add_key(tenancy.store, "light", ("consumer",))
        heavy = [asyncio.create_task(gw.chat(heavy_key)) for _ in range(5)]
        await gw.queued(4)
        light = await gw.chat(light_key)
        assert light.status_code == 200
        # The light request went next (its counter starts at the heavy tenant's, which then grows with the
        # output of the request it had running): at least three heavy requests were still waiting or running.
        done_before_light = sum(task.done() for task in heavy)
        assert done_before_light <= 2
        responses = await asyncio.gather(*heavy)
        assert all(r.status_code == 200 for r in responses)
        waits = sorted(float(r.headers["x-lockgate-queue-wait"]) for r in responses)
        assert waits[0] < waits[-1]
        assert float(light.headers["x-lockgate-queue-wait"]) < waits[-1]


async def test_requests_beyond_the_sequences_an_engine_runs_wait_in_the_gateway(
    renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    # KV for a hundred requests, but the engine runs 2 sequences at once and none may queue in it: a request
    # of two choices fills it, and the next one waits in the admission queue, not in the engine's.
    base = config()
    simulator = msgspec.structs.replace(base.engine.simulator, kv_capacity_tokens=100_000, max_batch=2)
    cfg = msgspec.structs.replace(
        base,
        engine=msgspec.structs.replace(base.engine, simulator=simulator),
        routing=RoutingConfig(replicas=ReplicaConfig(engine_queue=0)),
    )
    async with gateway_for(cfg, renderer, outcomes, tenancy) as gw:
        (replica,) = gw.services.scheduler.replicas
        assert replica.sequence_limit == 2
        both = asyncio.create_task(gw.chat(gw.acme, n=2))
        await eventually(lambda: _true(replica.sequences == 2))
        later = asyncio.create_task(gw.chat(gw.acme))
        await gw.queued(1)
        assert replica.in_flight == 1
        assert (await replica.engine.load()).waiting == 0
        # An administrator sees where the tenant stands in the queue; another tenant's administrator does not.
        admission = await gw.http.get("/admin/tenants/acme/admission", headers=bearer(tenancy.admin))
        assert admission.status_code == 200, admission.text
        ((weights, share),) = admission.json()["queues"].items()
        assert weights == replica.weights_sha256
        assert (share["queued"], share["in_flight"]) == (1, 1)
        assert share["counter"] >= share["virtual_time"]
        bulk_admin = await add_key(tenancy.store, "bulk", ("policy_admin",))
        other = await gw.http.get("/admin/tenants/acme/admission", headers=bearer(bulk_admin))
        assert other.status_code in (403, 404), other.text
        assert "queues" not in other.text
        first, second = await asyncio.gather(both, later)
        assert [len(first.json()["choices"]), second.status_code] == [2, 200]
        assert float(second.headers["x-lockgate-queue-wait"]) > 0
        assert replica.sequences == 0


async def test_priority_and_deadline_headers_are_checked(
    renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    async with gateway_for(config(), renderer, outcomes, tenancy) as gw:
        assert (await gw.chat(gw.acme, {"x-lockgate-priority": "batch"})).status_code == 200
        bad = await gw.chat(gw.acme, {"x-lockgate-priority": "urgent"})
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "x-lockgate-priority"
        # A batch tenant never runs as interactive.
        higher = await gw.chat(gw.bulk, {"x-lockgate-priority": "interactive"})
        assert higher.status_code == 400
        assert (await gw.chat(gw.bulk)).status_code == 200
        for value in ("0", "-1", "soon", "inf"):
            refused = await gw.chat(gw.acme, {"x-lockgate-queue-deadline": value})
            assert refused.status_code == 400, value
            assert refused.json()["error"]["param"] == "x-lockgate-queue-deadline"


async def test_a_request_whose_deadline_passes_in_the_queue_gets_504(
    renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    async with gateway_for(config(), renderer, outcomes, tenancy) as gw:
        running = await gw.occupied(max_tokens=MAX_TOKENS)
        late = await gw.chat(gw.acme, {"x-lockgate-queue-deadline": "0.1"})
        assert error_of(late) == (504, "deadline_expired")
        assert "Retry-After" in late.headers
        # The refusal is in the audit trail.
        request_id = late.headers["x-request-id"]

        async def refusals() -> list[tuple[str, str, str]]:
            records = await gw.services.audit.find("acme", request_id)
            return [(r.stage, r.decision, r.source) for r in records if r.stage == "admission"]

        async def recorded() -> bool:
            return bool(await refusals())

        await eventually(recorded)
        assert await refusals() == [("admission", "refuse", "deadline_expired")]
        assert (await running).status_code == 200
        assert gw.services.scheduler.depth() == 0


async def test_a_client_that_leaves_while_queued_leaves_the_queue_and_reaches_no_engine(
    renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    async with gateway_for(config(), renderer, outcomes, tenancy) as gw:
        running = await gw.occupied(max_tokens=MAX_TOKENS)
        leaving = asyncio.create_task(gw.chat(gw.acme))
        await gw.queued(1)
        leaving.cancel()  # the client closes its connection while its request waits for a replica
        with contextlib.suppress(asyncio.CancelledError):
            await leaving
        await eventually(lambda: _true(gw.services.scheduler.depth() == 0))

        async def left() -> bool:
            return any(o.status == "cancelled" for o in outcomes.items)

        await eventually(left)
        [cancelled] = [o for o in outcomes.items if o.status != "completed"]
        # Refunded whole, as a request that never reached an engine (one that ran counts its prompt).
        assert (cancelled.usage.prompt_tokens, cancelled.usage.completion_tokens) == (0, 0)
        assert (await running).status_code == 200
        assert await _in_flight(gw.services, 0)


async def test_an_unmeetable_deadline_is_refused_at_once(
    renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    # One token per second: the prediction says a queued request ahead takes far longer than 1 s (the one
    # in flight too: the second waits as a batch request, whose deadline is long enough for that).
    async with gateway_for(config(initial_service_rate=1.0), renderer, outcomes, tenancy) as gw:
        first = await gw.occupied()
        second = asyncio.create_task(gw.chat(gw.acme, {"x-lockgate-priority": "batch"}))
        await gw.queued(1)
        refused = await gw.chat(gw.acme, {"x-lockgate-queue-deadline": "1"})
        assert error_of(refused) == (503, "deadline_unmeetable")
        assert int(refused.headers["Retry-After"]) >= 1
        assert [r.status_code for r in await asyncio.gather(first, second)] == [200, 200]


async def test_a_full_tenant_queue_is_a_429(
    renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    async with gateway_for(config(max_queued_per_tenant=1), renderer, outcomes, tenancy) as gw:
        first = await gw.occupied()
        second = asyncio.create_task(gw.chat(gw.acme))
        await gw.queued(1)
        refused = await gw.chat(gw.acme)
        assert error_of(refused) == (429, "queue_full")
        assert "Retry-After" in refused.headers
        # Another tenant still gets in.
        assert (await gw.chat(gw.bulk)).status_code == 200
        assert [r.status_code for r in await asyncio.gather(first, second)] == [200, 200]


async def test_weights_no_replica_serves_are_a_503(
    renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    async with gateway_for(config(), renderer, outcomes, tenancy) as gw:
        registry = gw.services.registry
        served = registry.view.resolve_model(MODEL, key="")
        other = msgspec.structs.replace(served.spec, weights_sha256="0" * 64)
        await registry.publish("model", MODEL, "unserved", other, actor="test")
        refused = await gw.chat(gw.acme, model=f"{MODEL}@unserved")
        assert error_of(refused) == (503, "no_healthy_replica")


class DeadEngine:
    """A replica whose engine died: every request fails before its first token."""

    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self.model_name = MODEL
        self.max_model_len = 2048
        self.calls = 0

    async def generate(self, req: EngineRequest) -> AsyncGenerator[EngineDelta, None]:
        self.calls += 1
        raise EngineDeadError(f"{self.replica_id} died")
        yield  # pragma: no cover - makes this an async generator

    async def health(self) -> Health:
        return Health(ready=True)

    async def load(self) -> EngineLoad:
        return EngineLoad(running=0, waiting=0, kv_tokens_used=0, kv_tokens_capacity=100)


def _kill(replicas: Sequence[Any], index: int, kind: type[DeadEngine] = DeadEngine) -> DeadEngine:
    dead = kind(replicas[index].engine.replica_id)
    replicas[index].engine = dead
    return dead


async def test_a_request_fails_over_to_another_replica_before_its_first_token(
    renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    async with gateway_for(config(replicas=2), renderer, outcomes, tenancy) as gw:
        replicas = gw.services.scheduler.replicas
        dead = _kill(replicas, 0)  # the router's first choice: both are idle and its id sorts first
        response = await gw.chat(gw.acme, stream=True)
        assert response.status_code == 200
        assert "data: [DONE]" in response.text
        assert dead.calls == 1
        assert replicas[0].in_flight == replicas[1].in_flight == 0
        # With both dead, the client is told the engine is unavailable (no second failover).
        other = _kill(replicas, 1)
        refused = await gw.chat(gw.acme)
        assert refused.status_code == 503
        assert dead.calls + other.calls >= 2
        assert all(r.in_flight == 0 for r in replicas)


async def _true(value: bool) -> bool:
    return value


async def _in_flight(services: Services, count: int) -> bool:
    return sum(r.in_flight for r in services.scheduler.replicas) >= count


class DownEngine(DeadEngine):
    """A replica whose health check fails."""

    async def health(self) -> Health:
        return Health(ready=False, detail="gone")


async def test_readyz_lists_every_replica_and_a_pool_is_ready_while_one_is(
    renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    cfg = config(replicas=2)
    # Each probe checks again (a replica is killed between two probes), and in detail (an operator's key).
    cfg = msgspec.structs.replace(cfg, server=msgspec.structs.replace(cfg.server, readiness_cache=0.0))
    async with gateway_for(cfg, renderer, outcomes, tenancy) as gw:
        operator = await operator_headers(tenancy.store)
        body = (await gw.http.get("/readyz", headers=operator)).json()
        assert body["engines"] == {"simulated-0": True, "simulated-1": True}
        assert body["pools"] == {"default": True}
        replicas = gw.services.scheduler.replicas
        _kill(replicas, 0, DownEngine)
        response = await gw.http.get("/readyz", headers=operator)
        assert response.status_code == 200
        assert response.json()["engines"] == {"simulated-0": False, "simulated-1": True}
        _kill(replicas, 1, DownEngine)
        response = await gw.http.get("/readyz", headers=operator)
        assert response.status_code == 503
        assert "simulated-1: gone" in response.json()["detail"]


async def test_a_replica_kv_byte_budget_counts_in_the_registry_bytes_per_token(
    renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    # SmolLM2-135M in the registry: 2 x 30 layers x 3 KV heads x 64 head dim x 2 bytes.
    per_token = 2 * 30 * 3 * 64 * 2
    budget = 60  # tokens; the simulator itself reports 100
    spec = ReplicaSpec(kind="simulated", kv_cache_bytes=budget * per_token + per_token - 1)
    cfg = msgspec.structs.replace(config(), engines=[spec])
    async with gateway_for(cfg, renderer, outcomes, tenancy) as gw:
        [replica] = gw.services.scheduler.replicas
        assert replica.kv_budget_tokens == budget
        assert replica.kv_capacity_tokens == budget  # known before the engine's first report
        prompt = (await gw.chat(gw.acme, max_tokens=1)).json()["usage"]["prompt_tokens"]
        assert replica.last_load is not None
        assert replica.last_load.kv_tokens_capacity == 100
        assert replica.kv_capacity_tokens == budget  # the smaller of the two
        # A request fits exactly up to the budget, and no further.
        fitting = await gw.chat(gw.acme, max_tokens=budget - prompt)
        assert fitting.status_code == 200, fitting.text
        too_large = await gw.chat(gw.acme, max_tokens=budget - prompt + 1)
        assert too_large.status_code == 400
        assert too_large.json()["error"]["code"] == "context_length_exceeded"


async def test_liveness_fails_when_any_replicas_supervisor_gave_up(
    renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    class Unstartable(SimulatedEngine):
        async def start(self) -> None:
            raise RuntimeError("cannot allocate the KV cache")

    built: list[SimulatedEngine] = []

    def factory() -> Engine:
        kind = SimulatedEngine if not built else Unstartable
        built.append(kind(SimulatorConfig(), model_name=MODEL, replica_id="simulated-1"))
        return built[-1]

    doomed = SupervisedEngine(factory, RestartPolicy(health_interval=3600, max_restarts=1, backoff=0.0))
    await doomed.start()
    try:
        async with gateway_for(config(replicas=2), renderer, outcomes, tenancy) as gw:
            replicas = gw.services.scheduler.replicas
            replicas[1].engine = doomed  # the second replica: liveness once looked at the first only
            assert (await gw.http.get("/healthz")).status_code == 200
            built[0].kill()
            probe = EngineRequest(
                request_id="probe", prompt_token_ids=(1, 2), sampling=SamplingSpec(max_tokens=1)
            )
            with pytest.raises(EngineError):  # the death is seen by a call; the restart then fails
                _ = [d async for d in doomed.generate(probe)]
            async with asyncio.timeout(30):
                await doomed.wait_for("failed")
            response = await gw.http.get("/healthz")
            assert response.status_code == 503
            assert "simulated-1 could not be restarted" in response.json()["detail"]
    finally:
        await doomed.shutdown()

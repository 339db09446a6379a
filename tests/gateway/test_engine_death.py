"""Engine death through the HTTP API: open streams end with an error event, new requests get 503
`engine_unavailable` with Retry-After, `/readyz` says 503, the supervisor restarts the engine and service
resumes without restarting the gateway; if it cannot, `/healthz` fails. Quota reservations of the failed
requests settle with the usage they had.

The simulated engine dies by fault injection (virtual, fast); the real one by SIGKILL of its engine core.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import httpx
import openai
import pytest
from litestar import Litestar
from openai import AsyncStream
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam

from engines.base import Engine
from engines.simulated import SimulatedEngine, SimulatorConfig
from engines.supervisor import RestartPolicy, SupervisedEngine
from engines.vllm_local import VllmLocalEngine
from gateway.app import create_app
from gateway.generation.prompts import PromptRenderer
from policy.quota.base import BucketSpec
from policy.quota.memory import MemoryQuotaStore
from policy.quota.meter import QuotaMeter
from policy.tenants.models import Limits, Quotas, Tenant
from policy.tenants.sqlite import SqliteTenantStore
from tests.conftest import MODEL, OutcomeLog, add_key, billed, make_config, serving

QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a long story."}]
BURST = 100_000.0
# No refill on a frozen clock: what the buckets hold at the end is exactly what was charged.
QUOTAS = Quotas(
    tenant=Limits(requests_per_second=1, request_burst=1000, tokens_per_second=1, token_burst=BURST)
)
TOKENS = BucketSpec(key="tenant:{acme}:tok", capacity=BURST, rate=1)


class Gate:
    """A backoff sleep that lasts until the test opens it, so the restarting state can be observed."""

    def __init__(self) -> None:
        self._open = asyncio.Event()

    async def __call__(self, seconds: float) -> None:
        await self._open.wait()

    def open(self) -> None:
        """Let the supervisor's pending and future sleeps return."""
        self._open.set()


class Deployment:
    """A gateway on a supervised engine, tenant `acme` with quotas on a memory store, frozen clock."""

    def __init__(self, url: str, sdk: openai.AsyncOpenAI, app: Litestar) -> None:
        self.url = url
        self.sdk = sdk
        self.app = app

    async def status(self, path: str) -> int:
        async with httpx.AsyncClient(base_url=self.url) as http:
            return (await http.get(path)).status_code

    async def assert_every_reservation_settled(self, outcomes: OutcomeLog) -> None:
        """Every granted reservation settled, and the tenant was charged exactly what its requests used."""
        meter: QuotaMeter = self.app.state.services.meter
        async with asyncio.timeout(30):
            await meter.drain(30)
        assert meter.counters["reserved"] == len(outcomes.items)
        assert meter.counters["settled"] == meter.counters["reserved"]
        used = sum(billed(o.usage) for o in outcomes.items)
        [level] = await meter.store.levels([TOKENS], 0.0)
        assert level == BURST - used


Deploy = Callable[[SupervisedEngine], AbstractAsyncContextManager[Deployment]]


@pytest.fixture
def deploy(tmp_path: Path, renderer: PromptRenderer, outcomes: OutcomeLog) -> Deploy:
    @asynccontextmanager
    async def build(engine: SupervisedEngine) -> AsyncIterator[Deployment]:
        store = await SqliteTenantStore.open(tmp_path / "tenants.sqlite3")
        tenant = Tenant(tenant_id="acme", display_name="Acme", quotas=QUOTAS)
        await store.create_tenant(tenant, actor="test", now=0)
        key = await add_key(store, "acme", ("consumer",))
        app = create_app(
            # Each /readyz checks again: the clock is frozen, and the tests read it just after a death.
            make_config(readiness_cache=0),
            engine=engine,
            renderer=renderer,
            tenants=store,
            quota=MemoryQuotaStore(),
            clock=lambda: 0.0,
            sink=outcomes,
        )
        try:
            async with (
                serving(app) as url,
                openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as sdk,
            ):
                yield Deployment(url, sdk, app)
        finally:
            await store.close()

    return build


async def open_streams(sdk: openai.AsyncOpenAI, count: int) -> list[AsyncStream[ChatCompletionChunk]]:
    """`count` streams that have each delivered their first chunk (so they are running in the engine)."""
    streams = []
    for _ in range(count):
        stream = await sdk.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=1500, stream=True
        )
        await anext(aiter(stream))
        streams.append(stream)
    return streams


async def ends_with_an_error_event(stream: AsyncStream[ChatCompletionChunk]) -> str:
    """Read the stream to its end; the SDK raises on an SSE error event (and would stop at [DONE] without)."""
    with pytest.raises(openai.APIError) as ended:
        async for _ in stream:
            pass
    return ended.value.message


async def test_a_dead_engine_is_restarted_and_service_resumes(deploy: Deploy, outcomes: OutcomeLog) -> None:
    built: list[SimulatedEngine] = []

    def factory() -> Engine:
        built.append(SimulatedEngine(SimulatorConfig(decode_step_s=0.005), model_name=MODEL))
        return built[-1]

    gate = Gate()
    engine = SupervisedEngine(factory, RestartPolicy(health_interval=3600), sleep=gate)
    await engine.start()
    async with deploy(engine) as gw:
        streams = await open_streams(gw.sdk, 3)
        built[0].kill("engine core exited")
        messages = await asyncio.gather(*(ends_with_an_error_event(s) for s in streams))
        assert all("not available" in m for m in messages), messages
        await engine.wait_for("restarting")
        with pytest.raises(openai.APIStatusError) as refused:
            await gw.sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5)
        assert refused.value.status_code == 503
        # The engine's own refusal, or the router's once a refresh has taken the replica out.
        assert refused.value.code in ("engine_unavailable", "no_healthy_replica")
        assert int(refused.value.response.headers["Retry-After"]) >= 1
        assert await gw.status("/readyz") == 503
        assert await gw.status("/healthz") == 200  # it recovers by itself: no process restart wanted
        gate.open()
        await engine.wait_for("ready")
        answer = await gw.sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5)
        assert answer.choices[0].finish_reason == "length"
        assert await gw.status("/readyz") == 200
        assert engine.restarts == 1
        statuses = sorted(o.status for o in await outcomes.wait_count(5))
        # Refused by the router, the request never reached an engine (`refused`, refunded whole); refused by
        # the engine, it did (`error`). Which one depends on whether a refresh came first.
        refusal = "refused" if refused.value.code == "no_healthy_replica" else "error"
        assert statuses == sorted(["completed", "error", "error", "error", refusal])
        await gw.assert_every_reservation_settled(outcomes)
    await engine.shutdown()


async def test_liveness_fails_once_the_engine_cannot_be_restarted(
    deploy: Deploy,
) -> None:
    class Unstartable(SimulatedEngine):
        async def start(self) -> None:
            raise RuntimeError("cannot allocate the KV cache")

    built: list[SimulatedEngine] = []

    def factory() -> Engine:
        built.append((SimulatedEngine if not built else Unstartable)(SimulatorConfig(), model_name=MODEL))
        return built[-1]

    engine = SupervisedEngine(factory, RestartPolicy(health_interval=3600, max_restarts=2, backoff=0.0))
    await engine.start()
    async with deploy(engine) as gw:
        assert await gw.status("/healthz") == 200
        built[0].kill()
        with pytest.raises(openai.APIStatusError):
            await gw.sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5)
        await engine.wait_for("failed")
        assert await gw.status("/healthz") == 503
        assert await gw.status("/readyz") == 503
    await engine.shutdown()


async def test_killing_and_stopping_the_vllm_engine_core_mid_stream(
    deploy: Deploy, model_dir: Path, vllm_engine: VllmLocalEngine, outcomes: OutcomeLog
) -> None:
    def factory() -> Engine:
        # The session engine's measured step budget is reused (cached per host).
        return VllmLocalEngine(
            model_dir, model_name=MODEL, max_model_len=2048, kv_cache_bytes=128 << 20, replica_id="doomed"
        )

    # A stopped engine core counts as dead after many times the longest step this host takes.
    stall = 10 * (vllm_engine.step_seconds or 1.0)
    gate = Gate()
    engine = SupervisedEngine(factory, RestartPolicy(health_interval=0.2, stall_timeout=stall), sleep=gate)
    await engine.start()
    restart_bound = 600.0  # an engine start, bounded generously against a hang
    try:
        async with deploy(engine) as gw:
            # 1. SIGKILL: the open streams end with an error event; 503 with Retry-After while it restarts.
            first = engine.engine
            assert isinstance(first, VllmLocalEngine)
            streams = await open_streams(gw.sdk, 2)
            for pid in first.engine_core_pids():
                os.kill(pid, signal.SIGKILL)
            await asyncio.gather(*(ends_with_an_error_event(s) for s in streams))
            await engine.wait_for("restarting")
            with pytest.raises(openai.APIStatusError) as refused:
                await gw.sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5)
            assert refused.value.status_code == 503
            assert refused.value.code in ("engine_unavailable", "no_healthy_replica")
            # Which one depends on whether admission has seen the replica go down yet (its health is polled):
            # refused at admission, or admitted and then failed by the restarting engine.
            refusal = "refused" if refused.value.code == "no_healthy_replica" else "error"
            assert "Retry-After" in refused.value.response.headers
            assert await gw.status("/readyz") == 503
            gate.open()
            async with asyncio.timeout(restart_bound):
                await engine.wait_for("ready", "failed")
            assert engine.state == "ready"
            answer = await gw.sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5)
            assert answer.usage is not None
            assert answer.usage.completion_tokens == 5

            # 2. SIGSTOP: slow, not dead. A stream in flight ends with an error once the stall is seen, and
            # the engine is replaced (the stopped processes are killed by the shutdown).
            second = engine.engine
            assert isinstance(second, VllmLocalEngine)
            [stream] = await open_streams(gw.sdk, 1)
            for pid in second.engine_core_pids():
                os.kill(pid, signal.SIGSTOP)
            async with asyncio.timeout(stall + restart_bound):
                await ends_with_an_error_event(stream)
                await engine.wait_for("restarting")
            assert "stalled" in engine.last_error
            async with asyncio.timeout(restart_bound):
                await engine.wait_for("ready", "failed")
            assert engine.restarts == 2
            answer = await gw.sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5)
            assert answer.choices[0].finish_reason == "length"

            statuses = sorted(o.status for o in await outcomes.wait_count(6))
            assert statuses == sorted(["completed", "completed", "error", "error", "error", refusal])
            await gw.assert_every_reservation_settled(outcomes)
    finally:
        await engine.shutdown()

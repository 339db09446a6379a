"""The gateway in front of a real `vllm serve` replica (vLLM's OpenAI server in a subprocess), configured as
`[[engines]]` kind `vllm_remote`: answers, streams, a client that leaves aborts the request there, and the CPU
signal's "auto" is on."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import httpx
import msgspec
import pytest

from engines.vllm_remote import RemoteEngineConfig
from gateway.app import create_app
from gateway.config import Config, ReplicaSpec
from gateway.generation.prompts import PromptRenderer
from gateway.overload import OverloadConfig, OverloadGate
from gateway.services import Services
from routing.config import ReplicaConfig, RoutingConfig
from tests.conftest import (
    MODEL,
    OutcomeLog,
    Tenancy,
    eventually,
    keyless_metrics,
    lifespan,
    make_config,
    serving,
)
from tests.vllm_server import MAX_NUM_SEQS, SERVER_START_TIMEOUT


def remote_config(vllm_server: str, overload: OverloadConfig | None = None) -> Config:
    """The test config with one `vllm_remote` replica: `vllm_server`."""
    remote = RemoteEngineConfig(
        url=vllm_server,
        served_model=MODEL,
        max_model_len=2048,
        first_token_timeout=120.0,
        token_timeout=60.0,
        metrics_interval=0.2,
        start_timeout=SERVER_START_TIMEOUT,
        max_num_seqs=MAX_NUM_SEQS,
    )
    # On a loaded 2-core machine the server's /health and /metrics answer slowly while it generates: a
    # generous refresh bound keeps it from being taken out for slowness.
    routing = RoutingConfig(replicas=ReplicaConfig(refresh_timeout=30.0))
    config = keyless_metrics(make_config())
    return msgspec.structs.replace(
        config,
        engines=[ReplicaSpec(kind="vllm_remote", remote=remote)],
        routing=routing,
        overload=overload or config.overload,
    )


@pytest.fixture
async def gateway(
    vllm_server: str, renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(remote_config(vllm_server), renderer=renderer, tenants=tenancy.store, sink=outcomes)
    async with (
        serving(app, startup_timeout=SERVER_START_TIMEOUT + 30) as url,
        httpx.AsyncClient(base_url=url, timeout=120, headers=tenancy.consumer_headers) as http,
    ):
        yield http


async def server_metric(server: str, name: str) -> float:
    """One unlabelled-by-us metric of the vLLM server (its model label aside)."""
    async with httpx.AsyncClient(timeout=60) as http:
        text = (await http.get(f"{server}/metrics")).text
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, f"the server reports {name}"
    return float(match.group(1))


async def test_a_remote_replica_answers_through_the_gateway(gateway: httpx.AsyncClient) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 20,
        "temperature": 0,
    }
    response = await gateway.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert "Paris" in answer["choices"][0]["message"]["content"]
    assert answer["usage"]["completion_tokens"] > 0
    assert response.headers["x-lockgate-model"].startswith(f"{MODEL}@")
    assert "x-lockgate-queue-wait" in response.headers


async def test_a_client_that_leaves_aborts_the_request_on_the_replica(
    gateway: httpx.AsyncClient, vllm_server: str, outcomes: OutcomeLog
) -> None:
    # The request cannot end by itself before max_tokens (min_tokens = max_tokens): generating fewer tokens
    # than that on the replica proves the abort reached it. Counting what the client saw instead would
    # depend on how many tokens each upstream event carries, which grows when the machine is loaded.
    length = 2000
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a very long story about the sea."}],
        "max_tokens": length,
        "min_tokens": length,
        "stream": True,
    }
    generated_before = await server_metric(vllm_server, "vllm:generation_tokens_total")
    async with gateway.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        request_id = response.headers["x-request-id"]
        async for line in response.aiter_lines():
            if line.startswith("data: {") and '"content"' in line:
                break  # tokens are flowing: the request runs on the replica
    # The response is closed: the gateway closed its upstream stream, and vLLM aborted the request.
    outcome = await outcomes.wait_for(request_id, within=60)
    assert outcome.status == "cancelled"
    assert 0 < outcome.usage.completion_tokens < length

    async def gone() -> bool:
        return await server_metric(vllm_server, "vllm:num_requests_running") == 0

    await eventually(gone, within=120)
    generated = await server_metric(vllm_server, "vllm:generation_tokens_total") - generated_before
    assert 0 < generated < length


async def test_auto_turns_the_cpu_signal_on_in_front_of_remote_engines(
    vllm_server: str, renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    # Every engine is a vLLM server elsewhere: the process's CPU is the gateway's own, so "auto" sheds by it.
    config = remote_config(vllm_server, OverloadConfig(max_loop_lag=0.0, cpu_shedding="auto"))
    app = create_app(config, renderer=renderer, tenants=tenancy.store, sink=outcomes)
    gate: OverloadGate = app.state.overload
    assert gate.cpu is None  # decided once the lifespan knows its engines
    async with lifespan(app):
        assert gate.cpu is not None
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            assert "lockgate:cpu_shed_fraction" in (await http.get("/metrics")).text


async def test_a_worker_leaves_the_other_workers_their_part_of_a_remote_replica(
    vllm_server: str, renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    # One worker of two: a request another worker sent runs on the server, and the load report shows it.
    config = remote_config(vllm_server)
    config = msgspec.structs.replace(config, server=msgspec.structs.replace(config.server, workers=2))
    app = create_app(config, renderer=renderer, tenants=tenancy.store, sink=outcomes)
    body = {"model": MODEL, "prompt": "The sea", "max_tokens": 2000, "min_tokens": 2000, "stream": True}
    async with lifespan(app), httpx.AsyncClient(base_url=vllm_server, timeout=120) as other:
        services: Services = app.state.services
        (replica,) = services.scheduler.replicas
        assert replica.shared_by == 2
        async with other.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            # Kept referenced: a line iterator left unreferenced is closed by the collector, and with it the
            # response, which aborts the request on the server.
            lines = response.aiter_lines()
            async for line in lines:
                if line.startswith("data: {"):
                    break  # the other worker's request runs

            async def reported() -> bool:
                await replica.refresh()
                return replica.last_load is not None and replica.last_load.running >= 1

            await eventually(reported, within=60)
            # The sequence limit (16 + the engine queue of 2) less the other worker's (none of the reported
            # requests is this worker's); no await from here on, so no refresh runs in between.
            limit = replica.sequence_limit
            assert limit == MAX_NUM_SEQS + config.routing.replicas.engine_queue
            assert replica.last_load is not None
            room = max(limit // 2, limit - replica.last_load.running - replica.last_load.waiting)
            assert room < limit
            for i in range(room):
                replica.reserve(f"held-{i}", 1, 1)
            assert not replica.fits(1, 1)
            for i in range(room):
                replica.release(f"held-{i}")

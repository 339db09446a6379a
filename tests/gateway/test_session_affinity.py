"""A session's steps go to the replica that holds its prefix in the KV cache (the router's session affinity),
and their `cached_tokens` show the reuse; when that replica dies, the session goes on on the other one.

Two simulated replicas with a simulated prefix cache (`SimulatorConfig.prefix_cache_block`): a step's
leading prompt blocks that an earlier step filled on the same replica are reported as cached."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncGenerator
from typing import Any

import httpx
import msgspec

from engines.base import EngineDelta, EngineRequest
from engines.simulated import SimulatorConfig
from gateway.app import create_app
from gateway.config import Config, EngineConfig, ReplicaSpec, StorageConfig
from gateway.generation.prompts import PromptRenderer
from tests.conftest import MODEL, SESSION_DIR, OutcomeLog, Tenancy, make_config, serving
from tests.gateway.test_admission_http import DeadEngine

BLOCK = 16
STEPS = 10


def _tracked(replica: Any, served: list[str]) -> None:
    """Record in `served` the id of `replica` for each request it takes."""
    engine = replica.engine
    generate = engine.generate

    async def counted(req: EngineRequest) -> AsyncGenerator[EngineDelta, None]:
        served.append(replica.replica_id)
        async for delta in generate(req):
            yield delta

    engine.generate = counted


def two_replicas(simulator: SimulatorConfig) -> Config:
    """A test config with two simulated replicas of `simulator` and a registry database of its own."""
    return msgspec.structs.replace(
        make_config(),
        storage=StorageConfig(sqlite_path=str(SESSION_DIR / f"fleet-{uuid.uuid4().hex}.sqlite3")),
        engines=[ReplicaSpec(kind="simulated") for _ in range(2)],
        engine=EngineConfig(kind="simulated", simulator=simulator),
    )


async def test_a_sessions_steps_stay_on_the_replica_with_its_prefix_and_go_on_when_it_dies(
    renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    simulator = SimulatorConfig(decode_step_s=0.001, decode_step_s_per_seq=0.0, prefix_cache_block=BLOCK)
    app = create_app(two_replicas(simulator), renderer=renderer, tenants=tenancy.store, sink=outcomes)
    async with (
        serving(app) as url,
        httpx.AsyncClient(base_url=url, headers=tenancy.consumer_headers, timeout=60) as http,
    ):
        replicas = app.state.services.scheduler.replicas
        served: list[str] = []
        for replica in replicas:
            _tracked(replica, served)
        session = (await http.post("/v1/sessions", json={"model": MODEL})).json()["id"]

        async def step(n: int) -> int:
            body = {
                "step": n,
                "messages": [{"role": "user", "content": f"Step {n}: go on."}],
                "max_tokens": 8,
            }
            answer = await http.post(f"/v1/sessions/{session}/messages", json=body)
            assert answer.status_code == 200, answer.text
            cached: int = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            return cached

        cached = [await step(n) for n in range(1, STEPS + 1)]
        assert len(set(served)) == 1  # every step on one replica
        assert cached[0] == 0
        assert all(later > earlier for earlier, later in itertools.pairwise(cached[1:]))
        assert cached[-1] >= BLOCK * 4
        # The replica that held the session dies: the next step fails over and the session goes on there.
        holder = next(i for i, r in enumerate(replicas) if r.replica_id == served[0])
        replicas[holder].engine = DeadEngine(served[0])
        other = replicas[1 - holder].replica_id
        before = len(served)
        after = [await step(n) for n in range(STEPS + 1, STEPS + 4)]
        assert set(served[before:]) == {other}
        assert after[0] == 0  # a cold cache on the other replica
        assert after[2] > after[1] > 0  # warm again, on the new replica
        shown = (await http.get(f"/v1/sessions/{session}")).json()
        assert [s["step"] for s in shown["steps"]] == list(range(1, STEPS + 4))

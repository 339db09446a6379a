"""The choices of one request (`n` > 1) run on the replicas the router's score places them on: spread over
two idle simulated replicas, whole and streamed, each replica's reservation freed when the request ends, the
usage the sum of the choices' own."""

from __future__ import annotations

import uuid

import httpx
import msgspec
import pytest

from engines.simulated import SimulatorConfig
from gateway.app import create_app
from gateway.config import EngineConfig, ReplicaSpec, StorageConfig
from gateway.generation.prompts import PromptRenderer
from tests.conftest import MODEL, SESSION_DIR, OutcomeLog, Tenancy, make_config, serving
from tests.gateway.test_session_affinity import _tracked


@pytest.mark.parametrize("stream", [False, True])
async def test_two_choices_run_one_on_each_idle_replica(
    renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy, stream: bool
) -> None:
    simulator = SimulatorConfig(decode_step_s=0.001, decode_step_s_per_seq=0.0)
    config = msgspec.structs.replace(
        make_config(),
        storage=StorageConfig(sqlite_path=str(SESSION_DIR / f"spread-{uuid.uuid4().hex}.sqlite3")),
        engines=[ReplicaSpec(kind="simulated") for _ in range(2)],
        engine=EngineConfig(kind="simulated", simulator=simulator),
    )
    app = create_app(config, renderer=renderer, tenants=tenancy.store, sink=outcomes)
    async with (
        serving(app) as url,
        httpx.AsyncClient(base_url=url, headers=tenancy.consumer_headers, timeout=60) as http,
    ):
        replicas = app.state.services.scheduler.replicas
        served: list[str] = []
        for replica in replicas:
            _tracked(replica, served)
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Name a colour."}],
            "n": 2,
            "max_tokens": 6,
            "temperature": 1.0,
        }
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            texts = ["", ""]
            usage = None
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = msgspec.json.decode(line[6:])
                    for choice in event["choices"]:
                        texts[choice["index"]] += choice["delta"].get("content") or ""
                    usage = event.get("usage") or usage
            assert all(texts)
        else:
            response = await http.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            answer = response.json()
            assert [c["index"] for c in answer["choices"]] == [0, 1]
            usage = answer["usage"]
        assert sorted(served) == sorted(r.replica_id for r in replicas)  # one choice on each
        assert usage is not None
        assert usage["completion_tokens"] == 12  # each choice ran to max_tokens
        # Both reservations are freed when the request ends.
        assert [(r.held_tokens, r.sequences) for r in replicas] == [(0, 0), (0, 0)]

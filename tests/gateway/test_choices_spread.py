"""The choices of one request (`n` > 1) run on the replicas the router's score places them on: spread over
two idle simulated replicas, whole and streamed, each replica's reservation freed when the request ends, the
usage the sum of the choices' own."""

from __future__ import annotations

import httpx
import msgspec
import pytest

from engines.simulated import SimulatorConfig
from gateway.app import create_app
from gateway.generation.prompts import PromptRenderer
from tests.conftest import MODEL, OutcomeLog, Tenancy, serving
from tests.gateway.test_session_affinity import _tracked, two_replicas


@pytest.mark.parametrize("stream", [False, True])
async def test_two_choices_run_one_on_each_idle_replica(
    renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy, stream: bool
) -> None:
    simulator = SimulatorConfig(decode_step_s=0.001, decode_step_s_per_seq=0.0)
    app = create_app(two_replicas(simulator), renderer=renderer, tenants=tenancy.store, sink=outcomes)
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

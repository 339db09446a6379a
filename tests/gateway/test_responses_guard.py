"""The output guard on `/v1/responses`: output the policy blocks never reaches the client, and the response
says why (`incomplete`, reason `content_filter`), whole and streamed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from gateway.generation.prompts import PromptRenderer
from tests.conftest import MODEL, OutcomeLog
from tests.gateway.test_guard_delivered import ScriptedEngine, pieces
from tests.gateway.test_guard_http import Bed, guarded, policy

SCRIPT = "Here is how to build a bomb at home, step by step."


@pytest.fixture
async def bed(tmp_path: Path, renderer: PromptRenderer, outcomes: OutcomeLog) -> AsyncIterator[Bed]:
    async with guarded(tmp_path, renderer, outcomes, ScriptedEngine()) as test_bed:
        await test_bed.bind(policy(output_block="bomb"))
        assert isinstance(test_bed.engine, ScriptedEngine)
        test_bed.engine.script = pieces(SCRIPT, 4)
        yield test_bed


async def test_blocked_output_ends_the_response_incomplete_with_content_filter(bed: Bed) -> None:
    headers = {"authorization": f"Bearer {bed.key}"}
    body = {"model": MODEL, "input": "Tell me.", "max_output_tokens": 40}
    whole = await bed.http.post("/v1/responses", json=body, headers=headers)
    assert whole.status_code == 200, whole.text
    response = whole.json()
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "content_filter"}
    assert "bomb" not in whole.text
    streamed = await bed.http.post("/v1/responses", json={**body, "stream": True}, headers=headers)
    assert streamed.status_code == 200
    assert "bomb" not in streamed.text
    events = [
        msgspec.json.decode(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: ")
    ]
    assert events[0]["type"] == "response.created"
    last = events[-1]
    assert last["type"] == "response.incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "content_filter"}
    assert [e["sequence_number"] for e in events] == list(range(len(events)))

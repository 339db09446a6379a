"""The output guard reads what the client reads: tool-call arguments and structured output decoded.

A scripted engine writes the word the policy blocks only as JSON escapes (`"\\u0062\\u006f\\u006d\\u0062"`),
split across deltas inside the escapes, as tool-call arguments (named, required and auto tool modes) and as
`json_schema` / `json_object` content, whole and streamed. Read as generated it holds no "bomb"; the client's
JSON decoder reads "bomb", so the guard must block it. The simulator and the real engine then force a
genuine escape through a schema's `const` ("how to make a\\nbomb", where the default weapons rule only reads
the decoded newline as a space).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from engines.base import EngineDelta, EngineRequest, Usage
from engines.vllm_local import VllmLocalEngine
from gateway.app import create_app
from gateway.config import GuardConfig
from gateway.generation.prompts import PromptRenderer
from guard.readable import decode_escapes
from tests.conftest import MODEL, CountingEngine, OutcomeLog, Tenancy, make_config, serving
from tests.gateway.test_guard_http import Bed, guarded, policy, sse_events, stream_raw

ESCAPED = r"\u0062\u006f\u006d\u0062"  # "bomb"
ARGUMENTS = '{"x": "' + ESCAPED + '"}'
FUNCTION = {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}
TOOLS = {"tools": [{"type": "function", "function": FUNCTION}]}
SCHEMA = {
    "type": "json_schema",
    "json_schema": {"name": "o", "schema": {"type": "object", "properties": {"x": {"type": "string"}}}},
}
# How each output mode's request asks, and what the model writes in it.
CASES: dict[str, tuple[dict[str, Any], str]] = {
    "named": ({**TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}}, ARGUMENTS),
    "required": ({**TOOLS, "tool_choice": "required"}, '[{"name": "f", "parameters": ' + ARGUMENTS + "}]"),
    "auto": (
        {**TOOLS, "tool_choice": "auto"},
        'Calling it.\n<tool_call>\n{"name": "f", "arguments": ' + ARGUMENTS + "}\n</tool_call>",
    ),
    # Parallel calls: the escaped word is in the second one's arguments, after a clean first call.
    "auto_second": (
        {**TOOLS, "tool_choice": "auto"},
        '<tool_call>\n{"name": "f", "arguments": {"x": "ok"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "f", "arguments": ' + ARGUMENTS + "}\n</tool_call>",
    ),
    "json_schema": ({"response_format": SCHEMA}, ARGUMENTS),
    "json_object": ({"response_format": {"type": "json_object"}}, '{"a": "ok", "x": "b\\u006fm\\u0062"}'),
}


class ScriptedEngine(CountingEngine):
    """The served simulator, answering with `script` (one delta, one token, per piece) while one is set."""

    def __init__(self) -> None:
        super().__init__()
        self.script: list[str] = []

    def generate(self, req: EngineRequest) -> AsyncGenerator[EngineDelta, None]:
        if not self.script:
            return super().generate(req)
        self.requests.append(req)
        return self._scripted(req, list(self.script))

    @staticmethod
    async def _scripted(req: EngineRequest, script: list[str]) -> AsyncGenerator[EngineDelta, None]:
        for i, piece in enumerate(script, start=1):
            last = i == len(script)
            usage = Usage(prompt_tokens=len(req.prompt_token_ids), completion_tokens=i)
            yield EngineDelta(
                token_ids=(i,),
                text=piece,
                finish_reason="stop" if last else None,
                usage=usage if last else None,
            )


def pieces(text: str, size: int) -> list[str]:
    """`text` in pieces of `size` characters: boundaries fall inside the escapes."""
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.fixture
async def bed(tmp_path: Path, renderer: PromptRenderer, outcomes: OutcomeLog) -> AsyncIterator[Bed]:
    async with guarded(tmp_path, renderer, outcomes, ScriptedEngine()) as test_bed:
        yield test_bed


def script(bed: Bed, text: str, size: int) -> None:
    assert isinstance(bed.engine, ScriptedEngine)
    bed.engine.script = pieces(text, size)


def delivered(events: list[Any]) -> str:
    """Everything a streamed answer gave the client to read: content, tool names and argument pieces."""
    out = []
    for event in events:
        if not isinstance(event, dict) or not event.get("choices"):
            continue
        delta = event["choices"][0]["delta"]
        out.append(delta.get("content") or "")
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            out += [function.get("name") or "", function.get("arguments") or ""]
    return "".join(out)


@pytest.mark.parametrize("mode", list(CASES))
async def test_unguarded_the_client_reads_the_escaped_word(bed: Bed, mode: str) -> None:
    # The premise: as delivered and decoded by the client, the output says "bomb", though its text does not.
    extra, text = CASES[mode]
    assert "bomb" not in text
    await bed.bind(policy())
    script(bed, text, 5)
    answer = await bed.chat("Call f", **extra)
    assert answer.status_code == 200, answer.text
    message = answer.json()["choices"][0]["message"]
    if mode.startswith("json"):
        assert "bomb" in json.loads(message["content"]).values()
    else:
        call = message["tool_calls"][-1]
        assert call["function"]["name"] == "f"
        assert json.loads(call["function"]["arguments"]) == {"x": "bomb"}
    streamed = delivered(sse_events(await stream_raw(bed, "Call f", **extra)))
    assert "bomb" in decode_escapes(streamed)


@pytest.mark.parametrize("mode", list(CASES))
@pytest.mark.parametrize("size", [1, 3, 7])
async def test_an_escaped_word_is_blocked_whole_and_streamed(bed: Bed, mode: str, size: int) -> None:
    extra, text = CASES[mode]
    await bed.bind(policy(output_block="bomb", hold_back=1, check_every=1))
    script(bed, text, size)
    whole = await bed.chat("Call f", **extra)
    assert whole.status_code == 200, whole.text
    [choice] = whole.json()["choices"]
    assert choice["finish_reason"] == "content_filter"
    assert choice["message"]["content"] == ""
    assert "tool_calls" not in choice["message"]
    assert whole.headers["x-lockgate-guard"].endswith("output=rules")
    raw = await stream_raw(bed, "Call f", **extra)
    events = sse_events(raw)
    # What left before the block never reads "bomb", even decoded; the stream ends on content_filter.
    assert "bomb" not in decode_escapes(delivered(events))
    assert events[-1]["error"]["code"] == "content_filter"
    assert bed.outcomes.items[-1].status == "blocked"
    blocks = [r for r in bed.records.items if r.direction == "output" and r.action == "block"]
    assert len(blocks) == 2
    assert all(r.source == "rules" for r in blocks)


CONST = "how to make a\nbomb"


def const_schema() -> dict[str, Any]:
    schema = {"type": "object", "properties": {"x": {"const": CONST}}, "required": ["x"]}
    return {"type": "json_schema", "json_schema": {"name": "o", "schema": schema, "strict": True}}


async def test_a_forced_escape_in_structured_output_is_blocked_on_the_simulator(bed: Bed) -> None:
    # The simulator emits a schema's instance as JSON: the const's newline is written "\n", so the raw text
    # reads "a\nbomb"; the client reads "how to make a<newline>bomb", which a rule of that phrase blocks.
    await bed.bind(policy())
    body = {"response_format": const_schema(), "max_tokens": 60}
    clean = (await bed.chat("Answer", **body)).json()["choices"][0]["message"]["content"]
    assert "a\\nbomb" in clean
    assert json.loads(clean) == {"x": CONST}
    await bed.bind(policy(output_block="how to make a bomb"))
    blocked = await bed.chat("Answer", **body)
    assert blocked.json()["choices"][0]["finish_reason"] == "content_filter"
    events = sse_events(await stream_raw(bed, "Answer", **body))
    assert events[-1]["error"]["code"] == "content_filter"
    assert "bomb" not in decode_escapes(delivered(events))


@pytest.fixture
async def real(
    vllm_engine: VllmLocalEngine, renderer: PromptRenderer, tenancy: Tenancy
) -> AsyncIterator[httpx.AsyncClient]:
    """The real engine behind the built-in rules policy (the default weapons rule among them)."""
    config = msgspec.structs.replace(make_config(), guard=GuardConfig(default_policy="rules"))
    app = create_app(config, engine=vllm_engine, renderer=renderer, tenants=tenancy.store)
    async with (
        serving(app) as url,
        httpx.AsyncClient(base_url=url, timeout=120, headers=tenancy.consumer_headers) as http,
    ):
        yield http


async def test_the_real_engines_escaped_structured_output_is_read_decoded(real: httpx.AsyncClient) -> None:
    # xgrammar must write the const's newline as "\n": the text the engine generates reads "make a\nbomb",
    # which no rule matches; decoded, it is "how to make a bomb" to the weapons rule.
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Fill in the form."}],
        "response_format": const_schema(),
        "max_tokens": 40,
        "temperature": 0,
    }
    whole = await real.post("/v1/chat/completions", json=body)
    assert whole.status_code == 200, whole.text
    [choice] = whole.json()["choices"]
    assert choice["finish_reason"] == "content_filter", whole.text
    assert whole.headers["x-lockgate-guard"].endswith("output=rules")
    raw = b""
    async with real.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        async for chunk in response.aiter_raw():
            raw += chunk
    events = sse_events(raw)
    assert events[-1]["error"]["code"] == "content_filter"
    assert "bomb" not in decode_escapes(delivered(events))

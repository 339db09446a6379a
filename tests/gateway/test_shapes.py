"""The shapes of issue 9 through the whole gateway on the simulated engine (fast, exact): n choices,
required and named tool calls, json_schema answers, and what reaches the engine."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionToolParam

from engines.base import EngineDelta, EngineRequest
from engines.simulated import SimulatedEngine, SimulatorConfig
from gateway.app import create_app
from gateway.generation.prompts import PromptRenderer
from tests.conftest import MODEL, OutcomeLog, Tenancy, make_config, serving

PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
TOOLS: list[ChatCompletionToolParam] = [
    {"type": "function", "function": {"name": "forecast", "parameters": PARAMETERS}},
    {"type": "function", "function": {"name": "ping"}},
]


class RecordingEngine(SimulatedEngine):
    """The simulator, keeping every request it was sent."""

    def __init__(self) -> None:
        super().__init__(SimulatorConfig(decode_step_s=0.001, decode_step_s_per_seq=0.0), model_name=MODEL)
        self.requests: list[EngineRequest] = []

    def generate(self, req: EngineRequest) -> AsyncGenerator[EngineDelta, None]:
        self.requests.append(req)
        return super().generate(req)


@pytest.fixture
async def engine() -> AsyncIterator[RecordingEngine]:
    sim = RecordingEngine()
    await sim.start()
    yield sim
    await sim.shutdown()


@pytest.fixture
async def client(
    engine: RecordingEngine, renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> AsyncIterator[openai.AsyncOpenAI]:
    app = create_app(make_config(), engine=engine, renderer=renderer, tenants=tenancy.store, sink=outcomes)
    async with (
        serving(app) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=tenancy.consumer, max_retries=0) as sdk,
    ):
        yield sdk


async def test_n_choices_are_separate_engine_requests_merged_by_index(
    client: openai.AsyncOpenAI, engine: RecordingEngine, outcomes: OutcomeLog
) -> None:
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=5, seed=11, temperature=1.0
    )
    answer = raw.parse()
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert len({c.message.content for c in answer.choices}) == 3, "each choice has its own seed"
    sent = engine.requests[-3:]
    assert [r.sampling.seed for r in sent] == [11, 12, 13]
    assert len({r.request_id for r in sent}) == 3
    assert all(r.n == 1 and r.prompt_token_ids == sent[0].prompt_token_ids for r in sent)
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 15
    assert answer.usage.prompt_tokens == len(sent[0].prompt_token_ids)
    outcome = await outcomes.wait_for(raw.headers["x-request-id"])
    assert outcome.usage.completion_tokens == 15
    assert outcome.status == "completed"

    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        n=3,
        max_tokens=5,
        seed=11,
        temperature=1.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts = ["", "", ""]
    finishes: dict[int, str] = {}
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == [c.message.content for c in answer.choices]
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert usage is not None
    assert usage.completion_tokens == 15


async def test_required_and_named_calls_are_constrained_by_the_tool_schemas(
    client: openai.AsyncOpenAI, engine: RecordingEngine
) -> None:
    required = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Forecast for Oslo"}],
        tools=TOOLS,
        tool_choice="required",
    )
    constraint = engine.requests[-1].sampling.constraint
    assert constraint is not None
    schema = json.loads(constraint.schema)
    assert schema["type"] == "array"
    assert schema["maxItems"] == make_config().server.max_tool_calls
    calls = required.choices[0].message.tool_calls or []
    assert calls
    assert required.choices[0].finish_reason == "tool_calls"
    for call in calls:
        assert isinstance(call, openai.types.chat.ChatCompletionMessageFunctionToolCall)
        if call.function.name == "forecast":
            jsonschema.validate(json.loads(call.function.arguments), PARAMETERS)

    single = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Forecast for Oslo"}],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
    )
    assert json.loads(engine.requests[-1].sampling.constraint.schema)["maxItems"] == 1  # type: ignore[union-attr]
    assert len(single.choices[0].message.tool_calls or []) == 1

    named = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Forecast for Oslo"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "forecast"}},
        stream=True,
    )
    arguments = ""
    names = set()
    async for chunk in named:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                assert delta.index == 0
                names.add(delta.function.name if delta.function else None)
                arguments += (delta.function.arguments if delta.function else None) or ""
    assert names - {None} == {"forecast"}
    jsonschema.validate(json.loads(arguments), PARAMETERS)


async def test_json_schema_answers_validate_and_unsupported_features_are_named(
    client: openai.AsyncOpenAI,
) -> None:
    answer = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "A forecast please"}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "f", "schema": PARAMETERS, "strict": True},
        },
    )
    jsonschema.validate(json.loads(answer.choices[0].message.content or ""), PARAMETERS)
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "A forecast please"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "f", "schema": {"type": "number", "multipleOf": 0.5}},
            },
        )
    assert "multipleOf" in refused.value.message
    assert refused.value.body["param"] == "response_format.json_schema.schema"  # type: ignore[index]


async def test_everyday_fields_reach_the_engine(
    client: openai.AsyncOpenAI, engine: RecordingEngine, outcomes: OutcomeLog
) -> None:
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        logit_bias={"42": -100, "7": 3},
        metadata={"run": "nightly"},
        store=True,
        service_tier="auto",
        n=None,
        temperature=None,
        extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 2},
    )
    sampling = engine.requests[-1].sampling
    assert (sampling.frequency_penalty, sampling.presence_penalty) == (0.5, -0.5)
    assert sampling.logit_bias == ((42, -100.0), (7, 3.0))
    assert (sampling.top_k, sampling.min_p, sampling.repetition_penalty, sampling.min_tokens) == (
        5,
        0.1,
        1.2,
        2,
    )
    assert sampling.temperature == 1.0
    outcome = await outcomes.wait_for(raw.headers["x-request-id"])
    assert outcome.metadata == {"run": "nightly"}

"""Tools, structured outputs and the full sampling set, through the real `openai` SDK and LangChain, on the
real default model (SmolLM2-135M-Instruct on vLLM).

A 135M model is no agent: which tool it picks is often wrong. What these tests hold the gateway to is the
contract: a required or named call always parses and validates against the tool's schema, a json_schema
answer always parses into the client's model, a banned token never appears, n choices are returned and
charged, and an agent loop's history (SDK `model_dump()` output) is accepted.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import openai
import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from openai.types.chat import (
    ChatCompletionMessageFunctionToolCall,
    ChatCompletionMessageParam,
    ChatCompletionToolParam,
)
from pydantic import BaseModel, Field, SecretStr

from engines.vllm_local import VllmLocalEngine
from gateway.app import create_app
from gateway.generation.prompts import PromptRenderer
from tests.conftest import MODEL, OutcomeLog, Tenancy, make_config, serving

WEATHER: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
ADD: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPTS = [
    "What is the weather in Paris?",
    "Add 2 and 3.",
    "Is it raining in Tokyo? Use fahrenheit.",
    "What's 10 plus 32?",
    "Tell me a joke.",
    "Weather for Berlin please",
]


class City(BaseModel):
    """What the structured-output tests ask for."""

    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    # Bounded, as schemas for a small model should be: greedy, a 135M model may write digits forever.
    population: int = Field(ge=0, le=100_000_000)
    capital: bool


@pytest.fixture
async def gateway_url(
    vllm_engine: VllmLocalEngine, renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> AsyncIterator[str]:
    app = create_app(
        make_config(), engine=vllm_engine, renderer=renderer, tenants=tenancy.store, sink=outcomes
    )
    async with serving(app) as url:
        yield f"{url}/v1"


@pytest.fixture
async def client(gateway_url: str, tenancy: Tenancy) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=gateway_url, api_key=tenancy.consumer, max_retries=0) as sdk:
        yield sdk


def _validate_call(name: str, arguments: str) -> None:
    assert name in SCHEMAS, name
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


async def test_required_and_named_calls_always_parse_and_validate(client: openai.AsyncOpenAI) -> None:
    async def ask(prompt: str, choice: Any, seed: int) -> openai.types.chat.ChatCompletion:
        return await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=80,
            temperature=1.0,
            seed=seed,
        )

    named = {"type": "function", "function": {"name": "get_weather"}}
    answers = await asyncio.gather(
        *(ask(p, "required", i) for i, p in enumerate(PROMPTS)),
        *(ask(p, named, i) for i, p in enumerate(PROMPTS)),
    )
    for i, answer in enumerate(answers):
        choice = answer.choices[0]
        # "length": max_tokens cut a further call short; every whole call before it is returned.
        assert choice.finish_reason in ("tool_calls", "length"), choice
        calls = choice.message.tool_calls or []
        assert calls, choice
        for call in calls:
            assert isinstance(call, ChatCompletionMessageFunctionToolCall)
            assert call.id
            _validate_call(call.function.name, call.function.arguments)
        if i >= len(PROMPTS):
            assert [
                c.function.name for c in calls if isinstance(c, ChatCompletionMessageFunctionToolCall)
            ] == ["get_weather"]


async def test_parallel_tool_calls_false_yields_at_most_one_call(client: openai.AsyncOpenAI) -> None:
    answers = await asyncio.gather(
        *(
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"{p} Call every function you can, several times."}],
                tools=TOOLS,
                tool_choice=choice,
                parallel_tool_calls=False,
                max_tokens=80,
                temperature=1.0,
                seed=i,
            )
            for i, p in enumerate(PROMPTS[:3])
            for choice in ("required", "auto")
        )
    )
    for answer in answers:
        assert len(answer.choices[0].message.tool_calls or []) <= 1


async def test_a_tool_round_trip_whole_with_sdk_history(client: openai.AsyncOpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = await client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0
    )
    message = first.choices[0].message
    assert message.tool_calls
    # What agent loops send back: the SDK's own message object, nulls and all.
    dumped = message.model_dump()
    assert dumped["content"] is None
    assert "refusal" in dumped
    assert "audio" in dumped
    messages.append(dumped)
    for call in message.tool_calls:
        messages.append(
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}
        )
    final = await client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=40, temperature=0
    )
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    if answer.finish_reason != "tool_calls":
        assert answer.message.content


async def test_a_tool_round_trip_streamed_assembles_in_the_sdk(client: openai.AsyncOpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Add 2 and 3."}]
    async with client.chat.completions.stream(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=40,
        temperature=0,
    ) as stream:
        async for _event in stream:
            pass
        first = await stream.get_final_completion()
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    [call] = message.tool_calls or []
    assert call.function.name == "add"
    _validate_call("add", call.function.arguments)
    # The same request whole gives the same call: streamed deltas assemble to the whole answer.
    whole = await client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=40,
        temperature=0,
    )
    [whole_call] = whole.choices[0].message.tool_calls or []
    assert isinstance(whole_call, ChatCompletionMessageFunctionToolCall)
    assert json.loads(whole_call.function.arguments) == json.loads(call.function.arguments)
    followup: list[Any] = [
        *messages,
        message.model_dump(),
        {"role": "tool", "tool_call_id": call.id, "content": "5"},
    ]
    stream2 = await client.chat.completions.create(
        model=MODEL, messages=followup, tools=TOOLS, max_tokens=30, temperature=0, stream=True
    )
    parts = [c.choices[0].delta.content or "" async for c in stream2 if c.choices]
    assert "".join(parts)


async def test_json_schema_parses_into_the_clients_model_every_time(client: openai.AsyncOpenAI) -> None:
    cities = ["Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Cairo"]
    answers = await asyncio.gather(
        *(
            client.chat.completions.parse(
                model=MODEL,
                messages=[{"role": "user", "content": f"Describe the city of {city} as JSON."}],
                response_format=City,
                max_tokens=120,
                temperature=1.0,
                seed=i,
            )
            for i, city in enumerate(cities)
        )
    )
    for answer in answers:
        assert answer.choices[0].finish_reason == "stop"
        assert isinstance(answer.choices[0].message.parsed, City)


async def test_json_object_is_a_json_object(client: openai.AsyncOpenAI) -> None:
    answer = await client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "Reply with a JSON object holding the name and age of a person."}
        ],
        response_format={"type": "json_object"},
        max_tokens=200,
        temperature=0,
    )
    content = answer.choices[0].message.content or ""
    assert answer.choices[0].finish_reason == "stop", content
    assert isinstance(json.loads(content), dict)


async def test_n_choices_are_returned_and_charged(client: openai.AsyncOpenAI, outcomes: OutcomeLog) -> None:
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say something about the sea."}],
        n=2,
        max_tokens=12,
        temperature=1.0,
        seed=7,
        logprobs=True,
    )
    answer = raw.parse()
    assert [c.index for c in answer.choices] == [0, 1]
    per_choice = [len(c.logprobs.content or []) for c in answer.choices if c.logprobs]
    assert answer.usage is not None
    assert answer.usage.completion_tokens == sum(per_choice)
    outcome = await outcomes.wait_for(raw.headers["x-request-id"])
    assert outcome.usage.completion_tokens == sum(per_choice)
    assert outcome.usage.prompt_tokens == answer.usage.prompt_tokens

    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say something about the sea."}],
        n=2,
        max_tokens=12,
        temperature=1.0,
        seed=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts = {0: "", 1: ""}
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert [texts[0], texts[1]] == [c.message.content for c in answer.choices]
    assert usage is not None
    assert usage.completion_tokens == answer.usage.completion_tokens


async def test_a_banned_token_never_appears(client: openai.AsyncOpenAI, renderer: PromptRenderer) -> None:
    question: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "What is the capital of France?"}
    ]
    free = await client.chat.completions.create(
        model=MODEL, messages=question, max_tokens=10, temperature=0, logprobs=True
    )
    assert free.choices[0].logprobs is not None
    tokens = [e.token for e in free.choices[0].logprobs.content or []]
    banned = tokens[0]
    [banned_id] = renderer.tokenizer.encode(banned, add_special_tokens=False)
    assert renderer.tokenizer.decode([banned_id]) == banned
    biased = await client.chat.completions.create(
        model=MODEL,
        messages=question,
        max_tokens=10,
        temperature=0,
        logprobs=True,
        logit_bias={str(banned_id): -100},
    )
    assert biased.choices[0].logprobs is not None
    assert banned not in [e.token for e in biased.choices[0].logprobs.content or []]


async def test_penalties_and_vllm_sampling_extensions_are_accepted(
    gateway_url: str, tenancy: Tenancy
) -> None:
    async with openai.AsyncOpenAI(base_url=gateway_url, api_key=tenancy.consumer, max_retries=0) as sdk:
        answer = await sdk.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Count to five."}],
            max_tokens=12,
            frequency_penalty=0.5,
            presence_penalty=0,
            metadata={"team": "search"},
            store=False,
            service_tier="auto",
            extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 6},
        )
    assert answer.usage is not None
    assert answer.usage.completion_tokens >= 6


async def test_langchain_tools_and_structured_output(gateway_url: str, tenancy: Tenancy) -> None:
    @tool
    def get_weather(city: str, unit: str) -> str:
        """The current weather in a city (unit: celsius or fahrenheit)."""
        return f"21 degrees {unit} in {city}"

    llm = ChatOpenAI(
        model=MODEL, base_url=gateway_url, api_key=SecretStr(tenancy.consumer), max_retries=0, temperature=0
    )
    bound = llm.bind_tools([get_weather], tool_choice="get_weather")
    question = HumanMessage("What is the weather in Paris?")
    reply = await bound.ainvoke([question])
    assert isinstance(reply, AIMessage)
    [call] = reply.tool_calls
    assert call["name"] == "get_weather"
    assert set(call["args"]) == {"city", "unit"}
    result = ToolMessage(content=get_weather.invoke(call["args"]), tool_call_id=call["id"])
    final = await llm.bind_tools([get_weather]).ainvoke([question, reply, result])
    assert isinstance(final, AIMessage)
    # Streamed tool calls assemble into the same shape.
    merged: Any = None
    async for chunk in bound.astream([question]):
        merged = chunk if merged is None else merged + chunk
    assert isinstance(merged, AIMessageChunk)
    assert [c["name"] for c in merged.tool_calls] == ["get_weather"]

    structured = llm.with_structured_output(City, method="json_schema")
    city = await structured.ainvoke("Describe Paris as JSON.")
    assert isinstance(city, City)

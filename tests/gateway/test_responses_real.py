"""`/v1/responses` on the real default model (SmolLM2-135M-Instruct on vLLM) with the `openai` SDK and
openai-agents: whole, streamed through the SDK's accumulator, a function tool round trip, `responses.parse`,
`previous_response_id`, and an agent with its default model class.

As in `test_clients.py`, a 135M model is no agent; what these hold the gateway to is the contract: a required
call parses and validates against the tool's schema, a `text_format` answer parses into the client's model,
the streamed deltas are the final text, and a continuation's prompt holds the conversation before it.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import agents
import jsonschema
import openai
import pytest
from openai.types.responses import FunctionToolParam
from pydantic import Field

from tests.conftest import MODEL
from tests.gateway.test_clients import City

PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER: FunctionToolParam = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": PARAMETERS,
    "strict": True,
}


@pytest.fixture
def client(real_client: openai.AsyncOpenAI) -> openai.AsyncOpenAI:
    """The SDK on a gateway over the real default model (`tests.conftest.real_client`)."""
    return real_client


async def test_whole_streamed_and_continued(client: openai.AsyncOpenAI) -> None:
    first = await client.responses.create(
        model=MODEL, input="Name a colour.", instructions="Answer in one word.", max_output_tokens=12
    )
    assert first.status in ("completed", "incomplete")
    assert first.output_text
    assert first.usage is not None
    assert first.usage.input_tokens > 0
    assert 0 < first.usage.output_tokens <= 12
    assert first.to_dict()["store"] is True
    async with client.responses.stream(model=MODEL, input="Say hello.", max_output_tokens=12) as stream:
        seen = [event async for event in stream]
    deltas = [e.delta for e in seen if e.type == "response.output_text.delta"]
    # The SDK's accumulator: `response.completed`, or `response.incomplete` at the token limit.
    last = seen[-1]
    assert last.type in ("response.completed", "response.incomplete")
    final = last.response
    assert final.output_text == "".join(deltas) != ""
    # The stored conversation comes before the new input.
    second = await client.responses.create(
        model=MODEL, input="And another?", previous_response_id=first.id, max_output_tokens=12
    )
    assert second.usage is not None
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert (await client.responses.retrieve(second.id)).output_text == second.output_text


async def test_a_function_tool_round_trip_and_parsed_output(client: openai.AsyncOpenAI) -> None:
    question = "What is the weather in Paris?"
    first = await client.responses.create(
        model=MODEL, input=question, tools=[WEATHER], tool_choice="required", max_output_tokens=80
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls, first.output
    for call in calls:
        assert call.name == "get_weather"
        assert call.call_id
        jsonschema.validate(json.loads(call.arguments), PARAMETERS)
    items: list[Any] = [{"role": "user", "content": question}]
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items += [{"type": "function_call_output", "call_id": c.call_id, "output": "Sunny, 21 C."} for c in calls]
    answer = await client.responses.create(model=MODEL, input=items, tools=[WEATHER], max_output_tokens=24)
    assert answer.status in ("completed", "incomplete")
    assert answer.usage is not None
    assert first.usage is not None
    assert answer.usage.input_tokens > first.usage.input_tokens  # the call and its result were read
    parsed = await client.responses.parse(
        model=MODEL, input="Describe Paris.", text_format=City, max_output_tokens=120
    )
    assert parsed.status == "completed"
    assert isinstance(parsed.output_parsed, City)


async def test_an_agent_with_its_default_model_class(client: openai.AsyncOpenAI) -> None:
    agents.set_tracing_disabled(True)  # its traces would go to OpenAI's servers
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return "Sunny."

    agent = agents.Agent(
        name="weather",
        instructions="Use the tool.",
        model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
        tools=[get_weather],
        # A 135M model's free text rarely ends before its limit: the tool's result is the run's output. One
        # call: allowed several, the model may go on calling (three calls took 59 tokens in one run, and
        # another ran into the limit, `incomplete`, which the agent raises).
        model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=80),
        tool_use_behavior="stop_on_first_tool",
    )
    result = await agents.Runner.run(agent, "What is the weather in Rome?", max_turns=2)
    assert cities
    assert result.final_output == "Sunny."


async def test_an_agent_tool_loop_of_three_turns(client: openai.AsyncOpenAI) -> None:
    # Each turn must call the tool and sees every earlier call and result; the run ends after the third
    # turn's tool (a 135M model's free text would run to its limit, so the loop's end is the tool's). The
    # note is free text: unbounded, a long one ended a turn `incomplete` at 60 tokens (batch composition
    # changes a CPU engine's numerics) and, in bfloat16 on a CPU with native bf16, at 160; its schema now
    # bounds it (the gateway's grammar holds the model to `maxLength`), so 160 tokens a turn always suffice.
    agents.set_tracing_disabled(True)
    seen: list[str] = []

    @agents.function_tool
    def next_step(note: Annotated[str, Field(max_length=60)]) -> str:
        """Record a step of the plan and get the next one."""
        seen.append(note)
        return f"Step {len(seen)} recorded."

    def after_three(
        _context: agents.RunContextWrapper[Any], results: list[agents.FunctionToolResult]
    ) -> agents.ToolsToFinalOutputResult:
        return agents.ToolsToFinalOutputResult(
            is_final_output=len(seen) >= 3, final_output=results[-1].output
        )

    agent = agents.Agent(
        name="planner",
        instructions="Plan a trip, one step per tool call.",
        model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
        tools=[next_step],
        model_settings=agents.ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=160
        ),
        reset_tool_choice=False,
        tool_use_behavior=after_three,
    )
    result = await agents.Runner.run(agent, "Plan a day in Rome.", max_turns=3)
    assert len(result.raw_responses) == 3
    assert len(seen) == 3
    assert result.final_output == "Step 3 recorded."
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item"] * 3
    # Each turn's prompt held the conversation so far: the inputs grow turn by turn.
    inputs = [r.usage.input_tokens for r in result.raw_responses]
    assert inputs[0] < inputs[1] < inputs[2]

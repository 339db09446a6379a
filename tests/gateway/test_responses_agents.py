"""openai-agents against `/v1/responses` with its default model class (`OpenAIResponsesModel`): an agent
with a function tool runs its loop (a call, the tool's result sent back, the answer) through the gateway."""

from __future__ import annotations

from collections.abc import AsyncIterator

import agents
import openai
import pytest

from engines.simulated import SimulatedEngine
from gateway.app import create_app
from gateway.generation.prompts import PromptRenderer
from tests.conftest import MODEL, OutcomeLog, Tenancy, make_config, serving


@pytest.fixture
async def client(
    sim_engine: SimulatedEngine, renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> AsyncIterator[openai.AsyncOpenAI]:
    agents.set_tracing_disabled(True)  # its traces would go to OpenAI's servers
    app = create_app(
        make_config(), engine=sim_engine, renderer=renderer, tenants=tenancy.store, sink=outcomes
    )
    async with (
        serving(app) as url,
        openai.AsyncOpenAI(base_url=url + "/v1", api_key=tenancy.consumer) as http,
    ):
        yield http


async def test_an_agent_runs_its_tool_loop_through_the_responses_api(client: openai.AsyncOpenAI) -> None:
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny in {city}."

    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather.",
        model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
        tools=[get_weather],
        # The model must call the tool, whose result is the run's output (the simulated engine ends free
        # text only at its token limit, which the agent reports as a failed turn).
        model_settings=agents.ModelSettings(tool_choice="required", max_tokens=256),
        tool_use_behavior="stop_on_first_tool",
    )
    result = await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4)
    assert calls
    # The model may call the tool more than once in a turn (parallel calls): the first result ends the run.
    assert result.final_output in {f"Sunny in {city}." for city in calls}
    kinds = [item.type for item in result.new_items]
    assert kinds[0] == "tool_call_item"
    assert kinds[-1] == "tool_call_output_item"
    streamed = agents.Runner.run_streamed(agent, "And in Rome?", max_turns=4)
    events = [event async for event in streamed.stream_events()]
    assert events
    assert streamed.final_output in {f"Sunny in {city}." for city in calls}
    assert len(calls) >= 2

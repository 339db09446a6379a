"""openai-agents against `/v1/responses` with its default model class (`OpenAIResponsesModel`): an agent
with a function tool runs its loop (a call, the tool's result sent back, the answer) through the gateway,
and a loop of three turns (two tool calls, then an answer that ends by itself) on a scripted engine."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

import agents
import openai
import pytest

from engines.base import EngineDelta, EngineRequest
from engines.simulated import SimulatedEngine
from gateway.app import create_app
from gateway.generation.prompts import PromptRenderer
from tests.conftest import MODEL, OutcomeLog, Tenancy, make_config, serving
from tests.gateway.test_guard_delivered import ScriptedEngine, pieces


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


class TurnsEngine(ScriptedEngine):
    """The served simulator, answering its n-th generation with `turns[n]` (then as the simulator does)."""

    def __init__(self, turns: list[str]) -> None:
        super().__init__()
        self.turns = turns

    def generate(self, req: EngineRequest) -> AsyncGenerator[EngineDelta, None]:
        self.script = pieces(self.turns.pop(0), 7) if self.turns else []
        return super().generate(req)


def _tool_call(city: str) -> str:
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>'


@pytest.mark.parametrize("streamed", [False, True])
async def test_an_agent_runs_a_tool_loop_of_three_turns(
    streamed: bool, renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    # The model calls a tool, sees its result, calls it again, and answers in text that ends by itself: the
    # agent's default behaviour (run the model again after each tool) with the tool choice left to the model.
    answer = "Paris is sunny and Rome is rainy."
    engine = TurnsEngine([_tool_call("Paris"), _tool_call("Rome"), answer])
    weather = {"Paris": "Sunny.", "Rome": "Rainy."}
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return weather[city]

    agents.set_tracing_disabled(True)
    await engine.start()
    app = create_app(make_config(), engine=engine, renderer=renderer, tenants=tenancy.store, sink=outcomes)
    async with (
        serving(app) as url,
        openai.AsyncOpenAI(base_url=url + "/v1", api_key=tenancy.consumer) as client,
    ):
        agent = agents.Agent(
            name="weather",
            instructions="Look up each city, then answer.",
            model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
            tools=[get_weather],
            model_settings=agents.ModelSettings(max_tokens=128),
        )
        question = "What is the weather in Paris and in Rome?"
        if streamed:
            run = agents.Runner.run_streamed(agent, question, max_turns=5)
            assert [event async for event in run.stream_events()]
            final, items, raw = run.final_output, run.new_items, run.raw_responses
        else:
            result = await agents.Runner.run(agent, question, max_turns=5)
            final, items, raw = result.final_output, result.new_items, result.raw_responses
    await engine.shutdown()
    assert calls == ["Paris", "Rome"]
    assert final == answer
    assert [item.type for item in items] == [
        "tool_call_item",
        "tool_call_output_item",
        "tool_call_item",
        "tool_call_output_item",
        "message_output_item",
    ]
    assert len(raw) == 3
    # Each turn sent the whole conversation so far: the prompts grow with each call and its result.
    prompts = [len(req.prompt_token_ids) for req in engine.requests]
    assert len(prompts) == 3
    assert prompts[0] < prompts[1] < prompts[2]

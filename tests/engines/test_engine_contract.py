"""The contract every Engine keeps, run on each kind through the `contract_engine` fixture.

Assertions are about structure and invariants only, never exact tokens or text, so they hold for a real
model as well as for the simulator.
"""

from __future__ import annotations

import asyncio
import json
import math
import uuid
from collections.abc import AsyncGenerator
from typing import Any

import jsonschema
import pytest

from engines.base import (
    Engine,
    EngineDelta,
    EngineError,
    EngineRequest,
    EngineRequestError,
    OutputConstraint,
    SamplingSpec,
)

PROMPT = tuple(range(100, 140))  # valid ids in any vocabulary of 1000 or more
# Prompts that decode to whole words in the default model's vocabulary (PROMPT decodes to stray bytes,
# which the real engine's incremental detokenizer puts in front of the output text).
TEXT_PROMPT = tuple(range(300, 320))
OTHER_TEXT_PROMPT = tuple(range(1000, 1020))


def _request(sampling: SamplingSpec, prompt: tuple[int, ...] = PROMPT, n: int = 1) -> EngineRequest:
    return EngineRequest(
        request_id=f"contract-{uuid.uuid4().hex}", prompt_token_ids=prompt, sampling=sampling, n=n
    )


async def _collect(engine: Engine, req: EngineRequest) -> list[EngineDelta]:
    return [delta async for delta in engine.generate(req)]


def _token_ids(deltas: list[EngineDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


async def test_stream_ends_with_one_final_delta_with_usage(contract_engine: Engine) -> None:
    deltas = await _collect(contract_engine, _request(SamplingSpec(max_tokens=8, temperature=0.0)))
    assert deltas
    finals = [d for d in deltas if d.finish_reason is not None]
    assert finals == [deltas[-1]]
    assert all(d.usage is None for d in deltas[:-1])
    usage = deltas[-1].usage
    assert usage is not None
    assert usage.prompt_tokens == len(PROMPT)
    assert usage.completion_tokens == len(_token_ids(deltas))
    assert 0 < usage.completion_tokens <= 8
    assert usage.cached_tokens >= 0


async def test_small_max_tokens_finishes_with_length(contract_engine: Engine) -> None:
    # A stop on EOS within 5 tokens is possible for a real model only with a degenerate prompt.
    deltas = await _collect(contract_engine, _request(SamplingSpec(max_tokens=5, temperature=0.0)))
    assert deltas[-1].finish_reason == "length"
    assert len(_token_ids(deltas)) == 5


async def test_same_seed_gives_same_tokens(contract_engine: Engine) -> None:
    sampling = SamplingSpec(max_tokens=12, temperature=1.0, seed=1234)
    first = await _collect(contract_engine, _request(sampling))
    second = await _collect(contract_engine, _request(sampling))
    assert _token_ids(first) == _token_ids(second)


async def test_greedy_is_repeatable(contract_engine: Engine) -> None:
    sampling = SamplingSpec(max_tokens=12, temperature=0.0)
    first = await _collect(contract_engine, _request(sampling))
    second = await _collect(contract_engine, _request(sampling))
    assert _token_ids(first) == _token_ids(second)
    assert "".join(d.text for d in first) == "".join(d.text for d in second)


async def test_closing_stream_frees_the_request(contract_engine: Engine) -> None:
    stream = contract_engine.generate(_request(SamplingSpec(max_tokens=200, temperature=1.0)))
    # Closing is how cancellation reaches the engine, so the stream must be closable.
    assert isinstance(stream, AsyncGenerator)
    first = await anext(stream)
    assert first.finish_reason is None
    await stream.aclose()
    # A real engine may report the abort a little later, so poll for up to ~2 s.
    for _ in range(40):
        load = await contract_engine.load()
        if load.running == 0 and load.waiting == 0:
            break
        await asyncio.sleep(0.05)
    assert (load.running, load.waiting) == (0, 0)


async def test_load_reports_the_most_sequences_run_at_once(contract_engine: Engine) -> None:
    # The router holds requests beyond it in the gateway's fair queue (routing.replicas).
    load = await contract_engine.load()
    assert load.max_running > 0
    assert load.running <= load.max_running


async def test_logprobs_shape(contract_engine: Engine) -> None:
    deltas = await _collect(
        contract_engine, _request(SamplingSpec(max_tokens=6, temperature=1.0, seed=7, logprobs=2))
    )
    assert _token_ids(deltas)
    for delta in deltas:
        assert delta.logprobs is not None
        assert [lp.token_id for lp in delta.logprobs] == list(delta.token_ids)
        for lp in delta.logprobs:
            assert lp.logprob <= 0.0
            assert len(lp.top) == 2
            assert all(alt.logprob <= 0.0 for alt in lp.top)


async def test_over_max_model_len_is_refused(contract_engine: Engine) -> None:
    too_many = contract_engine.max_model_len - len(PROMPT) + 1
    with pytest.raises(EngineError):
        await _collect(contract_engine, _request(SamplingSpec(max_tokens=too_many)))


async def test_health_is_ready(contract_engine: Engine) -> None:
    assert (await contract_engine.health()).ready


async def test_score_next_token_scores_exactly_the_named_ids(contract_engine: Engine) -> None:
    named = [5, 17, 17, 400, 999]  # a duplicate is scored once
    scores = await contract_engine.score_next_token(list(PROMPT), named, priority=-10)
    assert sorted(scores) == [5, 17, 400, 999]
    assert all(v <= 0.0 for v in scores.values())
    # Log-probabilities of distinct first tokens: their probabilities sum to at most 1.
    assert sum(math.exp(v) for v in scores.values()) <= 1.0 + 1e-6
    # Greedy scoring of the same prompt is repeatable, and an id's value does not depend on the others named.
    again = await contract_engine.score_next_token(list(PROMPT), [999, 5])
    assert again == pytest.approx({5: scores[5], 999: scores[999]}, abs=1e-4)


async def test_score_next_token_refuses_a_prompt_with_no_room(contract_engine: Engine) -> None:
    with pytest.raises(EngineError):
        await contract_engine.score_next_token([100] * contract_engine.max_model_len, [5])


# Bounded lengths and values, so that a small model under the grammar finishes well within max_tokens.
CITY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}


def _tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    # One item of vLLM's tool_choice="required" schema (vllm.tool_parsers.utils).
    return {
        "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
        "required": ["name", "parameters"],
    }


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"utc_offset": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["utc_offset"],
    "additionalProperties": False,
}
REQUIRED_TOOL_SCHEMA: dict[str, Any] = {
    "type": "array",
    "minItems": 1,
    "items": {"type": "object", "anyOf": [_tool("get_weather", WEATHER), _tool("get_time", TIME)]},
}


def _constrained(kind: str, schema: dict[str, Any] | None = None, **sampling: Any) -> SamplingSpec:
    constraint = OutputConstraint(kind=kind, schema=json.dumps(schema) if schema else "")  # type: ignore[arg-type]
    return SamplingSpec(**{"max_tokens": 120, "constraint": constraint, **sampling})


def _finished_json(deltas: list[EngineDelta]) -> Any:
    """The JSON value the stream's text holds; the stream must have ended because the JSON was complete."""
    text = "".join(d.text for d in deltas)
    assert deltas[-1].finish_reason == "stop", text
    return json.loads(text)


async def test_json_schema_constraint_gives_a_valid_instance(contract_engine: Engine) -> None:
    samplings = [
        (_constrained("json_schema", CITY_SCHEMA, temperature=0.0), TEXT_PROMPT),
        (_constrained("json_schema", CITY_SCHEMA, temperature=0.0), OTHER_TEXT_PROMPT),
        (_constrained("json_schema", CITY_SCHEMA, temperature=1.0, seed=1), TEXT_PROMPT),
        (_constrained("json_schema", CITY_SCHEMA, temperature=1.0, seed=2), OTHER_TEXT_PROMPT),
    ]
    # Concurrent: one batch on a real engine.
    runs = await asyncio.gather(*(_collect(contract_engine, _request(s, p)) for s, p in samplings))
    for deltas in runs:
        jsonschema.validate(_finished_json(deltas), CITY_SCHEMA)


async def test_json_object_constraint_gives_an_object(contract_engine: Engine) -> None:
    samplings = [
        (_constrained("json_object", temperature=0.0), TEXT_PROMPT),
        (_constrained("json_object", temperature=1.0, seed=5), OTHER_TEXT_PROMPT),
    ]
    runs = await asyncio.gather(*(_collect(contract_engine, _request(s, p)) for s, p in samplings))
    for deltas in runs:
        assert isinstance(_finished_json(deltas), dict)


async def test_required_tool_call_schema_gives_calls(contract_engine: Engine) -> None:
    sampling = _constrained("json_schema", REQUIRED_TOOL_SCHEMA, temperature=0.0, max_tokens=160)
    calls = _finished_json(await _collect(contract_engine, _request(sampling, TEXT_PROMPT)))
    jsonschema.validate(calls, REQUIRED_TOOL_SCHEMA)
    assert isinstance(calls, list)
    assert len(calls) >= 1
    for call in calls:
        assert call["name"] in ("get_weather", "get_time")
        jsonschema.validate(call["parameters"], WEATHER if call["name"] == "get_weather" else TIME)


async def test_logit_bias_ban_keeps_a_token_out(contract_engine: Engine) -> None:
    greedy = _token_ids(
        await _collect(contract_engine, _request(SamplingSpec(max_tokens=4, temperature=0.0), TEXT_PROMPT))
    )
    banned = greedy[0]
    sampling = SamplingSpec(max_tokens=4, temperature=0.0, logit_bias=((banned, -100.0),))
    deltas = await _collect(contract_engine, _request(sampling, TEXT_PROMPT))
    assert _token_ids(deltas)
    assert banned not in _token_ids(deltas)


async def test_min_tokens_holds_back_a_stop(contract_engine: Engine) -> None:
    free = await _collect(contract_engine, _request(SamplingSpec(max_tokens=8, temperature=0.0), TEXT_PROMPT))
    # A stop string in the first token with visible text: without min_tokens the output would end there.
    stop = next(d.text for d in free if d.text.strip()).strip()[:1]
    sampling = SamplingSpec(max_tokens=8, temperature=0.0, stop=(stop,), min_tokens=6)
    deltas = await _collect(contract_engine, _request(sampling, TEXT_PROMPT))
    assert len(_token_ids(deltas)) >= 6
    assert deltas[-1].finish_reason in ("stop", "length")


async def test_penalties_top_k_and_min_p_are_accepted(contract_engine: Engine) -> None:
    sampling = SamplingSpec(
        max_tokens=6,
        temperature=1.0,
        seed=3,
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        repetition_penalty=1.2,
        top_k=20,
        min_p=0.05,
    )
    deltas = await _collect(contract_engine, _request(sampling))
    assert deltas[-1].finish_reason in ("stop", "length")
    assert 0 < len(_token_ids(deltas)) <= 6


async def test_n_above_one_is_refused(contract_engine: Engine) -> None:
    with pytest.raises(EngineRequestError):
        await _collect(contract_engine, _request(SamplingSpec(max_tokens=4), n=2))

"""The contract every Engine keeps, run on each kind through the `contract_engine` fixture.

Assertions are about structure and invariants only, never exact tokens or text, so they hold for a real
model as well as for the simulator.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import AsyncGenerator

import pytest

from engines.base import (
    Engine,
    EngineDelta,
    EngineError,
    EngineRequest,
    SamplingSpec,
)

PROMPT = tuple(range(100, 140))  # valid ids in any vocabulary of 1000 or more


def _request(sampling: SamplingSpec, prompt: tuple[int, ...] = PROMPT) -> EngineRequest:
    return EngineRequest(
        request_id=f"contract-{uuid.uuid4().hex}", prompt_token_ids=prompt, sampling=sampling
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

"""Scoring named token ids on the real vLLM engine while other requests share its steps."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from engines.base import EngineDelta, EngineRequest, SamplingSpec
from engines.vllm_local import VllmLocalEngine

PROMPT = tuple(range(2000, 2060))
NAMED = [18437, 10082, 2991, 6494, 20408, 34806, 16872]


def _request(max_tokens: int) -> EngineRequest:
    return EngineRequest(
        request_id=f"topk-{uuid.uuid4().hex}",
        prompt_token_ids=PROMPT,
        sampling=SamplingSpec(max_tokens=max_tokens, temperature=0.0, logprobs=3, ignore_eos=True),
    )


def _tops(deltas: list[EngineDelta]) -> list[dict[int, float]]:
    return [{alt.token_id: alt.logprob for alt in lp.top} for d in deltas for lp in d.logprobs or ()]


# In bfloat16 (the dtype on hosts with native bf16) logits of this model's size come in steps of 0.125, so a
# request's logprobs may move by a step when the batch it shares a step with changes; that is rounding, not
# what this test is about. (float32 moves far less.)
QUANTUM = 0.125


async def test_scoring_leaves_the_top_logprobs_of_a_shared_step_intact(vllm_engine: VllmLocalEngine) -> None:
    """vLLM 0.32 would hand a top-k request in the same step token 0 at -inf as its alternatives (see
    engines.vllm_local._patch_sampler); it must get its own top-k, as when it runs alone."""
    alone = _tops([d async for d in vllm_engine.generate(_request(24))])
    score_alone = await vllm_engine.score_next_token(PROMPT[:40], NAMED)

    async def generate() -> list[EngineDelta]:
        return [d async for d in vllm_engine.generate(_request(24))]

    task = asyncio.create_task(generate())
    scores = []
    while not task.done():  # score again and again while the generation runs, sharing its steps
        scores.append(await vllm_engine.score_next_token(PROMPT[:40], NAMED, priority=-10))
    shared = _tops(await task)
    assert len(scores) >= 2
    assert len(shared) == len(alone) == 24
    for position_alone, position_shared in zip(alone, shared, strict=True):
        assert len(position_shared) == 3
        assert 0 not in position_shared
        assert all(-50.0 < v <= 0.0 for v in position_shared.values())
        common = position_shared.keys() & position_alone.keys()
        assert len(common) >= 2  # a tie at the third place may go either way
        for t in common:
            assert position_shared[t] == pytest.approx(position_alone[t], abs=2 * QUANTUM + 1e-3)
    for score in scores:
        assert set(score) == set(NAMED)
        assert score == pytest.approx(score_alone, abs=2 * QUANTUM + 1e-3)

"""Bounded engine steps on the real vLLM engine: a long prompt is prefilled in chunks of the measured step
budget, so it neither stalls running streams nor delays an abort by more than about one step.

Guarantees are checked in engine steps (counted from vLLM's per-step scheduler stats), never in seconds:
the seconds one step takes on this host are what the budget was measured for, and what `ops/bench/steps`
reports.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import uuid

from engines.base import EngineRequest, SamplingSpec
from engines.vllm_local import VllmLocalEngine
from tests.conftest import assert_vllm_idle


def request(prompt_len: int, max_tokens: int) -> EngineRequest:
    rng = random.Random()
    return EngineRequest(
        request_id=uuid.uuid4().hex,
        # Random ordinary tokens under a fresh salt: nothing of it is in the prefix cache.
        prompt_token_ids=tuple(rng.randrange(1_000, 30_000) for _ in range(prompt_len)),
        sampling=SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        cache_salt=uuid.uuid4().hex,
    )


async def test_the_budget_was_measured_for_the_step_target(vllm_engine: VllmLocalEngine) -> None:
    profile = vllm_engine.profile
    assert profile is not None
    budget = vllm_engine.max_num_batched_tokens
    assert 16 <= budget <= vllm_engine.max_model_len
    assert budget % 16 == 0
    # What the profile predicts for a full step fits the target, unless the host cannot meet it at all.
    assert vllm_engine.step_seconds is not None
    assert vllm_engine.step_seconds <= vllm_engine.step_target_s or budget == 16
    # and the engine's health (what `/readyz` shows an operator) carries it.
    assert (await vllm_engine.health()).step_seconds == vllm_engine.step_seconds


async def test_a_long_prompt_delays_running_streams_by_about_one_step(vllm_engine: VllmLocalEngine) -> None:
    budget = vllm_engine.max_num_batched_tokens
    arrivals: list[int] = []  # the engine's step count when each token of the decoding stream arrived
    started = asyncio.Event()

    async def decode() -> None:
        async for delta in vllm_engine.generate(request(16, vllm_engine.max_model_len - 64)):
            arrivals.extend([vllm_engine.steps.count] * len(delta.token_ids))
            if len(arrivals) >= 3:
                started.set()

    decoding = asyncio.create_task(decode())
    try:
        await started.wait()
        prompt_len = 1500
        before = vllm_engine.steps.count
        deltas = [d async for d in vllm_engine.generate(request(prompt_len, 1))]
        after = vllm_engine.steps.count
    finally:
        decoding.cancel()
        await asyncio.gather(decoding, return_exceptions=True)
    assert deltas[-1].usage is not None
    assert deltas[-1].usage.prompt_tokens == prompt_len
    # Chunked: the prefill took at least one step per `budget` tokens (fewer when the decode shares them).
    assert after - before >= prompt_len // budget
    during = [step for step in arrivals if before < step <= after]
    # The decoding stream kept getting tokens all along: at most two steps between two of its tokens.
    assert len(during) >= (after - before) // 2, (before, after, during)
    gaps = [b - a for a, b in itertools.pairwise([before, *during, after])]
    assert max(gaps) <= 2, gaps


async def test_a_seeded_request_whose_prompt_spans_several_steps(vllm_engine: VllmLocalEngine) -> None:
    """vLLM's CPU worker cannot take back a draw made after a partial prefill (engines/vllm_cpu_seed.py): with
    chunked prefill a seeded request used to kill the engine core. It must work, and repeat exactly."""
    prompt = request(3 * vllm_engine.max_num_batched_tokens + 5, 1).prompt_token_ids
    sampling = SamplingSpec(max_tokens=12, temperature=1.0, seed=99)
    runs = []
    for _ in range(2):
        # Alone in the engine, prefix cache empty: the same batches and prefill chunks each time (a request
        # the previous test aborted may still be decoding, and a batch changes the logits' last bits).
        await assert_vllm_idle(vllm_engine)
        seeded = EngineRequest(request_id=uuid.uuid4().hex, prompt_token_ids=prompt, sampling=sampling)
        runs.append([t async for d in vllm_engine.generate(seeded) for t in d.token_ids])
    assert len(runs[0]) == 12
    assert runs[0] == runs[1]
    assert (await vllm_engine.health()).ready

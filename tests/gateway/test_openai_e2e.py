"""The official `openai` SDK against the gateway on a real vLLM engine (SmolLM2-135M-Instruct)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from engines.vllm_local import VllmLocalEngine
from gateway.app import create_app
from gateway.config import GuardConfig
from gateway.generation.prompts import PromptRenderer
from tests.conftest import MODEL, OutcomeLog, Tenancy, make_config, serving

QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def client(real_client: openai.AsyncOpenAI) -> openai.AsyncOpenAI:
    """The SDK on a gateway over the real default model (`tests.conftest.real_client`)."""
    return real_client


@pytest.fixture
async def unguarded_client(
    vllm_engine: VllmLocalEngine, renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> AsyncIterator[openai.AsyncOpenAI]:
    """A client under a policy without guard stages: alternatives to the chosen tokens (`top_logprobs`) are
    served only where no output guard would have to read them (tests/gateway/test_request_bounds.py)."""
    config = msgspec.structs.replace(make_config(), guard=GuardConfig(default_policy="none"))
    app = create_app(config, engine=vllm_engine, renderer=renderer, tenants=tenancy.store, sink=outcomes)
    async with (
        serving(app) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=tenancy.consumer, max_retries=0) as sdk,
    ):
        yield sdk


async def test_models_lists_the_alias_and_its_version(client: openai.AsyncOpenAI) -> None:
    models = await client.models.list()
    alias, version = models.data
    assert alias.id == MODEL
    assert version.id.startswith(f"{MODEL}@")
    extra = version.model_extra or {}
    assert extra["kind"] == "version"
    # SmolLM2-135M: 2 x 30 layers x 3 KV heads x 64 head dim x 2 bytes (bf16).
    assert extra["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 2
    assert (alias.model_extra or {})["targets"] == [{"model": version.id, "weight": 1.0}]


async def test_answers_name_the_exact_model_version(client: openai.AsyncOpenAI) -> None:
    [version] = [m.id for m in (await client.models.list()).data if "@" in m.id]
    raw = await client.chat.completions.with_raw_response.create(model=MODEL, messages=QUESTION, max_tokens=3)
    assert raw.headers["x-lockgate-model"] == version
    pinned = await client.chat.completions.with_raw_response.create(
        model=version, messages=QUESTION, max_tokens=3
    )
    assert pinned.headers["x-lockgate-model"] == version


async def test_chat_answers_and_counts_usage_exactly(
    client: openai.AsyncOpenAI, renderer: PromptRenderer
) -> None:
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=30, logprobs=True
    )
    assert raw.headers["x-request-id"]
    answer = raw.parse()
    choice = answer.choices[0]
    assert "Paris" in (choice.message.content or "")
    assert choice.finish_reason == "stop"
    assert answer.usage is not None
    # Prompt tokens: the gateway's own rendering of the chat template, which is what the engine received.
    assert answer.usage.prompt_tokens == len(
        await renderer.chat([{"role": "user", "content": "What is the capital of France?"}])
    )
    assert choice.logprobs is not None
    assert choice.logprobs.content is not None
    # One logprob entry per generated token.
    assert answer.usage.completion_tokens == len(choice.logprobs.content)
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


async def test_stream_deltas_concatenate_to_the_whole_answer(client: openai.AsyncOpenAI) -> None:
    prompt: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Name three colours and describe each in one sentence."}
    ]
    whole = await client.chat.completions.create(model=MODEL, messages=prompt, temperature=0, max_tokens=60)
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=prompt,
        temperature=0,
        max_tokens=60,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts: list[str] = []
    finish = None
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(parts) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage is not None
    assert whole.usage is not None
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens


async def test_stream_without_include_usage_sends_no_usage(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5, stream=True)
    chunks = [chunk async for chunk in stream]
    assert chunks
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


async def test_seed_makes_sampling_reproducible(client: openai.AsyncOpenAI) -> None:
    prompt: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Tell me a short story about a cat."}
    ]

    async def sample(seed: int) -> str:
        r = await client.chat.completions.create(
            model=MODEL, messages=prompt, temperature=1.0, max_tokens=40, seed=seed
        )
        return r.choices[0].message.content or ""

    first, again = await sample(1234), await sample(1234)
    assert first == again
    others = {await sample(s) for s in (1, 2, 3)}
    assert len(others | {first}) > 1, "different seeds should not all give the same text"


async def test_max_tokens_limits_the_answer(client: openai.AsyncOpenAI) -> None:
    r = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Write a long essay."}],
        max_tokens=7,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None
    assert r.usage.completion_tokens == 7


async def test_top_logprobs_are_returned(unguarded_client: openai.AsyncOpenAI) -> None:
    r = await unguarded_client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    logprobs = r.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.content is not None
    content = logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        # Greedy decoding picks the most likely token.
        assert entry.top_logprobs[0].token == entry.token


async def test_stop_sequence_ends_the_answer(client: openai.AsyncOpenAI) -> None:
    r = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=30, temperature=0, stop=[" is"]
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == "The capital of France"


async def test_legacy_completions_whole_and_streamed(client: openai.AsyncOpenAI) -> None:
    whole = await client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=0
    )
    text = whole.choices[0].text
    assert text
    assert whole.usage is not None
    assert whole.usage.completion_tokens == 8
    assert whole.choices[0].logprobs is not None
    assert len(whole.choices[0].logprobs.tokens or []) == 8
    stream = await client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
    )
    assert "".join([c.choices[0].text async for c in stream if c.choices]) == text


async def test_completions_accepts_token_ids(client: openai.AsyncOpenAI, renderer: PromptRenderer) -> None:
    ids = await renderer.text("The capital of France is")
    by_ids = await client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    by_text = await client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0
    )
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage is not None
    assert by_ids.usage.prompt_tokens == len(ids)


async def test_outcome_reports_completed_usage(client: openai.AsyncOpenAI, outcomes: OutcomeLog) -> None:
    raw = await client.chat.completions.with_raw_response.create(model=MODEL, messages=QUESTION, max_tokens=5)
    answer = raw.parse()
    outcome = await outcomes.wait_for(raw.headers["x-request-id"])
    assert outcome.status == "completed"
    assert answer.usage is not None
    assert outcome.usage.completion_tokens == answer.usage.completion_tokens
    assert outcome.usage.prompt_tokens == answer.usage.prompt_tokens

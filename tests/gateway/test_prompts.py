"""Prompt rendering: the ids are the tokenizer's own, whether a prompt is encoded in place or in the pool."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jinja2
import pytest

from gateway.generation.prompts import INLINE_CHARS, PromptRenderer


class CountingPool(ThreadPoolExecutor):
    """A thread pool that counts what it was handed."""

    def __init__(self) -> None:
        super().__init__(1)
        self.submitted = 0

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


def reference_chat(
    renderer: PromptRenderer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """The ids as `transformers` computes them: the template's text, then the tokenizer's call."""
    tokenizer = renderer.tokenizer
    text = tokenizer.apply_chat_template(
        messages, tools=tools, chat_template=renderer.template, add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


async def test_short_prompts_render_in_place_and_long_ones_in_the_pool(renderer: PromptRenderer) -> None:
    short = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Héllo, wörld! 12 + 30?"},
    ]
    long = [{"role": "user", "content": "The quick brown fox. " * (INLINE_CHARS // 10)}]
    with CountingPool() as pool:
        local = PromptRenderer(renderer.tokenizer, pool, renderer.template)
        assert await local.chat(short) == reference_chat(renderer, short)
        assert pool.submitted == 0
        assert await local.chat(long) == reference_chat(renderer, long)
        assert pool.submitted == 1
        # A message with more than a role and text (a name, tool calls): the pool, whatever its length.
        parts = [{"role": "user", "content": "hi", "name": "ann"}]
        assert await local.chat(parts) == reference_chat(renderer, parts)
        assert pool.submitted == 2


async def test_plain_prompts_keep_the_tokenizers_special_tokens(renderer: PromptRenderer) -> None:
    tokenizer = renderer.tokenizer
    with CountingPool() as pool:
        local = PromptRenderer(tokenizer, pool, renderer.template)
        for text in ["Once upon a time", "word " * INLINE_CHARS]:
            assert await local.text(text) == list(tokenizer(text, add_special_tokens=True)["input_ids"])
        assert pool.submitted == 1


# A template that reads what `apply_chat_template` passes it: the special tokens, tools, the generation flag.
_VARIABLES_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if tools %}<|im_start|>tools\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% if documents is none %}(no documents){% endif %}{{ eos_token }}{{ pad_token }}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# One that uses the helpers a template may call: Jinja's globals (`namespace`, `range`) and those transformers
# adds (`strftime_now`, `raise_exception`), which raises for a role it does not know.
_HELPERS_TEMPLATE = (
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% for i in range(ns.n) %}.{% endfor %}{{ strftime_now('%Y') | length }}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


async def test_rendering_gives_the_text_transformers_renders(renderer: PromptRenderer) -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    turns = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Héllo"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "12 + 30?"},
    ]
    with ThreadPoolExecutor(1) as pool:
        for template in [renderer.template, _VARIABLES_TEMPLATE, _HELPERS_TEMPLATE]:
            local = PromptRenderer(renderer.tokenizer, pool, template)
            for messages in [turns[1:2], turns]:
                for with_tools in [None, tools]:
                    expected = reference_chat(local, messages, with_tools)
                    assert await local.chat(messages, with_tools) == expected


async def test_a_template_that_raises_fails_the_render_as_transformers_does(renderer: PromptRenderer) -> None:
    messages = [{"role": "critic", "content": "Hi"}]
    with ThreadPoolExecutor(1) as pool:
        local = PromptRenderer(renderer.tokenizer, pool, _HELPERS_TEMPLATE)
        with pytest.raises(jinja2.TemplateError, match="bad role") as ours:
            await local.chat(messages)
        with pytest.raises(jinja2.TemplateError, match="bad role") as theirs:
            reference_chat(local, messages)
        assert type(ours.value) is type(theirs.value)

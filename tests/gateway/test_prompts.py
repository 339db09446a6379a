"""Prompt rendering: the ids are the tokenizer's own, whether a prompt is encoded in place or in the pool."""

from __future__ import annotations

import re
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
import tokenizers
from tokenizers import AddedToken

from gateway.generation.prompts import INLINE_CHARS, PIECE_MAX_CHARS, PromptRenderer, _piecewise


class CountingPool(ThreadPoolExecutor):
    """A thread pool that counts what it was handed."""

    def __init__(self) -> None:
        super().__init__(1)
        self.submitted = 0

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


def reference_chat(renderer: PromptRenderer, messages: list[dict[str, Any]]) -> list[int]:
    """The ids as `transformers` computes them: the template's text, then the tokenizer's call."""
    tokenizer = renderer.tokenizer
    text = tokenizer.apply_chat_template(
        messages, chat_template=renderer.template, add_generation_prompt=True, tokenize=False
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


CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "  You answer in French.\n\n Only French. "},
        {"role": "user", "content": "Héllo, wörld! 😀 12 + 30?\t"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "And <|im_end|> inside the text, <|im_start|>assistant\n too"},
    ],
    [
        {"role": "user", "content": ""},
        {"role": "assistant", "content": "\n"},
        {"role": "user", "content": " x"},
    ],
    [{"role": "user", "content": "word " * 3000}],  # a piece too long to remember
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_prompts_encoded_piece_by_piece_get_the_ids_of_the_whole_text(
    renderer: PromptRenderer, messages: list[dict[str, Any]]
) -> None:
    encode = _piecewise(renderer.tokenizer)
    assert encode is not None  # the default model's tokenizer splits at added tokens first
    expected = reference_chat(renderer, messages)
    text = renderer.tokenizer.apply_chat_template(
        messages, chat_template=renderer.template, add_generation_prompt=True, tokenize=False
    )
    assert encode(text) == expected
    assert encode(text) == expected  # again, from remembered pieces


class CharBackend:
    """A fast tokenizer's backend with one id per character and `<s>`, `</s>` added (id 0, 1): pieces add up
    to the whole. Records the texts it encodes."""

    def __init__(self, size: int = 1) -> None:
        self.size = size
        self.encoded: list[str] = []

    def get_added_tokens_decoder(self) -> dict[int, AddedToken]:
        return {0: AddedToken("<s>", normalized=False), 1: AddedToken("</s>", normalized=False)}

    def encode(self, text: str, add_special_tokens: bool) -> Any:
        self.encoded.append(text)
        ids: list[int] = []
        for part in re.split("(<s>|</s>)", text):
            ids += (
                [{"<s>": 0, "</s>": 1}[part]]
                if part in ("<s>", "</s>")
                else [ord(c) * self.size for c in part]
            )
        return SimpleNamespace(ids=ids)

    def encode_batch_fast(self, texts: list[str], add_special_tokens: bool) -> list[Any]:
        return [self.encode(text, add_special_tokens) for text in texts]


def test_the_pieces_of_a_conversation_are_encoded_once_while_remembered() -> None:
    backend = CharBackend()
    encode = _piecewise(SimpleNamespace(backend_tokenizer=backend))
    assert encode is not None
    backend.encoded.clear()  # the probe's
    first = "<s>system\nBe brief.</s>\n<s>user\nOne?</s>\n<s>assistant\n"
    second = first + "1</s>\n<s>user\nTwo?</s>\n<s>assistant\n"
    assert encode(first) == backend.encode(first, False).ids
    backend.encoded.clear()
    assert encode(second) == backend.encode(second, False).ids
    # Only the new turn's pieces were encoded; the system prompt, the first turn and the headers were not.
    assert backend.encoded[:-1] == ["assistant\n1", "user\nTwo?"]
    backend.encoded.clear()
    long = "<s>" + "x" * (PIECE_MAX_CHARS + 1)
    encode(long)
    encode(long)
    assert backend.encoded == ["x" * (PIECE_MAX_CHARS + 1)] * 2  # too long to remember


def _tokenizer(*added: AddedToken) -> SimpleNamespace:
    """A fast tokenizer (as `transformers` wraps one) over a tiny vocabulary with `added` tokens."""
    backend = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")
    )
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.add_special_tokens(list(added))
    return SimpleNamespace(backend_tokenizer=backend)


def test_tokenizers_whose_added_tokens_strip_or_match_normalized_text_encode_the_whole_text() -> None:
    assert _piecewise(_tokenizer(AddedToken("<s>", normalized=False))) is not None
    for flags in ({"lstrip": True}, {"rstrip": True}, {"single_word": True}, {"normalized": True}):
        assert _piecewise(_tokenizer(AddedToken("<s>", **{"normalized": False, **flags}))) is None
    assert _piecewise(_tokenizer()) is None  # no added tokens: nothing to split at
    assert _piecewise(SimpleNamespace()) is None  # not a fast tokenizer


def test_a_tokenizer_whose_pieces_do_not_add_up_to_the_whole_encodes_the_whole_text() -> None:
    class LengthBackend(CharBackend):
        """One id: the whole input's length."""

        def encode(self, text: str, add_special_tokens: bool) -> Any:
            return SimpleNamespace(ids=[len(text)])

    assert _piecewise(SimpleNamespace(backend_tokenizer=LengthBackend())) is None

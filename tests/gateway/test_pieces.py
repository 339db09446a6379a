"""Rendered prompts encoded piece by piece between special tokens: the same ids, less encoded."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest
import tokenizers
from tokenizers import AddedToken

from gateway.generation.pieces import PIECE_MAX_CHARS, PieceCache, piecewise_encoder
from gateway.generation.prompts import PromptRenderer
from tests.gateway.test_prompts import reference_chat

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
    encode = piecewise_encoder(renderer.tokenizer)
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
    encode = piecewise_encoder(SimpleNamespace(backend_tokenizer=backend))
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
    assert piecewise_encoder(_tokenizer(AddedToken("<s>", normalized=False))) is not None
    for flags in ({"lstrip": True}, {"rstrip": True}, {"single_word": True}, {"normalized": True}):
        assert piecewise_encoder(_tokenizer(AddedToken("<s>", **{"normalized": False, **flags}))) is None
    assert piecewise_encoder(_tokenizer()) is None  # no added tokens: nothing to split at
    assert piecewise_encoder(SimpleNamespace()) is None  # not a fast tokenizer


def test_a_tokenizer_whose_pieces_do_not_add_up_to_the_whole_encodes_the_whole_text() -> None:
    class LengthBackend(CharBackend):
        """One id: the whole input's length."""

        def encode(self, text: str, add_special_tokens: bool) -> Any:
            return SimpleNamespace(ids=[len(text)])

    assert piecewise_encoder(SimpleNamespace(backend_tokenizer=LengthBackend())) is None


def test_the_cache_drops_the_least_recently_used_pieces_past_its_size() -> None:
    backend = CharBackend()
    cache = PieceCache(max_chars=20)
    encode = piecewise_encoder(SimpleNamespace(backend_tokenizer=backend), cache)
    assert encode is not None
    backend.encoded.clear()
    encode("<s>" + "a" * 10 + "</s>" + "b" * 8)  # 18 characters remembered
    encode("<s>" + "a" * 10)  # used again: now the most recent
    encode("<s>" + "c" * 5)  # 23 > 20: b... goes, a... stays
    assert (len(cache), cache.chars) == (2, 15)
    backend.encoded.clear()
    encode("<s>" + "a" * 10 + "</s>" + "b" * 8)
    assert backend.encoded == ["b" * 8]

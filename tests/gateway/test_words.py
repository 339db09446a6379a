"""ASCII text encoded word by word (`gateway.generation.words`): the tokenizer's ids, fewer calls to it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.generation import words
from gateway.generation.words import word_encoder

# Mostly what the expression treats specially (contractions, spaces, digits, punctuation), some of anything.
_TRICKY = st.sampled_from(list(" \t\n\r\x0b\x0c'sStTrevmlLdD aZ09,.!?-_\x00\x7f"))
_TEXT = st.lists(
    st.one_of(_TRICKY, _TRICKY, st.characters(max_codepoint=127), st.characters(codec="utf-8")),
    max_size=40,
)


@pytest.fixture(scope="module")
def backend(model_dir: Path) -> tokenizers.Tokenizer:
    """The default model's tokenizer (SmolLM2's byte-level BPE)."""
    return tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def by_words(backend: tokenizers.Tokenizer) -> words.Encode:
    """A word encoder of the default tokenizer, shared by the examples of a property (built in ~0.1 s)."""
    encode = word_encoder(backend, backend.encode_batch_fast)
    assert encode is not None
    return encode


class Counting:
    """A tokenizer's BPE model and batch entry point, recording what each is given."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        self.backend = backend
        self.words: list[str] = []  # byte-level words given to the model
        self.batches: list[list[str]] = []

    def tokenize(self, word: str) -> Any:
        self.words.append(word)
        return self.backend.model.tokenize(word)

    def batch(self, texts: list[str], add_special_tokens: bool) -> Any:
        self.batches.append(list(texts))
        return self.backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)


def _ids(backend: tokenizers.Tokenizer, text: str) -> tuple[int, ...]:
    return tuple(backend.encode(text, add_special_tokens=False).ids)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=_TEXT)
def test_word_by_word_gets_the_ids_of_the_whole_text(
    backend: tokenizers.Tokenizer, by_words: words.Encode, parts: list[str]
) -> None:
    text = "".join(parts)
    assert by_words(text) == _ids(backend, text)
    assert by_words(text) == _ids(backend, text)  # again, from remembered words


def test_only_words_not_remembered_are_encoded(backend: tokenizers.Tokenizer) -> None:
    counting = Counting(backend)
    encode = word_encoder(backend, counting.batch, counting.tokenize)
    assert encode is not None
    counting.words.clear()  # the probe's
    text = "The zebra's  quizzical gaze, 1234 times!\n"
    assert encode(text) == _ids(backend, text)
    # As byte-level text (a space is "Ġ", a newline "Ċ"); the probe's words ("'s", " ") are remembered.
    assert counting.words == ["The", "Ġzebra", "Ġquizzical", "Ġgaze", ",", "Ġ1234", "Ġtimes", "!", "Ċ"]
    counting.words.clear()
    assert encode(text + "The gaze of the zebra") == _ids(backend, text + "The gaze of the zebra")
    assert counting.words == ["Ġof", "Ġthe"]
    assert counting.batches == []
    counting.words.clear()
    assert encode("Zèbre zebra") == _ids(backend, "Zèbre zebra")
    assert (counting.batches, counting.words) == ([["Zèbre zebra"]], [])  # not ASCII: whole


def test_past_its_size_the_memory_starts_again(
    backend: tokenizers.Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(words, "WORDS_MAX", 150)  # the probe's words fit, a few more do not
    counting = Counting(backend)
    encode = word_encoder(backend, counting.batch, counting.tokenize)
    assert encode is not None
    texts = [f"word{i} and some words {i * 7}" for i in range(40)]
    for text in texts * 2:
        assert encode(text) == _ids(backend, text)
    counting.words.clear()
    encode(texts[-1])
    assert counting.words == []  # remembered since the last restart


@pytest.mark.parametrize(
    "change",
    [
        lambda c: c.update(normalizer={"type": "NFC"}),
        lambda c: c["pre_tokenizer"].update(add_prefix_space=True),
        lambda c: c["pre_tokenizer"].update(use_regex=False),
        lambda c: c["model"].update(dropout=0.1),
        lambda c: c.update(pre_tokenizer={"type": "Whitespace"}),
    ],
    ids=["normalizer", "prefix-space", "no-regex", "dropout", "other-pre-tokenizer"],
)
def test_a_tokenizer_of_another_scheme_has_no_word_encoder(
    backend: tokenizers.Tokenizer, change: Any
) -> None:
    config = json.loads(backend.to_str())
    change(config)
    other = tokenizers.Tokenizer.from_str(json.dumps(config))
    assert word_encoder(other, other.encode_batch_fast) is None


def test_a_tokenizer_whose_words_do_not_add_up_has_no_word_encoder(backend: tokenizers.Tokenizer) -> None:
    def shifted(word: str) -> list[Any]:
        """The BPE model's ids, each one off: the probe's ids differ."""
        return [SimpleNamespace(id=token.id + 1) for token in backend.model.tokenize(word)]

    assert word_encoder(backend, backend.encode_batch_fast, shifted) is None
    assert word_encoder(object(), backend.encode_batch_fast) is None  # not a `tokenizers.Tokenizer`

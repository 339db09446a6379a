"""ASCII text encoded word by word for a byte-level BPE tokenizer, remembering the ids of recent words.

A byte-level BPE tokenizer without a normalizer (GPT-2's scheme, and SmolLM2's) first splits text into
words with one regular expression, then encodes each word on its own: the ids of a text are the ids of its
words, in order. Splitting is most of the work (the Rust library's regex engine and its byte-to-character
mapping, about 300,000 instructions for a 20-word prompt, 12% of a whole answer's in the gateway), and words
come back, so for ASCII text the gateway splits with Python's `re` (the same expression with its classes
spelled in ASCII) and looks each word's ids up. A word not remembered goes to the tokenizer's BPE model
alone (`model.tokenize` of its byte-level text: 2 us, where the tokenizer's entry point takes 7 us for one
word and 30 us for three, handing a batch to its thread pool). Text with any non-ASCII character is encoded
whole by the tokenizer, whose Unicode tables are not Python's. Checked when built: the tokenizer's
configuration must be exactly that scheme, and a probe text with every ASCII character in many contexts must
get the same ids both ways; otherwise there is no word encoder and texts are encoded whole.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from typing import Any

import tokenizers

# Words remembered per tokenizer; past this the memory starts again (about 200 bytes a word: 20 MB at most).
WORDS_MAX = 100_000

_WS = "\\t\\n\\x0b\\x0c\\r "
# GPT-2's expression, `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`, on ASCII.
_ASCII_WORDS = re.compile(
    rf"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^{_WS}A-Za-z0-9]+|[{_WS}]+(?![^{_WS}])|[{_WS}]+"
)
# Every ASCII character, in runs and alone, after and before spaces, with each contraction.
_PROBE = (
    "".join(map(chr, range(128)))
    + " ".join(chr(c) for c in range(128))
    + "It's we're I've I'm you'll he'd 'S 'T can't  x  \n\n y\t\t z \r\n 12345 a1b2 --- ?! \x0b\x0c end  "
)

Encode = Callable[[str], tuple[int, ...]]


def _byte_level_table() -> dict[int, str]:
    """GPT-2's `bytes_to_unicode` for the ASCII bytes: printable ones stand for themselves, the others (space
    and control characters) for the characters from U+0100 on, in order (`str.translate`'s table)."""
    printable = [b for b in range(128) if ord("!") <= b <= ord("~")]
    others = [b for b in range(256) if not (ord("!") <= b <= ord("~") or 0xA1 <= b <= 0xAC or b >= 0xAE)]
    return {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others) if b < 128}


_BYTE_LEVEL = _byte_level_table()


def _is_plain_byte_level(backend: Any) -> bool:
    """GPT-2's scheme: no normalizer; the ByteLevel pre-tokenizer with its expression and no prefix space;
    a BPE model that always merges the same way (no dropout)."""
    pre = backend.pre_tokenizer
    model = backend.model
    return (
        backend.normalizer is None
        and isinstance(pre, tokenizers.pre_tokenizers.ByteLevel)
        and pre.use_regex is True
        and pre.add_prefix_space is False
        and isinstance(model, tokenizers.models.BPE)
        and model.dropout is None
    )


def word_encoder(
    backend: Any, batch: Callable[..., Any], tokenize: Callable[[str], Any] | None = None
) -> Encode | None:
    """`text -> ids` (no special tokens added) for text without added tokens, by words (module docstring);
    `batch(texts, add_special_tokens=False)` encodes non-ASCII texts, `tokenize` (the BPE model's, unless
    given) the words not remembered. None when `backend` is not a `tokenizers.Tokenizer` of the plain
    byte-level BPE scheme or the probe's ids differ."""
    if not isinstance(backend, tokenizers.Tokenizer) or not _is_plain_byte_level(backend):
        return None
    words: dict[str, tuple[int, ...]] = {}
    split = _ASCII_WORDS.findall
    get = words.get
    tokenize = tokenize or backend.model.tokenize

    def encode(text: str) -> tuple[int, ...]:
        if not text.isascii():
            return tuple(batch([text], add_special_tokens=False)[0].ids)
        parts: list[str] = split(text)
        found = [get(word) for word in parts]
        if None in found:
            # The BPE model on the word's byte-level text, as the tokenizer runs it on each word.
            fresh = {
                w: tuple(token.id for token in tokenize(w.translate(_BYTE_LEVEL)))
                for w, ids in zip(parts, found, strict=True)
                if ids is None
            }
            if len(words) + len(fresh) > WORDS_MAX:
                words.clear()
            words.update(fresh)
            found = [fresh[w] if ids is None else ids for w, ids in zip(parts, found, strict=True)]
        return tuple(itertools.chain.from_iterable(filter(None, found)))  # every entry is ids by now

    whole = tuple(backend.encode(_PROBE, add_special_tokens=False).ids)
    return encode if encode(_PROBE) == whole else None

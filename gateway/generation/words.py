"""ASCII text encoded word by word for a byte-level BPE tokenizer, remembering the ids of recent words.

A byte-level BPE tokenizer without a normalizer (GPT-2's scheme, and SmolLM2's) first splits text into
words with one regular expression, then encodes each word on its own: the ids of a text are the ids of its
words, in order. Splitting is most of the work (the Rust library's regex engine and its byte-to-character
mapping, about 300,000 instructions for a 20-word prompt, 12% of a whole answer's in the gateway), and words
come back, so for ASCII text the gateway splits with Python's `re` (the same expression with its classes
spelled in ASCII) and looks each word's ids up, encoding only words it has not seen, all of a text's in one
call. Text with any non-ASCII character is encoded whole by the tokenizer, whose Unicode tables are not
Python's. Checked when built: the tokenizer's configuration must be exactly that scheme, and a probe text
with every ASCII character in many contexts must get the same ids both ways; otherwise there is no word
encoder and texts are encoded whole.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable
from typing import Any

# Words remembered; past this the memory starts again (about 100 bytes each).
WORDS_MAX = 200_000

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


def _is_plain_byte_level(config: dict[str, Any]) -> bool:
    """GPT-2's scheme: no normalizer; the ByteLevel pre-tokenizer with its expression and no prefix space;
    a BPE model that always merges the same way (no dropout)."""
    pre = config.get("pre_tokenizer") or {}
    model = config.get("model") or {}
    return (
        config.get("normalizer") is None
        and pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True) is True
        and pre.get("add_prefix_space") is False
        and model.get("type") == "BPE"
        and model.get("dropout") is None
    )


def word_encoder(backend: Any, batch: Callable[..., Any]) -> Encode | None:
    """`text -> ids` (no special tokens added) for text without added tokens, by words (module docstring),
    `batch(texts, add_special_tokens=False)` encoding the words not remembered and non-ASCII texts; None
    when the tokenizer is not a plain byte-level BPE one or the probe's ids differ."""
    try:
        config = json.loads(backend.to_str())
    except Exception:  # not a `tokenizers.Tokenizer`: no configuration to check
        return None
    if not isinstance(config, dict) or not _is_plain_byte_level(config):
        return None
    words: dict[str, tuple[int, ...]] = {}
    split = _ASCII_WORDS.findall
    get = words.get

    def encode(text: str) -> tuple[int, ...]:
        if not text.isascii():
            return tuple(batch([text], add_special_tokens=False)[0].ids)
        parts: list[str] = split(text)
        found = [get(word) for word in parts]
        if None in found:
            new = list(dict.fromkeys(w for w, ids in zip(parts, found, strict=True) if ids is None))
            fresh = {w: tuple(e.ids) for w, e in zip(new, batch(new, add_special_tokens=False), strict=True)}
            if len(words) + len(fresh) > WORDS_MAX:
                words.clear()
            words.update(fresh)
            found = [fresh[w] if ids is None else ids for w, ids in zip(parts, found, strict=True)]
        return tuple(itertools.chain.from_iterable(filter(None, found)))  # every entry is ids by now

    whole = tuple(backend.encode(_PROBE, add_special_tokens=False).ids)
    return encode if encode(_PROBE) == whole else None

"""Rendered prompts encoded piece by piece, remembering the ids of recent pieces.

A chat prompt is the template's text with special tokens between the messages (`<|im_start|>user ...
<|im_end|>`). A fast tokenizer splits its input at added tokens before anything else and encodes each piece
on its own, so encoding the pieces one by one gives the ids of the whole text; and the pieces come back
request after request (a tenant's system prompt, the template's role headers, the earlier turns of a
conversation), so only new text needs encoding. A 12-turn conversation with a 300-word system prompt,
each prompt seen once: 658 us to encode a prompt whole, 105 us by pieces (2-core EPYC).
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from gateway.generation.words import word_encoder

# The text of the pieces remembered, in characters (their ids take about 9 bytes a character: ~20 MB), and
# the longest piece remembered.
CACHE_CHARS = 2_000_000
PIECE_MAX_CHARS = 8192


class PieceCache:
    """The ids of recently encoded pieces, least recently used dropped first, up to `max_chars` characters of
    pieces in all. Shared by the event loop and the tokenizer's threads."""

    def __init__(self, max_chars: int = CACHE_CHARS) -> None:
        self.max_chars = max_chars
        self.chars = 0
        self._ids: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, piece: str) -> tuple[int, ...] | None:
        with self._lock:
            ids = self._ids.get(piece)
            if ids is not None:
                self._ids.move_to_end(piece)
            return ids

    def put(self, piece: str, ids: tuple[int, ...]) -> None:
        with self._lock:
            if piece in self._ids:
                return
            self._ids[piece] = ids
            self.chars += len(piece)
            while self.chars > self.max_chars:
                dropped, _ = self._ids.popitem(last=False)
                self.chars -= len(dropped)

    def __len__(self) -> int:
        return len(self._ids)


def piecewise_encoder(tokenizer: Any, cache: PieceCache | None = None) -> Callable[[str], list[int]] | None:
    """`text -> ids` of a rendered prompt (no special tokens added), encoded piece by piece between its added
    tokens, the ids of pieces of up to `PIECE_MAX_CHARS` characters kept in `cache`. None (encode the whole
    text) where pieces may not add up to the whole: a tokenizer that is not a fast one, an added token that
    strips whitespace or matches normalized text, or a probe that does not give the same ids both ways."""
    backend: Any = getattr(tokenizer, "backend_tokenizer", None)
    added = backend.get_added_tokens_decoder() if backend is not None else {}
    if not added or any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in added.values()):
        return None
    ids = {token.content: token_id for token_id, token in added.items()}
    # Longest first: at one position the longest added token matches, as the tokenizer's own matcher does.
    split = re.compile("(" + "|".join(re.escape(c) for c in sorted(ids, key=len, reverse=True)) + ")").split
    batch = getattr(backend, "encode_batch_fast", None) or backend.encode_batch
    pieces = cache if cache is not None else PieceCache()
    new_piece = word_encoder(backend, batch) or (
        lambda piece: tuple(batch([piece], add_special_tokens=False)[0].ids)
    )

    def encode_piece(piece: str) -> tuple[int, ...]:
        known = pieces.get(piece)
        if known is None:
            known = new_piece(piece)
            if len(piece) <= PIECE_MAX_CHARS:
                pieces.put(piece, known)
        return known

    def encode(text: str) -> list[int]:
        out: list[int] = []
        for i, part in enumerate(split(text)):
            if i % 2:  # an added token
                out.append(ids[part])
            elif part:
                out += encode_piece(part)
        return out

    names = list(ids)
    first, second = names[0], names[-1]
    probe = f"{first}system\n  Hello,  world!\t\n{second}\n{first}user ünïcode 😀 {second}{first}\n\nend "
    whole = list(backend.encode(probe, add_special_tokens=False).ids)
    return encode if encode(probe) == whole else None

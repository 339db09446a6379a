"""A streamed chat chunk's bytes are built around its text (`Formatter`), not encoded from Structs per token:
the same bytes as encoding the chunk, for any text, any choice, and an id or model name holding the marker."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engines.base import EngineDelta
from gateway.generation.responses import Formatter, sse
from gateway.schemas import ChatChunkChoice, ChatCompletionChunk, ChatDelta
from tests.gateway.test_tools import chat_plan

MARKED = "\x00lockgate\x00"  # the marker the formatter cuts its chunks at


def encoded(response_id: str, model: str, index: int, text: str) -> bytes:
    """The chunk as the Structs encode it."""
    choice = ChatChunkChoice(index=index, delta=ChatDelta(content=text))
    return sse(ChatCompletionChunk(id=response_id, created=7, model=model, choices=[choice]))


@settings(max_examples=300, deadline=None)
@given(
    texts=st.lists(st.text(max_size=12), min_size=1, max_size=4),
    index=st.integers(0, 2),
    model=st.sampled_from(["m", "SmolLM2-135M-Instruct@1", 'a "quoted" \\ model', MARKED]),
)
def test_content_chunks_are_the_bytes_the_structs_encode(texts: list[str], index: int, model: str) -> None:
    formatter = Formatter(chat_plan(3, None), "chatcmpl-r", model, 7)
    for text in texts:
        out = formatter.chunk(EngineDelta(index=index, text=text, token_ids=(1,)))
        assert out == ([encoded("chatcmpl-r", model, index, text)] if text else [])


def test_a_text_that_holds_the_marker_is_sent_as_it_is() -> None:
    formatter = Formatter(chat_plan(1, None), MARKED, MARKED, 7)
    for text in (MARKED, "a", MARKED * 2):
        out = formatter.chunk(EngineDelta(index=0, text=text, token_ids=(1,)))
        assert out == [encoded(MARKED, MARKED, 0, text)]

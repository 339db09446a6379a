"""The output guard's decoded view: JSON escapes resolved as a client's decoder resolves them, mid-stream
too, and the moderator releasing nothing whose decoded reading no check has passed."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard.moderator import OutputBlocked, moderate
from guard.readable import decode_escapes, readable
from tests.guard.test_moderator import Source

BOMB = r'{"x": "\u0062\u006f\u006d\u0062"}'


def test_escaped_arguments_read_as_the_client_reads_them() -> None:
    assert json.loads(BOMB) == {"x": "bomb"}
    assert readable(BOMB) == '{"x": "bomb"}'
    # Upper-case hex, and every single-character escape.
    assert readable(r'"\u0042\u004F\"\\\/\b\f\n\r\t"') == '"BO"\\/\b\f\n\r\t"'


def test_keys_and_names_are_decoded_too() -> None:
    call = r'<tool_call>{"name": "\u0062omb", "arguments": {"\u0062omb": 1}}</tool_call>'
    assert readable(call) == '<tool_call>{"name": "bomb", "arguments": {"bomb": 1}}</tool_call>'


def test_surrogate_pairs_join_and_lone_surrogates_cannot_reach_a_tokenizer() -> None:
    assert readable(r'"\ud83d\udca3 \uD83D\uDCA3"') == '"\U0001f4a3 \U0001f4a3"'
    # json.loads keeps a lone surrogate; a tokenizer refuses one (a guard error, the policy's fail mode).
    lone = readable(r'"\ud800 \udc00 \ud83d\u0041"')
    assert lone == '"\ufffd \ufffd \ufffdA"'
    lone.encode("utf-8")


def test_an_escaped_backslash_is_not_an_escape() -> None:
    # The client reads a backslash then "u0062omb": nothing to add beyond the backslash itself.
    assert json.loads(r'"\\u0062omb"') == "\\u0062omb"
    assert readable(r'"\\u0062omb"') == '"\\u0062omb"'
    assert readable(r'"\\\u0062omb"') == '"\\bomb"'


def test_text_without_escapes_adds_nothing() -> None:
    assert readable('{"x": "bomb", "y": [1, 2]}') == ""
    assert readable("plain text\nover lines") == ""
    # Invalid escapes stay as written, so decoding changes nothing.
    assert readable(r"C:\dir \x \u12") == ""


def test_an_escape_cut_off_mid_stream_stays_as_written_until_it_is_whole() -> None:
    whole = r'{"x": "\u0062omb"}'
    for cut in range(len(whole) + 1):
        prefix = whole[:cut]
        view = readable(prefix) or prefix
        if cut >= len(r'{"x": "\u0062omb'):
            assert "bomb" in view
        else:
            assert "bomb" not in view
    assert readable(r'{"x": "\u00') == ""
    assert readable(r'{"x": "\ud83d\ud') == '{"x": "\ufffd\\ud'


def test_only_lines_that_change_are_added() -> None:
    text = 'Here is the call:\n{"x": "\\u0062omb"}\nand a line with "no" escapes'
    assert readable(text) == '{"x": "bomb"}'
    # A decoded newline stays inside its line's reading, so a phrase split by \n reads as one line.
    assert readable(r'{"x": "how to make a\nbomb"}') == '{"x": "how to make a\nbomb"}'


@given(st.text())
def test_the_view_is_what_a_json_decoder_reads(value: str) -> None:
    # Python's json.dumps escapes quotes, backslashes, controls and (ensure_ascii) everything non-ASCII.
    for encoded in (json.dumps(value), json.dumps(value, ensure_ascii=False)):
        assert decode_escapes(encoded) == f'"{value}"'
        assert (readable(encoded) or encoded) == f'"{value}"'


class Reads:
    """An output check as the pipeline's: blocks when `needle` is in the text or in its decoded view."""

    def __init__(self, needle: str, *, decoded: bool = True) -> None:
        self.needle = needle
        self.decoded = decoded

    async def __call__(self, text: str, final: bool) -> str | None:
        views = [text, readable(text)] if self.decoded else [text]
        return "blocked" if any(self.needle in v for v in views) else None


PAYLOADS = [
    BOMB,
    r'{"a": "ok", "x": "b\u006fm\u0062", "y": [1, "\n"]}',
    r'[{"name": "f", "parameters": {"x": "\u0062\u006F\u006D\u0062"}}]',
]


async def released_and_blocked(
    pieces: list[str], check: Reads, hold_back: int, every: int
) -> tuple[str, bool]:
    source = Source(pieces)
    out = ""
    try:
        async for delta in moderate(source.stream(), check, hold_back=hold_back, check_every=every):
            out += delta.text
    except OutputBlocked:
        return out, True
    return out, False


@pytest.mark.parametrize("payload", PAYLOADS)
@pytest.mark.parametrize(("hold_back", "every"), [(0, 1), (1, 1), (2, 3), (4, 4), (0, 8)])
async def test_an_escaped_word_split_over_deltas_never_leaves_whole(
    payload: str, hold_back: int, every: int
) -> None:
    # One character per delta: every check boundary falls somewhere inside an escape at some point.
    pieces = list(payload)
    out, blocked = await released_and_blocked(pieces, Reads("bomb"), hold_back, every)
    assert blocked
    assert "bomb" not in decode_escapes(out)
    # What was released is a prefix of the output: the held tail, from the partial escape on, was not.
    assert payload.startswith(out)
    # Read as generated only, the same output goes out whole: the gap the decoded view closes.
    raw_out, raw_blocked = await released_and_blocked(pieces, Reads("bomb", decoded=False), hold_back, every)
    assert not raw_blocked
    assert json.loads(raw_out) == json.loads(payload)


@pytest.mark.parametrize("cut", range(1, len(BOMB)))
async def test_a_check_between_any_two_deltas_sees_the_escape_whole_before_release(cut: int) -> None:
    # Two deltas, split anywhere (inside `\u00|62` too); with no tail held back the first is released at
    # once if its own reading passes, and the second only after a check read it joined to the first.
    pieces = [BOMB[:cut], BOMB[cut:]]
    out, blocked = await released_and_blocked(pieces, Reads("bomb"), hold_back=0, every=1)
    assert blocked
    assert out in ("", BOMB[:cut])
    assert "bomb" not in decode_escapes(out)

"""The output guard's decoded view: JSON escapes resolved as a client's decoder resolves them, mid-stream
too, in bounded windows, and the moderator releasing nothing whose decoded reading no check has passed."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard.moderator import OutputBlocked, moderate
from guard.readable import Reading, decode_escapes
from tests.guard.test_moderator import Source

BOMB = r'{"x": "\u0062\u006f\u006d\u0062"}'
WIDE = 10_000  # a window wider than any text here


def readable(text: str, *, pieces: int = 1) -> str:
    """The decoded reading of `text` fed in `pieces` equal pieces, as one window ("" when nothing decodes
    differently)."""
    reading = Reading(overlap=0, width=WIDE)
    size = max(1, -(-len(text) // pieces))
    for i in range(0, len(text), size):
        reading.feed(text[i : i + size])
    return "".join(reading.final_windows())


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


def test_an_escape_cut_off_mid_stream_is_read_once_it_is_whole() -> None:
    whole = r'{"x": "\u0062omb"}'
    for cut in range(len(whole) + 1):
        reading = Reading(overlap=0, width=WIDE)
        reading.feed(whole[:cut])
        view = reading.window()
        if cut >= len(r'{"x": "\u0062'):
            assert view == whole[:cut].replace(r"\u0062", "b")
        else:
            # Nothing resolved yet; the cut-off escape is kept back, not read as written.
            assert view == ""
    # At the end an escape still cut off is read as written.
    assert readable(r'{"x": "\u00') == ""
    assert readable(r'{"x": "\ud83d\ud') == '{"x": "\ufffd\\ud'


def test_windows_without_an_escape_are_left_out() -> None:
    reading = Reading(overlap=3, width=16)
    reading.feed("plain text, " * 10)
    assert reading.window() == ""
    reading.feed(r'{"x": "\u0062omb"}')
    # The new text after the last 3 characters already read.
    assert reading.window() == 't, {"x": "bomb"}'
    reading.feed("more plain text " * 4)
    assert reading.window() == ""
    # The end, in windows of 16 overlapping by 3: only the one with an escape.
    reading.feed("plain text " * 3 + r"\u0062omb " + "plain text " * 3)
    assert reading.final_windows() == ["lain text bomb p"]


@given(st.text(), st.lists(st.integers(min_value=0, max_value=40), max_size=8))
def test_the_view_is_what_a_json_decoder_reads_however_it_is_split(value: str, cuts: list[int]) -> None:
    # Python's json.dumps escapes quotes, backslashes, controls and (ensure_ascii) everything non-ASCII.
    for encoded in (json.dumps(value), json.dumps(value, ensure_ascii=False)):
        assert decode_escapes(encoded) == f'"{value}"'
        reading = Reading(overlap=0, width=WIDE)
        at = 0
        for cut in sorted(min(c, len(encoded)) for c in cuts):
            reading.feed(encoded[at:cut])
            at = max(at, cut)
        reading.feed(encoded[at:])
        assert ("".join(reading.final_windows()) or encoded) == f'"{value}"'


@given(st.text(alphabet='ab"\\/ufnD8C0e', max_size=40), st.lists(st.integers(0, 40), max_size=6))
def test_reading_in_pieces_reads_what_decoding_the_whole_reads(text: str, cuts: list[int]) -> None:
    # Text that is no JSON at all, with escapes, cut-off escapes and surrogates split anywhere.
    reading = Reading(overlap=0, width=WIDE)
    at = 0
    for cut in sorted(cuts):
        reading.feed(text[at:cut])
        at = max(at, cut)
    reading.feed(text[at:])
    assert ("".join(reading.final_windows()) or text) == decode_escapes(text)


@pytest.mark.parametrize("overlap", [0, 3, 11])
@given(
    prefix=st.text(alphabet="abc ", max_size=60),
    suffix=st.text(alphabet="abc ", max_size=60),
    cuts=st.lists(st.integers(0, 200), max_size=10),
)
def test_an_escaped_phrase_as_long_as_the_overlap_lies_whole_in_a_window(
    overlap: int, prefix: str, suffix: str, cuts: list[int]
) -> None:
    # "bomb" escaped in full (24 characters written), read in windows checked at arbitrary points.
    phrase = "bomb"[: overlap + 1] if overlap < 3 else "bomb"
    written = prefix + "".join(f"\\u{ord(c):04x}" for c in phrase) + suffix
    reading = Reading(overlap=max(overlap, len(phrase) - 1), width=max(overlap, len(phrase) - 1) + 5)
    windows = []
    at = 0
    for cut in sorted(cuts):
        reading.feed(written[at:cut])
        at = max(at, cut)
        windows.append(reading.window())
    reading.feed(written[at:])
    windows += reading.final_windows()
    assert any(phrase in w for w in windows)


class Reads:
    """An output check as the pipeline's: blocks when `needle` is in the text or in its decoded view."""

    def __init__(self, needle: str, *, decoded: bool = True) -> None:
        self.needle = needle
        self.decoded = decoded

    async def __call__(self, text: str, decoded: str, final: bool) -> str | None:
        views = [text, decoded] if self.decoded else [text]
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

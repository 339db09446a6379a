"""Bounded output checks: every check scores a window, never the whole output again, and no phrase of up to
`hold_back + 1` tokens falls between windows (it is caught even when check boundaries split it)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.base import EngineDelta
from guard.moderator import OutputBlocked, moderate, windows_of
from guard.windows import window_starts


def tok(i: int) -> str:
    """Token i's text: delimited, so a run of tokens matches only itself ("<1><2>" is not in "<1><23>")."""
    return f"<{i}>"


def run_text(first: int, length: int) -> str:
    return "".join(tok(i) for i in range(first, first + length))


def deltas_of(sizes: list[int]) -> list[EngineDelta]:
    """Deltas of `sizes` tokens each (0: a token-less delta), numbered from 0; the last one finishes."""
    out, n = [], 0
    for i, size in enumerate(sizes):
        out.append(
            EngineDelta(
                token_ids=tuple(range(n, n + size)),
                text=run_text(n, size),
                finish_reason="stop" if i == len(sizes) - 1 else None,
            )
        )
        n += size
    return out


async def _stream(deltas: list[EngineDelta]) -> AsyncGenerator[EngineDelta, None]:
    for delta in deltas:
        yield delta


class Recorder:
    """Blocks any window holding `needle`; records every window's text and its size as `scored` told it."""

    def __init__(self, needle: str | None = None) -> None:
        self.needle = needle
        self.windows: list[str] = []
        self.sizes: list[int] = []
        self.done = 0

    async def check(self, text: str, decoded: str, final: bool) -> str | None:
        self.windows.append(text)
        return "blocked" if self.needle is not None and self.needle in text else None


async def moderated(
    deltas: list[EngineDelta], recorder: Recorder, hold_back: int, every: int, window: int | None
) -> tuple[str, OutputBlocked[str] | None]:
    released = ""
    try:
        async for delta in moderate(
            _stream(deltas),
            recorder.check,
            hold_back=hold_back,
            check_every=every,
            window=window,
            scored=recorder.sizes.append,
            done=lambda: setattr(recorder, "done", recorder.done + 1),
        ):
            released += delta.text
    except OutputBlocked as blocked:
        return released, blocked
    return released, None


@settings(max_examples=300, deadline=None)
@given(length=st.integers(0, 300), width=st.integers(1, 64), data=st.data())
def test_window_starts_cover_everything_and_keep_short_runs_whole(
    length: int, width: int, data: st.DataObject
) -> None:
    overlap = data.draw(st.integers(0, width - 1))
    starts = window_starts(length, width, overlap)
    windows = [range(s, min(s + width, length)) for s in starts]
    assert starts[0] == 0
    assert set().union(*windows) == set(range(length))
    run = min(overlap + 1, length)
    for first in range(length - run + 1 if run else 0):
        assert any(first in w and first + run - 1 in w for w in windows)


@pytest.mark.parametrize("overlap", [-1, 4, 5])
def test_an_overlap_that_would_never_advance_is_refused(overlap: int) -> None:
    with pytest.raises(ValueError, match="overlap"):
        window_starts(10, 4, overlap)


scenario = {
    "sizes": st.lists(st.integers(0, 6), min_size=1, max_size=120),
    "hold_back": st.integers(0, 24),
    "every": st.one_of(st.integers(1, 40), st.just(1 << 30)),  # 1 << 30: a whole answer, checked at the end
    "extra": st.one_of(st.none(), st.integers(1, 40)),
}


def _window(hold_back: int, extra: int | None) -> int | None:
    return None if extra is None else hold_back + extra


@settings(max_examples=400, deadline=None)
@given(**scenario)
def test_every_run_of_hold_back_tokens_lies_whole_in_a_checked_window(
    sizes: list[int], hold_back: int, every: int, extra: int | None
) -> None:
    deltas = deltas_of(sizes)
    total = sum(sizes)
    recorder = Recorder()
    window = _window(hold_back, extra)
    released, blocked = asyncio.run(moderated(deltas, recorder, hold_back, every, window))
    assert blocked is None
    assert released == "".join(d.text for d in deltas)
    assert recorder.done == 1
    # Every run of hold_back + 1 tokens (hold_back is the invariant's promise; one more is what it keeps).
    run = min(hold_back + 1, total)
    for first in range(total - run + 1):
        assert any(run_text(first, run) in w for w in recorder.windows), (first, run)
    # The cost of a check is bounded whatever the answer's length: about check_every + hold_back tokens
    # (or the final window), plus at most one delta's worth at each edge since deltas are never cut.
    bound = max(min(every, total) + hold_back, window or every + hold_back) + 2 * max(sizes)
    assert recorder.sizes == [w.count("<") for w in recorder.windows]
    assert all(size <= bound for size in recorder.sizes)


@settings(max_examples=400, deadline=None)
@given(**scenario, data=st.data())
def test_a_phrase_split_across_check_boundaries_is_caught_before_any_of_it_leaves(
    sizes: list[int], hold_back: int, every: int, extra: int | None, data: st.DataObject
) -> None:
    total = sum(sizes)
    if total == 0:
        return
    length = data.draw(st.integers(1, min(hold_back + 1, total)), label="phrase tokens")
    first = data.draw(st.integers(0, total - length), label="phrase start")
    recorder = Recorder(needle=run_text(first, length))
    released, blocked = asyncio.run(
        moderated(deltas_of(sizes), recorder, hold_back, every, _window(hold_back, extra))
    )
    assert blocked is not None
    # Not a token of the phrase reached the client: only what came before it was released.
    assert all(tok(i) not in released for i in range(first, first + length))
    assert recorder.done == 1


async def test_a_long_answer_costs_a_constant_per_check_not_a_re_read() -> None:
    # 2,048 one-token deltas, a check every 16 tokens with 8 held back: 128 checks of at most 24 tokens,
    # where re-reading the whole output each time would have scored about 2048 * 2049 / 32 = 131,000.
    recorder = Recorder()
    _released, blocked = await moderated(deltas_of([1] * 2048), recorder, 8, 16, None)
    assert blocked is None
    assert len(recorder.windows) == 128
    assert max(recorder.sizes) == 24
    assert sum(recorder.sizes) < 2048 * 1.6


async def test_a_whole_answer_is_scored_as_overlapping_bounded_windows() -> None:
    recorder = Recorder()
    released, blocked = await moderated(deltas_of([1] * 100), recorder, 4, 1 << 30, 24)
    assert blocked is None
    assert released == run_text(0, 100)
    # Windows of 24 tokens advancing by 20: 0-23, 20-43, 40-63, 60-83, 80-99.
    assert recorder.windows == [run_text(s, min(24, 100 - s)) for s in (0, 20, 40, 60, 80)]


def test_windows_of_never_cut_a_delta_and_keep_token_less_text() -> None:
    deltas = [
        EngineDelta(token_ids=(0, 1, 2), text="abc"),
        EngineDelta(token_ids=(), text="!"),
        EngineDelta(token_ids=(3,), text="d"),
        EngineDelta(token_ids=(4, 5), text="ef"),
    ]
    windows = windows_of(deltas, 2, 0)
    # Token windows [0, 2), [2, 4), [4, 6) widened to whole deltas; the token-less "!" is in one of them.
    assert windows == [("abc!", 3), ("abc!d", 4), ("ef", 2)]


async def test_a_window_no_longer_than_hold_back_is_refused() -> None:
    with pytest.raises(ValueError, match="window"):
        await moderated(deltas_of([1, 1]), Recorder(), 8, 4, 8)

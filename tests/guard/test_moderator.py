"""The stream moderator: only checked text is released, the tail is held back, a block closes the source."""

from __future__ import annotations

from collections.abc import AsyncGenerator

import pytest

from engines.base import EngineDelta, Usage
from guard.moderator import OutputBlocked, moderate

WORDS = [f" w{i}" for i in range(40)]


class Source:
    """An engine stream of one token per delta; records whether it was closed early."""

    def __init__(self, words: list[str]) -> None:
        self.words = words
        self.sent = 0
        self.closed_early = False

    async def stream(self) -> AsyncGenerator[EngineDelta, None]:
        try:
            for i, word in enumerate(self.words):
                last = i == len(self.words) - 1
                self.sent += 1
                yield EngineDelta(
                    token_ids=(i,),
                    text=word,
                    finish_reason="stop" if last else None,
                    usage=Usage(prompt_tokens=3, completion_tokens=i + 1) if last else None,
                )
        except GeneratorExit:
            self.closed_early = self.sent < len(self.words)
            raise


class Checks:
    """Blocks any text containing `needle`; records (text, final) of every check."""

    def __init__(self, needle: str | None = None) -> None:
        self.needle = needle
        self.calls: list[tuple[str, bool]] = []

    async def __call__(self, text: str, decoded: str, final: bool) -> str | None:
        self.calls.append((text, final))
        return "blocked" if self.needle and self.needle in text else None


async def run(
    words: list[str], checks: Checks, hold_back: int, every: int
) -> tuple[list[EngineDelta], OutputBlocked[str] | None, Source]:
    source = Source(words)
    released: list[EngineDelta] = []
    try:
        async for delta in moderate(source.stream(), checks, hold_back=hold_back, check_every=every):
            released.append(delta)
    except OutputBlocked as blocked:
        return released, blocked, source
    return released, None, source


@pytest.mark.parametrize(("hold_back", "every"), [(0, 1), (0, 4), (3, 4), (8, 4), (4, 16), (50, 4)])
async def test_clean_output_is_released_whole_and_only_after_checks(hold_back: int, every: int) -> None:
    checks = Checks()
    released, blocked, source = await run(WORDS, checks, hold_back, every)
    assert blocked is None
    assert "".join(d.text for d in released) == "".join(WORDS)
    assert [t for d in released for t in d.token_ids] == list(range(len(WORDS)))
    assert released[-1].finish_reason == "stop"
    assert released[-1].usage is not None
    # Checks ran every `every` tokens (never on the last delta's own turn) and once at the end.
    assert [final for _, final in checks.calls] == [False] * ((len(WORDS) - 1) // every) + [True]
    # Each check scored a bounded window: what the last check left held (at least `hold_back` tokens of
    # context, fewer only at the start) and what came since, never the whole output again.
    covered = (len(WORDS) - 1) // every * every  # tokens the last check before the end had seen
    assert checks.calls[-1] == ("".join(WORDS[max(0, covered - hold_back) :]), True)
    assert all(text.count(" w") <= every + hold_back for text, _ in checks.calls)
    assert not source.closed_early


@pytest.mark.parametrize(("hold_back", "every"), [(0, 4), (3, 4), (8, 4), (4, 16)])
async def test_released_text_was_always_checked_and_the_tail_held_back(hold_back: int, every: int) -> None:
    checks = Checks()
    source = Source(WORDS)
    out, released_tokens = "", 0
    async for delta in moderate(source.stream(), checks, hold_back=hold_back, check_every=every):
        out += delta.text
        released_tokens += len(delta.token_ids)
        checked, final = checks.calls[-1]
        # Everything released was in a window some check passed...
        seen = {word for text, _ in checks.calls for word in text.split()}
        assert set(out.split()) <= seen
        if not final:
            # ...and, until the final check, at least `hold_back` of the tokens checked are still held.
            covered = int(checked.split()[-1][1:]) + 1
            assert released_tokens <= covered - hold_back


@pytest.mark.parametrize(("hold_back", "every"), [(2, 1), (4, 4), (2, 2), (8, 3)])
async def test_no_byte_of_a_blocked_span_is_released(hold_back: int, every: int) -> None:
    # A two-token span, " w20 w21": with hold_back >= its length, no part of it leaves before the block.
    checks = Checks(needle=" w20 w21")
    released, blocked, source = await run(WORDS, checks, hold_back, every)
    assert blocked is not None
    assert blocked.decision == "blocked"
    out = "".join(d.text for d in released)
    assert " w20" not in out
    assert " w21" not in out
    # The source was closed mid-stream (the engine request is aborted), right after the span arrived.
    assert source.closed_early
    assert source.sent < len(WORDS)
    assert source.sent <= 22 + every


async def test_a_block_at_the_final_check_releases_nothing_held() -> None:
    checks = Checks(needle=" w39")
    released, blocked, _ = await run(WORDS, checks, hold_back=4, every=8)
    assert blocked is not None
    assert " w39" not in "".join(d.text for d in released)
    assert checks.calls[-1][1] is True


async def test_whole_mode_checks_once_at_the_end() -> None:
    checks = Checks()
    released, blocked, _ = await run(WORDS, checks, hold_back=0, every=1 << 30)
    assert blocked is None
    assert len(released) == 1
    assert checks.calls == [("".join(WORDS), True)]

"""Streaming output moderation: hold generated text back until it has been checked.

The moderator sits between the engine stream and the client. It keeps every delta it receives until a check
covers it: a check runs at least every `check_every` tokens and at the end. After a check passes, the deltas
it covered are released except those within the last `hold_back` tokens: an unsafe phrase can span the
boundary of a check ("how to build a b" | "omb"), so the tail waits for the next check, which sees it with
what follows. At the end everything left is checked once more and released. Nothing is released that no
passing check has seen.

Each check scores a bounded window, never the whole output so far (which made a long answer cost a number
of full re-reads that grows with its length): exactly the deltas still held, which are everything no passing
check covered yet plus the shortest run of whole deltas before it that holds `hold_back` tokens. So a check
costs about `check_every + hold_back` tokens however long the answer grows. The final check scores what is
held the same way, split into overlapping windows of at most `window` tokens when it is longer than that
(a whole answer, checked only at the end, is scored as such a sequence, each window by the whole cascade).
Earlier windows are not scored again: a passing check already saw them, and the overlap keeps every phrase
of up to `hold_back + 1` tokens whole in one window (the invariant is stated in `moderate`).

Each check also reads the output as the client reads it once it decodes JSON (`guard.readable`): the decoded
text since the last check, after an overlap of `CHARS_PER_TOKEN * (hold_back + 1) - 1` characters, when an
escape was resolved in it; the final check's in windows of `CHARS_PER_TOKEN * window` characters. So an
escaped phrase that reads as up to `CHARS_PER_TOKEN * (hold_back + 1)` characters is read whole however
many tokens its escapes take as written.

A check that blocks raises `OutputBlocked`; the moderator then closes the engine stream, which aborts the
engine request. The caller turns that into the client's `content_filter` ending.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Generic, TypeVar

from engines.base import EngineDelta
from guard.readable import CHARS_PER_TOKEN, Reading
from guard.windows import window_starts

D = TypeVar("D")


class OutputBlocked(Exception, Generic[D]):
    """A check blocked the output; `decision` is what the check returned."""

    def __init__(self, decision: D) -> None:
        super().__init__("the output guard blocked this response")
        self.decision = decision


# A check of (text, decoded, final) returns None when the text may be released, or the blocking decision.
Check = Callable[[str, str, bool], Awaitable[D | None]]


def merge(deltas: list[EngineDelta]) -> EngineDelta:
    """One delta carrying the tokens, text and logprobs of `deltas`, and the last one's ending."""
    if len(deltas) == 1:
        return deltas[0]
    logprobs = [lp for d in deltas for lp in (d.logprobs or ())]
    return EngineDelta(
        token_ids=tuple(t for d in deltas for t in d.token_ids),
        text="".join(d.text for d in deltas),
        logprobs=tuple(logprobs) if any(d.logprobs is not None for d in deltas) else None,
        finish_reason=deltas[-1].finish_reason,
        usage=deltas[-1].usage,
    )


def windows_of(deltas: Sequence[EngineDelta], width: int, overlap: int) -> list[tuple[str, int]]:
    """(text, tokens) of overlapping windows of whole deltas covering `deltas`: the token windows of
    `window_starts`, each widened to the deltas it touches (a delta's text is never cut), so every run of
    up to `overlap + 1` tokens still lies whole in one of them."""
    ends: list[int] = []  # ends[i]: tokens in deltas[: i + 1]
    total = 0
    for delta in deltas:
        total += len(delta.token_ids)
        ends.append(total)
    windows = []
    first = 0  # the first delta that may touch the next window
    for start in window_starts(total, width, overlap):
        stop = min(start + width, total)
        # The deltas holding tokens [start, stop): from the one holding token `start` to the one holding
        # token `stop - 1` (every delta, token-less ones included, when there are no tokens at all).
        lo = first
        while lo < len(deltas) - 1 and ends[lo] <= start:
            lo += 1
        hi = lo
        while hi < len(deltas) - 1 and ends[hi] < stop:
            hi += 1
        # Token-less deltas at either edge go in too: their text (if any) is in no other window otherwise.
        while lo > 0 and not deltas[lo - 1].token_ids:
            lo -= 1
        while hi < len(deltas) - 1 and not deltas[hi + 1].token_ids:
            hi += 1
        first = lo
        part = deltas[lo : hi + 1]
        windows.append(("".join(d.text for d in part), sum(len(d.token_ids) for d in part)))
    return windows


async def moderate(
    source: AsyncGenerator[EngineDelta, None],
    check: Check[D],
    *,
    hold_back: int,
    check_every: int,
    window: int | None = None,
    scored: Callable[[int], None] | None = None,
    done: Callable[[], None] | None = None,
) -> AsyncGenerator[EngineDelta, None]:
    """Yield `source`'s deltas once checked (merged per release); raise OutputBlocked when a check blocks.

    `check(text, decoded, final)` sees one window of the output and one of its decoded reading ("" when
    decoding changes nothing there; see the module docstring); `final` is true for the last window of the
    check at the end. `window`: the most tokens the final check scores at once (default
    `check_every + hold_back`; more than `hold_back`). `scored(tokens)` is told each window's size just
    before it is checked (the guard work to meter; a decoded window counts one token per `CHARS_PER_TOKEN`
    characters); `done()` is called once, however the moderation ends.
    """
    width = check_every + hold_back if window is None else window
    if width <= hold_back:
        raise ValueError(f"window ({width}) must be longer than hold_back ({hold_back})")
    reading = Reading(overlap=CHARS_PER_TOKEN * (hold_back + 1) - 1, width=CHARS_PER_TOKEN * width)
    held: deque[EngineDelta] = deque()
    held_tokens = 0  # tokens in `held`
    unchecked = 0  # tokens received since the last check
    try:
        async with contextlib.aclosing(source):
            async for delta in source:
                held.append(delta)
                reading.feed(delta.text)
                held_tokens += len(delta.token_ids)
                unchecked += len(delta.token_ids)
                # The last delta is checked with everything else at the end (the source ends right after it;
                # it is drained, not closed, so the engine request counts as completed).
                if delta.finish_reason is not None or unchecked < check_every:
                    continue
                unchecked = 0
                # Invariant: `held` is everything no passing check has covered, preceded by the shortest run
                # of whole deltas (all of them, if fewer) of the covered output that holds `hold_back` tokens.
                # So a check of `held` sees every phrase of up to `hold_back + 1` tokens that ends in what is
                # new whole, in one window: the covered part of such a phrase is at most `hold_back` tokens.
                decoded = reading.window()
                if scored is not None:
                    scored(held_tokens + _tokens(decoded))
                blocked = await check("".join(d.text for d in held), decoded, False)
                if blocked is not None:
                    raise OutputBlocked(blocked)
                # Release the oldest held deltas while what stays held still covers `hold_back` tokens.
                release: list[EngineDelta] = []
                while held and held_tokens - len(held[0].token_ids) >= hold_back:
                    first = held.popleft()
                    held_tokens -= len(first.token_ids)
                    release.append(first)
                if release:
                    yield merge(release)
            if not held:
                return
            rest = list(held)
            # What is held is no longer than `width` unless deltas came in large pieces, or nothing was
            # checked before (a whole answer): then it is scored in overlapping windows of at most `width`.
            parts = (
                windows_of(rest, width, hold_back)
                if held_tokens > width
                else [("".join(d.text for d in rest), held_tokens)]
            )
            readings = reading.final_windows()
            # Raw and decoded windows are checked in pairs; the longer list's rest goes with "" beside it.
            count = max(len(parts), len(readings))
            for i in range(count):
                text, tokens = parts[i] if i < len(parts) else ("", 0)
                decoded = readings[i] if i < len(readings) else ""
                if scored is not None:
                    scored(tokens + _tokens(decoded))
                blocked = await check(text, decoded, i == count - 1)
                if blocked is not None:
                    raise OutputBlocked(blocked)
            yield merge(rest)
    finally:
        if done is not None:
            done()


def _tokens(decoded: str) -> int:
    """The guard tokens a decoded window is metered as (it was never tokenized here)."""
    return -(-len(decoded) // CHARS_PER_TOKEN)

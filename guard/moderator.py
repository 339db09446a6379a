"""Streaming output moderation: hold generated text back until it has been checked.

The moderator sits between the engine stream and the client. It keeps every delta it receives until a check
covers it: a check runs on the whole output so far at least every `check_every` tokens and at the end.
After a check passes, the deltas it covered are released except those within the last `hold_back` tokens: an
unsafe phrase can span the boundary of a check ("how to build a b" | "omb"), so the tail waits for the next
check, which sees it with what follows. At the end everything left is checked once more and released.
Nothing is released that no passing check has seen.

A check that blocks raises `OutputBlocked`; the moderator then closes the engine stream, which aborts the
engine request. The caller turns that into the client's `content_filter` ending.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Generic, TypeVar

from engines.base import EngineDelta

D = TypeVar("D")


class OutputBlocked(Exception, Generic[D]):
    """A check blocked the output; `decision` is what the check returned."""

    def __init__(self, decision: D) -> None:
        super().__init__("the output guard blocked this response")
        self.decision = decision


# A check returns None when the text may be released, or the blocking decision.
Check = Callable[[str, bool], Awaitable[D | None]]


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


async def moderate(
    source: AsyncGenerator[EngineDelta, None],
    check: Check[D],
    *,
    hold_back: int,
    check_every: int,
) -> AsyncGenerator[EngineDelta, None]:
    """Yield `source`'s deltas once checked (merged per release); raise OutputBlocked when a check blocks.

    `check(text, final)` sees the whole output so far; `final` is true for the check at the end.
    """
    held: deque[EngineDelta] = deque()
    held_tokens = 0  # tokens in `held`
    unchecked = 0  # tokens received since the last check
    text: list[str] = []
    async with contextlib.aclosing(source):
        async for delta in source:
            held.append(delta)
            held_tokens += len(delta.token_ids)
            unchecked += len(delta.token_ids)
            text.append(delta.text)
            # The last delta is checked with everything else at the end (the source ends right after it; it
            # is drained, not closed, so the engine request counts as completed).
            if delta.finish_reason is not None or unchecked < check_every:
                continue
            unchecked = 0
            blocked = await check("".join(text), False)
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
        blocked = await check("".join(text), True)
        if blocked is not None:
            raise OutputBlocked(blocked)
        yield merge(list(held))

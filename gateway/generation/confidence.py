"""The confidence gate of a route's cascade (`registry.models.CascadeSpec`): the first model's answer is held
until its confidence is measured, and a confidence under the route's threshold ends the attempt before
anything of it is released, so that the stronger model answers instead.

The measure is the mean log-probability of the generated tokens (the engine returns the chosen token's
log-probability when asked for `logprobs: 0`; the client sees logprobs only when it asked for them). A whole
answer is measured in full; a stream on its first `within_tokens` tokens (or all of it, if it ends sooner),
held back meanwhile like the output guard's window: it sits between the engine and the output guard, so
the guard, and the client, read nothing until the gate has decided. Tokens the gate read were generated:
the tracker counts them, and the tenant is charged for them.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Callable

from engines.base import EngineDelta


class LowConfidence(Exception):
    """The answer's confidence is under the route's threshold: the attempt ends unreleased."""

    def __init__(self, confidence: float, tokens: int, threshold: float) -> None:
        super().__init__(f"mean token log-probability {confidence:.3f} over {tokens} tokens < {threshold}")
        self.confidence = confidence
        self.tokens = tokens


Measured = Callable[[float, int], None]


def confidence_gate(
    threshold: float, within: int | None, measured: Measured
) -> Callable[[AsyncGenerator[EngineDelta, None]], AsyncGenerator[EngineDelta, None]]:
    """A transform of one choice's deltas: held until `within` tokens (None: the whole answer) have been
    generated or the answer ends, then `measured(confidence, tokens)` is called and either LowConfidence is
    raised (confidence < `threshold`) or the held deltas and the rest pass through. An answer the engine
    gave no log-probabilities for cannot be measured, and passes."""

    async def gate(deltas: AsyncGenerator[EngineDelta, None]) -> AsyncGenerator[EngineDelta, None]:
        async with contextlib.aclosing(deltas):
            held: list[EngineDelta] = []
            total, count, tokens = 0.0, 0, 0
            async for delta in deltas:
                held.append(delta)
                tokens += len(delta.token_ids)
                for entry in delta.logprobs or ():
                    total += entry.logprob
                    count += 1
                if delta.finish_reason is not None or (within is not None and tokens >= within):
                    break
            if count:
                confidence = total / count
                measured(confidence, count)
                if confidence < threshold:
                    raise LowConfidence(confidence, count, threshold)
            for delta in held:
                yield delta
            async for delta in deltas:
                yield delta

    return gate

"""What happened to one generation request, known however it ended.

The tracker counts what the engine produced as it arrives, so a request that ends early (client gone, stalled
reader, engine error, shutdown) still has exact usage: later stages charge it to quotas and audit it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from engines.base import EngineDelta, FinishReason, Usage
from gateway.observe.outcome import Outcome, Status

if TYPE_CHECKING:
    from gateway.observe.timeline import RequestTimeline

OutcomeSink = Callable[[Outcome], None]


def discard_outcome(outcome: Outcome) -> None:
    """Default sink: nothing more (each request's timeline logs its end as one JSON line: gateway.observe)."""


class RequestTracker:
    """Counts one request's output and reports its `Outcome` exactly once."""

    def __init__(
        self,
        request_id: str,
        model: str,
        prompt_tokens: int,
        stream: bool,
        sink: OutcomeSink,
        *,
        tokenizer: str = "",
        chat_template: str = "",
        choices: int = 1,
        metadata: dict[str, str] | None = None,
        on_output: Callable[[int, int], None] | None = None,
        timeline: RequestTimeline | None = None,
    ) -> None:
        self.request_id = request_id
        # Where the request's time went: one timestamp per delta with tokens; it ends with the outcome.
        self._timeline = timeline
        if timeline is not None:
            timeline.expect_outcome()
        self._choices = choices
        self._metadata = metadata
        # Told how many tokens each delta brought, and of which choice (the admission lease charges the tenant
        # and the choice's replica).
        self._on_output = on_output
        self._model = model
        self._tokenizer = tokenizer
        self._chat_template = chat_template
        self._prompt_tokens = prompt_tokens
        self._stream = stream
        self._sink = sink
        self._completion_tokens = 0
        self._guard_tokens = 0
        # Each choice's final usage, by choice index.
        self._finals: dict[int, Usage] = {}
        self._finish: FinishReason | None = None
        self._stalled = False
        self.outcome: Outcome | None = None

    def observe(self, delta: EngineDelta, choice: int = 0) -> None:
        """Count a delta of choice `choice` as the engine produced it."""
        self._completion_tokens += len(delta.token_ids)
        if delta.token_ids:
            if self._timeline is not None:
                self._timeline.token()
            if self._on_output is not None:
                self._on_output(len(delta.token_ids), choice)
        if delta.finish_reason is not None:
            self._finish = delta.finish_reason
            if delta.usage is not None:
                self._finals[choice] = delta.usage

    def guard_scored(self, tokens: int) -> None:
        """The output guard is scoring a window of `tokens` generated tokens (charged with the usage)."""
        self._guard_tokens += tokens

    def mark_stalled(self) -> None:
        """The client stopped reading; the coming cancellation is a stall, not a disconnect."""
        self._stalled = True

    def usage(self) -> Usage:
        """Usage so far: the engine's final figures when every choice sent them (the prompt counted once, as
        OpenAI counts it for n > 1), else what was counted."""
        finals = list(self._finals.values())
        if len(finals) == self._choices:
            return Usage(
                prompt_tokens=finals[0].prompt_tokens,
                completion_tokens=sum(u.completion_tokens for u in finals),
                cached_tokens=finals[0].cached_tokens,
                guard_tokens=self._guard_tokens,
            )
        return Usage(
            prompt_tokens=self._prompt_tokens,
            completion_tokens=self._completion_tokens,
            guard_tokens=self._guard_tokens,
        )

    def finish(self, status: Status) -> Outcome:
        """Record how the request ended (the first call wins) and hand the outcome to the sink."""
        if self.outcome is not None:
            return self.outcome
        if status == "cancelled" and self._stalled:
            status = "stalled"
        self.outcome = Outcome(
            request_id=self.request_id,
            model=self._model,
            status=status,
            finish_reason=self._finish,
            usage=self.usage(),
            stream=self._stream,
            tokenizer=self._tokenizer,
            chat_template=self._chat_template,
            metadata=self._metadata,
        )
        self._sink(self.outcome)
        if self._timeline is not None:
            self._timeline.record_outcome(self.outcome)
        return self.outcome

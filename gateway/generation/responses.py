"""Engine output in OpenAI's response shapes: whole responses and SSE chunks, chat and legacy completions."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from engines.base import EngineDelta, FinishReason, TokenLogprob, Usage
from gateway.generation.planning import Plan
from gateway.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobEntry,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    PromptTokensDetails,
    TopLogprobEntry,
    UsageInfo,
)

_encoder = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"
CONTENT_FILTER = "content_filter"


def sse(payload: msgspec.Struct) -> bytes:
    """One server-sent event carrying `payload` as JSON."""
    return b"data: " + _encoder.encode(payload) + b"\n\n"


def usage_info(usage: Usage) -> UsageInfo:
    """OpenAI `usage` from engine usage."""
    return UsageInfo(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
    )


def _finish(reason: FinishReason | None) -> str | None:
    # "abort" only reaches a client when the server shuts down mid-request; OpenAI has no such value.
    return None if reason is None else ("length" if reason == "length" else "stop")


def _chat_logprobs(entries: Sequence[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            ChatLogprobEntry(
                token=e.token,
                logprob=e.logprob,
                bytes=list(e.token.encode()),
                top_logprobs=[
                    TopLogprobEntry(token=t.token, logprob=t.logprob, bytes=list(t.token.encode()))
                    for t in e.top
                ],
            )
            for e in entries
        ]
    )


def _completion_logprobs(entries: Sequence[TokenLogprob], offset: int) -> CompletionLogprobs:
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return CompletionLogprobs(
        tokens=[e.token for e in entries],
        token_logprobs=[e.logprob for e in entries],
        top_logprobs=[{t.token: t.logprob for t in e.top} for e in entries],
        text_offset=offsets,
    )


class Formatter:
    """Turns one request's engine deltas into OpenAI output (streaming chunks or one whole response)."""

    def __init__(self, plan: Plan, response_id: str, model: str, created: int) -> None:
        self._plan = plan
        self._id = response_id
        self._model = model
        self._created = created
        self._offset = 0

    # ---- streaming ----

    def _chat_chunk(
        self, delta: ChatDelta, finish: str | None = None, logprobs: ChatLogprobs | None = None
    ) -> bytes:
        choice = ChatChunkChoice(index=0, delta=delta, finish_reason=finish, logprobs=logprobs)
        return sse(
            ChatCompletionChunk(id=self._id, created=self._created, model=self._model, choices=[choice])
        )

    def opening(self) -> list[bytes]:
        """Events sent before the first token (chat announces the assistant role)."""
        if self._plan.kind == "chat":
            return [self._chat_chunk(ChatDelta(role="assistant", content=""))]
        return []

    def chunk(self, delta: EngineDelta) -> list[bytes]:
        """Events for one engine delta (none when it carries neither text nor a finish reason)."""
        finish = _finish(delta.finish_reason)
        if not delta.text and finish is None:
            return []
        entries = delta.logprobs if self._plan.logprobs and delta.logprobs else ()
        if self._plan.kind == "chat":
            out = []
            if delta.text:
                logprobs = _chat_logprobs(entries) if self._plan.logprobs else None
                out.append(self._chat_chunk(ChatDelta(content=delta.text), logprobs=logprobs))
            if finish is not None:
                out.append(self._chat_chunk(ChatDelta(), finish))
            return out
        completion_logprobs = _completion_logprobs(entries, self._offset) if self._plan.logprobs else None
        self._offset += len(delta.text)
        choice = CompletionChoice(
            index=0, text=delta.text, finish_reason=finish, logprobs=completion_logprobs
        )
        return [sse(Completion(id=self._id, created=self._created, model=self._model, choices=[choice]))]

    def filtered(self) -> list[bytes]:
        """The chunk that ends a stream the output guard stopped (`finish_reason: content_filter`)."""
        if self._plan.kind == "chat":
            return [self._chat_chunk(ChatDelta(), CONTENT_FILTER)]
        choice = CompletionChoice(index=0, text="", finish_reason=CONTENT_FILTER, logprobs=None)
        return [sse(Completion(id=self._id, created=self._created, model=self._model, choices=[choice]))]

    def closing(self, usage: Usage) -> list[bytes]:
        """The usage event (when asked for) and `[DONE]`."""
        out = []
        if self._plan.include_usage:
            info = usage_info(usage)
            if self._plan.kind == "chat":
                out.append(
                    sse(
                        ChatCompletionChunk(
                            id=self._id, created=self._created, model=self._model, choices=[], usage=info
                        )
                    )
                )
            else:
                out.append(
                    sse(
                        Completion(
                            id=self._id, created=self._created, model=self._model, choices=[], usage=info
                        )
                    )
                )
        out.append(DONE)
        return out

    # ---- whole response ----

    def whole(
        self, deltas: Sequence[EngineDelta], usage: Usage, *, filtered: bool = False
    ) -> ChatCompletion | Completion:
        """The non-streaming response built from all deltas; `filtered`: the output guard blocked it, and
        none of its text is sent."""
        if filtered:
            deltas = ()
        text = "".join(d.text for d in deltas)
        finish = _finish(next((d.finish_reason for d in reversed(deltas) if d.finish_reason), None))
        if filtered:
            finish = CONTENT_FILTER
        entries = [e for d in deltas for e in (d.logprobs or ())]
        if self._plan.kind == "chat":
            choice = ChatChoice(
                index=0,
                message=AssistantMessage(content=text),
                finish_reason=finish,
                logprobs=_chat_logprobs(entries) if self._plan.logprobs else None,
            )
            return ChatCompletion(
                id=self._id,
                created=self._created,
                model=self._model,
                choices=[choice],
                usage=usage_info(usage),
            )
        completion = CompletionChoice(
            index=0,
            text=text,
            finish_reason=finish,
            logprobs=_completion_logprobs(entries, 0) if self._plan.logprobs else None,
        )
        return Completion(
            id=self._id,
            created=self._created,
            model=self._model,
            choices=[completion],
            usage=usage_info(usage),
        )

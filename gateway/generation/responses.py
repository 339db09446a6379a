"""Engine output in OpenAI's response shapes: whole responses and SSE chunks, chat and legacy completions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from engines.base import EngineDelta, FinishReason, TokenLogprob, Usage
from gateway.generation.planning import Plan
from gateway.generation.tools import CallStream, parse_whole
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


# Where a chunk's text goes: a text no id or model name is expected to hold (one that does has its chunks
# encoded whole).
_MARK = "\x00lockgate\x00"
_MARK_JSON = _encoder.encode(_MARK)


def _around(chunk: bytes) -> tuple[bytes, bytes] | None:
    """The bytes of `chunk` before and after the marker text; None where it is not found exactly once."""
    if chunk.count(_MARK_JSON) != 1:
        return None
    before, _, after = chunk.partition(_MARK_JSON)
    return before, after


def usage_info(usage: Usage) -> UsageInfo:
    """OpenAI `usage` from engine usage."""
    return UsageInfo(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
        guard_tokens=usage.guard_tokens or None,
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
    """Turns one request's engine deltas into OpenAI output (streaming chunks or one whole response), per
    choice (`EngineDelta.index`); tool calls are parsed out of chat output when the request offered tools."""

    def __init__(self, plan: Plan, response_id: str, model: str, created: int, tokenizer: Any = None) -> None:
        self._plan = plan
        self._id = response_id
        self._model = model
        self._created = created
        self._tokenizer = tokenizer
        # Per choice: text offset (completion logprobs), tool-call parsing state, whether it has ended.
        self._offsets: dict[int, int] = {}
        self._calls: dict[int, CallStream] = {}
        self._ended: set[int] = set()
        # Per choice: a plain content chunk's bytes around its text (chat without logprobs or tools).
        self._content: dict[int, tuple[bytes, bytes] | None] = {}

    # ---- streaming ----

    def _chat_chunk(
        self, index: int, delta: ChatDelta, finish: str | None = None, logprobs: ChatLogprobs | None = None
    ) -> bytes:
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish, logprobs=logprobs)
        return sse(
            ChatCompletionChunk(id=self._id, created=self._created, model=self._model, choices=[choice])
        )

    def _content_chunk(self, index: int, text: str, logprobs: ChatLogprobs | None) -> bytes:
        """A chat chunk carrying `text`: with no logprobs, the choice's chunk bytes around the text's JSON
        (the same bytes as encoding the chunk, without building and encoding three Structs per token)."""
        if logprobs is not None:
            return self._chat_chunk(index, ChatDelta(content=text), logprobs=logprobs)
        if index not in self._content:
            self._content[index] = _around(self._chat_chunk(index, ChatDelta(content=_MARK)))
        around = self._content[index]
        if around is None:
            return self._chat_chunk(index, ChatDelta(content=text))
        return around[0] + _encoder.encode(text) + around[1]

    def _completion_chunk(self, choice: CompletionChoice) -> bytes:
        return sse(Completion(id=self._id, created=self._created, model=self._model, choices=[choice]))

    def opening(self) -> list[bytes]:
        """Events sent before the first token (chat announces the assistant role of each choice)."""
        if self._plan.kind == "chat":
            return [
                self._chat_chunk(i, ChatDelta(role="assistant", content=""))
                for i in range(self._plan.choices)
            ]
        return []

    def _call_stream(self, index: int) -> CallStream | None:
        use = self._plan.tools
        if use is None:
            return None
        if index not in self._calls:
            self._calls[index] = CallStream(use, self._tokenizer)
        return self._calls[index]

    def chunk(self, delta: EngineDelta) -> list[bytes]:
        """Events for one engine delta (none when it carries nothing to send)."""
        finish = _finish(delta.finish_reason)
        index = delta.index
        if finish is not None:
            self._ended.add(index)
        entries = delta.logprobs if self._plan.logprobs and delta.logprobs else ()
        if self._plan.kind != "chat":
            if not delta.text and finish is None:
                return []
            offset = self._offsets.get(index, 0)
            text_logprobs = _completion_logprobs(entries, offset) if self._plan.logprobs else None
            self._offsets[index] = offset + len(delta.text)
            choice = CompletionChoice(
                index=index, text=delta.text, finish_reason=finish, logprobs=text_logprobs
            )
            return [self._completion_chunk(choice)]
        logprobs = _chat_logprobs(entries) if self._plan.logprobs else None
        calls = self._call_stream(index)
        if calls is None:
            out = [self._content_chunk(index, delta.text, logprobs)] if delta.text else []
            if finish is not None:
                out.append(self._chat_chunk(index, ChatDelta(), finish))
            return out
        pieces = [calls.feed(delta.text)] if delta.text else []
        if finish is not None:
            pieces.append(calls.finish())
        out = []
        for piece in pieces:
            if piece.content or piece.calls:
                message = ChatDelta(content=piece.content, tool_calls=piece.calls or None)
                out.append(self._chat_chunk(index, message, logprobs=logprobs))
                logprobs = None
        if finish is not None:
            out.append(self._chat_chunk(index, ChatDelta(), _with_calls(finish, calls.called)))
        return out

    def filtered(self) -> list[bytes]:
        """The chunks that end a stream the output guard stopped (`finish_reason: content_filter` for every
        choice not ended yet)."""
        open_choices = [i for i in range(self._plan.choices) if i not in self._ended]
        if self._plan.kind == "chat":
            return [self._chat_chunk(i, ChatDelta(), CONTENT_FILTER) for i in open_choices]
        return [
            self._completion_chunk(
                CompletionChoice(index=i, text="", finish_reason=CONTENT_FILTER, logprobs=None)
            )
            for i in open_choices
        ]

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

    def _chat_choice(self, index: int, deltas: Sequence[EngineDelta], filtered: bool) -> ChatChoice:
        text = "".join(d.text for d in deltas)
        finish = CONTENT_FILTER if filtered else _last_finish(deltas)
        entries = [e for d in deltas for e in (d.logprobs or ())]
        logprobs = _chat_logprobs(entries) if self._plan.logprobs else None
        use = self._plan.tools
        if use is None or filtered:
            return ChatChoice(
                index=index,
                message=AssistantMessage(role="assistant", content=text),
                finish_reason=finish,
                logprobs=logprobs,
            )
        parsed = parse_whole(use, text, self._tokenizer)
        message = AssistantMessage(role="assistant", content=parsed.content, tool_calls=parsed.calls or None)
        if finish is not None:
            finish = _with_calls(finish, bool(parsed.calls))
        return ChatChoice(index=index, message=message, finish_reason=finish, logprobs=logprobs)

    def whole(
        self, deltas: Sequence[EngineDelta], usage: Usage, *, filtered: bool = False
    ) -> ChatCompletion | Completion:
        """The non-streaming response built from all deltas; `filtered`: the output guard blocked it, and
        none of its text is sent."""
        by_choice: dict[int, list[EngineDelta]] = {i: [] for i in range(self._plan.choices)}
        if not filtered:
            for delta in deltas:
                by_choice[delta.index].append(delta)
        if self._plan.kind == "chat":
            return ChatCompletion(
                id=self._id,
                created=self._created,
                model=self._model,
                choices=[self._chat_choice(i, ds, filtered) for i, ds in by_choice.items()],
                usage=usage_info(usage),
            )
        choices = [
            CompletionChoice(
                index=i,
                text="".join(d.text for d in ds),
                finish_reason=CONTENT_FILTER if filtered else _last_finish(ds),
                logprobs=(
                    _completion_logprobs([e for d in ds for e in (d.logprobs or ())], 0)
                    if self._plan.logprobs
                    else None
                ),
            )
            for i, ds in by_choice.items()
        ]
        return Completion(
            id=self._id, created=self._created, model=self._model, choices=choices, usage=usage_info(usage)
        )


def _last_finish(deltas: Sequence[EngineDelta]) -> str | None:
    return _finish(next((d.finish_reason for d in reversed(deltas) if d.finish_reason), None))


def _with_calls(finish: str, called: bool) -> str:
    """OpenAI's finish reason of an answer that called tools."""
    return "tool_calls" if called and finish == "stop" else finish

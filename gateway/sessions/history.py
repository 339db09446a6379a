"""A session's conversation: the messages the next step's prompt repeats, and the assistant's reply read
back from an answer as it was sent (a chat completion, whole or streamed), so that what the history holds is
exactly what the client received and the output guard checked."""

from __future__ import annotations

import math

import msgspec

from gateway.chat_read import ReadAnswer, ReadFunction, ReadMessage, ReadToolCall, read_answer
from gateway.keeping import StoredAnswer
from gateway.schemas import ChatMessage, FunctionCall, ToolCall
from gateway.sessions.base import SessionRecord, Usage


class UnreadableAnswerError(Exception):
    """An answer that is not a chat completion this gateway sent."""


def messages_of(record: SessionRecord) -> list[ChatMessage]:
    """Every step's messages and reply, in order: the history the next step continues."""
    return [m for step in record.steps for m in (*step.messages, step.reply)]


def reply_of(answer: StoredAnswer, history_chars: int) -> tuple[ChatMessage, Usage]:
    """The assistant message of `answer` (its first choice) and the step's usage. A stream sent without
    `include_usage` has none: its tokens are estimated from `history_chars` (the conversation's characters)
    and the reply's, at three characters a token."""
    if answer.media_type.startswith("text/event-stream"):
        parts = [_decode(line[5:]) for line in answer.body.splitlines() if line.startswith(b"data: {")]
        deltas = [c.delta for p in parts for c in p.choices if c.index == 0 and c.delta is not None]
        usage = next((p.usage for p in reversed(parts) if p.usage is not None), None)
        reply = _joined(deltas)
    else:
        whole = _decode(answer.body)
        first = next((c.message for c in whole.choices if c.index == 0 and c.message is not None), None)
        if first is None:
            raise UnreadableAnswerError("the answer has no first choice")
        reply, usage = _message(first.content, first.refusal, first.tool_calls), whole.usage
    if usage is None:
        estimate = Usage(
            prompt_tokens=math.ceil(history_chars / 3), completion_tokens=math.ceil(characters([reply]) / 3)
        )
        return reply, estimate
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return reply, Usage(
        prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens, cached_tokens=cached
    )


def _decode(body: bytes) -> ReadAnswer:
    try:
        return read_answer(body)
    except msgspec.DecodeError as exc:
        raise UnreadableAnswerError(f"the answer does not decode: {exc}") from exc


def _joined(deltas: list[ReadMessage]) -> ChatMessage:
    """The message a stream's deltas make: texts joined, tool calls assembled by index."""
    content = "".join(d.content or "" for d in deltas)
    refusal = "".join(d.refusal or "" for d in deltas)
    calls: dict[int, ReadToolCall] = {}
    for call in (c for d in deltas for c in d.tool_calls or ()):
        before = calls.get(call.index)
        if before is None:
            calls[call.index] = call
            continue
        first, more = before.function or ReadFunction(), call.function or ReadFunction()
        arguments = (first.arguments or "") + (more.arguments or "")
        calls[call.index] = ReadToolCall(
            call.index, before.id or call.id, ReadFunction(first.name or more.name, arguments)
        )
    return _message(content or None, refusal or None, [calls[i] for i in sorted(calls)] or None)


def _message(content: str | None, refusal: str | None, calls: list[ReadToolCall] | None) -> ChatMessage:
    tool_calls = [
        ToolCall(
            id=c.id or f"call_{c.index}",
            function=FunctionCall(
                name=(c.function.name if c.function else None) or "",
                arguments=(c.function.arguments if c.function else None) or "",
            ),
        )
        for c in calls or ()
    ]
    return ChatMessage(role="assistant", content=content, refusal=refusal, tool_calls=tool_calls or None)


def characters(messages: list[ChatMessage]) -> int:
    """The text characters of `messages` (content, refusals, tool call arguments)."""
    total = 0
    for m in messages:
        if isinstance(m.content, str):
            total += len(m.content)
        elif m.content is not None:
            total += sum(len(p.text or "") for p in m.content)
        total += len(m.refusal or "") + sum(len(c.function.arguments) for c in m.tool_calls or ())
    return total

"""A chat completion as this gateway sent it, read back: a whole answer or one event of its stream, decoded
leniently (every field optional, unknown ones ignored). What reads its own answers uses it: a session's
recorded reply (`gateway.sessions.history`) and the Responses API's re-telling (`gateway.responses_api`)."""

from __future__ import annotations

import msgspec


class ReadFunction(msgspec.Struct, frozen=True):
    """A tool call's function, or a piece of it."""

    name: str | None = None
    arguments: str | None = None


class ReadToolCall(msgspec.Struct, frozen=True):
    """A tool call, or a piece of one (`index` says which)."""

    index: int = 0
    id: str | None = None
    function: ReadFunction | None = None


class ReadMessage(msgspec.Struct, frozen=True):
    """A whole answer's message, or a stream event's delta."""

    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ReadToolCall] | None = None


class ReadChoice(msgspec.Struct, frozen=True):
    """One choice."""

    index: int = 0
    message: ReadMessage | None = None
    delta: ReadMessage | None = None
    finish_reason: str | None = None


class ReadDetails(msgspec.Struct, frozen=True):
    """`usage.prompt_tokens_details`."""

    cached_tokens: int = 0


class ReadUsage(msgspec.Struct, frozen=True):
    """`usage`."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: ReadDetails | None = None


class ReadError(msgspec.Struct, frozen=True):
    """A stream's error event."""

    message: str = ""
    code: str | None = None


class ReadAnswer(msgspec.Struct, frozen=True):
    """A whole answer, or one event of a stream (an error event has only `error`)."""

    id: str = ""
    model: str = ""
    choices: list[ReadChoice] = msgspec.field(default_factory=list)
    usage: ReadUsage | None = None
    error: ReadError | None = None


read_answer = msgspec.json.Decoder(ReadAnswer).decode

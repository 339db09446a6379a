"""OpenAI wire schemas (msgspec Structs): requests we accept and responses we send.

Requests forbid unknown fields: a field we do not support is refused by name rather than silently ignored.
"""

from __future__ import annotations

from typing import Literal

import msgspec

Role = Literal["system", "developer", "user", "assistant", "tool"]


class _Request(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of the request structs."""


class TextPart(_Request, frozen=True, kw_only=True):
    """One text part of a multi-part message content."""

    type: Literal["text"]
    text: str


class ChatMessage(_Request, frozen=True, kw_only=True):
    """One chat message."""

    role: Role
    content: str | list[TextPart]
    name: str | None = None
    # A tool message answers the assistant's tool call with this id. Its content is untrusted: the guard
    # checks it for injection like user text.
    tool_call_id: str | None = None

    def text(self) -> str:
        """The content as one string."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Request, frozen=True, kw_only=True):
    """`stream_options`."""

    include_usage: bool = False


class _Sampling(_Request, frozen=True, kw_only=True):
    """Fields shared by both completion endpoints."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class ChatCompletionRequest(_Sampling, frozen=True, kw_only=True):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class CompletionRequest(_Sampling, frozen=True, kw_only=True):
    """`POST /v1/completions`. One prompt: a string or a list of token ids."""

    prompt: str | list[int | str]
    logprobs: int | None = None
    echo: bool = False


# ---- responses -------------------------------------------------------------------------------------------


class _Response(msgspec.Struct, frozen=True, kw_only=True):
    """Base of the response structs."""


class PromptTokensDetails(_Response, frozen=True, kw_only=True):
    """`usage.prompt_tokens_details`."""

    cached_tokens: int = 0


class UsageInfo(_Response, frozen=True, kw_only=True):
    """`usage`."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprobEntry(_Response, frozen=True, kw_only=True):
    """One alternative in chat `top_logprobs`."""

    token: str
    logprob: float
    bytes: list[int]


class ChatLogprobEntry(_Response, frozen=True, kw_only=True):
    """One generated token in chat `logprobs.content`."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprobEntry]


class ChatLogprobs(_Response, frozen=True, kw_only=True):
    """Chat `choices[].logprobs`."""

    content: list[ChatLogprobEntry]


class CompletionLogprobs(_Response, frozen=True, kw_only=True):
    """Legacy completions `choices[].logprobs`."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class AssistantMessage(_Response, frozen=True, kw_only=True):
    """The answer of a non-streaming chat completion."""

    role: Literal["assistant"] = "assistant"
    content: str = ""


class ChatChoice(_Response, frozen=True, kw_only=True):
    """One choice of a chat completion."""

    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(_Response, frozen=True, kw_only=True):
    """A non-streaming chat completion."""

    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    object: Literal["chat.completion"] = "chat.completion"


class ChatDelta(_Response, frozen=True, kw_only=True, omit_defaults=True):
    """The incremental message of a chat chunk."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Response, frozen=True, kw_only=True):
    """One choice of a chat chunk."""

    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(_Response, frozen=True, kw_only=True):
    """One SSE event of a streaming chat completion."""

    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class CompletionChoice(_Response, frozen=True, kw_only=True):
    """One choice of a completion (also used in its stream chunks)."""

    index: int
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(_Response, frozen=True, kw_only=True):
    """A completion, or one chunk of a streaming completion (OpenAI uses one object type for both)."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    object: Literal["text_completion"] = "text_completion"


class AliasTargetCard(_Response, frozen=True, kw_only=True):
    """One version an alias routes to, with its share of requests."""

    model: str
    weight: float


class ModelCard(_Response, frozen=True, kw_only=True):
    """One entry of `GET /v1/models`: an alias (what clients usually name) or a pinnable `name@version`."""

    id: str
    created: int
    owned_by: str = "lockgate"
    object: Literal["model"] = "model"
    # Lockgate's extensions.
    kind: Literal["alias", "version"] = "alias"
    targets: list[AliasTargetCard] | None = None
    max_model_len: int | None = None
    tokenizer: str | None = None
    chat_template: str | None = None
    weights_sha256: str | None = None
    kv_bytes_per_token: int | None = None


class ModelList(_Response, frozen=True, kw_only=True):
    """`GET /v1/models`."""

    data: list[ModelCard]
    object: Literal["list"] = "list"

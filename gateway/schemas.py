"""OpenAI wire schemas (msgspec Structs): requests we accept and responses we send.

Requests forbid unknown fields: a field we do not support is refused by name rather than silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from registry.models import NAME_PATTERN

Role = Literal["system", "developer", "user", "assistant", "tool"]
# A model as a request names it: a registry name (an alias), or a pinned `name@version`; the OpenAPI document
# states the pattern the server enforces.
ModelName = Annotated[
    str,
    msgspec.Meta(
        pattern=f"^{NAME_PATTERN.pattern}(@{NAME_PATTERN.pattern})?$",
        description="A model name, or a pinned version `name@version`.",
    ),
]


class _Request(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of the request structs. A field sent as `null` is the same as a field left out."""


class ContentPart(_Request, frozen=True, kw_only=True):
    """One part of a multi-part message content. Only text reaches the model: the other part types OpenAI
    defines are decoded so that planning can refuse them with a clear message (the model reads text only)."""

    type: str
    text: str | None = None
    refusal: str | None = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None


class FunctionCall(_Request, frozen=True, kw_only=True):
    """The function of a tool call: its name and its arguments as JSON text."""

    name: str
    arguments: str
    # The openai SDK's parsed helpers carry this; the arguments text is what counts.
    parsed_arguments: Any = None


class ToolCall(_Request, frozen=True, kw_only=True):
    """A tool call of an earlier assistant turn."""

    # Present when the SDK assembled the call from a stream.
    index: int | None = None
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request, frozen=True, kw_only=True):
    """One chat message as clients send it (with the null fields of an SDK response's `model_dump()`)."""

    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # A tool message answers the assistant's tool call with this id. Its content is untrusted: the guard
    # checks it for injection like user text.
    tool_call_id: str | None = None
    # Assistant turns: the calls it made, or what it refused.
    tool_calls: list[ToolCall] | None = None
    refusal: str | None = None
    # Carried by SDK responses; accepted when null (planning refuses audio and legacy function calls).
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None
    # The openai SDK's `parse()` result carries the parsed content; `content` is what counts.
    parsed: Any = None


class FunctionDefinition(_Request, frozen=True, kw_only=True):
    """A function the model may call: `parameters` is its arguments' JSON schema."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request, frozen=True, kw_only=True):
    """One entry of `tools`."""

    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Request, frozen=True, kw_only=True):
    """The function a named tool choice forces."""

    name: str


class NamedToolChoice(_Request, frozen=True, kw_only=True):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`."""

    type: Literal["function"]
    function: ToolChoiceFunction


class JsonSchemaFormat(_Request, frozen=True, kw_only=True):
    """`response_format.json_schema`."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class ResponseFormat(_Request, frozen=True, kw_only=True):
    """`response_format`: free text, any JSON object, or JSON valid against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Request, frozen=True, kw_only=True):
    """`stream_options`."""

    include_usage: bool | None = None
    # Sent by some SDK versions; obfuscation padding is never added here.
    include_obfuscation: bool | None = None


ServiceTier = Literal["auto", "default", "flex", "scale", "priority", "fast"]


class _Sampling(_Request, frozen=True, kw_only=True):
    """Fields shared by both completion endpoints."""

    model: ModelName
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    # Token id (as a string key, as OpenAI sends it) -> bias in [-100, 100].
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None


class ChatCompletionRequest(_Sampling, frozen=True, kw_only=True):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # Kept with the request's outcome (at most 16 pairs, as OpenAI allows).
    metadata: dict[str, str] | None = None
    # Accepted with OpenAI's values; no effect here (nothing is stored; one service tier).
    store: bool | None = None
    service_tier: ServiceTier | None = None
    # Accepted; no effect (prefix caching is per tenant already; the key is not an identity).
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    modalities: list[str] | None = None


class CompletionRequest(_Sampling, frozen=True, kw_only=True):
    """`POST /v1/completions`. One prompt: a string or a list of token ids."""

    prompt: str | list[int | str]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class ModerationInputPart(_Request, frozen=True, kw_only=True):
    """One part of a multi-modal moderation input: `{"type": "text", "text": ...}`. Image parts
    (`image_url`) are decoded so that they can be refused by name (the policies read text only)."""

    type: str
    text: str | None = None
    image_url: Any = None


class ModerationRequest(_Request, frozen=True, kw_only=True):
    """`POST /v1/moderations`: one text, or a list of texts (or of text parts), each checked on its own by the
    tenant's safety policy. `model` is accepted and ignored: the tenant's policy answers."""

    input: str | list[str | ModerationInputPart]
    model: str | None = None


class EmbeddingRequest(_Request, frozen=True, kw_only=True):
    """`POST /v1/embeddings`: one text or a list of texts, each embedded on its own by an embedding model
    (`model`: its name, or a pinned `name@version`). Token-id inputs (a list of ints, or of lists of ints)
    decode so that they can be refused by name: the encoder reads text only."""

    model: ModelName
    input: str | list[str | int | list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    # Only the model's own number of dimensions (vectors are not shortened).
    dimensions: int | None = None
    user: str | None = None


# ---- responses -------------------------------------------------------------------------------------------


class _Response(msgspec.Struct, frozen=True, kw_only=True):
    """Base of the response structs."""


class PromptTokensDetails(_Response, frozen=True, kw_only=True):
    """`usage.prompt_tokens_details`."""

    cached_tokens: int = 0


class UsageInfo(_Response, frozen=True, kw_only=True, omit_defaults=True):
    """`usage`."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    # Ours: generated tokens the output guard scored, charged as a line of their own (not in total_tokens,
    # which is OpenAI's prompt + completion). OpenAI's SDKs keep unknown usage fields (`model_extra`). Left
    # out (omit_defaults) when the output was not guarded, so unguarded usage is exactly OpenAI's.
    guard_tokens: int | None = None


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


class ResponseFunctionCall(_Response, frozen=True, kw_only=True):
    """The function of a tool call the model made: arguments as JSON text."""

    name: str
    arguments: str


class ResponseToolCall(_Response, frozen=True, kw_only=True):
    """A tool call in a whole chat completion."""

    id: str
    function: ResponseFunctionCall
    type: Literal["function"] = "function"


class AssistantMessage(_Response, frozen=True, kw_only=True, omit_defaults=True):
    """The answer of a non-streaming chat completion (`content` null when it only calls tools)."""

    content: str | None
    # No default: omit_defaults would leave it out, and SDKs read a missing role as null.
    role: Literal["assistant"]
    tool_calls: list[ResponseToolCall] | None = None


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


class DeltaFunctionCall(_Response, frozen=True, kw_only=True, omit_defaults=True):
    """A piece of a streamed tool call's function: the name once, then pieces of the arguments' JSON text."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Response, frozen=True, kw_only=True, omit_defaults=True):
    """A piece of a streamed tool call; `index` says which call (the SDK concatenates pieces by index)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatDelta(_Response, frozen=True, kw_only=True, omit_defaults=True):
    """The incremental message of a chat chunk."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


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
    """One entry of `GET /v1/models`: an alias (what clients usually name), a pinnable `name@version`, or a
    route (`kind: "route"`: a name that chooses the model of each request)."""

    id: str
    created: int
    owned_by: str = "lockgate"
    object: Literal["model"] = "model"
    # Lockgate's extensions.
    kind: Literal["alias", "version", "route"] = "alias"
    targets: list[AliasTargetCard] | None = None
    # A route (a name that chooses the model per request): its version, and every model it may choose.
    route: str | None = None
    models: list[str] | None = None
    max_model_len: int | None = None
    tokenizer: str | None = None
    chat_template: str | None = None
    weights_sha256: str | None = None
    kv_bytes_per_token: int | None = None


class ModelList(_Response, frozen=True, kw_only=True):
    """`GET /v1/models`."""

    data: list[ModelCard]
    object: Literal["list"] = "list"


class ModerationVerdict(_Response, frozen=True, kw_only=True):
    """Lockgate's extension of a moderation result: what the policy decided and which path decided it
    (`source`: rules, model, band, fail_open, none; `off` when the policy does not check inputs), and
    whether the decision was escalated for human review."""

    action: Literal["allow", "block"]
    source: str
    category: str | None = None
    review: bool = False


class ModerationResult(_Response, frozen=True, kw_only=True):
    """One input's result, as OpenAI's `Moderation` (keys like `self-harm` and `sexual/minors`), plus the
    policy's other categories under their own names and `lockgate` (the decision)."""

    flagged: bool
    categories: dict[str, bool]
    category_scores: dict[str, float]
    category_applied_input_types: dict[str, list[str]]
    lockgate: ModerationVerdict


class ModerationResponse(_Response, frozen=True, kw_only=True):
    """`POST /v1/moderations`: one result per input, in order; `model` names the policy version that
    answered (`lockgate-policy:<name>@<version>`)."""

    id: str
    model: str
    results: list[ModerationResult]


class Embedding(_Response, frozen=True, kw_only=True):
    """One input's vector: floats, or (`encoding_format: base64`) its little-endian float32 bytes, base64."""

    index: int
    embedding: list[float] | str
    object: Literal["embedding"] = "embedding"


class EmbeddingUsage(_Response, frozen=True, kw_only=True):
    """`usage` of an embedding: the inputs' tokens (the embedding model's tokenizer, special tokens
    included), all of them prompt tokens."""

    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Response, frozen=True, kw_only=True):
    """`POST /v1/embeddings`: one vector per input, in order; `model` is the name the request sent (the
    version that answered is in `x-lockgate-model`)."""

    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
    object: Literal["list"] = "list"

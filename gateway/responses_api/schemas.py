"""The Responses API's wire shapes (`POST /v1/responses`): the request as the openai SDK and openai-agents
send it, and the response object and output items as OpenAI documents them.

Requests forbid unknown fields, as every request here does: a field this gateway does not support is refused
by name. Output items a client sends back as input (`input += response.output`, the SDK's tool loop) carry the
fields of the items this gateway returned, so those are accepted on input items too.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from gateway.schemas import ModelName


class _Request(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of the request structs. A field sent as `null` is the same as a field left out."""


class InputContent(_Request, frozen=True, kw_only=True):
    """One part of an input message's content: text reaches the model (`input_text`, and `output_text` or
    `refusal` of an earlier answer sent back); images and files are refused by name."""

    type: str
    text: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None
    # The SDK's `responses.parse` result carries the parsed text; `text` is what counts.
    parsed: Any = None
    image_url: Any = None
    file_id: Any = None
    file_data: Any = None
    file_url: Any = None
    filename: Any = None
    detail: Any = None


class InputItem(_Request, frozen=True, kw_only=True):
    """One input item: a message (`type` "message" or left out), a `function_call` the model made in an
    earlier turn, or a `function_call_output` (a tool's result: untrusted text, checked like a user's)."""

    type: str | None = None
    id: str | None = None
    status: str | None = None
    role: str | None = None
    content: str | list[InputContent] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    parsed_arguments: Any = None
    output: str | list[InputContent] | None = None


class FunctionTool(_Request, frozen=True, kw_only=True):
    """A function the model may call (`tools[]`); other tool types are refused by name."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(_Request, frozen=True, kw_only=True):
    """`tool_choice: {"type": "function", "name": ...}`."""

    type: str
    name: str | None = None


class TextFormat(_Request, frozen=True, kw_only=True):
    """`text.format`: free text, any JSON object, or JSON valid against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class TextConfig(_Request, frozen=True, kw_only=True):
    """`text`."""

    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None


class Reasoning(_Request, frozen=True, kw_only=True):
    """`reasoning`: accepted empty (the served models do not reason); an effort or summary is refused."""

    effort: None = None
    summary: None = None
    generate_summary: None = None


class StreamOptions(_Request, frozen=True, kw_only=True):
    """`stream_options`."""

    include_obfuscation: bool | None = None


class ResponseCreateRequest(_Request, frozen=True, kw_only=True):
    """`POST /v1/responses`."""

    model: ModelName
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # Default true: kept for the tenant's policy's `stored_response_ttl` (`gateway.responses_api.stored`).
    store: bool | None = None
    previous_response_id: str | None = None
    include: list[str] | None = None
    truncation: Literal["disabled"] | None = None
    reasoning: Reasoning | None = None
    background: Literal[False] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


# ---- the response ----------------------------------------------------------------------------------------


class _Response(msgspec.Struct, frozen=True, kw_only=True):
    """Base of the response structs."""


class OutputText(_Response, frozen=True, kw_only=True):
    """`output_text` content of an output message."""

    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    type: Literal["output_text"] = "output_text"


class OutputMessage(_Response, frozen=True, kw_only=True, tag_field="type", tag="message"):
    """An output `message` item (`type` "message", the tag)."""

    id: str
    content: list[OutputText]
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"


class FunctionCall(_Response, frozen=True, kw_only=True, tag_field="type", tag="function_call"):
    """An output `function_call` item (`type` "function_call", the tag): the model asks the client to run
    `name` with `arguments` (JSON)."""

    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class InputTokensDetails(_Response, frozen=True, kw_only=True):
    """`usage.input_tokens_details`."""

    cached_tokens: int = 0


class OutputTokensDetails(_Response, frozen=True, kw_only=True):
    """`usage.output_tokens_details`."""

    reasoning_tokens: int = 0


class ResponseUsage(_Response, frozen=True, kw_only=True):
    """`usage`."""

    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)


class IncompleteDetails(_Response, frozen=True, kw_only=True):
    """Why a response stopped early: its output token limit, or the output guard."""

    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(_Response, frozen=True, kw_only=True):
    """Why a response failed."""

    code: str
    message: str


class ResponseObject(_Response, frozen=True, kw_only=True):
    """A response (`object: "response"`)."""

    id: str
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    output: list[OutputMessage | FunctionCall]
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    text: dict[str, Any] = msgspec.field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: Literal["disabled"] = "disabled"
    store: bool = False
    background: bool = False
    previous_response_id: str | None = None
    user: str | None = None
    object: Literal["response"] = "response"

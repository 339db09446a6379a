"""A Responses API request as the chat completion the pipeline runs: one renderer, one quota path, one input
guard for both routes.

    input (string)                    one user message
    input items                       messages in order; `function_call` items become the assistant's tool
                                      calls (consecutive ones one turn), `function_call_output` items tool
                                      messages (results: untrusted, checked like user text)
    instructions                      a system message first (the client's: not trusted instructions)
    tools, tool_choice, parallel_tool_calls, text.format, temperature, top_p, max_output_tokens, metadata,
    user, stream                      their chat completion fields

    previous_response_id              the stored conversation it names, before this request's input
                                      (`gateway.responses_api.stored`)

What the chat route cannot do is refused with a 400 naming the field: images and files, built-in tools,
`include`, reasoning effort, background runs.
"""

from __future__ import annotations

from typing import Literal

from gateway.errors import InvalidRequestError
from gateway.responses_api.schemas import FunctionTool, InputContent, InputItem, ResponseCreateRequest
from gateway.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedToolChoice,
    ResponseFormat,
    StreamOptions,
    Tool,
    ToolCall,
    ToolChoiceFunction,
)

_TEXT_PARTS = ("input_text", "output_text", "refusal")


def unsupported(param: str, what: str) -> InvalidRequestError:
    """The 400 for a part of the Responses API this gateway does not serve."""
    return InvalidRequestError(f"{what} is not supported", param=param, code="unsupported_parameter")


def input_messages(req: ResponseCreateRequest) -> list[ChatMessage]:
    """The request's `input` as chat messages (module docstring)."""
    messages: list[ChatMessage] = []
    if isinstance(req.input, str):
        messages.append(ChatMessage(role="user", content=req.input))
    else:
        for i, item in enumerate(req.input):
            _append(messages, item, f"input[{i}]")
    if not messages:
        raise InvalidRequestError("input must hold at least one item", param="input", code="invalid_value")
    return messages


def chat_request(
    req: ResponseCreateRequest, messages: list[ChatMessage], history: list[ChatMessage] | None = None
) -> ChatCompletionRequest:
    """The chat completion request `req` means, with its input `messages` after the `history` of the
    response it continues (module docstring)."""
    if req.include:
        raise unsupported("include", "include")
    instructions = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    messages = [*instructions, *(history or ()), *messages]
    stream = bool(req.stream)
    return ChatCompletionRequest(
        model=req.model,
        messages=messages,
        max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        tools=[_tool(t, f"tools[{i}]") for i, t in enumerate(req.tools)] if req.tools else None,
        tool_choice=_tool_choice(req),
        parallel_tool_calls=req.parallel_tool_calls,
        response_format=_format(req),
        metadata=req.metadata,
        user=req.user,
        stream=stream,
        # The final event carries the usage, so the stream always asks for it.
        stream_options=StreamOptions(include_usage=True) if stream else None,
        safety_identifier=req.safety_identifier,
        prompt_cache_key=req.prompt_cache_key,
    )


def _append(messages: list[ChatMessage], item: InputItem, where: str) -> None:
    kind = item.type or "message"
    if kind == "message":
        if item.role not in ("user", "system", "developer", "assistant"):
            raise InvalidRequestError(
                f"{where}.role must be user, system, developer or assistant", param=f"{where}.role"
            )
        content = _text(item.content, f"{where}.content")
        messages.append(ChatMessage(role=item.role, content=content))  # type: ignore[arg-type]
    elif kind == "function_call":
        if not item.call_id or not item.name or item.arguments is None:
            raise InvalidRequestError(
                "a function_call item needs call_id, name and arguments", param=where, code="invalid_value"
            )
        call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
        last = messages[-1] if messages else None
        if last is not None and last.role == "assistant" and last.tool_calls and not last.content:
            messages[-1] = ChatMessage(role="assistant", tool_calls=[*last.tool_calls, call])
        else:
            messages.append(ChatMessage(role="assistant", tool_calls=[call]))
    elif kind == "function_call_output":
        if not item.call_id or item.output is None:
            raise InvalidRequestError(
                "a function_call_output item needs call_id and output", param=where, code="invalid_value"
            )
        output = _text(item.output, f"{where}.output")
        messages.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=output))
    else:
        raise unsupported(f"{where}.type", f"input item type {kind!r}")


def _text(content: str | list[InputContent] | None, where: str) -> str:
    if content is None:
        raise InvalidRequestError(f"{where} is required", param=where, code="invalid_value")
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type not in _TEXT_PARTS:
            raise unsupported(f"{where}[{j}].type", f"content part type {part.type!r} (the model reads text)")
        texts.append(part.text if part.type != "refusal" else part.refusal)
    return "".join(t or "" for t in texts)


def _tool(tool: FunctionTool, where: str) -> Tool:
    if tool.type != "function":
        raise unsupported(f"{where}.type", f"tool type {tool.type!r} (function tools only)")
    if not tool.name:
        raise InvalidRequestError("a function tool needs a name", param=f"{where}.name", code="invalid_value")
    definition = FunctionDefinition(
        name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict
    )
    return Tool(type="function", function=definition)


def _tool_choice(req: ResponseCreateRequest) -> Literal["none", "auto", "required"] | NamedToolChoice | None:
    choice = req.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    if choice.type != "function" or not choice.name:
        raise unsupported("tool_choice", f"tool_choice of type {choice.type!r}")
    return NamedToolChoice(type="function", function=ToolChoiceFunction(name=choice.name))


def _format(req: ResponseCreateRequest) -> ResponseFormat | None:
    fmt = req.text.format if req.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if not fmt.name:
        raise InvalidRequestError("a json_schema format needs a name", param="text.format.name")
    schema = JsonSchemaFormat(
        name=fmt.name, description=fmt.description, schema_=fmt.schema_, strict=fmt.strict
    )
    return ResponseFormat(type="json_schema", json_schema=schema)

"""OpenAI tool calling: which tools a request offers, how they reach the prompt, how calls come out.

Prompt. A chat template that renders `tools` itself gets them (and assistant `tool_calls` in the history) as
Hugging Face templates expect. A template that does not (the default model's) gets one documented format, in
a system message (`TOOLS_PROMPT`, the Hermes convention): the tools as JSON schemas inside `<tools>`, calls
written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, results given back inside
`<tool_response>` in a user turn. `tool_choice: "none"` leaves the tools out of the prompt.

Output, by `tool_choice`:
- `auto`: free text; calls are parsed out of it by vLLM's Hermes tool parser (whole, or incrementally while
  streaming), text before the first call is the message content.
- a named function: decoding is constrained to the function's `parameters` schema, so the whole output is the
  call's arguments.
- `required`: decoding is constrained to a JSON array of `{"name", "parameters"}` objects (vLLM's
  convention; one item at most when `parallel_tool_calls` is false), so every call parses and validates.
With `parallel_tool_calls: false`, only the first call of an `auto` answer is returned.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import msgspec

from gateway.errors import InvalidRequestError
from gateway.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    DeltaFunctionCall,
    DeltaToolCall,
    ResponseFunctionCall,
    ResponseToolCall,
)
from guard.base import Source, Span

ToolMode = Literal["none", "auto", "required", "named"]
# OpenAI's rule for function names.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128

TOOLS_PROMPT = """You can call functions. They are described as JSON schemas inside <tools></tools>:
<tools>
{tools}
</tools>
To call functions, answer with one <tool_call></tool_call> block per call, each holding a JSON object with \
the function's name and its arguments:
<tool_call>
{{"name": "<function name>", "arguments": {{"<argument>": "<value>"}}}}
</tool_call>
Function results come back inside <tool_response></tool_response>."""


class ToolSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One function the model may call."""

    name: str
    description: str | None
    parameters: dict[str, Any]
    strict: bool

    def as_openai(self) -> dict[str, Any]:
        """The tool as OpenAI (and Hugging Face chat templates) write it."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolUse(msgspec.Struct, frozen=True, kw_only=True):
    """What a chat request asks of tools."""

    tools: tuple[ToolSpec, ...]
    mode: ToolMode
    named: str = ""  # mode "named": the function to call
    parallel: bool = True

    def tool(self, name: str) -> ToolSpec:
        """The tool called `name`."""
        return next(t for t in self.tools if t.name == name)


def tool_use(req: ChatCompletionRequest) -> ToolUse | None:
    """The request's tools and tool choice, checked (None when it offers none)."""
    if not req.tools:
        if req.tool_choice not in (None, "none"):
            raise InvalidRequestError(
                "tool_choice is only allowed when tools are specified", param="tool_choice"
            )
        if req.parallel_tool_calls is not None:
            raise InvalidRequestError(
                "parallel_tool_calls is only allowed when tools are specified", param="parallel_tool_calls"
            )
        return None
    if len(req.tools) > MAX_TOOLS:
        raise InvalidRequestError(f"at most {MAX_TOOLS} tools are allowed", param="tools")
    specs: list[ToolSpec] = []
    for i, tool in enumerate(req.tools):
        function = tool.function
        if not _NAME.fullmatch(function.name):
            raise InvalidRequestError(
                f"function name {function.name!r} must be 1-64 letters, digits, '_' or '-'",
                param=f"tools[{i}].function.name",
            )
        if any(s.name == function.name for s in specs):
            raise InvalidRequestError(
                f"function {function.name!r} is defined twice", param=f"tools[{i}].function.name"
            )
        specs.append(
            ToolSpec(
                name=function.name,
                description=function.description,
                parameters=function.parameters or {"type": "object", "properties": {}},
                strict=bool(function.strict),
            )
        )
    choice = req.tool_choice or "auto"
    if isinstance(choice, str):
        mode: ToolMode = choice
        named = ""
    else:
        mode, named = "named", choice.function.name
        if all(s.name != named for s in specs):
            raise InvalidRequestError(
                f"tool_choice names function {named!r}, which is not in tools", param="tool_choice"
            )
    parallel = req.parallel_tool_calls is not False
    return ToolUse(tools=tuple(specs), mode=mode, named=named, parallel=parallel)


def _arguments(raw: str, where: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"tool call arguments are not valid JSON: {exc}", param=where) from exc


def _call_json(name: str, arguments: Any) -> str:
    return json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)


def _call_tag(call_json: str) -> str:
    return f"<tool_call>\n{call_json}\n</tool_call>"


class Rendered(NamedTuple):
    """What the chat template gets, and the same text as the guard sees it."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    # Every client-supplied text that reaches the prompt, in prompt order (see `_entry_span`).
    spans: tuple[Span, ...]


# Where each role's text comes from, for the guard (a tool result stays a tool result when it is rendered in
# a user turn).
_SOURCES: dict[str, Source] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


def _entry_span(entry: dict[str, Any], source: Source, trusted: bool) -> Span | None:
    """Every field of a template entry but its role, as one span: content, name, tool calls with their
    arguments, ids, and any field added later. Built from the entry itself, so no field can reach the prompt
    without reaching the guard."""
    parts = [
        value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        for key, value in entry.items()
        if key != "role"
    ]
    text = "\n".join(part for part in parts if part)
    return Span(text=text, source=source, trusted=trusted) if text else None


def template_messages(
    messages: Sequence[ChatMessage],
    texts: Sequence[str],
    use: ToolUse | None,
    native: bool,
    trusted: Sequence[bool] | None = None,
) -> Rendered:
    """Messages (with their content as `texts`) and tools as the chat template gets them, and their guard
    spans (message i trusted where `trusted[i]`; tool definitions never are).

    `native`: the template renders tools and tool calls itself; otherwise they are written in
    `TOOLS_PROMPT`'s format.
    """
    offered = use is not None and use.mode != "none"
    out: list[dict[str, Any]] = []
    spans: list[Span | None] = []  # one per entry
    for i, (message, text) in enumerate(zip(messages, texts, strict=True)):
        calls = message.tool_calls or []
        source, trust = _SOURCES[message.role], trusted is not None and trusted[i]
        if native:
            entry: dict[str, Any] = {"role": message.role, "content": text}
            if calls:
                entry["tool_calls"] = [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {
                            "name": call.function.name,
                            "arguments": _arguments(
                                call.function.arguments, f"messages[{i}].tool_calls[{j}].function.arguments"
                            ),
                        },
                    }
                    for j, call in enumerate(calls)
                ]
            if message.tool_call_id is not None:
                entry["tool_call_id"] = message.tool_call_id
            if message.name is not None:
                entry["name"] = message.name
            spans.append(_entry_span(entry, source, trust))
        elif message.role == "tool":
            entry = {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
            spans.append(Span(text=text, source=source, trusted=trust) if text else None)
        else:
            calls_json = [
                _call_json(
                    call.function.name,
                    _arguments(call.function.arguments, f"messages[{i}].tool_calls[{j}].function.arguments"),
                )
                for j, call in enumerate(calls)
            ]
            parts = [text] if text else []
            entry = {"role": message.role, "content": "\n".join(parts + [_call_tag(c) for c in calls_json])}
            # The guard reads what the client wrote, without the tags this format wraps it in.
            guarded = "\n".join(parts + calls_json)
            spans.append(Span(text=guarded, source=source, trusted=trust) if guarded else None)
        out.append(entry)
    if not offered or use is None:
        return Rendered(out, None, _present(spans))
    if native:
        tools = [t.as_openai() for t in use.tools]
        # The tools' names, descriptions and schemas are the client's text like any other.
        definitions = Span(text=json.dumps(tools, ensure_ascii=False), source="document")
        return Rendered(out, tools, _present([definitions, *spans]))
    lines = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in use.tools)
    prompt = TOOLS_PROMPT.format(tools=lines)
    if use.mode == "named":
        prompt += f"\nCall the function {use.named} now: answer with its arguments as one JSON object."
    elif use.mode == "required":
        prompt += (
            '\nCall functions now: answer with a JSON array of {"name": ..., "parameters": {...}} objects.'
        )
    definitions = Span(text=lines, source="document")
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        return Rendered(out, None, _present([spans[0], definitions, *spans[1:]]))
    out.insert(0, {"role": "system", "content": prompt})
    return Rendered(out, None, _present([definitions, *spans]))


def _present(spans: Sequence[Span | None]) -> tuple[Span, ...]:
    return tuple(span for span in spans if span is not None)


def _call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _hermes(tokenizer: Any) -> Any:
    # Imported once at startup off the event loop (`preload`), so this is a lookup in sys.modules.
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    return Hermes2ProToolParser(tokenizer)


def preload() -> None:
    """Import vLLM's tool parser (seconds, the first time): call it in a thread at startup."""
    import vllm.tool_parsers.hermes_tool_parser  # noqa: F401


class ParsedOutput(msgspec.Struct, frozen=True, kw_only=True):
    """A whole answer split into message content and tool calls."""

    content: str | None
    calls: list[ResponseToolCall]


def parse_whole(use: ToolUse, text: str, tokenizer: Any) -> ParsedOutput:
    """Content and tool calls of a whole answer (unparsable constrained output stays content)."""
    if use.mode == "none":
        return ParsedOutput(content=text, calls=[])
    if use.mode == "named":
        return ParsedOutput(content=None, calls=[_response_call(use.named, text)])
    if use.mode == "required":
        items = _complete_items(text)
        if not items:
            return ParsedOutput(content=text, calls=[])  # max_tokens cut it before one call was whole
        calls = [
            _response_call(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items
        ]
        return ParsedOutput(content=None, calls=calls)
    found = _hermes(tokenizer).extract_tool_calls(text, None)
    if not found.tools_called:
        return ParsedOutput(content=text, calls=[])
    calls = [_response_call(c.function.name, c.function.arguments) for c in found.tool_calls]
    return ParsedOutput(content=found.content or None, calls=calls if use.parallel else calls[:1])


def _complete_items(text: str) -> list[dict[str, Any]]:
    """The complete items of a JSON array of calls, also when max_tokens cut it short: every whole item is a
    call the grammar let through, so it validates; a cut-off last item is dropped."""
    decoder = json.JSONDecoder()
    items: list[dict[str, Any]] = []
    position = text.find("[")
    if position < 0:
        return items
    position += 1
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        try:
            item, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return items
        if not isinstance(item, dict) or "name" not in item or "parameters" not in item:
            return items
        items.append(item)


def _response_call(name: str, arguments: str) -> ResponseToolCall:
    return ResponseToolCall(id=_call_id(), function=ResponseFunctionCall(name=name, arguments=arguments))


class StreamPiece(msgspec.Struct, frozen=True, kw_only=True):
    """What one streamed piece of output adds to the message: content, tool-call pieces, or both."""

    content: str | None = None
    calls: list[DeltaToolCall] = msgspec.field(default_factory=list)


class CallStream:
    """One choice's streamed output turned into content and tool-call deltas the SDKs assemble by index."""

    def __init__(self, use: ToolUse, tokenizer: Any) -> None:
        self._use = use
        self._tokenizer = tokenizer
        self._text = ""
        self._content_sent = 0
        self._parser = _hermes(tokenizer) if use.mode == "auto" else None
        self._named_started = False
        self.called = False

    def feed(self, text: str) -> StreamPiece:
        """The piece `text` adds (constrained `required` output waits for `finish`)."""
        previous, self._text = self._text, self._text + text
        mode = self._use.mode
        if mode == "none":
            return StreamPiece(content=text)
        if mode == "named":
            self.called = True
            if self._named_started:
                return StreamPiece(calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text))])
            self._named_started = True
            start = DeltaToolCall(
                index=0,
                id=_call_id(),
                type="function",
                function=DeltaFunctionCall(name=self._use.named, arguments=text),
            )
            return StreamPiece(calls=[start])
        if mode == "required" or self._parser is None:
            return StreamPiece()
        found = self._parser.extract_tool_calls_streaming(previous, self._text, text, (), (), (), None)
        if found is None:
            return StreamPiece()
        content = found.content or None
        if content:
            self._content_sent += len(content)
        calls = [
            self._delta(call) for call in found.tool_calls or () if self._use.parallel or call.index == 0
        ]
        self.called = self.called or bool(found.tool_calls)
        return StreamPiece(content=content, calls=calls)

    @staticmethod
    def _delta(call: Any) -> DeltaToolCall:
        function = (
            call.function if isinstance(call.function, dict) else call.function.model_dump(exclude_none=True)
        )
        return DeltaToolCall(
            index=call.index,
            id=call.id,
            type="function" if call.id else None,
            function=DeltaFunctionCall(name=function.get("name"), arguments=function.get("arguments")),
        )

    def finish(self) -> StreamPiece:
        """What is left at the end: held-back text, or a `required` answer's calls."""
        mode = self._use.mode
        if mode == "required":
            whole = parse_whole(self._use, self._text, self._tokenizer)
            self.called = bool(whole.calls)
            calls = [
                DeltaToolCall(
                    index=i,
                    id=call.id,
                    type="function",
                    function=DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments),
                )
                for i, call in enumerate(whole.calls)
            ]
            return StreamPiece(content=whole.content, calls=calls)
        if mode == "auto" and not self.called and self._content_sent < len(self._text):
            # The parser holds back a tail that might start a <tool_call> tag; it did not.
            rest = self._text[self._content_sent :]
            self._content_sent = len(self._text)
            return StreamPiece(content=rest)
        return StreamPiece()

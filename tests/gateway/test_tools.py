"""Tool calling without an engine: how tools reach the prompt, and how calls come out of output text."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import msgspec
import pytest

from engines.base import EngineDelta, EngineRequest, SamplingSpec, Usage
from gateway.generation.planning import Plan
from gateway.generation.prompts import PromptRenderer
from gateway.generation.responses import Formatter
from gateway.generation.tools import (
    TOOLS_PROMPT,
    CallStream,
    ToolSpec,
    ToolUse,
    parse_whole,
    template_messages,
)
from gateway.schemas import ChatMessage, DeltaToolCall, ToolCall
from guard.base import Span
from registry.view import ResolvedModel

WEATHER = ToolSpec(
    name="get_weather",
    description="Weather in a city",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    strict=False,
)
ADD = ToolSpec(
    name="add",
    description=None,
    parameters={"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    strict=False,
)
AUTO = ToolUse(tools=(WEATHER, ADD), mode="auto")
CALLS = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
)


def message(**fields: Any) -> ChatMessage:
    return msgspec.convert(fields, ChatMessage)


HISTORY = [
    message(role="system", content="Be brief."),
    message(role="user", content="Weather in Paris?"),
    message(
        role="assistant",
        content=None,
        tool_calls=[{"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
    ),
    message(role="tool", tool_call_id="c1", content='{"sky": "clear"}'),
]
TEXTS = ["Be brief.", "Weather in Paris?", "", '{"sky": "clear"}']


def test_without_template_support_tools_go_into_the_system_message_in_one_format() -> None:
    messages, tools, _ = template_messages(HISTORY, TEXTS, AUTO, native=False)
    assert tools is None
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\n")
    assert TOOLS_PROMPT.splitlines()[0] in system
    assert json.dumps(WEATHER.as_openai()) in system
    # The assistant's call and the tool's answer are written in the same format, as plain turns.
    assert messages[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    }
    assert messages[3] == {"role": "user", "content": '<tool_response>\n{"sky": "clear"}\n</tool_response>'}


def test_tool_choice_none_leaves_the_tools_out_but_keeps_the_history() -> None:
    messages, tools, _ = template_messages(
        HISTORY, TEXTS, msgspec.structs.replace(AUTO, mode="none"), native=False
    )
    assert tools is None
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert "<tool_call>" in messages[2]["content"]


def test_a_forced_call_is_announced_in_the_prompt() -> None:
    named, _, _ = template_messages(
        HISTORY[1:2], TEXTS[1:2], ToolUse(tools=(WEATHER,), mode="named", named="get_weather"), native=False
    )
    assert named[0]["role"] == "system"
    assert "Call the function get_weather now" in named[0]["content"]


NATIVE_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments.city }}]"
    "{% endfor %}"
    "{% if m.tool_call_id %}(answers {{ m.tool_call_id }}){% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


async def test_a_template_that_renders_tools_gets_them_natively(renderer: PromptRenderer) -> None:
    with ThreadPoolExecutor(1) as executor:
        native = PromptRenderer(renderer.tokenizer, executor, template=NATIVE_TEMPLATE)
        assert native.supports_tools
        assert not renderer.supports_tools
        messages, tools, _ = template_messages(HISTORY, TEXTS, AUTO, native=True)
        assert tools == [WEATHER.as_openai(), ADD.as_openai()]
        text = renderer.tokenizer.decode(await native.chat(messages, tools))
    assert text.startswith("TOOLS:get_weather;add;<system>Be brief.")
    # Arguments arrive parsed, as Hugging Face templates expect.
    assert "[call get_weather Paris]" in text
    assert "(answers c1)" in text
    assert "<tool_call>" not in text


def test_auto_output_is_parsed_with_vllms_hermes_parser(renderer: PromptRenderer) -> None:
    parsed = parse_whole(AUTO, CALLS, renderer.tokenizer)
    assert parsed.content == "Let me check. "
    assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris"}),
        ("add", {"a": 1, "b": 2}),
    ]
    assert len({c.id for c in parsed.calls}) == 2
    single = parse_whole(msgspec.structs.replace(AUTO, parallel=False), CALLS, renderer.tokenizer)
    assert [c.function.name for c in single.calls] == ["get_weather"]
    plain = parse_whole(AUTO, "No tools needed.", renderer.tokenizer)
    assert (plain.content, plain.calls) == ("No tools needed.", [])


def assemble(pieces: list[tuple[str | None, list[DeltaToolCall]]]) -> tuple[str, list[dict[str, str]]]:
    """What the openai SDK builds from streamed deltas: content concatenated, calls merged by index."""
    content = ""
    calls: dict[int, dict[str, str]] = {}
    for text, deltas in pieces:
        content += text or ""
        for d in deltas:
            call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += d.id or ""
            if d.function is not None:
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("step", [1, 3, 7, 50])
def test_streamed_auto_calls_assemble_to_the_whole_parse(renderer: PromptRenderer, step: int) -> None:
    stream = CallStream(AUTO, renderer.tokenizer)
    pieces = []
    for i in range(0, len(CALLS), step):
        piece = stream.feed(CALLS[i : i + step])
        pieces.append((piece.content, piece.calls))
    end = stream.finish()
    pieces.append((end.content, end.calls))
    content, calls = assemble(pieces)
    assert stream.called
    assert content.strip() == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("add", {"a": 1, "b": 2}),
    ]
    assert all(c["id"] for c in calls)


def test_streamed_text_that_only_looks_like_a_call_is_released_at_the_end(renderer: PromptRenderer) -> None:
    stream = CallStream(AUTO, renderer.tokenizer)
    text = "Use the tag <tool"
    pieces = [stream.feed(text[i : i + 4]) for i in range(0, len(text), 4)]
    end = stream.finish()
    assert "".join(p.content or "" for p in [*pieces, end]) == text
    assert not stream.called


def test_parallel_calls_off_streams_only_the_first_call(renderer: PromptRenderer) -> None:
    stream = CallStream(msgspec.structs.replace(AUTO, parallel=False), renderer.tokenizer)
    pieces = [stream.feed(CALLS[i : i + 5]) for i in range(0, len(CALLS), 5)]
    _, calls = assemble([(p.content, p.calls) for p in [*pieces, stream.finish()]])
    assert [c["name"] for c in calls] == ["get_weather"]


def test_a_named_call_streams_its_arguments_as_they_come(renderer: PromptRenderer) -> None:
    use = ToolUse(tools=(WEATHER,), mode="named", named="get_weather")
    stream = CallStream(use, renderer.tokenizer)
    pieces = [stream.feed(part) for part in ['{"ci', 'ty":"Pa', 'ris"}']]
    content, calls = assemble([(p.content, p.calls) for p in [*pieces, stream.finish()]])
    assert content == ""
    assert calls == [{"id": calls[0]["id"], "name": "get_weather", "arguments": '{"city":"Paris"}'}]


def test_a_required_array_cut_by_max_tokens_keeps_its_whole_calls(renderer: PromptRenderer) -> None:
    use = ToolUse(tools=(WEATHER, ADD), mode="required")
    cut = '[{"name":"add","parameters":{"a":1,"b":2}},{"name":"get_weather","parameters":{"ci'
    parsed = parse_whole(use, cut, renderer.tokenizer)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed.calls] == [
        ("add", {"a": 1, "b": 2})
    ]
    assert parse_whole(use, '[{"name":"ad', renderer.tokenizer).calls == []
    stream = CallStream(use, renderer.tokenizer)
    assert stream.feed(cut[:10]).calls == []
    assert [
        c.function.name for c in stream.finish().calls if c.function
    ] == []  # text fed so far: no whole call
    stream = CallStream(use, renderer.tokenizer)
    stream.feed(cut)
    assert [c.function.name for c in stream.finish().calls if c.function] == ["add"]


def test_history_tool_calls_round_trip_through_the_request_schema() -> None:
    call = msgspec.convert(
        {
            "id": "c1",
            "type": "function",
            "index": 0,
            "function": {"name": "f", "arguments": "{}", "parsed_arguments": {}},
        },
        ToolCall,
    )
    assert call.function.name == "f"


def chat_plan(n: int, tools: ToolUse | None) -> Plan:
    return Plan(
        kind="chat",
        request_id="r",
        model_name="m",
        # The formatter never reads the model version.
        model=cast(ResolvedModel, None),
        engine_request=EngineRequest(
            request_id="e", prompt_token_ids=(1,), sampling=SamplingSpec(max_tokens=8), n=n
        ),
        stream=True,
        include_usage=False,
        logprobs=False,
        spans=(Span(text="x", source="user"),),
        tools=tools,
    )


def events(chunks: list[bytes]) -> list[dict[str, Any]]:
    out = []
    for chunk in chunks:
        for line in chunk.decode().split("\n"):
            if line.startswith("data: {"):
                out.append(json.loads(line[6:]))
    return out


def test_the_formatter_keeps_choices_apart(renderer: PromptRenderer) -> None:
    formatter = Formatter(chat_plan(2, None), "chatcmpl-r", "m", 0, renderer.tokenizer)
    chunks = formatter.opening()
    for delta in [
        EngineDelta(token_ids=(1,), text="a", index=1),
        EngineDelta(token_ids=(1,), text="b", index=0),
        EngineDelta(token_ids=(1,), text="c", index=1, finish_reason="stop"),
        EngineDelta(token_ids=(1,), text="d", index=0, finish_reason="length"),
    ]:
        chunks += formatter.chunk(delta)
    texts: dict[int, str] = {0: "", 1: ""}
    finishes: dict[int, str] = {}
    for event in events(chunks):
        [choice] = event["choices"]
        texts[choice["index"]] += choice["delta"].get("content", "")
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {0: "bd", 1: "ac"}
    assert finishes == {0: "length", 1: "stop"}


def test_a_whole_answer_that_calls_tools_finishes_with_tool_calls(renderer: PromptRenderer) -> None:
    formatter = Formatter(chat_plan(1, AUTO), "chatcmpl-r", "m", 0, renderer.tokenizer)
    whole = formatter.whole(
        [EngineDelta(token_ids=(1,), text=CALLS, finish_reason="stop")],
        Usage(prompt_tokens=1, completion_tokens=1),
    )
    body = json.loads(msgspec.json.encode(whole))
    [choice] = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["role"] == "assistant"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather", "add"]

"""A chat completion's answer as a Responses API response: whole, or its event stream re-told as the
Responses API's events.

Whole: the first choice's text becomes one `message` item with one `output_text` part, each tool call a
`function_call` item; `finish_reason` "length" is status `incomplete` (reason `max_output_tokens`),
"content_filter" (the output guard) `incomplete` (reason `content_filter`); usage is input, output and cached
tokens.

Streamed, in the documented order::

    response.created, response.in_progress
    per item: response.output_item.added
        message: response.content_part.added, response.output_text.delta..., response.output_text.done,
                 response.content_part.done
        function_call: response.function_call_arguments.delta..., response.function_call_arguments.done
        response.output_item.done
    response.completed | response.incomplete (reason) | response.failed (an engine or guard error)

Each event is `event: <type>` and `data: <json>` with a `sequence_number`. The chat stream's events are what
the pipeline sent, after the output guard: this module only re-tells them.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from msgspec.structs import replace

from gateway.chat_read import (
    ReadAnswer,
    ReadError,
    ReadFunction,
    ReadMessage,
    ReadToolCall,
    ReadUsage,
    read_answer,
)
from gateway.responses_api.schemas import (
    FunctionCall,
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    ResponseCreateRequest,
    ResponseError,
    ResponseObject,
    ResponseUsage,
)
from gateway.schemas import ChatCompletion

_ENCODE = msgspec.json.Encoder().encode


_WHOLE = msgspec.json.Decoder(ChatCompletion)


def skeleton(req: ResponseCreateRequest, rid: str, model: str) -> ResponseObject:
    """The response before its output: what the request asked for, echoed as OpenAI does."""
    return ResponseObject(
        id=rid,
        created_at=int(time.time()),
        model=model,
        status="in_progress",
        output=[],
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        metadata=req.metadata or {},
        parallel_tool_calls=req.parallel_tool_calls is not False,
        temperature=req.temperature,
        top_p=req.top_p,
        tool_choice=msgspec.to_builtins(req.tool_choice) if req.tool_choice is not None else "auto",
        tools=[msgspec.to_builtins(t) for t in req.tools or ()],
        text={"format": msgspec.to_builtins(req.text.format)}
        if req.text and req.text.format
        else {"format": {"type": "text"}},
        user=req.user,
        store=req.store is True,
        previous_response_id=req.previous_response_id,
    )


def _usage(usage: ReadUsage | Any) -> ResponseUsage:
    details = usage.prompt_tokens_details
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        output_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=details.cached_tokens if details else 0),
    )


def _ended(response: ResponseObject, finish: str | None) -> ResponseObject:
    if finish == "length":
        return replace(
            response, status="incomplete", incomplete_details=IncompleteDetails(reason="max_output_tokens")
        )
    if finish == "content_filter":
        return replace(
            response, status="incomplete", incomplete_details=IncompleteDetails(reason="content_filter")
        )
    return replace(response, status="completed")


def whole(req: ResponseCreateRequest, body: bytes | ChatCompletion, rid: str) -> ResponseObject:
    """Response `rid` as a whole chat completion makes it."""
    chat = body if isinstance(body, ChatCompletion) else _WHOLE.decode(body)
    response = skeleton(req, rid, chat.model)
    items: list[OutputMessage | FunctionCall] = []
    first = next((c for c in chat.choices if c.index == 0), None)
    if first is not None:
        if first.message.content:
            items.append(OutputMessage(id=f"msg_{rid[5:]}", content=[OutputText(text=first.message.content)]))
        for i, call in enumerate(first.message.tool_calls or ()):
            items.append(
                FunctionCall(
                    id=f"fc_{rid[5:]}_{i}",
                    call_id=call.id,
                    name=call.function.name,
                    arguments=call.function.arguments,
                )
            )
    response = replace(response, output=items, usage=_usage(chat.usage))
    return _ended(response, first.finish_reason if first else None)


class _Events:
    """The Responses API events of one chat stream, built as its chunks arrive."""

    def __init__(self, req: ResponseCreateRequest, rid: str) -> None:
        self._req = req
        self._rid = rid
        self._seq = 0
        self.response: ResponseObject | None = None
        self._items: list[OutputMessage | FunctionCall] = []
        self._text: str | None = None  # the open message item's text (None: no message open)
        self._calls: dict[int, FunctionCall] = {}  # open function calls by the chat stream's index
        self._finish: str | None = None
        self._usage: ResponseUsage | None = None

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + _ENCODE(data) + b"\n\n"

    def start(self, chunk: ReadAnswer) -> list[bytes]:
        self.response = skeleton(self._req, self._rid, chunk.model)
        body = msgspec.to_builtins(self.response)
        return [
            self.event("response.created", response=body),
            self.event("response.in_progress", response=body),
        ]

    def chunk(self, chunk: ReadAnswer) -> list[bytes]:
        out: list[bytes] = []
        if chunk.usage is not None:
            self._usage = _usage(chunk.usage)
        for choice in chunk.choices:
            if choice.index != 0:
                continue
            delta = choice.delta or ReadMessage()
            if delta.content:
                out += self._open_message()
                self._text = (self._text or "") + delta.content
                out.append(
                    self.event(
                        "response.output_text.delta",
                        item_id=self._message_id,
                        output_index=len(self._items),
                        content_index=0,
                        delta=delta.content,
                        logprobs=[],
                    )
                )
            for call in delta.tool_calls or ():
                out += self._call_delta(call)
            if choice.finish_reason is not None:
                self._finish = choice.finish_reason
        return out

    @property
    def _message_id(self) -> str:
        assert self.response is not None
        return f"msg_{self.response.id[5:]}"

    def _open_message(self) -> list[bytes]:
        if self._text is not None:
            return []
        self._text = ""
        item = OutputMessage(id=self._message_id, content=[], status="in_progress")
        index = len(self._items)
        return [
            self.event("response.output_item.added", output_index=index, item=msgspec.to_builtins(item)),
            self.event(
                "response.content_part.added",
                item_id=item.id,
                output_index=index,
                content_index=0,
                part=msgspec.to_builtins(OutputText(text="")),
            ),
        ]

    def _close_message(self) -> list[bytes]:
        if self._text is None:
            return []
        text, self._text = self._text, None
        index = len(self._items)
        item = OutputMessage(id=self._message_id, content=[OutputText(text=text)])
        self._items.append(item)
        part = msgspec.to_builtins(item.content[0])
        return [
            self.event(
                "response.output_text.done",
                item_id=item.id,
                output_index=index,
                content_index=0,
                text=text,
                logprobs=[],
            ),
            self.event(
                "response.content_part.done", item_id=item.id, output_index=index, content_index=0, part=part
            ),
            self.event("response.output_item.done", output_index=index, item=msgspec.to_builtins(item)),
        ]

    def _call_delta(self, call: ReadToolCall) -> list[bytes]:
        assert self.response is not None
        out: list[bytes] = []
        fn = call.function or ReadFunction()
        open_call = self._calls.get(call.index)
        if open_call is None:
            out += self._close_message()
            out += self._close_calls()
            open_call = FunctionCall(
                id=f"fc_{self.response.id[5:]}_{call.index}",
                call_id=call.id or f"call_{call.index}",
                name=fn.name or "",
                arguments="",
                status="in_progress",
            )
            self._calls[call.index] = open_call
            index = len(self._items)
            out.append(
                self.event(
                    "response.output_item.added", output_index=index, item=msgspec.to_builtins(open_call)
                )
            )
        if fn.arguments:
            self._calls[call.index] = replace(open_call, arguments=open_call.arguments + fn.arguments)
            out.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=open_call.id,
                    output_index=len(self._items),
                    delta=fn.arguments,
                )
            )
        return out

    def _close_calls(self) -> list[bytes]:
        out: list[bytes] = []
        for key in sorted(self._calls):
            call = replace(self._calls.pop(key), status="completed")
            index = len(self._items)
            self._items.append(call)
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=call.id,
                    output_index=index,
                    arguments=call.arguments,
                )
            )
            out.append(
                self.event("response.output_item.done", output_index=index, item=msgspec.to_builtins(call))
            )
        return out

    def done(self) -> list[bytes]:
        assert self.response is not None
        out = [*self._close_message(), *self._close_calls()]
        final = _ended(replace(self.response, output=self._items, usage=self._usage), self._finish)
        kind = "response.completed" if final.status == "completed" else "response.incomplete"
        return [*out, self.event(kind, response=msgspec.to_builtins(final))]

    def failed(self, error: ReadError) -> list[bytes]:
        assert self.response is not None
        if self._finish == "content_filter":  # the guard's block: the stream said why already
            out = [*self._close_message(), *self._close_calls()]
            final = _ended(replace(self.response, output=self._items, usage=self._usage), self._finish)
            return [*out, self.event("response.incomplete", response=msgspec.to_builtins(final))]
        failure = ResponseError(code=error.code or "server_error", message=error.message)
        final = replace(self.response, status="failed", output=self._items, error=failure, usage=self._usage)
        return [self.event("response.failed", response=msgspec.to_builtins(final))]


async def events(
    req: ResponseCreateRequest, chat_events: AsyncIterator[bytes], rid: str
) -> AsyncIterator[bytes]:
    """The Responses API events of a chat completion stream, as response `rid` (module docstring)."""
    state = _Events(req, rid)
    ended = False
    async for block in chat_events:
        out: list[bytes] = []
        for line in block.split(b"\n"):
            if ended or not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data.strip() == b"[DONE]":
                if state.response is not None:
                    out += state.done()
                ended = True
                continue
            chunk = read_answer(data)
            if chunk.error is not None:
                if state.response is None:
                    state.response = skeleton(req, rid, req.model)
                out += state.failed(chunk.error)
                ended = True
                continue
            if state.response is None:
                out += state.start(chunk)
            out += state.chunk(chunk)
        if out:
            yield b"".join(out)


async def final(req: ResponseCreateRequest, answer: bytes, streamed: bool, rid: str) -> ResponseObject:
    """Response `rid` as a kept chat answer makes it: whole, or the last event of its stream re-told."""
    if not streamed:
        return whole(req, answer, rid)

    async def once() -> AsyncIterator[bytes]:
        yield answer

    last = b""
    async for block in events(req, once(), rid):
        last = block
    data = last.rstrip().rsplit(b"\ndata: ", 1)[-1]
    return msgspec.convert(msgspec.json.decode(data)["response"], ResponseObject)

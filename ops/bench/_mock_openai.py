"""The engine alone behind the least an OpenAI-compatible server can be: `ops.bench.overhead`'s baseline.

    python -m ops.bench._mock_openai --port 8101

A raw ASGI app on uvicorn (the same server, event loop and HTTP parser as `lockgate serve`) that answers
`POST /v1/chat/completions`, whole and streamed, from a `SimulatedEngine` at zero delay: no auth, quota,
guard, prompt template or tokenizer (a prompt of N words is N token ids). `GET /healthz` says it is up.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import msgspec

from engines.base import EngineRequest, SamplingSpec
from engines.simulated import SimulatedEngine, SimulatorConfig

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

ZERO_DELAY = SimulatorConfig(prefill_s_per_token=0.0, decode_step_s=0.0, decode_step_s_per_seq=0.0)


class _Message(msgspec.Struct):
    content: str = ""


class _StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _ChatRequest(msgspec.Struct):
    messages: list[_Message]
    model: str = "simulated"
    max_tokens: int = 16
    stream: bool = False
    stream_options: _StreamOptions | None = None


_decoder = msgspec.json.Decoder(_ChatRequest)
_encoder = msgspec.json.Encoder()
_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class MockOpenAI:
    """The ASGI app: one simulated engine, started and stopped by the lifespan."""

    def __init__(self, config: SimulatorConfig = ZERO_DELAY) -> None:
        """An app whose engine runs `config`."""
        self.engine = SimulatedEngine(config)
        self._ids: Iterator[int] = itertools.count()

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        """Dispatch one ASGI connection scope."""
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            if scope["path"] == "/v1/chat/completions" and scope["method"] == "POST":
                await self._chat(receive, send)
            elif scope["path"] == "/healthz":
                await _respond(send, 200, b'{"status":"ok"}')
            else:
                await _respond(send, 404, b'{"error":{"message":"not found","code":"not_found"}}')

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.engine.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.engine.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _chat(self, receive: Receive, send: Send) -> None:
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        try:
            chat = _decoder.decode(body)
        except msgspec.DecodeError as exc:
            error = {"error": {"message": str(exc), "code": "invalid_request"}}
            await _respond(send, 400, _encoder.encode(error))
            return
        words = sum(len(m.content.split()) for m in chat.messages)
        request_id = f"chatcmpl-mock-{next(self._ids)}"
        req = EngineRequest(
            request_id=request_id,
            prompt_token_ids=tuple(range(1, words + 1)),
            sampling=SamplingSpec(max_tokens=chat.max_tokens, ignore_eos=True),
        )
        head = {"id": request_id, "created": int(time.time()), "model": chat.model}
        if chat.stream:
            usage = chat.stream_options is not None and chat.stream_options.include_usage
            await self._stream(req, head, usage, send)
        else:
            await self._whole(req, head, send)

    async def _whole(self, req: EngineRequest, head: dict[str, Any], send: Send) -> None:
        parts: list[str] = []
        finish: str | None = None
        usage: dict[str, int] = {}
        async for delta in self.engine.generate(req):
            parts.append(delta.text)
            if delta.finish_reason is not None and delta.usage is not None:
                finish = delta.finish_reason
                usage = _usage(delta.usage.prompt_tokens, delta.usage.completion_tokens)
        answer = {
            **head,
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(parts)},
                    "finish_reason": finish,
                }
            ],
            "usage": usage,
        }
        await _respond(send, 200, _encoder.encode(answer))

    async def _stream(self, req: EngineRequest, head: dict[str, Any], usage: bool, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        chunk = {**head, "object": "chat.completion.chunk"}
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        await _event(send, {**chunk, "choices": [role]})
        async for delta in self.engine.generate(req):
            choice = {"index": 0, "delta": {"content": delta.text}, "finish_reason": delta.finish_reason}
            await _event(send, {**chunk, "choices": [choice]})
            if usage and delta.usage is not None:
                counts = _usage(delta.usage.prompt_tokens, delta.usage.completion_tokens)
                await _event(send, {**chunk, "choices": [], "usage": counts})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _event(send: Send, payload: dict[str, Any]) -> None:
    body = b"data: " + _encoder.encode(payload) + b"\n\n"
    await send({"type": "http.response.body", "body": body, "more_body": True})


async def _respond(send: Send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": _JSON})
    await send({"type": "http.response.body", "body": body})


def main(argv: Sequence[str] | None = None) -> int:
    """Serve the mock on 127.0.0.1 until interrupted."""
    import uvicorn

    parser = argparse.ArgumentParser(
        prog="python -m ops.bench._mock_openai", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    uvicorn.run(MockOpenAI(), host="127.0.0.1", port=args.port, log_level="warning", lifespan="on")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

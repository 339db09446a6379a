"""A stand-in `vllm serve` process for fleet tests that need controlled timing and a small, exact KV budget:
`python -m tests.fake_vllm_server --port P --kv-tokens N`. It speaks what `engines.vllm_remote` uses
(`/health`, `/v1/models`, `/metrics`, streamed `/v1/completions` with token ids) and counts, as an engine
would allocate them at a request's end, the KV tokens of the requests it runs at once: prompt + max_tokens
each. `GET /stats` answers the most it ever held and the most sequences at once (what the gateways admitted
to it, all of them together). Every token takes `--token-interval` seconds; the ids are 1, 2, 3...
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

import uvicorn

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class FakeVllmServer:
    """The ASGI app (module docstring)."""

    def __init__(self, *, model: str, kv_tokens: int, token_interval: float) -> None:
        self.model, self.kv_tokens = model, kv_tokens
        self.token_interval = token_interval
        self.held = self.running = self.steps = 0
        self.most_held = self.most_running = self.served = 0

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        raw = await read_body(receive)
        path = scope["path"]
        if path == "/health":
            await _answer(send, 200, b"")
        elif path == "/v1/models":
            await _answer(send, 200, json.dumps({"object": "list", "data": [{"id": self.model}]}).encode())
        elif path == "/metrics":
            await _answer(send, 200, self.metrics().encode(), b"text/plain")
        elif path == "/stats":
            stats = {"most_held": self.most_held, "most_running": self.most_running, "served": self.served}
            await _answer(send, 200, json.dumps(stats).encode())
        elif path == "/v1/completions":
            await self.complete(json.loads(raw), send)
        else:
            await _answer(send, 404, b"")

    def metrics(self) -> str:
        labels = f'engine="0",model_name="{self.model}"'
        return "\n".join(
            [
                f"vllm:num_requests_running{{{labels}}} {float(self.running)}",
                f"vllm:num_requests_waiting{{{labels}}} 0.0",
                f"vllm:kv_cache_usage_perc{{{labels}}} {self.held / self.kv_tokens}",
                f"vllm:iteration_tokens_total_count{{{labels}}} {float(self.steps)}",
                f'vllm:cache_config_info{{block_size="16",kv_cache_size_tokens="{self.kv_tokens}"}} 1.0',
                "",
            ]
        )

    async def complete(self, body: dict[str, Any], send: Send) -> None:
        tokens = len(body["prompt"]) + int(body["max_tokens"])
        self.held += tokens
        self.running += 1
        self.most_held = max(self.most_held, self.held)
        self.most_running = max(self.most_running, self.running)
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")],
                }
            )
            for i in range(int(body["max_tokens"])):
                await asyncio.sleep(self.token_interval)
                self.steps += 1
                last = i == int(body["max_tokens"]) - 1
                choice = {
                    "index": 0,
                    "text": " t",
                    "token_ids": [i + 1],
                    "finish_reason": "length" if last else None,
                }
                await _event(send, {"id": "cmpl-fake", "object": "text_completion", "choices": [choice]})
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": int(body["max_tokens"])}
            await _event(
                send, {"id": "cmpl-fake", "object": "text_completion", "choices": [], "usage": usage}
            )
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
            self.served += 1
        finally:
            self.held -= tokens
            self.running -= 1


async def read_body(receive: Receive) -> bytes:
    """The whole request body of an ASGI request."""
    raw = b""
    while True:
        message = await receive()
        raw += bytes(message.get("body", b""))
        if not message.get("more_body"):
            return raw


async def _event(send: Send, body: dict[str, Any]) -> None:
    await send(
        {"type": "http.response.body", "body": f"data: {json.dumps(body)}\n\n".encode(), "more_body": True}
    )


async def _answer(send: Send, status: int, body: bytes, kind: bytes = b"application/json") -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", kind)]})
    await send({"type": "http.response.body", "body": body})


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--kv-tokens", type=int, default=1000)
    parser.add_argument("--token-interval", type=float, default=0.02)
    args = parser.parse_args(argv)
    app = FakeVllmServer(model=args.model, kv_tokens=args.kv_tokens, token_interval=args.token_interval)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", lifespan="off")


if __name__ == "__main__":
    main()

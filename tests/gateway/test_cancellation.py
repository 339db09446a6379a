"""Cancellation and backpressure on a real vLLM engine: clients that leave or stop reading free the engine.

Idleness is checked in vLLM's own state: its front end has no unfinished request, and its engine core can
reset the prefix cache, which it refuses while any running request still holds KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from litestar import Litestar

from engines.vllm_local import VllmLocalEngine
from gateway.app import create_app
from gateway.generation.prompts import PromptRenderer
from tests.conftest import (
    MODEL,
    OutcomeLog,
    Tenancy,
    assert_vllm_idle,
    eventually,
    lifespan,
    make_config,
    serving,
    within_steps,
)

LONG = 1500  # tokens: far more than a test waits for; with min_tokens only an abort ends these requests early


async def engine_has_a_request(engine: VllmLocalEngine) -> None:
    """Wait until vLLM has accepted a request."""

    async def has_one() -> bool:
        return bool(engine.llm.get_num_unfinished_requests() > 0)

    await eventually(has_one, within=within_steps(engine, 4))


async def steps_pass(engine: VllmLocalEngine, count: int) -> None:
    """Wait until the engine has run `count` more steps."""
    target = engine.steps.count + count

    async def reached() -> bool:
        return engine.steps.count >= target

    await eventually(reached, within=within_steps(engine, count))


def body(
    stream: bool, max_tokens: int = LONG, content: str = "Write a very long story about the sea."
) -> bytes:
    return json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "min_tokens": max_tokens,  # a sampled end of text cannot finish it before the test is done
            "stream": stream,
            "temperature": 0.8,
        }
    ).encode()


@pytest.fixture
async def served(
    vllm_engine: VllmLocalEngine, renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> AsyncIterator[str]:
    app = create_app(
        make_config(), engine=vllm_engine, renderer=renderer, tenants=tenancy.store, sink=outcomes
    )
    async with serving(app) as url:
        yield url


async def raw_post(url: str, key: str, payload: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
        + f"authorization: Bearer {key}\r\n".encode()
        + f"content-length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    await writer.drain()
    return reader, writer


async def test_disconnect_mid_stream_aborts_the_engine_request(
    served: str, vllm_engine: VllmLocalEngine, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    async with (
        httpx.AsyncClient(base_url=served, timeout=30, headers=tenancy.consumer_headers) as http,
        http.stream("POST", "/v1/chat/completions", content=body(True)) as response,
    ):
        assert response.status_code == 200
        request_id = response.headers["x-request-id"]
        seen = 0
        async for line in response.aiter_lines():
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                seen += 1
            if seen == 3:
                break
    # Leaving the block closes the connection mid-stream.
    outcome = await outcomes.wait_for(request_id)
    assert outcome.status == "cancelled"
    assert 3 <= outcome.usage.completion_tokens < LONG
    await assert_vllm_idle(vllm_engine)


async def test_disconnect_before_the_first_token(
    served: str, vllm_engine: VllmLocalEngine, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    # A long prompt is prefilled in chunks of the step budget, one chunk per step; vLLM aborts between steps.
    prompt = f"{uuid.uuid4().hex} " + "word " * 1500  # a unique start: no prefix of it is cached
    _, writer = await raw_post(served, tenancy.consumer, body(True, max_tokens=200, content=prompt))
    await engine_has_a_request(vllm_engine)
    await steps_pass(vllm_engine, 2)
    # Two steps in, the prefill is still running: it was split into chunks of the step budget.
    assert vllm_engine.llm.get_num_unfinished_requests() == 1
    writer.close()
    # Freed within about one step: the step in progress ends, the abort is taken, nothing more runs.
    await assert_vllm_idle(vllm_engine, steps=3)
    [outcome] = await outcomes.wait_count(1, within=within_steps(vllm_engine, 4))
    assert outcome.status == "cancelled"
    assert outcome.usage.completion_tokens == 0


async def test_client_leaving_before_its_request_is_read_reaches_no_engine(
    served: str, vllm_engine: VllmLocalEngine, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    payload = body(True)
    host, port = served.removeprefix("http://").split(":")
    _, writer = await asyncio.open_connection(host, int(port))
    # Announces the whole body, sends half of it, and leaves.
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
        + f"authorization: Bearer {tenancy.consumer}\r\ncontent-length: {len(payload)}\r\n\r\n".encode()
        + payload[: len(payload) // 2]
    )
    await writer.drain()
    writer.close()
    async with httpx.AsyncClient(base_url=served, headers=tenancy.consumer_headers) as http:
        # The server is still fine, and nothing was sent to the engine for the half request.
        assert (await http.get("/v1/models")).status_code == 200
    assert outcomes.items == []
    await assert_vllm_idle(vllm_engine)


async def test_non_streaming_request_is_aborted_when_the_client_leaves(
    served: str, vllm_engine: VllmLocalEngine, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    _, writer = await raw_post(served, tenancy.consumer, body(False))
    await engine_has_a_request(vllm_engine)
    writer.close()
    [outcome] = await outcomes.wait_count(1)
    assert outcome.status == "cancelled"
    assert outcome.usage.completion_tokens < LONG
    await assert_vllm_idle(vllm_engine)


class StalledClient:
    """An ASGI client that sends one request, reads the headers and one body chunk, then never reads again."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload
        self.sent_request = False
        self.status: int | None = None
        self.chunks: list[bytes] = []
        self._never = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        if not self.sent_request:
            self.sent_request = True
            return {"type": "http.request", "body": self.payload, "more_body": False}
        await self._never.wait()  # connected, silent
        raise AssertionError("unreachable")

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body":
            if self.chunks:
                await self._never.wait()  # the socket buffer is full: this send never completes
            self.chunks.append(message["body"])


def http_scope(path: str, key: str) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"content-type", b"application/json"),
            (b"host", b"test"),
            (b"authorization", f"Bearer {key}".encode()),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
        "state": {},
    }


@pytest.mark.parametrize("buffer", [0, 4])
async def test_stalled_reader_is_cut_off_and_its_request_aborted(
    vllm_engine: VllmLocalEngine,
    renderer: PromptRenderer,
    outcomes: OutcomeLog,
    tenancy: Tenancy,
    buffer: int,
) -> None:
    config = make_config(stream_stall_timeout=0.5, stream_buffer=buffer)
    app: Litestar = create_app(
        config, engine=vllm_engine, renderer=renderer, tenants=tenancy.store, sink=outcomes
    )
    client = StalledClient(body(True))
    async with lifespan(app):
        async with asyncio.timeout(20):
            await app(http_scope("/v1/chat/completions", tenancy.consumer), client.receive, client.send)  # type: ignore[arg-type]
    assert client.status == 200
    assert len(client.chunks) == 1
    [outcome] = await outcomes.wait_count(1)
    assert outcome.status == "stalled"
    # Bounded: the engine was not pulled much beyond what the buffer holds while the client stalled.
    assert outcome.usage.completion_tokens < LONG
    await assert_vllm_idle(vllm_engine)

"""The generation routes' fast path (`gateway.edge.fastpath`) answers as the Litestar handlers do: the same
request through both (the Litestar route is reached behind a root path, which the fast path leaves to it)
gets the same status, error body and answer shape."""

from __future__ import annotations

from typing import Any

import httpx
import msgspec
import pytest
from litestar import MediaType, Request, Response

from engines.simulated import SimulatedEngine
from gateway.app import create_app
from gateway.edge.adapter import send_encoded
from gateway.generation.prompts import PromptRenderer
from tests.conftest import MODEL, OutcomeLog, Tenancy, lifespan, make_config

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "seed": 7}


def _shape(response: httpx.Response) -> tuple[int, Any]:
    """Status and the body with what differs per request (ids, times) left out."""
    body = response.json()
    if response.status_code == 200:
        return 200, (body["object"], [c["finish_reason"] for c in body["choices"]], body["usage"])
    return response.status_code, body


@pytest.mark.parametrize(
    ("path", "payload", "auth"),
    [
        ("/v1/chat/completions", CHAT, True),
        ("/v1/completions", {"model": MODEL, "prompt": "The sky is", "max_tokens": 3}, True),
        ("/v1/chat/completions", CHAT, False),
        ("/v1/chat/completions", {**CHAT, "bogus": 1}, True),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x" * 2_000_000}]}, True),
        ("/v1/chat/completions", {**CHAT, "model": "nope"}, True),
    ],
    ids=["chat", "completion", "401", "400-unknown-field", "413", "404-model"],
)
async def test_the_fast_path_and_the_litestar_route_answer_alike(
    sim_engine: SimulatedEngine,
    renderer: PromptRenderer,
    outcomes: OutcomeLog,
    tenancy: Tenancy,
    path: str,
    payload: dict[str, Any],
    auth: bool,
) -> None:
    app = create_app(
        make_config(), engine=sim_engine, renderer=renderer, tenants=tenancy.store, sink=outcomes
    )
    headers = tenancy.consumer_headers if auth else {}
    answers = []
    async with lifespan(app):
        for root in ("", "/api"):
            transport = httpx.ASGITransport(app=app, root_path=root)  # type: ignore[arg-type]
            async with httpx.AsyncClient(transport=transport, base_url="http://gw", headers=headers) as http:
                answers.append(await http.post(f"{root}{path}", json=payload))
    fast, routed = answers
    assert _shape(fast) == _shape(routed)
    assert fast.headers.get("x-request-id")
    assert fast.headers["content-type"] == routed.headers["content-type"]
    # The same headers in the same order (values such as ids and remaining quota differ per request).
    assert [name for name, _ in fast.headers.raw] == [name for name, _ in routed.headers.raw]
    assert fast.headers["content-length"] == str(len(fast.content))


async def test_a_streams_events_ready_together_leave_in_one_write(
    sim_engine: SimulatedEngine, renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    app = create_app(
        make_config(), engine=sim_engine, renderer=renderer, tenants=tenancy.store, sink=outcomes
    )
    writes: list[bytes] = []

    async def recorded(scope: Any, receive: Any, send: Any) -> None:
        async def send_recorded(message: Any) -> None:
            if message["type"] == "http.response.body":
                writes.append(message["body"])
            await send(message)

        await app(scope, receive, send_recorded)

    payload = {**CHAT, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 4}
    transport = httpx.ASGITransport(app=recorded)
    async with (
        lifespan(app),
        httpx.AsyncClient(
            transport=transport, base_url="http://gw", headers=tenancy.consumer_headers
        ) as http,
    ):
        assert (await http.post("/v1/chat/completions", json=payload)).status_code == 200
    events = [[e for e in w.split(b"\n\n") if e] for w in writes if w]
    assert all(e.startswith(b"data: ") for w in events for e in w)
    # The role with the first delta's text; the last delta's text with its finish; the usage with [DONE].
    assert b'"role":"assistant"' in events[0][0]
    assert b'"content":"' in events[0][1]
    assert events[-1][-1] == b"data: [DONE]"
    assert b'"usage":{' in events[-1][0]
    assert len(events[-1]) == 2
    finish = events[-2][-1]
    assert b'"finish_reason":"length"' in finish
    assert b'"content":"' in events[-2][-2]
    assert sum(b'"finish_reason":"length"' in e for w in events for e in w) == 1


class _Answer(msgspec.Struct, frozen=True):
    id: str
    text: str
    tokens: list[int]


@pytest.mark.parametrize(
    "response",
    [
        Response(
            content=_Answer(id="a", text="héllo \u2028", tokens=[1, 2]), headers={"X-Lockgate-Model": "m@1"}
        ),
        Response(content=b'{"error":{}}', status_code=429, headers={"Retry-After": "1"}),
        Response(content=b"", status_code=499),
        Response(content=b"{}", headers={"content-type": "application/json; charset=utf-8"}),
    ],
    ids=["struct", "error", "client-closed", "own-content-type"],
)
async def test_an_encoded_response_sends_what_litestars_sends(response: Response[Any]) -> None:
    messages: list[Any] = []
    sent: list[Any] = []

    async def record(into: list[Any], message: Any) -> None:
        into.append(message)

    scope: Any = {"type": "http", "method": "POST", "headers": [], "state": {}}
    request: Request[Any, Any, Any] = Request(scope)
    await response.to_asgi_response(None, request)(request.scope, _nothing, lambda m: record(messages, m))
    assert await send_encoded(response, lambda m: record(sent, m))
    assert sent == messages


async def test_a_stream_is_not_sent_encoded() -> None:
    async def chunks() -> Any:
        yield b"data: 1\n\n"

    assert not await send_encoded(Response(content=chunks(), media_type=MediaType.TEXT), _never_sent)


async def _nothing() -> Any:
    raise AssertionError("nothing is received")


async def _never_sent(message: Any) -> None:
    raise AssertionError(f"sent {message}")

"""`x-request-id` on every response: the client's own id when valid, else a new one; set, never doubled; the
same id on an answer the app sends and on a refusal the overload gate sends."""

from __future__ import annotations

import time
from typing import Any

import pytest
from litestar.types import Receive, Scope, Send

from gateway.config import Config
from gateway.edge.adapter import route_template
from gateway.observe.observer import RequestObserver, observe_middleware
from gateway.overload import LoopLagMonitor, OverloadConfig, OverloadGate
from gateway.requestid import assign_request_id, request_id_in


async def _call(app: Any, inbound: list[tuple[bytes, bytes]]) -> list[Any]:
    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def receive() -> Any:
        raise AssertionError("nothing is received")

    scope: Any = {"type": "http", "path": "/v1/chat/completions", "headers": inbound, "state": {}}
    await app(scope, receive, send)
    return sent


async def _answer(headers: list[tuple[bytes, bytes]], inbound: list[tuple[bytes, bytes]]) -> tuple[Any, str]:
    """The headers an app's answer leaves the observe middleware with, and the id the app read."""
    seen: dict[str, str] = {}

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen["id"] = request_id_in(scope)
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    sent = await _call(
        observe_middleware(app, RequestObserver(Config(), time.monotonic), route_template), inbound
    )
    return sent[0]["headers"], seen["id"]


@pytest.mark.parametrize("own", [[], [(b"X-Request-ID", b"the-app's"), (b"x-request-id", b"again")]])
async def test_the_id_is_set_once_after_the_apps_headers(own: list[tuple[bytes, bytes]]) -> None:
    headers, handled = await _answer([(b"content-type", b"application/json"), *own], [])
    assert headers == [(b"content-type", b"application/json"), (b"x-request-id", handled.encode())]
    assert len(handled) == 24


async def test_a_valid_client_id_is_echoed_and_an_invalid_one_replaced() -> None:
    headers, handled = await _answer([], [(b"x-request-id", b"retry-7:a.b_c")])
    assert handled == "retry-7:a.b_c"
    assert headers == [(b"x-request-id", b"retry-7:a.b_c")]
    headers, handled = await _answer([], [(b"x-request-id", b"no spaces allowed")])
    assert handled != "no spaces allowed"
    assert headers == [(b"x-request-id", handled.encode())]


async def test_a_refusal_of_the_gate_carries_the_clients_id_or_a_new_one() -> None:
    async def never(scope: Scope, receive: Receive, send: Send) -> None:
        raise AssertionError("a refused request reaches nothing behind the gate")

    gate = OverloadGate(OverloadConfig(max_in_flight=0), LoopLagMonitor(0.01, 1, time.monotonic))
    app = gate.wrap(never)
    start = (await _call(app, [(b"x-request-id", b"retry-7")]))[0]
    assert start["status"] == 503
    assert dict(start["headers"])[b"x-request-id"] == b"retry-7"
    fresh = dict((await _call(app, []))[0]["headers"])[b"x-request-id"]
    assert len(fresh) == 24
    assert gate.shed["in_flight"] == 2


def test_an_assigned_id_stays_the_requests() -> None:
    scope: Any = {"type": "http", "headers": []}
    first = assign_request_id(scope)
    assert assign_request_id(scope) == first == request_id_in(scope)

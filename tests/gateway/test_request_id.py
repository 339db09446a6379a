"""`x-request-id` on every response: the client's own id when valid, else a new one; set, never doubled."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.requestid import request_id_in, request_id_middleware


async def _answer(headers: list[tuple[bytes, bytes]], inbound: list[tuple[bytes, bytes]]) -> tuple[Any, str]:
    seen: dict[str, str] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen["id"] = request_id_in(scope)
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def receive() -> Any:
        raise AssertionError("nothing is received")

    scope: Any = {"type": "http", "headers": inbound, "state": {}}
    await request_id_middleware(app)(scope, receive, send)
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

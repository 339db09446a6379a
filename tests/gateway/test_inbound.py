"""The fast path reads a request without Litestar's request object (`gateway.inbound`,
`read_limited`): the same headers and body, the same limits and errors as Litestar's `Request.body()`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from litestar import Litestar, Request, post
from litestar.exceptions import ClientException
from litestar.exceptions.http_exceptions import RequestEntityTooLarge

from gateway.edge.adapter import find_route
from gateway.edge.decoding import read_limited
from gateway.errors import ClientClosedError
from gateway.inbound import AsgiInbound

_Message = dict[str, Any]


def _receiver(messages: Sequence[_Message]) -> Any:
    queue = list(messages)

    async def receive() -> _Message:
        return queue.pop(0)

    return receive


def _scope(headers: list[tuple[bytes, bytes]], limit: int | None = None) -> Any:
    """A POST scope with a route handler whose body limit is `limit` (Litestar's request reads it)."""

    @post("/", request_max_body_size=limit)
    async def handler() -> None: ...

    app = Litestar([handler])
    route = find_route(app, "/", "POST")
    return {"type": "http", "method": "POST", "headers": headers, "state": {}, "route_handler": route.handler}


def _chunks(*parts: bytes) -> list[_Message]:
    return [
        {"type": "http.request", "body": part, "more_body": i < len(parts) - 1}
        for i, part in enumerate(parts)
    ]


def test_headers_read_as_litestar_reads_them() -> None:
    headers = [(b"Authorization", b"Bearer k1"), (b"x-session-id", b"first"), (b"x-session-id", b"second")]
    inbound = AsgiInbound(_scope(headers), _receiver([]))
    litestar = Request[Any, Any, Any](_scope(headers))
    for name in ("authorization", "x-session-id", "x-absent"):
        assert inbound.headers.get(name) == litestar.headers.get(name)
    assert inbound.headers.get("x-session-id") == "first"


async def _both(
    headers: list[tuple[bytes, bytes]], messages: list[_Message], limit: int | None
) -> list[bytes | type[Exception]]:
    """What `read_limited` and Litestar's `Request.body()` make of one request (the body, or the error)."""
    results: list[bytes | type[Exception]] = []
    for ours in (True, False):
        scope = _scope(headers, limit)
        try:
            if ours:
                results.append(await read_limited(AsgiInbound(scope, _receiver(messages)), limit))
            else:
                results.append(await Request[Any, Any, Any](scope, _receiver(messages)).body())
        except Exception as exc:
            results.append(type(exc))
    return results


@pytest.mark.parametrize(
    ("headers", "messages", "limit", "expected"),
    [
        ([(b"content-length", b"5")], _chunks(b"hello"), 10, b"hello"),
        ([], _chunks(b"ab", b"", b"cd"), 4, b"abcd"),
        ([], _chunks(b""), 10, b""),
        ([], _chunks(b"x" * 8, b"x" * 8), None, b"x" * 16),
        # Announced over the limit: refused before anything is read.
        ([(b"content-length", b"11")], [], 10, RequestEntityTooLarge),
        # Sent over the limit without saying so.
        ([], _chunks(b"x" * 6, b"x" * 6), 10, RequestEntityTooLarge),
        ([(b"content-length", b"ten")], _chunks(b"x"), 10, ClientException),
    ],
    ids=["whole", "chunked", "empty", "no-limit", "announced-413", "streamed-413", "bad-length"],
)
async def test_a_body_reads_as_litestar_reads_it(
    headers: list[tuple[bytes, bytes]], messages: list[_Message], limit: int | None, expected: Any
) -> None:
    ours, litestar = await _both(headers, messages, limit)
    assert ours == expected
    assert litestar == expected


async def test_a_client_that_leaves_before_its_body_is_whole_is_a_closed_request() -> None:
    messages = [*_chunks(b"abc", b"def")[:1], {"type": "http.disconnect"}]
    with pytest.raises(ClientClosedError):
        await read_limited(AsgiInbound(_scope([]), _receiver(messages)), 100)

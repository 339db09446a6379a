"""Every response carries `x-request-id`; handlers read the same id to name the engine request."""

from __future__ import annotations

import secrets
from typing import Any

from litestar import Request
from litestar.datastructures import MutableScopeHeaders
from litestar.enums import ScopeType
from litestar.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "x-request-id"
_STATE_KEY = "lockgate_request_id"


def new_request_id() -> str:
    """A random, unguessable request id."""
    return secrets.token_hex(12)


def request_id_of(request: Request[Any, Any, Any]) -> str:
    """The id the middleware gave this request."""
    value = request.scope.get("state", {}).get(_STATE_KEY)
    return value if isinstance(value, str) else new_request_id()


def request_id_middleware(app: ASGIApp) -> ASGIApp:
    """Give each HTTP request an id and add it to the response headers (errors included)."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != ScopeType.HTTP:
            await app(scope, receive, send)
            return
        request_id = new_request_id()
        scope.setdefault("state", {})[_STATE_KEY] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableScopeHeaders.from_message(message)[HEADER] = request_id
            await send(message)

        await app(scope, receive, send_with_id)

    return middleware

"""Every response carries `x-request-id`; handlers read the same id.

A client may send its own `x-request-id` (1-64 letters, digits, `.`, `_`, `:` or `-`): the gateway then uses
and echoes it, so that a retry with the same id lands on the same canary version. Engine request ids add a
random suffix to it, so two requests reusing one id never collide inside an engine.
"""

from __future__ import annotations

import re
import secrets

from litestar.enums import ScopeType
from litestar.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "x-request-id"
_NAME = HEADER.encode()
_STATE_KEY = "lockgate_request_id"
_CLIENT_ID = re.compile(rb"[A-Za-z0-9._:-]{1,64}")


def new_request_id() -> str:
    """A random, unguessable request id."""
    return secrets.token_hex(12)


def engine_request_id(request_id: str) -> str:
    """A unique engine-side id for a request (client ids may repeat)."""
    return f"{request_id}-{secrets.token_hex(4)}"


def _inbound(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id" and _CLIENT_ID.fullmatch(value):
            return value.decode()
    return None


def request_id_in(scope: Scope) -> str:
    """The id the middleware gave the request of this scope ("" when it gave none)."""
    value = scope.get("state", {}).get(_STATE_KEY)
    return value if isinstance(value, str) else ""


def request_id_of(scope: Scope) -> str:
    """The id the middleware gave the request of this scope, else a new one."""
    return request_id_in(scope) or new_request_id()


def request_id_middleware(app: ASGIApp) -> ASGIApp:
    """Give each HTTP request an id and add it to the response headers (errors included)."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != ScopeType.HTTP:
            await app(scope, receive, send)
            return
        request_id = _inbound(scope) or new_request_id()
        scope.setdefault("state", {})[_STATE_KEY] = request_id
        header = (_NAME, request_id.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                # Set, not added: one the app wrote itself is replaced.
                headers = [h for h in message.get("headers", ()) if h[0].lower() != _NAME]
                headers.append(header)
                message["headers"] = headers
            await send(message)

        await app(scope, receive, send_with_id)

    return middleware

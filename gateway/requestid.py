"""Every response carries `x-request-id`; handlers read the same id.

A client may send its own `x-request-id` (1-64 letters, digits, `.`, `_`, `:` or `-`): the gateway then uses
and echoes it (logs, audit records and appeals name it). It picks nothing: canary versions are keyed by the
tenant and API key (`gateway.secret`), so no choice of id steers a request. Engine request ids add a random
suffix to it, so two requests reusing one id never collide inside an engine.
"""

from __future__ import annotations

import re
import secrets

from litestar.types import HTTPResponseStartEvent, Scope

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
    """The id `assign_request_id` gave the request of this scope ("" when it gave none)."""
    value = scope.get("state", {}).get(_STATE_KEY)
    return value if isinstance(value, str) else ""


def request_id_of(scope: Scope) -> str:
    """The id `assign_request_id` gave the request of this scope, else a new one."""
    return request_id_in(scope) or new_request_id()


def assign_request_id(scope: Scope) -> str:
    """Give the request of this scope its id (the client's valid one, else a new one), kept in its state;
    the same id on a second call."""
    state = scope.setdefault("state", {})
    request_id = state.get(_STATE_KEY)
    if not isinstance(request_id, str):
        request_id = state[_STATE_KEY] = _inbound(scope) or new_request_id()
    return request_id


def stamp(message: HTTPResponseStartEvent, request_id: str) -> None:
    """Set `x-request-id` on a response's start message, after the app's headers (set, not added: one the
    app wrote itself is replaced).

    Responses are stamped where they leave the app (the observe middleware's send, and the overload gate's
    refusals), not by a send wrapper of their own: each message of a response passes one wrapper fewer."""
    headers = [h for h in message.get("headers", ()) if h[0].lower() != _NAME]
    headers.append((_NAME, request_id.encode()))
    message["headers"] = headers

"""The generation routes without Litestar's request cycle: the gateway's hot path.

`POST /v1/chat/completions` and `POST /v1/completions` are nearly all the traffic, and a profile of the event
loop put about a third of its time in Litestar's request cycle around them: routing, the exception
middleware, dependency injection and signature parsing, response handling (`ops.bench.overhead`,
`docs/overhead.md`). `fast_generation` answers these two routes straight from ASGI with the same code the
Litestar handlers run (`generate`): the principal from `principal_of`, the body read within the route's
limit (its 413 is the route's), the pipeline's own response objects, and errors rendered by the app's
exception handlers (`gateway.errors.exception_handlers`) as Litestar would. The request is read through an
`AsgiInbound` (`gateway.inbound`), not Litestar's request object, which is built only to render an error or
send a stream. Every other request, including other
methods on these paths, goes to Litestar; the two routes stay registered there, where the OpenAPI document
is generated from them.

It sits inside the observe middleware (the request's timeline is in the scope) and outside Litestar's own
middleware stack, which the generation routes do not use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import msgspec
from litestar import MediaType, Request, Response
from litestar.enums import ScopeType
from litestar.handlers import HTTPRouteHandler
from litestar.types import (
    ASGIApp,
    HTTPResponseBodyEvent,
    HTTPResponseStartEvent,
    Receive,
    Scope,
    Send,
)

from gateway.decoding import body_limit, read_limited
from gateway.errors import exception_handlers
from gateway.generation.flow import close_client_watch
from gateway.generation.pipeline import run_chat, run_completion
from gateway.inbound import AsgiInbound, Inbound
from gateway.security import allow, principal_of
from gateway.service import Services
from policy.auth import Principal

if TYPE_CHECKING:
    from litestar import Litestar

Kind = Literal["chat", "completion"]
_encode = msgspec.json.Encoder().encode
FAST_PATHS: dict[str, Kind] = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


async def generate(
    kind: Kind, services: Services, inbound: Inbound, principal: Principal, max_body: int | None
) -> Response[Any]:
    """Chat or legacy completions for a consumer: the body (at most `max_body` bytes; None: no limit)
    decoded, then the generation pipeline."""
    allow(principal, "consumer")
    body = await read_limited(inbound, max_body)
    if kind == "chat":
        return await run_chat(services, services.chat_decoder.decode(body), inbound, principal)
    return await run_completion(services, services.completion_decoder.decode(body), inbound, principal)


def _handler_for(handlers: dict[type[Exception] | int, Any], exc: Exception) -> Any:
    """The handler in `handlers` for `exc`: the first of its classes that has one (as Litestar looks)."""
    for klass in type(exc).__mro__:
        if klass in handlers:
            return handlers[klass]
    return handlers[Exception]


def fast_generation(app: Litestar, inner: ASGIApp) -> ASGIApp:
    """`inner` (Litestar's handler), with the generation routes answered directly (module docstring)."""
    routes: dict[str, tuple[Any, str, int | None]] = {}
    handlers = exception_handlers()

    def route(path: str) -> tuple[Any, str, int | None]:
        # The registered route handler, its path template and body limit, looked up once.
        if path not in routes:
            _, handler, _, _, template = app.asgi_router.handle_routing(path=path, method="POST")
            assert isinstance(handler, HTTPRouteHandler)  # the generation routes are @post handlers
            routes[path] = (handler, template, body_limit(handler))
        return routes[path]

    async def asgi(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            kind = FAST_PATHS.get(scope.get("path", "")) if scope["type"] == ScopeType.HTTP else None
            if kind is None or scope.get("method") != "POST" or scope.get("root_path"):
                await inner(scope, receive, send)
                return
            handler, template, limit = route(scope["path"])
            # What Litestar's request object, built only for an error or a stream, reads of the scope.
            scope["route_handler"] = handler
            scope["path_template"] = template
            scope.setdefault("path_params", {})
            inbound = AsgiInbound(scope, receive)
            services: Services = app.state.services
            try:
                principal = await principal_of(inbound, services)
                response = await generate(kind, services, inbound, principal, limit)
            except Exception as exc:  # rendered as the app's handlers render it (never a traceback)
                response = _handler_for(handlers, exc)(Request(scope, receive, send), exc)
            if not await send_encoded(response, send):
                await response.to_asgi_response(None, Request(scope, receive, send))(scope, receive, send)
        finally:
            # The response has been sent (or never will be): the request's client is watched no more (the
            # generation routes' Litestar handlers watch it too, `ClientWatch`).
            close_client_watch(scope)

    return asgi


async def send_encoded(response: Response[Any], send: Send) -> bool:
    """Send a plain JSON response of bytes or a msgspec Struct (every whole answer and error) as the two ASGI
    messages Litestar's response would send: the same body, the same headers in the same order (its own, then
    content type and length), without building Litestar's response object. False (nothing sent) for
    anything else: streams, cookies, background tasks."""
    content = response.content
    status = response.status_code or 200
    if (
        type(response) is not Response
        or not isinstance(content, bytes | msgspec.Struct)
        or (response.media_type or MediaType.JSON) != MediaType.JSON
        or response.cookies
        or response.background is not None
        or status in (204, 304)
        or status < 200
    ):
        return False
    body = content if isinstance(content, bytes) else _encode(content)
    headers = [
        (name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in response.headers.items()
    ]
    present = {name for name, _ in headers}
    if b"content-type" not in present:
        headers.append((b"content-type", b"application/json"))
    if b"content-length" not in present:
        headers.append((b"content-length", str(len(body)).encode()))
    start: HTTPResponseStartEvent = {
        "type": "http.response.start",
        "status": status,
        "headers": headers,
    }
    end: HTTPResponseBodyEvent = {"type": "http.response.body", "body": body, "more_body": False}
    await send(start)
    await send(end)
    return True

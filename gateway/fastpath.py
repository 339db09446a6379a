"""The generation routes without Litestar's request cycle: the gateway's hot path.

`POST /v1/chat/completions` and `POST /v1/completions` are nearly all the traffic, and a profile of the event
loop put about a third of its time in Litestar's request cycle around them: routing, the exception
middleware, dependency injection and signature parsing, response handling (`ops.bench.overhead`, README
"Gateway overhead"). `fast_generation` answers these two routes straight from ASGI with the same code the
Litestar handlers run (`generate`): the principal from `provide_principal`, the body through
`Request.body()` (Litestar's request object, with the route handler in the scope, so the body limit and its
413 are the route's), the pipeline's own response objects, and errors rendered by the app's exception
handlers (`gateway.errors.exception_handlers`) as Litestar would. Every other request, including other
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
from litestar.types import (
    ASGIApp,
    HTTPResponseBodyEvent,
    HTTPResponseStartEvent,
    Receive,
    Scope,
    Send,
)

from gateway.decoding import read_body
from gateway.errors import exception_handlers
from gateway.generation.pipeline import run_chat, run_completion
from gateway.security import allow, provide_principal
from gateway.service import Services
from policy.auth import Principal

if TYPE_CHECKING:
    from litestar import Litestar

Kind = Literal["chat", "completion"]
_encode = msgspec.json.Encoder().encode
FAST_PATHS: dict[str, Kind] = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


async def generate(
    kind: Kind, services: Services, request: Request[Any, Any, Any], principal: Principal
) -> Response[Any]:
    """Chat or legacy completions for a consumer: the body decoded, then the generation pipeline."""
    allow(principal, "consumer")
    body = await read_body(request)
    if kind == "chat":
        return await run_chat(services, services.chat_decoder.decode(body), request, principal)
    return await run_completion(services, services.completion_decoder.decode(body), request, principal)


def _handler_for(handlers: dict[type[Exception] | int, Any], exc: Exception) -> Any:
    """The handler in `handlers` for `exc`: the first of its classes that has one (as Litestar looks)."""
    for klass in type(exc).__mro__:
        if klass in handlers:
            return handlers[klass]
    return handlers[Exception]


def fast_generation(app: Litestar, inner: ASGIApp) -> ASGIApp:
    """`inner` (Litestar's handler), with the generation routes answered directly (module docstring)."""
    routes: dict[str, tuple[Any, str]] = {}
    handlers = exception_handlers()

    def route(path: str) -> tuple[Any, str]:
        # The registered route handler (its body limit) and path template, looked up once.
        if path not in routes:
            _, handler, _, _, template = app.asgi_router.handle_routing(path=path, method="POST")
            routes[path] = (handler, template)
        return routes[path]

    async def asgi(scope: Scope, receive: Receive, send: Send) -> None:
        kind = FAST_PATHS.get(scope.get("path", "")) if scope["type"] == ScopeType.HTTP else None
        if kind is None or scope.get("method") != "POST" or scope.get("root_path"):
            await inner(scope, receive, send)
            return
        handler, template = route(scope["path"])
        scope["route_handler"] = handler
        scope["path_template"] = template
        scope.setdefault("path_params", {})
        request: Request[Any, Any, Any] = Request(scope, receive, send)
        services: Services = app.state.services
        try:
            principal = await provide_principal(request, services)
            response = await generate(kind, services, request, principal)
        except Exception as exc:  # rendered as the app's handlers render it (never a traceback)
            response = _handler_for(handlers, exc)(request, exc)
        if not await send_encoded(response, send):
            await response.to_asgi_response(None, request)(scope, receive, send)

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

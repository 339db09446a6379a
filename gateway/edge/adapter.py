"""The one adapter onto Litestar's internals: everything the edge takes from Litestar beyond its public API.

The fast path (`gateway.edge.fastpath`) answers two routes without Litestar's request cycle, so it has to do
what that cycle would have done, the way Litestar does it. What it relies on, all here and nowhere else in
the gateway (`tests/gateway/test_litestar_contract.py` fails, naming it, when a Litestar upgrade changes any):

- routing: `app.asgi_router.handle_routing(path=, method=)`, the router's cached lookup, which returns
  `(asgi_app, route_handler, path, path_params, path_template)` (`find_route`);
- the scope keys Litestar's `Litestar.__call__` and its router write before a handler runs, which its
  `Request` and response encoding then read: `app`, `litestar_app`, `state`, `route_handler`,
  `path_template`, `path_params` (`enter_route`); the observer reads `path_template` back
  (`route_template`);
- the exception middleware's handler lookup, `get_exception_handler` (a private module), over the route's
  resolved handlers (`HTTPRouteHandler.resolve_exception_handlers`) (`render_error`);
- a route's body limit as Litestar resolves it (`HTTPRouteHandler.resolve_request_max_body_size`);
- whether Litestar would run anything between the router and the handler or around the app (`plain`): the
  middleware it stacks on a route (`routing_trie.mapping.build_route_middleware_stack`: the CSRF,
  compression, response cache and allowed-hosts configs and the handler's resolved middleware) or in front
  of the router (CORS), and `before_send` hooks (Litestar wraps `send` with them). The fast path answers
  only plain routes, so configuring any of these on the app
  (an allowed-hosts list, say) can never be skipped by it;
- what a plain JSON `Response` sends: two ASGI messages, its own headers, then content type and length
  (`send_encoded`, checked against Litestar's own encoding by `tests/gateway/test_fastpath.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from litestar import MediaType, Request, Response
from litestar.handlers import HTTPRouteHandler
from litestar.middleware._internal.exceptions.middleware import get_exception_handler
from litestar.types import (
    ExceptionHandlersMap,
    HTTPResponseBodyEvent,
    HTTPResponseStartEvent,
    Receive,
    Scope,
    Send,
)

if TYPE_CHECKING:
    from litestar import Litestar

_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True, slots=True)
class Route:
    """A registered HTTP route as Litestar resolved it: its handler, path template, body limit (None: no
    limit) and exception handlers (the app's, the router's and the handler's own, merged)."""

    handler: HTTPRouteHandler
    template: str
    body_limit: int | None
    exception_handlers: ExceptionHandlersMap
    # Nothing of Litestar runs between its router and the handler, or around the app (module docstring).
    plain: bool


def body_limit(handler: HTTPRouteHandler) -> int | None:
    """The most bytes a route takes in a body (None: no limit), as Litestar resolves it."""
    return handler.resolve_request_max_body_size() or None


def find_route(app: Litestar, path: str, method: str) -> Route:
    """The route `app` sends `method path` to, through Litestar's own (cached) router lookup. TypeError if it
    is not an HTTP route handler (the fast path's routes are `@post` handlers)."""
    _, handler, _, _, template = app.asgi_router.handle_routing(path=path, method=method)
    if not isinstance(handler, HTTPRouteHandler):
        raise TypeError(f"{method} {path} is not an HTTP route handler: {handler!r}")
    wrapped = (
        app.csrf_config
        or app.compression_config
        or app.allowed_hosts
        or app.cors_config
        or app.before_send
        or handler.cache
        or handler.resolve_middleware()
    )
    return Route(handler, template, body_limit(handler), handler.resolve_exception_handlers(), not wrapped)


def enter_route(scope: Scope, app: Litestar, route: Route) -> None:
    """Write into `scope` what Litestar's `__call__` and router write before a handler runs, and what its
    `Request` (built only to render an error or send a stream) reads: the app, the state, the route's handler
    and path template, and its path parameters (the fast path's routes have none)."""
    scope["app"] = scope["litestar_app"] = app
    scope.setdefault("state", {})
    scope["route_handler"] = route.handler
    scope["path_template"] = route.template
    scope.setdefault("path_params", {})


def route_template(scope: Scope) -> str:
    """The path template of the route that answered the request of `scope` ("" when no route did)."""
    return str(scope.get("path_template", ""))


def render_error(route: Route, exc: Exception, scope: Scope, receive: Receive, send: Send) -> Response[Any]:
    """`exc` rendered by the handler Litestar's exception middleware would pick for it on `route`."""
    handler = get_exception_handler(route.exception_handlers, exc)
    if handler is None:  # the app registers a handler for `Exception`: never reached
        raise exc
    response: Response[Any] = handler(Request(scope, receive, send), exc)
    return response


async def send_response(response: Response[Any], scope: Scope, receive: Receive, send: Send) -> None:
    """Send `response` as Litestar would: encoded directly where `send_encoded` can, else through Litestar's
    own ASGI response (streams)."""
    if not await send_encoded(response, send):
        await response.to_asgi_response(None, Request(scope, receive, send))(scope, receive, send)


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

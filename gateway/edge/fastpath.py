"""The generation routes without Litestar's request cycle: the gateway's hot path.

`POST /v1/chat/completions` and `POST /v1/completions` are nearly all the traffic, and a profile of the event
loop put about a third of its time in Litestar's request cycle around them: routing, the exception
middleware, dependency injection and signature parsing, response handling (`ops.bench.overhead`,
`docs/overhead.md`). `fast_generation` answers these two routes straight from ASGI with the same code the
Litestar handlers run (`generate` below): the principal from `principal_of`, the body read
within the route's limit (its 413 is the route's), the pipeline's own response objects, and errors rendered
by the handler Litestar would pick for the route. The request is read through an `AsgiInbound`
(`gateway.inbound`), not Litestar's request object, which is built only to render an error or send a
stream. Every other request goes to Litestar: other methods on these paths, any request under a root path,
and every request to a route on which Litestar would run middleware of its own (allowed hosts, CORS, CSRF,
compression, a cache, a handler's middleware: `adapter.Route.plain`), so no such setting is ever skipped.
The two routes stay registered there, where the OpenAPI document is generated from them.

Whatever this takes from Litestar's internals (the route lookup, the scope keys, the exception-handler
lookup, the response encoding) is in `gateway.edge.adapter`. It sits inside the observe middleware (the
request's timeline is in the scope) and in front of `Litestar.__call__` (`gateway.edge.stack`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from litestar import Response
from litestar.enums import ScopeType
from litestar.types import ASGIApp, Receive, Scope, Send

from gateway.edge.adapter import Route, enter_route, find_route, render_error, send_response
from gateway.edge.decoding import Decoder, read_limited
from gateway.edge.security import allow, principal_of
from gateway.edge.sessions import session_chat, step_of
from gateway.errors import InvalidRequestError
from gateway.generation.flow import close_client_watch
from gateway.generation.pipeline import run_chat, run_completion
from gateway.idempotency.replay import entry_name, fingerprint, key_of
from gateway.inbound import AsgiInbound, Inbound
from gateway.keeping import unsettled
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.services import Services
from gateway.sessions.service import SESSION_HEADER
from policy.auth import Principal

if TYPE_CHECKING:
    from litestar import Litestar

Kind = Literal["chat", "completion"]
# The request bodies, decoded with errors that name the field (immutable: shared by every request).
_CHAT = Decoder(ChatCompletionRequest)
_COMPLETION = Decoder(CompletionRequest)
# The paths the fast path answers, and which kind of generation each is.
FAST_PATHS: dict[str, Kind] = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


async def generate(
    kind: Kind, services: Services, inbound: Inbound, principal: Principal, max_body: int | None
) -> Response[Any]:
    """Chat or legacy completions for a consumer: the body (at most `max_body` bytes; None: no limit)
    decoded, then the generation pipeline. What both the fast path and the Litestar handlers
    (`gateway.api.completions`) run."""
    allow(principal, "consumer")
    body = await read_limited(inbound, max_body)
    key = key_of(inbound.headers) if services.idempotency is not None else None
    session = inbound.headers.get(SESSION_HEADER)
    if session is not None and kind != "chat":
        raise InvalidRequestError("sessions hold chat conversations", param=SESSION_HEADER)

    async def run() -> Response[Any]:
        if session is not None:
            number = step_of(inbound.headers)
            return await session_chat(services, inbound, principal, session, number, _CHAT.decode(body))
        if kind == "chat":
            return await run_chat(services.generation, _CHAT.decode(body), inbound, principal)
        return await run_completion(services.generation, _COMPLETION.decode(body), inbound, principal)

    if key is None or services.idempotency is None:
        return await run()
    name = entry_name(principal.tenant.tenant_id, principal.key.key_id, kind, key)
    state = inbound.scope.setdefault("state", {})
    return await services.idempotency.run(name, fingerprint(body), run, state)


def fast_generation(app: Litestar, inner: ASGIApp) -> ASGIApp:
    """`inner` (Litestar's own entry point), with the generation routes answered directly (module
    docstring)."""
    routes: dict[str, Route] = {}

    def route(path: str) -> Route:
        # The registered route, looked up once per path.
        if path not in routes:
            routes[path] = find_route(app, path, "POST")
        return routes[path]

    async def asgi(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            kind = FAST_PATHS.get(scope.get("path", "")) if scope["type"] == ScopeType.HTTP else None
            if kind is None or scope.get("method") != "POST" or scope.get("root_path"):
                await inner(scope, receive, send)
                return
            found = route(scope["path"])
            if not found.plain:  # Litestar's own middleware must see it (`adapter.Route.plain`)
                await inner(scope, receive, send)
                return
            enter_route(scope, app, found)
            inbound = AsgiInbound(scope, receive)
            services: Services = app.state.services
            try:
                principal = await principal_of(inbound, services)
                response = await generate(kind, services, inbound, principal, found.body_limit)
            except Exception as exc:  # rendered as the app's handlers render it (never a traceback)
                response = render_error(found, exc, scope, receive, send)
            await send_response(response, scope, receive, send)
        finally:
            # The response has been sent (or never will be): the request's client is watched no more (the
            # generation routes' Litestar handlers watch it too, `ClientWatch`), and a streamed answer's
            # `Idempotency-Key` claim that no stream settled is released.
            close_client_watch(scope)
            for held in unsettled(scope.get("state")):
                await held.settle(None)

    return asgi

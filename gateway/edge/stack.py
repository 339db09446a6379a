"""The gateway's ASGI stack: what every connection passes through, outermost first.

    OverloadGate.wrap     sheds generation requests while overloaded: a 503 that costs no routing,
                          parsing or auth, counted by the gate (`lockgate:shed_requests_total`)
    observe_middleware    times every HTTP request from its arrival and sets its `x-request-id`, on
                          every answer (the router's own 404 and 405 included, which Litestar's route
                          middleware never sees)
    fast_generation       answers `POST /v1/chat/completions` and `/v1/completions` without Litestar's
                          request cycle (`gateway.edge.fastpath`)
    Litestar.__call__     everything else, unchanged: the lifespan, routing, Litestar's middleware and
                          exception handlers, the route handlers

`Gateway` is the Litestar app the gateway serves: its ASGI entry point runs the stack, whose innermost layer
is Litestar's own entry point. Nothing of the app is replaced after it is built (`app.asgi_handler` is
Litestar's); the outer layers pass the lifespan and every other non-HTTP message straight through.
"""

from __future__ import annotations

from typing import Any, cast

from litestar import Litestar
from litestar.types import ASGIApp, LifeSpanReceive, LifeSpanScope, LifeSpanSend, Receive, Scope, Send

from gateway.edge.adapter import route_template
from gateway.edge.fastpath import fast_generation
from gateway.observe.observer import RequestObserver, observe_middleware
from gateway.overload import OverloadGate


class Gateway(Litestar):
    """A Litestar app behind the gateway's edge (module docstring). `overload` and `observer` are the app's
    own (built with it, not shared between apps); the other arguments are Litestar's."""

    def __init__(self, *, overload: OverloadGate, observer: RequestObserver, **litestar: Any) -> None:
        super().__init__(**litestar)
        litestar_entry = cast("ASGIApp", super().__call__)
        self._edge: ASGIApp = overload.wrap(
            observe_middleware(fast_generation(self, litestar_entry), observer, route_template)
        )

    async def __call__(
        self,
        scope: Scope | LifeSpanScope,
        receive: Receive | LifeSpanReceive,
        send: Send | LifeSpanSend,
    ) -> None:
        """The ASGI entry point: the stack (module docstring)."""
        await self._edge(scope, receive, send)  # type: ignore[arg-type]

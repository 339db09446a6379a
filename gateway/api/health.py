"""`GET /healthz` and `GET /readyz`: the liveness and readiness probes (tag `health`, no key needed)."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get
from litestar.di import NamedDependency
from litestar.openapi.datastructures import ResponseSpec
from litestar.status_codes import HTTP_200_OK, HTTP_503_SERVICE_UNAVAILABLE

from gateway.api.openapi import BEARER, public
from gateway.edge.security import allow_operator, principal_of
from gateway.errors import AuthenticationError, PermissionDeniedError, StoreUnavailableError
from gateway.readiness import unrecoverable
from gateway.services import Services


@get(
    "/healthz",
    responses={
        HTTP_503_SERVICE_UNAVAILABLE: ResponseSpec(
            dict[str, str],
            generate_examples=False,
            description='The gateway cannot recover by itself: `{"status": "dead", "detail": ...}`.',
        )
    },
)
async def healthz(services: NamedDependency[Services]) -> Response[dict[str, str]]:
    """Liveness: 200 while the gateway can serve or recover by itself; 503 once it cannot (its engine
    supervisor gave up), so that a process supervisor restarts it."""
    detail = unrecoverable(services.generation)
    if detail:
        return Response(
            content={"status": "dead", "detail": detail}, status_code=HTTP_503_SERVICE_UNAVAILABLE
        )
    return Response(content={"status": "ok"}, status_code=HTTP_200_OK)


@get(
    "/readyz",
    # No key (a load balancer's probe), or an `operator` key of the operating organisation for the detail.
    security=[{}, *BEARER],
    responses={
        HTTP_503_SERVICE_UNAVAILABLE: ResponseSpec(
            dict[str, Any],
            generate_examples=False,
            description="Not ready: `status: not_ready` (for an operator key, the same body as ready's, with "
            "the `detail` of the engines down).",
        )
    },
)
async def readyz(
    request: Request[Any, Any, Any], services: NamedDependency[Services]
) -> Response[dict[str, Any]]:
    """Readiness: 200 `{"status": "ready"}` while every pool has a ready engine and the registry view is
    fresh, else 503 `{"status": "not_ready"}`, as checked within the last `[server] readiness_cache`
    seconds. For an `operator` key of the operating organisation, the detail: each engine replica, pool and
    the registry view (any other caller, or a key that fails, gets the status alone: replica ids and error
    text stay inside)."""
    readiness = await services.readiness.check()
    body = readiness.body if await _is_operator(request, services) else {"status": readiness.body["status"]}
    status = HTTP_200_OK if readiness.ready else HTTP_503_SERVICE_UNAVAILABLE
    return Response(content=body, status_code=status)


async def _is_operator(request: Request[Any, Any, Any], services: Services) -> bool:
    """Whether the request carries a key with the `operator` role of the operating organisation. Never an
    error: a probe is answered whatever its key (a bad one just gets no detail)."""
    if "authorization" not in request.headers:
        return False
    try:
        allow_operator(await principal_of(request, services), "operator")
    except (AuthenticationError, PermissionDeniedError, StoreUnavailableError):
        return False
    return True


ROUTES = [public("health", [healthz, readyz])]

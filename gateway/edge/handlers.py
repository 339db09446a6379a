"""The app's exception handlers: every error a route raises, rendered in the OpenAI shape and noted on the
request's timeline (`gateway.observe.timeline`). The fast path renders through the same handlers
(`gateway.edge.adapter.render_error`)."""

from __future__ import annotations

import logging
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException

from gateway.errors import (
    APIError,
    AuthenticationError,
    EngineUnavailableError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    StoreUnavailableError,
    error_response,
)
from gateway.observe.timeline import note_error
from policy.tenants.base import UnavailableError as TenantStoreUnavailableError

log = logging.getLogger("lockgate.errors")

_HTTP_TYPES = {
    400: InvalidRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    413: PayloadTooLargeError,
    503: EngineUnavailableError,
}


def _on_api_error(request: Request[Any, Any, Any], exc: APIError) -> Response[bytes]:
    note_error(request.scope, exc.code, exc.status_code)
    return error_response(exc, exc.headers)


def _on_http_exception(request: Request[Any, Any, Any], exc: HTTPException) -> Response[bytes]:
    status = exc.status_code
    if status == 413:
        api: APIError = PayloadTooLargeError(
            "request body is larger than the configured limit", code="body_too_large"
        )
    elif status == 405:
        api = InvalidRequestError(
            f"method {request.method} is not allowed on {request.url.path}", code="method_not_allowed"
        )
        api.status_code = 405
    elif status == 404:
        api = NotFoundError(f"no route {request.method} {request.url.path}")
    else:
        api = _HTTP_TYPES.get(status, APIError)(exc.detail)
        api.status_code = status
    note_error(request.scope, api.code, api.status_code)
    return error_response(api, exc.headers)


def _on_store_unavailable(
    request: Request[Any, Any, Any], exc: TenantStoreUnavailableError
) -> Response[bytes]:
    log.warning("tenant store unavailable on %s %s: %s", request.method, request.url.path, exc)
    api = StoreUnavailableError("the tenant store is unavailable; try again shortly", retry_after=1)
    note_error(request.scope, api.code, api.status_code)
    return error_response(api, api.headers)


def _on_unexpected(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    # Still a bug: logged with its traceback, answered without internals.
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(APIError("internal error; the request id names it in the server log"))


def exception_handlers() -> dict[type[Exception] | int, Any]:
    """Handlers that render every error in the OpenAI shape."""
    return {
        APIError: _on_api_error,
        HTTPException: _on_http_exception,
        TenantStoreUnavailableError: _on_store_unavailable,
        Exception: _on_unexpected,
    }

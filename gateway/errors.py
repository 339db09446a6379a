"""Errors the gateway answers with, always in the OpenAI error shape.

Exceptions::

    APIError                      status + OpenAI `type`, `param`, `code`
    ├── InvalidRequestError       400 invalid_request_error (names the field in `param`)
    ├── NotFoundError             404 not_found_error
    ├── AuthenticationError       401 authentication_error (missing, unknown, expired, revoked key)
    ├── PermissionDeniedError     403 permission_error (missing role, or another tenant's object)
    ├── PayloadTooLargeError      413 invalid_request_error
    ├── RateLimitedError          429 rate_limit_exceeded (with Retry-After)
    ├── EngineUnavailableError    503 service_unavailable (no engine can take the request now)
    ├── StoreUnavailableError     503 service_unavailable, code store_unavailable (the tenant store cannot
    │                             answer now and the key is not cached; with Retry-After)
    └── EngineFailedError         502 engine_error (the engine failed this request)

Litestar's own HTTP exceptions (unknown route, wrong method, body over the size limit) are rendered in the
same shape by the app's handlers (`gateway.edge.handlers`), and so is a tenant store that cannot be reached
on any route (the admin API included): 503 `store_unavailable`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import msgspec
from litestar import MediaType, Response


def retry_after_seconds(seconds: float) -> int:
    """A wait of `seconds` as `Retry-After` says it: whole seconds, rounded up, at least 1."""
    return max(1, math.ceil(seconds))


def retry_after_headers(seconds: float, *, exact: bool = False) -> dict[str, str]:
    """The headers of a refusal that may succeed in `seconds`: `Retry-After` in whole seconds (HTTP's unit),
    rounded up, at least 1. `exact`: the wait is known to the millisecond (a quota bucket's refill), so
    `retry-after-ms` says it too; the openai SDKs prefer it, so their automatic retry of a request that fits
    again in 0.12 s waits 0.12 s, not a whole second. Estimates (a queue's wait, an engine's restart) stay in
    whole seconds: clients told the same millisecond would come back together."""
    headers = {"Retry-After": str(retry_after_seconds(seconds))}
    if exact:
        headers["retry-after-ms"] = str(max(1, math.ceil(seconds * 1000)))
    return headers


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    """The inner object of an OpenAI error response."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct, frozen=True, kw_only=True):
    """`{"error": {...}}` as OpenAI sends it."""

    error: ErrorBody


class APIError(Exception):
    """An error that becomes an OpenAI-shaped HTTP response."""

    status_code = 500
    error_type = "server_error"
    # The machine-readable `code` of an error raised without one: every error carries a code.
    default_code = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        self.headers = dict(headers or {})

    def body(self) -> ErrorResponse:
        """The response body."""
        return ErrorResponse(
            error=ErrorBody(message=self.message, type=self.error_type, param=self.param, code=self.code)
        )


class InvalidRequestError(APIError):
    """The request is malformed or asks for something unsupported; `param` names the field."""

    status_code = 400
    error_type = "invalid_request_error"
    default_code = "invalid_value"


class AuthenticationError(APIError):
    """No valid API key."""

    status_code = 401
    error_type = "authentication_error"
    default_code = "invalid_api_key"


class PermissionDeniedError(APIError):
    """The key may not do this."""

    status_code = 403
    error_type = "permission_error"
    default_code = "permission_denied"


class RateLimitedError(APIError):
    """A quota bucket is short; `Retry-After` says when the request would fit."""

    status_code = 429
    error_type = "rate_limit_exceeded"
    default_code = "rate_limit_exceeded"


class ClientClosedError(APIError):
    """The client went away before its request was read (nginx's 499: logged, never seen by anyone)."""

    status_code = 499
    error_type = "client_closed_request"
    default_code = "client_closed_request"


class NotFoundError(APIError):
    """The named resource (route, model) does not exist."""

    status_code = 404
    error_type = "not_found_error"
    default_code = "not_found"


class PayloadTooLargeError(APIError):
    """The body is over the configured limit."""

    status_code = 413
    error_type = "invalid_request_error"
    default_code = "body_too_large"


class EngineUnavailableError(APIError):
    """No engine can take the request now."""

    status_code = 503
    error_type = "service_unavailable"
    default_code = "unavailable"


class StoreUnavailableError(APIError):
    """A store the request needs (the tenant store, for a key that is not cached) cannot answer now."""

    status_code = 503
    error_type = "service_unavailable"

    def __init__(self, message: str, *, retry_after: int, code: str = "store_unavailable") -> None:
        super().__init__(message, code=code, headers=retry_after_headers(retry_after))


class EngineFailedError(APIError):
    """The engine failed while serving the request."""

    status_code = 502
    error_type = "engine_error"
    default_code = "engine_error"


def error_response(exc: APIError, headers: Mapping[str, str] | None = None) -> Response[bytes]:
    """Render an `APIError` as a Litestar response."""
    return Response(
        content=msgspec.json.encode(exc.body()),
        status_code=exc.status_code,
        media_type=MediaType.JSON,
        headers=dict(headers or {}),
    )

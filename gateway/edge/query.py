"""Query strings read strictly: each parameter known to the route and given at most once (400 naming it)."""

from __future__ import annotations

from typing import Any

from litestar import Request

from gateway.errors import InvalidRequestError


def single_params(request: Request[Any, Any, Any], allowed: frozenset[str]) -> dict[str, str]:
    """The query parameters, each given at most once and each one this route knows."""
    params: dict[str, str] = {}
    for name, value in request.query_params.multi_items():
        if name not in allowed:
            raise InvalidRequestError(f"unknown parameter {name!r}", param=name, code="unknown_parameter")
        if name in params:
            raise InvalidRequestError(f"{name} may be given once", param=name, code="invalid_value")
        params[name] = value
    return params

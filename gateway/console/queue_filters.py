"""The review queue's query parameters (`GET /audit/queue`, `/audit/queue/counts`, `/audit/appeals`), shared
with the console's filter form: which undecided items a reviewer looks at, in what order, a page at a time.

    tenant=        a tenant (global reviewers; a tenant's reviewer may name only its own: 403 other_tenant)
    decision= stage= source= category= severity=      the appealed decision's facets, exactly
    policy=        name@version exactly, or a bare name for every version
    older_than= newer_than=                           age in seconds (filed at least / at most that long ago)
    sort=oldest|newest                                oldest filed first (default) or newest first
    limit= after=                                     page size (1..MAX_APPEAL_LIMIT) and keyset (last id)

An unknown parameter, one given twice, or a bad value is a 400 naming it.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
from litestar import Request
from litestar.di import Provide
from litestar.params import FromQuery

from gateway.edge.query import single_params
from gateway.errors import InvalidRequestError, PermissionDeniedError
from policy.appeals.base import MAX_APPEAL_LIMIT, AppealFilter

_FACET_PARAMS = ("decision", "stage", "source", "category", "severity", "policy")
PAGE_PARAMS = frozenset({"limit", "after"})
FILTER_PARAMS = frozenset({"tenant", *_FACET_PARAMS, "older_than", "newer_than", "sort"})


class QueueQuery(msgspec.Struct, frozen=True, kw_only=True):
    """A reviewer's view of the queue: whose items (None: every tenant), which, and which page."""

    tenant: str | None
    filters: AppealFilter
    limit: int = 100
    after: str | None = None


def _bad(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code="invalid_value")


def _seconds(param: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise _bad(param, f"{param} must be a number of seconds >= 0, got {text!r}")
    return value


def queue_query(params: dict[str, str], scope: str | None, now: float, *, paged: bool = True) -> QueueQuery:
    """The queue query `params` ask for within the caller's `scope` (a tenant, None for every tenant);
    without `paged`, `limit` and `after` are refused (a count has no pages)."""
    for name in ("state", *(() if paged else PAGE_PARAMS)):
        if name in params:
            raise InvalidRequestError(f"unknown parameter {name!r}", param=name, code="unknown_parameter")
    tenant = params.get("tenant", scope)
    if scope is not None and tenant != scope:
        message = "this key may only review its own tenant"
        raise PermissionDeniedError(message, param="tenant", code="other_tenant")
    if tenant == "":
        raise _bad("tenant", "tenant must not be empty")
    facets: dict[str, Any] = {}
    for name in _FACET_PARAMS:
        if name in params:
            if not params[name] or len(params[name]) > 200:
                raise _bad(name, f"{name} must be 1..200 characters")
            facets[name] = params[name]
    if "older_than" in params:
        facets["filed_to"] = now - _seconds("older_than", params["older_than"])
    if "newer_than" in params:
        facets["filed_from"] = now - _seconds("newer_than", params["newer_than"])
    sort = params.get("sort", "oldest")
    if sort not in ("oldest", "newest"):
        raise _bad("sort", f"sort must be oldest or newest, got {sort!r}")
    limit = 100
    if paged and "limit" in params:
        text = params["limit"]
        if not (text.isascii() and text.isdigit() and 1 <= int(text) <= MAX_APPEAL_LIMIT):
            raise _bad("limit", f"limit must be an integer in 1..{MAX_APPEAL_LIMIT}")
        limit = int(text)
    filters = AppealFilter(**facets, newest_first=sort == "newest")
    after = params.get("after") if paged else None
    return QueueQuery(tenant=tenant, filters=filters, limit=limit, after=after)


def _queue_params(
    request: Request[Any, Any, Any],
    tenant: FromQuery[str | None] = None,
    decision: FromQuery[str | None] = None,
    stage: FromQuery[str | None] = None,
    source: FromQuery[str | None] = None,
    category: FromQuery[str | None] = None,
    severity: FromQuery[str | None] = None,
    policy: FromQuery[str | None] = None,
    older_than: FromQuery[str | None] = None,
    newer_than: FromQuery[str | None] = None,
    sort: FromQuery[str | None] = None,
    limit: FromQuery[str | None] = None,
    after: FromQuery[str | None] = None,
) -> dict[str, str]:
    """The queue's query parameters, each given at most once and each one known (else 400; `state` is left
    to the routes that take it); named here so that the OpenAPI document lists them."""
    return single_params(request, FILTER_PARAMS | PAGE_PARAMS | {"state"})


# The dependency a queue route takes its parameters through: `queue_params: dict[str, str]`.
QUEUE_PARAMS = {"queue_params": Provide(_queue_params, sync_to_thread=False)}

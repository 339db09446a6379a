"""Reviewer API over the audit trail of gate decisions (`/audit/...`, role `reviewer`).

A reviewer key sees its own tenant's records only; one of the operating organisation (tenant `lockgate`) is a
global reviewer, who sees every tenant's and may name one with `tenant`. Another tenant's record answers 404
like a missing one (a 403 would confirm that it exists); naming another tenant in `tenant` is 403 whatever
the name, so that says nothing either.

    GET /audit/decisions                 a page of records, filtered; `next_cursor` fetches the next page
    GET /audit/decisions/{tenant}/{seq}  one record (with its stage runs and scores)
    GET /audit/requests/{request_id}     every record of a request id
    GET /audit/export                    every record the filters match, as NDJSON, read page by page
    GET /audit/verify                    the hash chain of one tenant or of each: 200 when every chain is ok,
                                         409 `audit_chain_broken` (with the reports) when one is not: a
                                         broken chain is evidence of tampering, not a server error. Read in
                                         pages off the writer's connection; checked against the MAC key and
                                         this process's signed checkpoints (409 `audit_checkpoints_forged`
                                         when their file does not verify)

Filters (query parameters): tenant, since, until (unix seconds, since <= at < until), decision, stage,
category, policy (`name@version`, or `name` for every version), fail_open=true, flagged=true; pages: limit
(1..1000, default 100), cursor. A bad or unknown parameter is 400 with `param` naming it.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar, get_args

import msgspec
from litestar import MediaType, Request, Response, get
from litestar.di import NamedDependency
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import OpenAPIType, Schema
from litestar.params import FromPath
from litestar.response import Stream

from gateway.api.openapi import errors, query, query_parameters, secured
from gateway.edge.query import single_params
from gateway.edge.security import reviewer_scope
from gateway.errors import (
    ErrorBody,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    StoreUnavailableError,
)
from gateway.services import Services
from policy.audit.base import MAX_QUERY_LIMIT, AuditQuery, AuditStore, AuditUnavailableError
from policy.audit.base import NotFoundError as AuditNotFoundError
from policy.audit.checkpoints import CheckpointError
from policy.audit.records import AuditRecord, ChainFault, ChainReport, Decision, Stage
from policy.auth import Principal

T = TypeVar("T")

_FILTERS = frozenset(
    {"tenant", "since", "until", "decision", "stage", "category", "policy", "fail_open", "flagged"}
)
_LIST_PARAMS = _FILTERS | {"limit", "cursor"}
# The export streams every match (from `cursor` on, to resume one that broke off): no `limit`.
_EXPORT_PARAMS = _FILTERS | {"cursor"}
_DECISIONS: tuple[str, ...] = get_args(Decision)
_STAGES: tuple[str, ...] = get_args(Stage)
_encoder = msgspec.json.Encoder()
_cursor_decoder = msgspec.json.Decoder(tuple[str, int])

# The query parameters as the OpenAPI document shows them (the handlers read the query string themselves).
_STRING = Schema(type=OpenAPIType.STRING)
_SECONDS = Schema(type=OpenAPIType.NUMBER)
_BOOLEAN = Schema(type=OpenAPIType.BOOLEAN)
_TENANT = query("tenant", _STRING, "The tenant (global reviewers; others may name only their own: else 403).")
_FILTER_PARAMETERS = (
    _TENANT,
    query("since", _SECONDS, "Records at or after this time (unix seconds)."),
    query("until", _SECONDS, "Records before this time (unix seconds)."),
    query("decision", Schema(type=OpenAPIType.STRING, enum=list(_DECISIONS)), "Records of this decision."),
    query("stage", Schema(type=OpenAPIType.STRING, enum=list(_STAGES)), "Records of this stage."),
    query("category", _STRING, "Records of this category."),
    query("policy", _STRING, "`name@version`, or `name` for every version."),
    query("fail_open", _BOOLEAN, "`true`: only decisions the policy let through failing open."),
    query("flagged", _BOOLEAN, "`true`: only decisions flagged for review."),
    query("cursor", _STRING, "`next_cursor` of the previous page (export: resume after it)."),
)
_LIMIT = query(
    "limit", Schema(type=OpenAPIType.INTEGER, minimum=1, maximum=MAX_QUERY_LIMIT), "Page size (default 100)."
)


class DecisionPage(msgspec.Struct, frozen=True, kw_only=True):
    """`GET /audit/decisions`: a page of records; `next_cursor` (None: this was the last page) the next."""

    data: list[AuditRecord]
    next_cursor: str | None


class RequestRecords(msgspec.Struct, frozen=True, kw_only=True):
    """`GET /audit/requests/{request_id}`: its records, ordered by (tenant, seq)."""

    data: list[AuditRecord]


class ChainStatus(msgspec.Struct, frozen=True, kw_only=True):
    """One tenant's chain as `verify` found it."""

    ok: bool
    checked: int
    first_bad_seq: int | None
    reason: ChainFault | None
    detail: str
    last_seq: int
    unkeyed: int = 0  # records without a MAC (written before the chain was keyed)


class VerifyResult(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """`GET /audit/verify`: the chains by tenant; with a 409 also `error`, in the OpenAI shape."""

    ok: bool
    tenants: dict[str, ChainStatus]
    error: ErrorBody | None = None


def encode_cursor(record: AuditRecord) -> str:
    """The opaque cursor of the page after `record`."""
    raw = _encoder.encode((record.tenant, record.seq))
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _bad(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code="invalid_value")


def _decode_cursor(text: str) -> tuple[str, int]:
    try:
        tenant, seq = _cursor_decoder.decode(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
    except (binascii.Error, ValueError, msgspec.DecodeError) as exc:
        raise _bad("cursor", "cursor is not one this API returned") from exc
    if seq < 0:
        raise _bad("cursor", "cursor is not one this API returned")
    return tenant, seq


def _number(param: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise _bad(param, f"{param} must be a number of unix seconds, got {text!r}")
    return value


def _flag(param: str, text: str) -> bool:
    if text not in ("true", "false"):
        raise _bad(param, f"{param} must be true or false, got {text!r}")
    return text == "true"


def _one_of(param: str, text: str, allowed: tuple[str, ...]) -> str:
    if text not in allowed:
        raise _bad(param, f"{param} must be one of {', '.join(allowed)}; got {text!r}")
    return text


def parse_query(request: Request[Any, Any, Any], scope: str | None, allowed: frozenset[str]) -> AuditQuery:
    """The store query the request's parameters ask for, within the caller's scope."""
    p = single_params(request, allowed)
    tenant = p.get("tenant", scope)
    if scope is not None and tenant != scope:
        raise PermissionDeniedError(
            "this key may only review its own tenant", param="tenant", code="other_tenant"
        )
    if tenant == "":
        raise _bad("tenant", "tenant must not be empty")
    limit = 100
    if "limit" in p:
        if not (p["limit"].isascii() and p["limit"].isdigit() and 1 <= int(p["limit"]) <= MAX_QUERY_LIMIT):
            raise _bad("limit", f"limit must be an integer in 1..{MAX_QUERY_LIMIT}")
        limit = int(p["limit"])
    after_tenant, after_seq = _decode_cursor(p["cursor"]) if "cursor" in p else (None, 0)
    since = _number("since", p["since"]) if "since" in p else None
    until = _number("until", p["until"]) if "until" in p else None
    return msgspec.convert(
        {
            "tenant": tenant,
            "since": since,
            "until": until,
            "decision": _one_of("decision", p["decision"], _DECISIONS) if "decision" in p else None,
            "stage": _one_of("stage", p["stage"], _STAGES) if "stage" in p else None,
            "category": p.get("category"),
            "policy": p.get("policy"),
            "fail_open_only": _flag("fail_open", p["fail_open"]) if "fail_open" in p else False,
            "flagged_only": _flag("flagged", p["flagged"]) if "flagged" in p else False,
            "after_tenant": after_tenant,
            "after_seq": after_seq,
            "limit": limit,
        },
        AuditQuery,
    )


async def _audit(call: Awaitable[T]) -> T:
    """Run an audit store call; 503 (retry) while the store cannot answer."""
    try:
        return await call
    except AuditUnavailableError as exc:
        raise StoreUnavailableError(f"the audit store is unavailable: {exc}", retry_after=1) from exc


@get(
    "/audit/decisions",
    responses=errors(400),
    operation_class=query_parameters(*_FILTER_PARAMETERS, _LIMIT),
)
async def list_decisions(
    request: Request[Any, Any, Any],
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
) -> DecisionPage:
    """A page of decisions, ordered by (tenant, seq)."""
    q = parse_query(request, reviewer_scope(principal), _LIST_PARAMS)
    page = await _audit(services.audit.query(q))
    more = len(page) == q.page_size()
    return DecisionPage(data=page, next_cursor=encode_cursor(page[-1]) if more else None)


@get("/audit/decisions/{tenant:str}/{seq:int}", responses=errors(400, 404))
async def get_decision(
    tenant: FromPath[str],
    seq: FromPath[int],
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
) -> AuditRecord:
    """One decision record."""
    return await reviewer_record(services, principal, tenant, seq)


async def reviewer_record(services: Services, principal: Principal, tenant: str, seq: int) -> AuditRecord:
    """Decision `tenant`/`seq` if the reviewer may see it: 404 outside their scope, like a missing one."""
    scope = reviewer_scope(principal)
    missing = NotFoundError(f"no audit record {tenant}/{seq}", code="not_found")
    if scope is not None and tenant != scope:
        raise missing
    try:
        return await _audit(services.audit.get(tenant, seq))
    except AuditNotFoundError:
        raise missing from None


@get("/audit/requests/{request_id:str}", responses=errors(400))
async def request_decisions(
    request_id: FromPath[str], services: NamedDependency[Services], principal: NamedDependency[Principal]
) -> RequestRecords:
    """Every decision recorded for one request id (none: an empty list)."""
    scope = reviewer_scope(principal)
    return RequestRecords(data=await _audit(services.audit.find(scope, request_id)))


async def _ndjson(store: AuditStore, q: AuditQuery, page: list[AuditRecord]) -> AsyncIterator[bytes]:
    """The records of `page` and of every page after it, one JSON line each (one page in memory at a time).

    A store that fails mid-export aborts the response, so a cut-off export never looks complete.
    """
    while page:
        yield _encoder.encode_lines(page)
        if len(page) < q.page_size():
            return
        q = q.after(page[-1])
        page = await store.query(q)


@get(
    "/audit/export",
    responses={
        200: ResponseSpec(
            AuditRecord,
            generate_examples=False,
            media_type="application/x-ndjson",
            description="Every matching record, one `AuditRecord` JSON object a line, by (tenant, seq).",
        ),
        **errors(400),
    },
    operation_class=query_parameters(*_FILTER_PARAMETERS),
)
async def export_decisions(
    request: Request[Any, Any, Any],
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
) -> Stream:
    """Every decision the filters match, as NDJSON in (tenant, seq) order."""
    q = msgspec.structs.replace(
        parse_query(request, reviewer_scope(principal), _EXPORT_PARAMS), limit=MAX_QUERY_LIMIT
    )
    # The first page before the response starts, so a store that is down is a 503, not an empty export.
    first = await _audit(services.audit.query(q))
    return Stream(_ndjson(services.audit, q, first), media_type="application/x-ndjson")


def _status(report: ChainReport) -> ChainStatus:
    return ChainStatus(
        ok=report.ok,
        checked=report.checked,
        first_bad_seq=report.first_bad_seq,
        reason=report.reason,
        detail=report.detail,
        last_seq=report.last_seq,
        unkeyed=report.unkeyed,
    )


@get(
    "/audit/verify",
    responses={
        200: ResponseSpec(VerifyResult, generate_examples=False, description="Every chain verifies."),
        **errors(400),
        409: ResponseSpec(
            VerifyResult,
            generate_examples=False,
            description="A chain does not verify (evidence of tampering): the reports, and `error` "
            "(`audit_chain_broken`) in the OpenAI shape.",
        ),
    },
    operation_class=query_parameters(_TENANT),
)
async def verify_chains(
    request: Request[Any, Any, Any],
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
) -> Response[bytes]:
    """Verify the hash chain of the named tenant (scoped reviewers: their own), or of every tenant."""
    scope = reviewer_scope(principal)
    tenant = single_params(request, frozenset({"tenant"})).get("tenant", scope)
    if scope is not None and tenant != scope:
        raise PermissionDeniedError(
            "this key may only review its own tenant", param="tenant", code="other_tenant"
        )
    names = [tenant] if tenant is not None else [t.tenant_id for t in await services.tenants.list_tenants()]
    try:
        known = await services.audit_checkpoints.read() if services.audit_checkpoints else {}
    except CheckpointError as exc:
        # The checkpoint file itself was tampered with: nothing can be verified against it.
        body = VerifyResult(
            ok=False,
            tenants={},
            error=ErrorBody(message=str(exc), type="conflict_error", code="audit_checkpoints_forged"),
        )
        return Response(content=_encoder.encode(body), status_code=409, media_type=MediaType.JSON)
    chains = {name: _status(await _audit(services.audit.verify(name, known.get(name, ())))) for name in names}
    broken = sorted(name for name, status in chains.items() if not status.ok)
    error = None
    if broken:
        error = ErrorBody(
            message=f"the audit chain of {', '.join(broken)} does not verify",
            type="conflict_error",
            code="audit_chain_broken",
        )
    body = VerifyResult(ok=not broken, tenants=chains, error=error)
    return Response(
        content=_encoder.encode(body), status_code=409 if broken else 200, media_type=MediaType.JSON
    )


ROUTES = [
    secured("audit", [list_decisions, get_decision, request_decisions, export_decisions, verify_chains])
]

"""Admin API of the versioned registry (`/admin/registry/...`): publish versions, move aliases, roll back.

Policy administrators of the operating organisation may change the registry and read all of it; another
tenant's `policy_admin` reads the model catalogue and what its tenant is bound to, and nothing else
(`gateway.api.registry_scope`: the rest reads as an unpublished name does, an empty list). A change is served
by this replica at once and by every other replica within `registry.refresh_interval`.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, TypeVar, get_args

import msgspec
from litestar import Request, get, post, put
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery
from litestar.status_codes import HTTP_200_OK, HTTP_201_CREATED

from gateway.api.openapi import errors, request_body, secured
from gateway.api.registry_scope import registry_scope
from gateway.edge.decoding import Decoder, read_body
from gateway.edge.security import allow_operator
from gateway.errors import APIError, EngineUnavailableError, InvalidRequestError, NotFoundError
from gateway.publish_check import PublishRefusedError
from gateway.services import Services
from guard.figures import Figures
from policy.auth import Principal
from registry.errors import ConflictError, InvalidError, RegistryError, UnavailableError
from registry.errors import NotFoundError as RegistryNotFoundError
from registry.models import (
    SPEC_TYPES,
    Alias,
    AliasChange,
    AliasTarget,
    FiguresRecord,
    Kind,
    Published,
    Spec,
)

T = TypeVar("T")
KINDS: tuple[str, ...] = get_args(Kind)


class RegistryConflictError(APIError):
    """The version exists with other content."""

    status_code = 409
    error_type = "conflict_error"
    default_code = "conflict"


class PublishBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`POST /admin/registry/{kind}/{name}/versions`. `force` (an `operator` key of the operating
    organisation only) publishes a policy or guard model version the publish check refuses."""

    version: str
    spec: msgspec.Raw
    force: bool = False


class AliasBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`PUT /admin/registry/{kind}/{name}/alias`: one version, or canary targets whose weights sum to 1."""

    targets: list[AliasTarget]


class PublishedView(msgspec.Struct, frozen=True, kw_only=True):
    """A published version as the admin API shows it (the spec decoded)."""

    ref: str
    kind: Kind
    name: str
    version: str
    content_hash: str
    published_at: float
    actor: str
    spec: Any


_publish = Decoder(PublishBody)
_alias = Decoder(AliasBody)


def _kind(kind: str) -> Kind:
    if kind not in KINDS:
        raise NotFoundError(f"no registry kind `{kind}`; kinds are {', '.join(KINDS)}", param="kind")
    return kind  # type: ignore[return-value]


def _shown(p: Published) -> PublishedView:
    return PublishedView(
        ref=p.ref,
        kind=p.kind,
        name=p.name,
        version=p.version,
        content_hash=p.content_hash,
        published_at=p.published_at,
        actor=p.actor,
        spec=msgspec.json.decode(p.spec_json),
    )


async def _call(call: Awaitable[T]) -> T:
    """Run a registry call, mapping its errors to HTTP ones that name the problem."""
    try:
        return await call
    except RegistryNotFoundError as exc:
        raise NotFoundError(str(exc), code="not_found") from exc
    except ConflictError as exc:
        raise RegistryConflictError(str(exc), code="version_conflict") from exc
    except InvalidError as exc:
        raise InvalidRequestError(str(exc), code="invalid_registry_change") from exc
    except UnavailableError as exc:
        raise EngineUnavailableError(str(exc), code="registry_unavailable") from exc
    except RegistryError as exc:
        raise InvalidRequestError(str(exc), code="registry_error") from exc


def _spec(kind: Kind, raw: msgspec.Raw) -> Spec:
    try:
        spec: Spec = msgspec.json.decode(raw, type=SPEC_TYPES[kind])
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(f"spec: {exc}", param="spec", code="invalid_value") from exc
    return spec


# What a registry change can answer besides 401/403/503: invalid, unknown kind or name, conflicting content
# (or, on a publish, a refused publish check).
_CHANGE_ERRORS = (400, 404, 409)


@post(
    "/admin/registry/{kind:str}/{name:str}/versions",
    status_code=HTTP_201_CREATED,
    dependencies=request_body(
        PublishBody,
        {
            "version": "2",
            "spec": {"text": "{% for m in messages %}{{ m.content }}{% endfor %}"},
        },
        description="A version and its spec: the spec's fields are those of the kind's spec type.",
    ),
    responses=errors(*_CHANGE_ERRORS, 413),
)
async def publish_version(
    kind: FromPath[str],
    name: FromPath[str],
    request: Request[Any, Any, Any],
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
) -> PublishedView:
    """Publish an immutable version (identical content again is accepted; other content is 409). A policy
    or guard model version is measured first (`gateway.publish_check`): 409 with its figures when it
    regresses against the version it replaces or cannot be measured, unless forced by an operator."""
    allow_operator(principal)
    checked = _kind(kind)
    body = _publish.decode(await read_body(request))
    if body.force:
        # Asked for, not only used: a key that may not force learns nothing from trying.
        allow_operator(principal, "operator")
    spec = _spec(checked, body.spec)
    registry, check = services.registry, services.publish_check
    reports = () if check is None else await check.measure(checked, name, body.version, spec)
    refused = any(r.refused for r in reports)
    if refused and not body.force:
        raise PublishRefusedError(reports)
    published = await _call(registry.publish(checked, name, body.version, spec, actor=principal.key.key_id))
    if check is not None and reports:
        await _call(check.record(published, reports, forced=refused))
    return _shown(published)


@get("/admin/registry/{kind:str}/{name:str}/versions", responses=errors(400, 404))
async def list_versions(
    kind: FromPath[str],
    name: FromPath[str],
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
) -> list[PublishedView]:
    """The versions of one name, oldest first (none outside the caller's scope)."""
    scope = await registry_scope(services, principal)
    checked = _kind(kind)
    versions = services.registry.view.versions(checked, name)
    return [_shown(p) for p in versions] if scope.shows(checked, name) else []


class FiguresView(msgspec.Struct, frozen=True, kw_only=True):
    """A version's recorded figures (`gateway.publish_check`) as the admin API shows them."""

    ref: str
    context: str
    suite_sha256: str
    figures: Figures | None
    error: str
    baseline: str
    forced: bool
    at: float
    actor: str


def _figures(record: FiguresRecord) -> FiguresView:
    return FiguresView(
        ref=f"{record.name}@{record.version}",
        context=record.context,
        suite_sha256=record.suite_sha256,
        figures=msgspec.json.decode(record.figures, type=Figures) if record.figures else None,
        error=record.error,
        baseline=record.baseline,
        forced=record.forced,
        at=record.at,
        actor=record.actor,
    )


@get("/admin/registry/{kind:str}/{name:str}/figures", responses=errors(400, 404))
async def list_figures(
    kind: FromPath[str],
    name: FromPath[str],
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
) -> list[FiguresView]:
    """The figures the publish check recorded for each version of one name, oldest first (none outside the
    caller's scope)."""
    scope = await registry_scope(services, principal)
    checked = _kind(kind)
    # Read either way, so that a hidden name takes as long to answer as an unpublished one.
    records = await _call(services.registry.store.figures(checked, name))
    return [_figures(r) for r in records] if scope.shows(checked, name) else []


@put(
    "/admin/registry/{kind:str}/{name:str}/alias",
    status_code=HTTP_200_OK,
    dependencies=request_body(
        AliasBody, {"targets": [{"version": "1", "weight": 0.9}, {"version": "2", "weight": 0.1}]}
    ),
    responses=errors(*_CHANGE_ERRORS, 413),
)
async def set_alias(
    kind: FromPath[str],
    name: FromPath[str],
    request: Request[Any, Any, Any],
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
) -> Alias:
    """Point an alias at one version, or split it between two (canary, deterministic per request id)."""
    allow_operator(principal)
    checked = _kind(kind)
    body = _alias.decode(await read_body(request))
    return await _call(services.registry.set_alias(checked, name, body.targets, actor=principal.key.key_id))


@post(
    "/admin/registry/{kind:str}/{name:str}/rollback",
    status_code=HTTP_200_OK,
    responses=errors(*_CHANGE_ERRORS),
)
async def rollback(
    kind: FromPath[str],
    name: FromPath[str],
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
) -> Alias:
    """Move an alias back to what it pointed at before its last change, in one call."""
    allow_operator(principal)
    return await _call(services.registry.rollback(_kind(kind), name, actor=principal.key.key_id))


@get("/admin/registry/{kind:str}/{name:str}/history", responses=errors(400, 404))
async def alias_history(
    kind: FromPath[str],
    name: FromPath[str],
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
    limit: FromQuery[int] = 100,
) -> list[AliasChange]:
    """Every change of an alias, newest first (none outside the caller's scope)."""
    scope = await registry_scope(services, principal)
    checked = _kind(kind)
    if not 1 <= limit <= 1000:
        raise InvalidRequestError("limit must be in 1..1000", param="limit", code="invalid_value")
    # Read either way, so that a hidden name takes as long to answer as an unpublished one.
    history = await _call(services.registry.store.alias_history(checked, name, limit))
    return history if scope.shows(checked, name) else []


@get("/admin/registry/aliases", responses=errors(400, 404))
async def list_aliases(
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
    kind: FromQuery[str | None] = None,
) -> list[Alias]:
    """Every alias (of one kind) the caller may read, as this replica serves it now."""
    scope = await registry_scope(services, principal)
    aliases = services.registry.view.aliases(None if kind is None else _kind(kind))
    return [a for a in aliases if scope.shows(a.kind, a.name)]


ROUTES = [
    secured(
        "registry",
        [publish_version, list_versions, list_figures, set_alias, rollback, alias_history, list_aliases],
    )
]

"""Authentication and authorization at the HTTP edge: the `principal` dependency and role checks."""

from __future__ import annotations

from typing import Any

from litestar import Request
from litestar.di import NamedDependency

from gateway.errors import (
    AuthenticationError,
    PermissionDeniedError,
    RateLimitedError,
    StoreUnavailableError,
    retry_after_headers,
)
from gateway.inbound import Inbound
from gateway.observe.timeline import timeline_in
from gateway.services import Services
from policy.auth import SYSTEM_TENANT, AuthError, ForbiddenError, Principal, ThrottledError, require_role
from policy.auth import StoreUnavailableError as KeyStoreUnavailableError
from policy.auth_limit import source_of
from policy.tenants.models import Role


async def provide_principal(
    request: Request[Any, Any, Any], services: NamedDependency[Services]
) -> Principal:
    """The caller's principal (`principal_of`), for Litestar's dependency injection."""
    # It takes `services` (not the app state) so that Litestar resolves the two one after the other: two
    # independent dependencies are resolved concurrently in an anyio task group, which cost more than the
    # whole authentication of a cached key (measured with ops.bench.overhead).
    return await principal_of(request, services)


async def principal_of(inbound: Inbound, services: Services) -> Principal:
    """The caller's principal from `Authorization: Bearer <key>`, or 401; 503 `store_unavailable` (with
    Retry-After) when the key is not cached and the tenant store cannot answer now; 429 `auth_rate_limited`
    (with Retry-After) when the client's address failed too often and the key is not cached."""
    timeline = timeline_in(inbound.scope, services.clock)
    start = timeline.now()
    client = inbound.scope.get("client")
    source = source_of(client[0] if client else None)
    try:
        principal: Principal = await services.auth.authenticate(inbound.headers.get("authorization"), source)
    except AuthError as exc:
        raise AuthenticationError(
            str(exc), code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
        ) from exc
    except ThrottledError as exc:
        raise RateLimitedError(
            str(exc), code="auth_rate_limited", headers=retry_after_headers(exc.retry_after)
        ) from exc
    except KeyStoreUnavailableError as exc:
        raise StoreUnavailableError(str(exc), retry_after=exc.retry_after) from exc
    finally:
        timeline.phase("auth", start)
    timeline.tenant = principal.tenant.tenant_id
    timeline.key_id = principal.key.key_id
    return principal


def allow(principal: Principal, role: Role) -> None:
    """403 unless the key has `role`."""
    try:
        require_role(principal, role)
    except ForbiddenError as exc:
        raise PermissionDeniedError(str(exc), code="missing_role") from exc


def allow_tenant(principal: Principal, tenant_id: str) -> None:
    """403 unless the caller administers every tenant or this tenant is its own (same answer for absent ones,
    so that ids of other tenants cannot be probed)."""
    allow(principal, "policy_admin")
    if not principal.is_operator_admin and principal.tenant.tenant_id != tenant_id:
        raise other_tenant_error()


def other_tenant_error() -> PermissionDeniedError:
    """The 403 for another tenant's resource, and for an absent one asked by a tenant's own administrator."""
    return PermissionDeniedError("this key may only administer its own tenant", code="other_tenant")


def allow_operator(principal: Principal, role: Role = "policy_admin") -> None:
    """403 unless the caller holds `role` (a policy administrator by default) in the operating organisation,
    whose keys act on every tenant (and read the metrics, which name them all)."""
    allow(principal, role)
    if principal.tenant.tenant_id != SYSTEM_TENANT:
        raise PermissionDeniedError(
            f"only `{role}` keys of the operating organisation may do this", code="operator_only"
        )


def reviewer_scope(principal: Principal) -> str | None:
    """The tenant whose decisions and appeals the caller may review (None: every tenant, for reviewers of the
    operating organisation); 403 without the `reviewer` role."""
    allow(principal, "reviewer")
    tenant = principal.tenant.tenant_id
    return None if tenant == SYSTEM_TENANT else tenant

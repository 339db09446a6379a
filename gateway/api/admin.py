"""Admin API for policy administrators: tenants, their quotas, and API keys (`/admin/...`).

Policy administrators of the operating organisation (tenant `lockgate`) administer every tenant. A
`policy_admin` key of another tenant may read its own tenant and manage its own keys, never another tenant's,
and may not change its own quotas, weight or priority class. Every change is recorded by the store (who, what,
before, after).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable
from typing import Annotated, Any, TypeVar

import msgspec
from litestar import Request, get, patch, post, put
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery
from litestar.status_codes import HTTP_200_OK, HTTP_201_CREATED

from gateway.api.openapi import errors, request_body, secured
from gateway.edge.decoding import Decoder, read_body
from gateway.edge.security import allow, allow_operator, allow_tenant, other_tenant_error
from gateway.errors import APIError, InvalidRequestError, NotFoundError, PermissionDeniedError
from gateway.services import Services
from policy.auth import Principal
from policy.tenants import keys
from policy.tenants.base import ConflictError
from policy.tenants.base import NotFoundError as StoreNotFoundError
from policy.tenants.models import AdminChange, ApiKey, Limits, PriorityClass, Quotas, Role, Tenant
from registry.errors import RegistryError
from routing.admission_types import TenantShare

T = TypeVar("T")
_TENANT_ID = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


class ConflictAPIError(APIError):
    """The object already exists."""

    status_code = 409
    error_type = "conflict_error"
    default_code = "conflict"


class TenantUpdate(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`PATCH /admin/tenants/{id}`: the fields to change."""

    display_name: str | None = None
    weight: float | None = None
    quotas: Quotas | None = None
    policy: str | None = None
    retain_prompts: bool | None = None
    # Omitted or null leaves it as it is (as for every field here).
    content_retention_days: float | None = None
    max_priority: PriorityClass | None = None
    # A registry prompt alias or `name@version`; "" removes the tenant's system prompt.
    system_prompt: str | None = None
    # The tenant's plan label for model routes; "" removes it.
    tier: Annotated[str, msgspec.Meta(max_length=32)] | None = None


class KeyCreate(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`POST /admin/tenants/{id}/keys`."""

    roles: list[Role] = msgspec.field(default_factory=lambda: ["consumer"])
    label: str = ""
    # Lifetime in seconds from now; None = no expiry.
    expires_in: float | None = None
    # Operator administrators only: the registry prompt this key's chat requests get instead of the tenant's,
    # and whether the key's own system and developer messages are trusted instructions.
    system_prompt: str | None = None
    trusted_instructions: bool = False


class KeyCreated(msgspec.Struct, frozen=True, kw_only=True):
    """A new key: `key` is the secret, shown this once and never again."""

    key: str
    key_id: str
    tenant_id: str
    roles: tuple[Role, ...]
    label: str
    created_at: float
    expires_at: float | None
    system_prompt: str | None = None
    trusted_instructions: bool = False


# The store sets created_at; a value sent for it is ignored.
_tenant_create = Decoder(Tenant)
_tenant_update = Decoder(TenantUpdate)
_key_create = Decoder(KeyCreate)
_quotas = Decoder(Quotas)


def _check_limits(limits: Limits | None, where: str) -> None:
    if limits is None:
        return
    for field in ("requests_per_second", "request_burst", "tokens_per_second", "token_burst"):
        if getattr(limits, field) <= 0:
            raise InvalidRequestError(
                f"{where}.{field} must be > 0", param=f"{where}.{field}", code="invalid_value"
            )


def _check_tenant(tenant: Tenant, prefix: str = "") -> None:
    if not _TENANT_ID.match(tenant.tenant_id):
        raise InvalidRequestError(
            "tenant_id must be 1-63 lowercase letters, digits, '-' or '_', starting with a letter or digit",
            param="tenant_id",
            code="invalid_value",
        )
    if tenant.weight <= 0:
        raise InvalidRequestError("weight must be > 0", param="weight", code="invalid_value")
    days = tenant.content_retention_days
    if days is not None and not days > 0:
        raise InvalidRequestError(
            "content_retention_days must be > 0", param="content_retention_days", code="invalid_value"
        )
    _check_limits(tenant.quotas.tenant, f"{prefix}quotas.tenant")
    _check_limits(tenant.quotas.per_key, f"{prefix}quotas.per_key")


def _check_policy(services: Services, policy: str) -> None:
    """A tenant binds to a policy alias (follows it) or a pinned `name@version`; either must resolve."""
    try:
        services.registry.view.resolve_policy(policy, key="")
    except RegistryError as exc:
        raise InvalidRequestError(
            f"policy `{policy}` does not resolve: {exc}", param="policy", code="unknown_policy"
        ) from exc


def _check_prompt(services: Services, prompt: str | None) -> None:
    """A system prompt binding is a registry prompt alias or a pinned `name@version` that resolves."""
    if prompt is None:
        return
    try:
        services.registry.view.resolve_prompt(prompt, key="")
    except RegistryError as exc:
        raise InvalidRequestError(
            f"system_prompt `{prompt}` does not resolve: {exc}", param="system_prompt", code="unknown_prompt"
        ) from exc


async def _store(call: Awaitable[T]) -> T:
    """Run a store call, mapping its errors to HTTP ones."""
    try:
        return await call
    except StoreNotFoundError as exc:
        raise NotFoundError(str(exc), code="not_found") from exc
    except ConflictError as exc:
        raise ConflictAPIError(str(exc), code="already_exists") from exc


def _forget(services: Services, tenant_id: str) -> None:
    # This replica applies the change at once; others within auth.cache_ttl.
    services.auth.forget(tenant_id=tenant_id)


@post(
    "/admin/tenants",
    status_code=HTTP_201_CREATED,
    dependencies=request_body(
        Tenant,
        {
            "tenant_id": "acme",
            "display_name": "Acme",
            "weight": 2,
            "quotas": {
                "tenant": {
                    "requests_per_second": 5,
                    "request_burst": 10,
                    "tokens_per_second": 2000,
                    "token_burst": 8000,
                }
            },
            "max_priority": "interactive",
        },
        component="TenantCreate",
    ),
    responses=errors(400, 409, 413),
)
async def create_tenant(
    request: Request[Any, Any, Any],
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
) -> Tenant:
    """Create a tenant (operator administrators only)."""
    allow_operator(principal)
    tenant = _tenant_create.decode(await read_body(request))
    _check_tenant(tenant)
    _check_policy(services, tenant.policy)
    _check_prompt(services, tenant.system_prompt)
    return await _store(
        services.tenants.create_tenant(tenant, actor=principal.key.key_id, now=services.clock())
    )


@get("/admin/tenants", responses=errors())
async def list_tenants(
    services: NamedDependency[Services], principal: NamedDependency[Principal]
) -> list[Tenant]:
    """Every tenant (operator administrators) or the caller's own."""
    allow_tenant(principal, principal.tenant.tenant_id)
    if principal.is_operator_admin:
        return await services.tenants.list_tenants()
    return [await _store(services.tenants.get_tenant(principal.tenant.tenant_id))]


@get("/admin/tenants/{tenant_id:str}", responses=errors(400, 404))
async def get_tenant(
    tenant_id: FromPath[str], services: NamedDependency[Services], principal: NamedDependency[Principal]
) -> Tenant:
    """One tenant."""
    allow_tenant(principal, tenant_id)
    return await _store(services.tenants.get_tenant(tenant_id))


async def _update(
    services: Services, principal: Principal, tenant_id: str, changes: dict[str, Any]
) -> Tenant:
    allow_operator(principal)
    current = await _store(services.tenants.get_tenant(tenant_id))
    updated = msgspec.structs.replace(current, **changes)
    _check_tenant(updated)
    _check_policy(services, updated.policy)
    _check_prompt(services, updated.system_prompt)
    result = await _store(
        services.tenants.update_tenant(updated, actor=principal.key.key_id, now=services.clock())
    )
    _forget(services, tenant_id)
    return result


@patch(
    "/admin/tenants/{tenant_id:str}",
    status_code=HTTP_200_OK,
    dependencies=request_body(TenantUpdate, {"weight": 3, "policy": "default"}),
    responses=errors(400, 404, 413),
)
async def update_tenant(
    tenant_id: FromPath[str],
    request: Request[Any, Any, Any],
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
) -> Tenant:
    """Change any of a tenant's fields but its id and created_at (operator administrators only)."""
    body = _tenant_update.decode(await read_body(request))
    changes = {k: v for k, v in msgspec.structs.asdict(body).items() if v is not None}
    if body.system_prompt == "":
        changes["system_prompt"] = None
    return await _update(services, principal, tenant_id, changes)


@put(
    "/admin/tenants/{tenant_id:str}/quotas",
    status_code=HTTP_200_OK,
    dependencies=request_body(
        Quotas,
        {
            "per_key": {
                "requests_per_second": 1,
                "request_burst": 2,
                "tokens_per_second": 500,
                "token_burst": 2000,
            },
            "fail_mode": "closed",
        },
    ),
    responses=errors(400, 404, 413),
)
async def set_quotas(
    tenant_id: FromPath[str],
    request: Request[Any, Any, Any],
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
) -> Tenant:
    """Replace a tenant's quotas (operator administrators only)."""
    allow_operator(principal)
    quotas = _quotas.decode(await read_body(request))
    # `param` names the field as it is in this body (`tenant.request_burst`), like decoding errors do.
    _check_limits(quotas.tenant, "tenant")
    _check_limits(quotas.per_key, "per_key")
    return await _update(services, principal, tenant_id, {"quotas": quotas})


@post(
    "/admin/tenants/{tenant_id:str}/keys",
    status_code=HTTP_201_CREATED,
    dependencies=request_body(KeyCreate, {"roles": ["consumer"], "label": "ci", "expires_in": 86400}),
    responses=errors(400, 404, 413),
)
async def create_key(
    tenant_id: FromPath[str],
    request: Request[Any, Any, Any],
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
) -> KeyCreated:
    """Create an API key for a tenant; the response is the only time its secret is shown."""
    allow_tenant(principal, tenant_id)
    body = _key_create.decode(await read_body(request))
    roles = tuple(dict.fromkeys(body.roles))
    if not roles:
        raise InvalidRequestError("a key needs at least one role", param="roles", code="invalid_value")
    if not principal.is_operator_admin and not set(roles) <= set(principal.key.roles):
        raise PermissionDeniedError("a key may not be given roles its creator lacks", code="role_escalation")
    if body.expires_in is not None and body.expires_in <= 0:
        raise InvalidRequestError("expires_in must be > 0 seconds", param="expires_in", code="invalid_value")
    if (body.trusted_instructions or body.system_prompt is not None) and not principal.is_operator_admin:
        # What the guard trusts is the operator's to decide, never a tenant's own.
        field = "trusted_instructions" if body.trusted_instructions else "system_prompt"
        raise PermissionDeniedError(
            f"only an operator administrator may set {field} on a key", param=field, code="operator_only"
        )
    _check_prompt(services, body.system_prompt)
    now = services.clock()
    plaintext, key_id, secret_hash = keys.new_key()
    key = ApiKey(
        key_id=key_id,
        tenant_id=tenant_id,
        roles=roles,
        label=body.label,
        created_at=now,
        expires_at=None if body.expires_in is None else now + body.expires_in,
        system_prompt=body.system_prompt,
        trusted_instructions=body.trusted_instructions,
    )
    stored = await _store(services.tenants.add_key(key, secret_hash, actor=principal.key.key_id, now=now))
    return KeyCreated(
        key=plaintext,
        key_id=stored.key_id,
        tenant_id=stored.tenant_id,
        roles=stored.roles,
        label=stored.label,
        created_at=stored.created_at,
        expires_at=stored.expires_at,
        system_prompt=stored.system_prompt,
        trusted_instructions=stored.trusted_instructions,
    )


@get("/admin/tenants/{tenant_id:str}/keys", responses=errors(400, 404))
async def list_keys(
    tenant_id: FromPath[str], services: NamedDependency[Services], principal: NamedDependency[Principal]
) -> list[ApiKey]:
    """A tenant's keys (never their secrets)."""
    allow_tenant(principal, tenant_id)
    await _store(services.tenants.get_tenant(tenant_id))
    return await services.tenants.list_keys(tenant_id)


class TenantAdmission(msgspec.Struct, frozen=True, kw_only=True):
    """`GET /admin/tenants/{id}/admission`: where a tenant stands in this gateway process's fair admission
    queues, one per model weights hash (by its sha256)."""

    tenant_id: str
    queues: dict[str, TenantShare]


@get("/admin/tenants/{tenant_id:str}/admission", responses=errors(400, 404))
async def tenant_admission(
    tenant_id: FromPath[str], services: NamedDependency[Services], principal: NamedDependency[Principal]
) -> TenantAdmission:
    """A tenant's requests queued and in flight, and its virtual token counter against each queue's virtual
    time (why its requests wait), as this gateway process sees them."""
    allow_tenant(principal, tenant_id)
    await _store(services.tenants.get_tenant(tenant_id))
    return TenantAdmission(tenant_id=tenant_id, queues=services.scheduler.shares(tenant_id))


@post("/admin/keys/{key_id:str}/revoke", status_code=HTTP_200_OK, responses=errors(400, 404))
async def revoke_key(
    key_id: FromPath[str], services: NamedDependency[Services], principal: NamedDependency[Principal]
) -> ApiKey:
    """Revoke a key: at once on this replica, within `auth.cache_ttl` seconds on every other."""
    allow(principal, "policy_admin")
    try:
        stored = await services.tenants.get_key(key_id)
    except StoreNotFoundError:
        if not principal.is_operator_admin:
            # The same answer as for another tenant's key, so that a tenant cannot probe key ids.
            raise other_tenant_error() from None
        raise NotFoundError(f"no key {key_id}", code="not_found") from None
    allow_tenant(principal, stored.key.tenant_id)
    revoked = await _store(
        services.tenants.revoke_key(key_id, actor=principal.key.key_id, now=services.clock())
    )
    services.auth.forget(key_id=key_id)
    return revoked


@get("/admin/changes", responses=errors(400))
async def list_changes(
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
    limit: FromQuery[int] = 100,
    target: FromQuery[str | None] = None,
) -> list[AdminChange]:
    """The record of admin changes, newest first (operator administrators only)."""
    allow_operator(principal)
    if not 1 <= limit <= 1000:
        raise InvalidRequestError("limit must be in 1..1000", param="limit", code="invalid_value")
    return await services.tenants.changes(limit, target=target)


ROUTES = [
    secured(
        "admin",
        [
            create_tenant,
            list_tenants,
            get_tenant,
            update_tenant,
            set_quotas,
            create_key,
            list_keys,
            tenant_admission,
            revoke_key,
            list_changes,
        ],
    )
]

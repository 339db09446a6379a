"""Tenants and API keys: the `TenantStore` protocol, its SQLite and PostgreSQL backends (both named by
`TENANT_STORE` for `registry.db.stores.open_store`), and key material."""

from policy.tenants.base import ConflictError, NotFoundError, TenantStore, TenantStoreError, UnavailableError
from policy.tenants.keys import hash_secret, new_key, parse_key, verify
from policy.tenants.migrations import MIGRATIONS, Migration
from policy.tenants.models import (
    ROLES,
    AdminChange,
    ApiKey,
    FailMode,
    Limits,
    PriorityClass,
    Quotas,
    Role,
    StoredKey,
    Tenant,
)
from policy.tenants.postgres import PostgresTenantStore
from policy.tenants.sqlite import SqliteTenantStore
from registry.db.stores import StoreKind

TENANT_STORE: StoreKind[TenantStore] = StoreKind(
    "tenants", sqlite=SqliteTenantStore.open, postgres=PostgresTenantStore.open
)

__all__ = [
    "MIGRATIONS",
    "ROLES",
    "TENANT_STORE",
    "AdminChange",
    "ApiKey",
    "ConflictError",
    "FailMode",
    "Limits",
    "Migration",
    "NotFoundError",
    "PostgresTenantStore",
    "PriorityClass",
    "Quotas",
    "Role",
    "SqliteTenantStore",
    "StoredKey",
    "Tenant",
    "TenantStore",
    "TenantStoreError",
    "UnavailableError",
    "hash_secret",
    "new_key",
    "parse_key",
    "verify",
]

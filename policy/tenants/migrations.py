"""The tenant store's schema: ordered migrations, and how Structs map to rows, for SQLite and PostgreSQL.

Tables::

    schema_migrations(version)                 one row per applied migration
    tenants(tenant_id PK, display_name, weight, quotas JSON, policy, retain_prompts 0/1, created_at,
            max_priority 'interactive'/'batch', content_retention_days NULL = the default,
            system_prompt NULL = none)
    api_keys(key_id PK, tenant_id FK, roles JSON, label, created_at, expires_at, revoked_at, secret_hash,
             system_prompt NULL = the tenant's, trusted_instructions 0/1)
    admin_changes(id PK, at, actor, action, target, before JSON, after JSON)    append-only

The SQL is shared wherever one statement serves both dialects; `Migration.statements` adds the few
per-dialect pieces (the auto-increment id, the append-only triggers). The runners of `registry.db` apply,
in one transaction each, the migrations whose version `schema_migrations` lacks, so applying is
idempotent. Never edit a released migration: append a new one.
"""

from __future__ import annotations

import msgspec

from policy.tenants.models import AdminChange, ApiKey, PriorityClass, Quotas, Role, StoredKey, Tenant
from registry.db import Row
from registry.db import migrations as db

# Re-exported under their old names here (`Migration` is public in `policy.tenants`): the types are shared.
from registry.db.migrations import Dialect as Dialect
from registry.db.migrations import Migration as Migration

MIGRATIONS_TABLE = "schema_migrations"
# The runners of `registry.db` take MIGRATIONS and MIGRATIONS_TABLE; this statement and `pending` stay
# public here for anyone inspecting the schema from this module.
CREATE_MIGRATIONS_TABLE = db.create_table_sql(MIGRATIONS_TABLE)

MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        version=1,
        summary="tenants, api_keys, admin_changes",
        shared=(
            """CREATE TABLE tenants (
                tenant_id TEXT PRIMARY KEY,
                display_name TEXT NOT NULL,
                weight DOUBLE PRECISION NOT NULL,
                quotas TEXT NOT NULL,
                policy TEXT NOT NULL,
                retain_prompts INTEGER NOT NULL,
                created_at DOUBLE PRECISION NOT NULL
            )""",
            """CREATE TABLE api_keys (
                key_id TEXT PRIMARY KEY,
                tenant_id TEXT NOT NULL REFERENCES tenants (tenant_id),
                roles TEXT NOT NULL,
                label TEXT NOT NULL,
                created_at DOUBLE PRECISION NOT NULL,
                expires_at DOUBLE PRECISION,
                revoked_at DOUBLE PRECISION,
                secret_hash TEXT NOT NULL
            )""",
            "CREATE INDEX api_keys_by_tenant ON api_keys (tenant_id, created_at)",
            """CREATE TABLE admin_changes (
                id {id_pk},
                at DOUBLE PRECISION NOT NULL,
                actor TEXT NOT NULL,
                action TEXT NOT NULL,
                target TEXT NOT NULL,
                before TEXT,
                after TEXT
            )""",
            "CREATE INDEX admin_changes_by_target ON admin_changes (target, id)",
        ),
    ),
    Migration(
        version=2,
        summary="admin_changes refuses UPDATE and DELETE",
        # The change record is evidence: enforce append-only in the database, not just by convention.
        sqlite=(
            """CREATE TRIGGER admin_changes_no_update BEFORE UPDATE ON admin_changes
               BEGIN SELECT RAISE(ABORT, 'admin_changes is append-only'); END""",
            """CREATE TRIGGER admin_changes_no_delete BEFORE DELETE ON admin_changes
               BEGIN SELECT RAISE(ABORT, 'admin_changes is append-only'); END""",
        ),
        postgres=(
            """CREATE FUNCTION admin_changes_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
               BEGIN RAISE EXCEPTION 'admin_changes is append-only'; END $$""",
            """CREATE TRIGGER admin_changes_append_only BEFORE UPDATE OR DELETE ON admin_changes
               FOR EACH ROW EXECUTE FUNCTION admin_changes_append_only()""",
        ),
    ),
    Migration(
        version=3,
        summary="tenants.max_priority",
        # Tenants created before priority classes keep what they had: everything interactive.
        shared=("ALTER TABLE tenants ADD COLUMN max_priority TEXT NOT NULL DEFAULT 'interactive'",),
    ),
    Migration(
        version=4,
        summary="tenants.content_retention_days",
        # NULL: the tenant keeps content for the configured default, as every tenant did before.
        shared=("ALTER TABLE tenants ADD COLUMN content_retention_days DOUBLE PRECISION",),
    ),
    Migration(
        version=5,
        summary="system prompts of tenants and keys; keys granted trusted instructions",
        # Existing keys keep no grant: what their clients send as system messages is scored like user text.
        shared=(
            "ALTER TABLE tenants ADD COLUMN system_prompt TEXT",
            "ALTER TABLE api_keys ADD COLUMN system_prompt TEXT",
            "ALTER TABLE api_keys ADD COLUMN trusted_instructions INTEGER NOT NULL DEFAULT 0",
        ),
    ),
    Migration(
        version=6,
        summary="tenants.tier",
        # Tenants created before tiers have none: no route rule on tiers holds for them.
        shared=("ALTER TABLE tenants ADD COLUMN tier TEXT NOT NULL DEFAULT ''",),
    ),
)


def pending(applied: set[int]) -> list[Migration]:
    """The migrations not yet applied, in version order."""
    return db.pending(MIGRATIONS, applied)


# Row codecs. Column lists are fixed so rows decode by position on both drivers.
# The stores build their tenant statements from these names, so no statement can miss a column.
TENANT_FIELDS = (
    "tenant_id",
    "display_name",
    "weight",
    "quotas",
    "policy",
    "retain_prompts",
    "created_at",
    "max_priority",
    "content_retention_days",
    "system_prompt",
    "tier",
)
TENANT_COLUMNS = ", ".join(TENANT_FIELDS)
# What an update sets: every column but the id and created_at, which never change (`tenant_update_row`).
TENANT_UPDATE_COLUMNS = tuple(c for c in TENANT_FIELDS if c not in ("tenant_id", "created_at"))
KEY_FIELDS = (
    "key_id",
    "tenant_id",
    "roles",
    "label",
    "created_at",
    "expires_at",
    "revoked_at",
    "secret_hash",
    "system_prompt",
    "trusted_instructions",
)
KEY_COLUMNS = ", ".join(KEY_FIELDS)
CHANGE_COLUMNS = "id, at, actor, action, target, before, after"
RECORD_COLUMNS = "at, actor, action, target, before, after"

_quotas = msgspec.json.Decoder(Quotas)
_roles = msgspec.json.Decoder(tuple[Role, ...])
_encode = msgspec.json.Encoder()


def tenant_row(tenant: Tenant) -> tuple[object, ...]:
    """Column values of a tenant, in TENANT_FIELDS order."""
    quotas = _encode.encode(tenant.quotas).decode()
    return (
        tenant.tenant_id,
        tenant.display_name,
        # float() because Structs do not validate on construction, and asyncpg refuses an int for float8.
        float(tenant.weight),
        quotas,
        tenant.policy,
        int(tenant.retain_prompts),
        float(tenant.created_at),
        tenant.max_priority,
        _opt_float(tenant.content_retention_days),
        tenant.system_prompt,
        tenant.tier,
    )


def tenant_update_row(tenant: Tenant) -> tuple[object, ...]:
    """Column values of a tenant, in TENANT_UPDATE_COLUMNS order."""
    row = dict(zip(TENANT_FIELDS, tenant_row(tenant), strict=True))
    return tuple(row[column] for column in TENANT_UPDATE_COLUMNS)


def tenant_from_row(row: Row) -> Tenant:
    """A tenant from a row selected as TENANT_COLUMNS."""
    return Tenant(
        tenant_id=row[0],
        display_name=row[1],
        weight=float(row[2]),
        quotas=_quotas.decode(row[3]),
        policy=row[4],
        retain_prompts=bool(row[5]),
        created_at=float(row[6]),
        max_priority=msgspec.convert(row[7], PriorityClass),
        content_retention_days=_opt_float(row[8]),
        system_prompt=row[9],
        tier=row[10],
    )


def key_row(key: ApiKey, secret_hash: str) -> tuple[object, ...]:
    """Column values of a key, in KEY_COLUMNS order."""
    return (
        key.key_id,
        key.tenant_id,
        encode_roles(key.roles),
        key.label,
        float(key.created_at),
        _opt_float(key.expires_at),
        _opt_float(key.revoked_at),
        secret_hash,
        key.system_prompt,
        int(key.trusted_instructions),
    )


def stored_key_from_row(row: Row) -> StoredKey:
    """A key and its hash from a row selected as KEY_COLUMNS."""
    key = ApiKey(
        key_id=row[0],
        tenant_id=row[1],
        roles=_roles.decode(row[2]),
        label=row[3],
        created_at=float(row[4]),
        expires_at=_opt_float(row[5]),
        revoked_at=_opt_float(row[6]),
        system_prompt=row[8],
        trusted_instructions=bool(row[9]),
    )
    return StoredKey(key=key, secret_hash=row[7])


def _opt_float(value: float | None) -> float | None:
    return None if value is None else float(value)


def encode_roles(roles: tuple[Role, ...]) -> str:
    """Roles as stored: a JSON array."""
    return _encode.encode(roles).decode()


def change_from_row(row: Row) -> AdminChange:
    """An admin change from a row selected as CHANGE_COLUMNS."""
    return AdminChange(
        change_id=int(row[0]),
        at=float(row[1]),
        actor=row[2],
        action=row[3],
        target=row[4],
        before=row[5],
        after=row[6],
    )


def snapshot(obj: Tenant | ApiKey | None) -> str | None:
    """An object as recorded in an admin change (JSON; ApiKey has no hash, so none is ever recorded)."""
    return None if obj is None else _encode.encode(obj).decode()


def change_row(
    now: float, actor: str, action: str, before: Tenant | ApiKey | None, after: Tenant | ApiKey
) -> tuple[object, ...]:
    """Column values of the record of `before` becoming `after`, in RECORD_COLUMNS order."""
    target = f"tenant:{after.tenant_id}" if isinstance(after, Tenant) else f"key:{after.key_id}"
    return (float(now), actor, action, target, snapshot(before), snapshot(after))

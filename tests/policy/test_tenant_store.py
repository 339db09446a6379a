"""The `TenantStore` contract, run on SQLite (a file) and on a real PostgreSQL; and API key material."""

from __future__ import annotations

import asyncio
import re
import sqlite3
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import asyncpg  # type: ignore[import-untyped]
import msgspec
import pytest

import policy.tenants
from policy.tenants import (
    MIGRATIONS,
    ApiKey,
    ConflictError,
    Limits,
    NotFoundError,
    PostgresTenantStore,
    Quotas,
    SqliteTenantStore,
    Tenant,
    TenantStore,
    TenantStoreError,
    hash_secret,
    new_key,
    parse_key,
    verify,
)
from policy.tenants.migrations import MIGRATIONS_TABLE
from registry.db.postgres import open_pool
from registry.db.sqlite import SqliteWorker
from tests.backends import PG_DSN, SqlBackend, sql_backend

QUOTAS = Quotas(
    tenant=Limits(requests_per_second=0.1, request_burst=3.0, tokens_per_second=1234.5678, token_burst=1e6),
    per_key=Limits(requests_per_second=1 / 3, request_burst=1.5, tokens_per_second=0.007, token_burst=2.2),
    fail_mode="open",
)
ACME = Tenant(
    tenant_id="acme",
    display_name="Acme",
    weight=2.5,
    quotas=QUOTAS,
    policy="strict",
    retain_prompts=True,
    content_retention_days=1 / 3,
    max_priority="batch",
    system_prompt="acme-prompt@2",
)


Backend = SqlBackend[TenantStore]


@pytest.fixture(params=["sqlite", "postgres"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    """A SQLite file in tmp_path, or a fresh PostgreSQL schema dropped afterwards. No PostgreSQL = failure."""

    async def postgres(schema: str) -> TenantStore:
        return await PostgresTenantStore.open(PG_DSN, schema=schema)

    async with sql_backend(request.param, tmp_path, SqliteTenantStore.open, postgres) as opened:
        yield opened


@pytest.fixture
async def tenant_store(backend: Backend) -> TenantStore:
    """A migrated, empty store on each backend."""
    return await backend.open()


def _key(key_id: str, tenant_id: str = "acme", roles: Sequence[str] = ("consumer",)) -> ApiKey:
    return msgspec.convert({"key_id": key_id, "tenant_id": tenant_id, "roles": list(roles)}, ApiKey)


async def test_create_get_list_update_tenant(tenant_store: TenantStore) -> None:
    created = await tenant_store.create_tenant(ACME, actor="bootstrap", now=1000.25)
    assert created == msgspec.structs.replace(ACME, created_at=1000.25)
    assert await tenant_store.get_tenant("acme") == created
    # Floats inside the JSON quotas and in their own columns come back bit for bit.
    assert (await tenant_store.get_tenant("acme")).quotas == QUOTAS
    assert (await tenant_store.get_tenant("acme")).max_priority == "batch"
    assert (await tenant_store.get_tenant("acme")).content_retention_days == 1 / 3

    # Every field but the id and created_at is replaced (max_priority and content_retention_days back to
    # their defaults among them).
    changed = Tenant(tenant_id="acme", display_name="Acme Ltd", weight=0.1, policy="lenient", created_at=5.0)
    updated = await tenant_store.update_tenant(changed, actor="k1", now=2000.0)
    assert updated == msgspec.structs.replace(changed, created_at=1000.25)
    assert await tenant_store.get_tenant("acme") == updated
    assert updated.max_priority == "interactive"
    assert updated.content_retention_days is None
    # And set again: a period is stored as given, bit for bit.
    longer = await tenant_store.update_tenant(
        msgspec.structs.replace(updated, content_retention_days=365.25), actor="k1", now=2001.0
    )
    assert longer.content_retention_days == 365.25
    assert await tenant_store.get_tenant("acme") == longer

    # Ids sort by code point on every backend, whatever the database collation.
    for tenant_id in ("b", "a-b", "aa", "A"):
        await tenant_store.create_tenant(
            Tenant(tenant_id=tenant_id, display_name=tenant_id), actor="a", now=1
        )
    assert [t.tenant_id for t in await tenant_store.list_tenants()] == ["A", "a-b", "aa", "acme", "b"]


async def test_duplicate_and_unknown_tenant(tenant_store: TenantStore) -> None:
    await tenant_store.create_tenant(ACME, actor="bootstrap", now=1.0)
    with pytest.raises(ConflictError):
        await tenant_store.create_tenant(Tenant(tenant_id="acme", display_name="other"), actor="x", now=2.0)
    assert (await tenant_store.get_tenant("acme")).display_name == "Acme"
    with pytest.raises(NotFoundError):
        await tenant_store.get_tenant("nobody")
    with pytest.raises(NotFoundError):
        await tenant_store.update_tenant(Tenant(tenant_id="nobody", display_name="n"), actor="x", now=3.0)
    with pytest.raises(NotFoundError):
        await tenant_store.add_key(_key("k-orphan", tenant_id="nobody"), "h", actor="x", now=4.0)
    assert issubclass(NotFoundError, TenantStoreError)
    # Failed calls roll back whole: their change records are gone with them.
    assert [c.action for c in await tenant_store.changes()] == ["tenant.create"]


async def test_keys(tenant_store: TenantStore) -> None:
    await tenant_store.create_tenant(ACME, actor="bootstrap", now=1.0)
    await tenant_store.create_tenant(
        Tenant(tenant_id="beta", display_name="Beta"), actor="bootstrap", now=1.0
    )
    _, key_id, secret_hash = new_key()
    added = await tenant_store.add_key(
        _key(key_id, roles=("consumer", "reviewer")), secret_hash, actor="a", now=10.0
    )
    assert added.created_at == 10.0
    stored = await tenant_store.get_key(key_id)
    assert (stored.key, stored.secret_hash) == (added, secret_hash)
    with pytest.raises(ConflictError):
        await tenant_store.add_key(_key(key_id), "other-hash", actor="a", now=11.0)
    with pytest.raises(NotFoundError):
        await tenant_store.get_key("missing")

    await tenant_store.add_key(_key("kb", tenant_id="beta"), "hash-b", actor="a", now=12.0)
    await tenant_store.add_key(_key("ka", tenant_id="acme"), "hash-a", actor="a", now=13.0)
    assert [k.key_id for k in await tenant_store.list_keys("acme")] == [key_id, "ka"]
    assert [k.key_id for k in await tenant_store.list_keys()] == [key_id, "kb", "ka"]
    assert await tenant_store.list_keys("nobody") == []
    listed = await tenant_store.list_keys()
    assert all(type(k) is ApiKey and not hasattr(k, "secret_hash") for k in listed)
    assert secret_hash.encode() not in msgspec.json.encode(listed)


async def test_a_key_keeps_its_system_prompt_and_trust_grant(tenant_store: TenantStore) -> None:
    await tenant_store.create_tenant(ACME, actor="bootstrap", now=1.0)
    granted = msgspec.structs.replace(_key("kt"), system_prompt="agent@1", trusted_instructions=True)
    added = await tenant_store.add_key(granted, "hash-t", actor="a", now=2.0)
    assert (added.system_prompt, added.trusted_instructions) == ("agent@1", True)
    assert (await tenant_store.get_key("kt")).key == added
    plain = await tenant_store.add_key(_key("kp"), "hash-p", actor="a", now=3.0)
    assert (plain.system_prompt, plain.trusted_instructions) == (None, False)
    assert [k for k in await tenant_store.list_keys("acme")] == [added, plain]
    assert (await tenant_store.get_tenant("acme")).system_prompt == "acme-prompt@2"


async def test_revoke_is_idempotent(tenant_store: TenantStore) -> None:
    await tenant_store.create_tenant(ACME, actor="bootstrap", now=1.0)
    await tenant_store.add_key(_key("k1"), "h1", actor="a", now=2.0)
    first = await tenant_store.revoke_key("k1", actor="a", now=10.0)
    again = await tenant_store.revoke_key("k1", actor="b", now=20.0)
    assert first.revoked_at == again.revoked_at == 10.0
    assert not (await tenant_store.get_key("k1")).key.active(now=5.0)
    # Racing revokes agree on one time and leave one record.
    await tenant_store.add_key(_key("k2"), "h2", actor="a", now=3.0)
    results = await asyncio.gather(
        *(tenant_store.revoke_key("k2", actor="a", now=float(t)) for t in range(30, 40))
    )
    assert len({k.revoked_at for k in results}) == 1
    assert [c.action for c in await tenant_store.changes(target="key:k2")] == ["key.revoke", "key.add"]
    with pytest.raises(NotFoundError):
        await tenant_store.revoke_key("missing", actor="a", now=1.0)


async def test_every_change_is_recorded(tenant_store: TenantStore) -> None:
    created = await tenant_store.create_tenant(ACME, actor="bootstrap", now=1.0)
    updated = await tenant_store.update_tenant(
        msgspec.structs.replace(ACME, weight=4.0), actor="k-admin", now=2.0
    )
    key = await tenant_store.add_key(_key("k1"), "secret-hash-k1", actor="k-admin", now=3.0)
    revoked = await tenant_store.revoke_key("k1", actor="k-ops", now=4.0)

    changes = await tenant_store.changes()
    expected = [
        ("k-ops", "key.revoke", "key:k1", key, revoked),
        ("k-admin", "key.add", "key:k1", None, key),
        ("k-admin", "tenant.update", "tenant:acme", created, updated),
        ("bootstrap", "tenant.create", "tenant:acme", None, created),
    ]
    assert len(changes) == len(expected)
    for change, (actor, action, target, before, after) in zip(changes, expected, strict=True):
        assert (change.actor, change.action, change.target) == (actor, action, target)
        assert change.before == (None if before is None else msgspec.json.encode(before).decode())
        assert change.after == msgspec.json.encode(after).decode()
        assert "secret-hash-k1" not in (change.after or "")
    assert [c.at for c in changes] == [4.0, 3.0, 2.0, 1.0]
    assert [c.change_id for c in changes] == sorted((c.change_id for c in changes), reverse=True)
    assert [c.action for c in await tenant_store.changes(target="tenant:acme")] == [
        "tenant.update",
        "tenant.create",
    ]
    assert [c.action for c in await tenant_store.changes(2)] == ["key.revoke", "key.add"]
    assert await tenant_store.changes(target="tenant:nobody") == []


async def test_max_priority_update_is_stored_and_recorded(tenant_store: TenantStore) -> None:
    plain = await tenant_store.create_tenant(
        Tenant(tenant_id="plain", display_name="Plain"), actor="bootstrap", now=1.0
    )
    assert plain.max_priority == "interactive"
    assert (await tenant_store.get_tenant("plain")).max_priority == "interactive"

    batch = await tenant_store.update_tenant(
        msgspec.structs.replace(plain, max_priority="batch"), actor="k-admin", now=2.0
    )
    assert batch == msgspec.structs.replace(plain, max_priority="batch")
    assert await tenant_store.get_tenant("plain") == batch
    assert [t.max_priority for t in await tenant_store.list_tenants()] == ["batch"]

    [change, _] = await tenant_store.changes(target="tenant:plain")
    assert (change.actor, change.action) == ("k-admin", "tenant.update")
    assert msgspec.json.decode(change.before or "")["max_priority"] == "interactive"
    assert msgspec.json.decode(change.after or "")["max_priority"] == "batch"
    assert msgspec.json.decode(change.after or "", type=Tenant) == batch

    back = await tenant_store.update_tenant(plain, actor="k-admin", now=3.0)
    assert back == plain
    assert (await tenant_store.get_tenant("plain")).max_priority == "interactive"
    assert [c.action for c in await tenant_store.changes(target="tenant:plain")] == [
        "tenant.update",
        "tenant.update",
        "tenant.create",
    ]


async def test_admin_changes_are_append_only(backend: Backend) -> None:
    store = await backend.open()
    await store.create_tenant(ACME, actor="bootstrap", now=1.0)
    for sql in ("UPDATE {schema}.admin_changes SET actor = 'x'", "DELETE FROM {schema}.admin_changes"):
        with pytest.raises((sqlite3.DatabaseError, asyncpg.PostgresError), match="append-only"):
            await backend.raw(sql)
    assert [c.actor for c in await store.changes()] == ["bootstrap"]


async def test_migrations_are_idempotent(backend: Backend) -> None:
    first = await backend.open()
    await first.create_tenant(ACME, actor="bootstrap", now=1.0)
    second = await backend.open()
    assert await second.get_tenant("acme") == await first.get_tenant("acme")
    rows = await backend.raw("SELECT version FROM {schema}.schema_migrations ORDER BY version")
    assert [row[0] for row in rows] == [m.version for m in MIGRATIONS] == [1, 2, 3, 4, 5, 6]


async def _open_at_migration_2(backend: Backend) -> None:
    """Create the backend's database as a release with migrations 1 and 2 left it, then close it."""
    released = MIGRATIONS[:2]
    assert [m.version for m in released] == [1, 2]
    if backend.name == "sqlite":
        worker = await SqliteWorker.open(
            backend.location, migrations=released, table=MIGRATIONS_TABLE, foreign_keys=True
        )
        await worker.close()
    else:
        pool = await open_pool(
            PG_DSN,
            schema=backend.location,
            migrations=released,
            table=MIGRATIONS_TABLE,
            lock_key=0x4C6B6774_74657374,
            min_size=1,
            max_size=1,
        )
        await pool.close()


async def test_a_database_at_migration_2_migrates_to_interactive(backend: Backend) -> None:
    await _open_at_migration_2(backend)
    # A tenant as the release with two migrations wrote it: no max_priority column yet.
    await backend.raw(
        "INSERT INTO {schema}.tenants (tenant_id, display_name, weight, quotas, policy, retain_prompts,"
        """ created_at) VALUES ('old', 'Old', 2.0, '{"fail_mode":"open"}', 'strict', 1, 7.5)"""
    )
    assert await backend.raw("SELECT version FROM {schema}.schema_migrations ORDER BY version") == [
        (1,),
        (2,),
    ]

    store = await backend.open()
    expected = Tenant(
        tenant_id="old",
        display_name="Old",
        weight=2.0,
        quotas=Quotas(fail_mode="open"),
        policy="strict",
        retain_prompts=True,
        created_at=7.5,
        max_priority="interactive",
        content_retention_days=None,
        system_prompt=None,
        tier="",
    )
    assert await store.get_tenant("old") == expected
    rows = await backend.raw("SELECT version FROM {schema}.schema_migrations ORDER BY version")
    assert [row[0] for row in rows] == [1, 2, 3, 4, 5, 6]
    # The migrated table takes the new columns like a fresh one.
    batch = await store.update_tenant(
        msgspec.structs.replace(expected, max_priority="batch", content_retention_days=90.0, tier="pro"),
        actor="a",
        now=8.0,
    )
    assert await store.get_tenant("old") == batch
    created = await store.create_tenant(ACME, actor="a", now=9.0)
    assert await store.get_tenant("acme") == created


async def test_sqlite_never_blocks_the_event_loop(tmp_path: Path) -> None:
    store = await SqliteTenantStore.open(tmp_path / "busy.db")
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    try:
        await store.create_tenant(ACME, actor="bootstrap", now=0.0)
        for i in range(200):
            await store.update_tenant(msgspec.structs.replace(ACME, weight=float(i + 1)), actor="a", now=i)
    finally:
        task.cancel()
        await store.close()
    # Each write suspends the caller until the worker thread is done, and the loop runs the ticker meanwhile.
    assert ticks >= 200
    with pytest.raises(TenantStoreError):
        await store.get_tenant("acme")
    await store.close()


async def test_sqlite_in_memory() -> None:
    store = await SqliteTenantStore.open(":memory:")
    try:
        await store.create_tenant(ACME, actor="bootstrap", now=1.0)
        assert (await store.get_tenant("acme")).quotas == QUOTAS
    finally:
        await store.close()


async def test_postgres_refuses_unsafe_schema_names() -> None:
    with pytest.raises(ValueError, match="schema"):
        await PostgresTenantStore.open(PG_DSN, schema='x"; DROP TABLE tenants; --')


def test_key_format_and_verify() -> None:
    plaintext, key_id, secret_hash = new_key()
    assert re.fullmatch(r"lg-[0-9a-f]{12}-[A-Za-z0-9_-]{43}", plaintext)
    parsed = parse_key(plaintext)
    assert parsed is not None
    assert parsed[0] == key_id
    secret = parsed[1]
    assert plaintext == f"lg-{key_id}-{secret}"
    assert hash_secret(secret) == secret_hash
    assert verify(secret, secret_hash)
    assert not verify(secret + "x", secret_hash)
    assert not verify(secret, "é" * 64)
    # What is stored (id and hash) does not contain the secret.
    assert re.fullmatch(r"[0-9a-f]{64}", secret_hash)
    assert secret_hash != secret
    assert secret not in secret_hash
    other = new_key()
    assert {other[0], other[1], other[2]}.isdisjoint({plaintext, key_id, secret_hash})


@pytest.mark.parametrize(
    "plaintext",
    [
        "",
        "lg",
        "lg-",
        "sk-0123456789ab-" + "a" * 43,
        "lg-0123456789AB-" + "a" * 43,
        "lg-0123456789a-" + "a" * 43,
        "lg-0123456789ab-" + "a" * 42,
        "lg-0123456789ab-" + "a" * 44,
        "lg-0123456789ab-" + "a" * 42 + "=",
        "lg-0123456789ab_" + "a" * 43,
        " lg-0123456789ab-" + "a" * 43,
        "lg-0123456789ab-" + "a" * 43 + "\n",
    ],
)
def test_parse_malformed_key(plaintext: str) -> None:
    assert parse_key(plaintext) is None


def test_public_names() -> None:
    assert set(policy.tenants.__all__) == {
        *("TenantStore", "TenantStoreError", "NotFoundError", "ConflictError", "UnavailableError"),
        *("Tenant", "Quotas", "Limits", "ApiKey", "StoredKey", "AdminChange", "Role", "ROLES", "FailMode"),
        *("PriorityClass", "TENANT_STORE"),
        *("SqliteTenantStore", "PostgresTenantStore", "Migration", "MIGRATIONS"),
        *("new_key", "hash_secret", "parse_key", "verify"),
    }

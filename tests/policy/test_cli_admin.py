"""`lockgate admin create-key`: bootstrap keys (and their tenant) into the configured SQLite store."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
import pytest

from gateway import cli
from policy.auth import SYSTEM_TENANT
from policy.tenants.keys import parse_key, verify
from policy.tenants.models import Tenant
from policy.tenants.sqlite import SqliteTenantStore


@pytest.fixture
def db(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The SQLite file the CLI is configured to use (its folder does not exist yet)."""
    path = tmp_path / "state" / "lockgate.sqlite3"
    monkeypatch.setenv("LOCKGATE_STORAGE__SQLITE_PATH", str(path))
    monkeypatch.setenv("LOCKGATE_STORAGE__BACKEND", "sqlite")
    return path


@asynccontextmanager
async def opened(path: Path) -> AsyncIterator[SqliteTenantStore]:
    store = await SqliteTenantStore.open(path)
    try:
        yield store
    finally:
        await store.close()


async def create_key(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[str, str, str]:
    """Run the command (it runs its own event loop, so on a thread); (key_id, secret, plaintext)."""
    capsys.readouterr()
    code = await asyncio.to_thread(cli.main, ["admin", "create-key", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 1, out
    parsed = parse_key(lines[0])
    assert parsed is not None, lines[0]
    assert lines[0] not in err  # the key is printed once, on stdout only
    return parsed[0], parsed[1], lines[0]


async def test_create_key_creates_the_tenant_and_a_key_with_those_roles(
    db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key_id, secret, _ = await create_key(
        capsys, "--tenant", "t1", "--role", "consumer", "--role", "reviewer", "--label", "boot"
    )
    async with opened(db) as store:
        tenant = await store.get_tenant("t1")
        assert (tenant.tenant_id, tenant.display_name) == ("t1", "t1")
        [created] = await store.changes(target="tenant:t1")
        assert (created.actor, created.action, created.before) == ("bootstrap", "tenant.create", None)
        assert created.after is not None
        assert msgspec.json.decode(created.after, type=Tenant) == tenant

        [key] = await store.list_keys("t1")
        assert (key.key_id, key.tenant_id, key.roles, key.label) == (
            key_id,
            "t1",
            ("consumer", "reviewer"),
            "boot",
        )
        assert key.active(key.created_at)
        stored = await store.get_key(key_id)
        assert verify(secret, stored.secret_hash)
        assert not verify(secret + "x", stored.secret_hash)
        [added] = await store.changes(target=f"key:{key_id}")
        assert (added.actor, added.action) == ("bootstrap", "key.add")
        assert secret not in (added.after or "")


async def test_a_second_key_for_the_same_tenant_keeps_the_tenant(
    db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first_id, first_secret, _ = await create_key(capsys, "--tenant", "t1", "--role", "consumer")
    second_id, second_secret, _ = await create_key(capsys, "--tenant", "t1", "--role", "reviewer")
    assert first_id != second_id
    async with opened(db) as store:
        assert [t.tenant_id for t in await store.list_tenants()] == ["t1"]
        assert [c.action for c in await store.changes(target="tenant:t1")] == ["tenant.create"]
        listed = {k.key_id: k.roles for k in await store.list_keys("t1")}
        assert listed == {first_id: ("consumer",), second_id: ("reviewer",)}
        assert verify(first_secret, (await store.get_key(first_id)).secret_hash)
        assert verify(second_secret, (await store.get_key(second_id)).secret_hash)
        assert [(c.actor, c.action) for c in await store.changes()] == [
            ("bootstrap", "key.add"),
            ("bootstrap", "key.add"),
            ("bootstrap", "tenant.create"),
        ]


async def test_default_is_a_policy_admin_key_of_the_operator(
    db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key_id, secret, _ = await create_key(capsys)
    async with opened(db) as store:
        assert [t.tenant_id for t in await store.list_tenants()] == [SYSTEM_TENANT]
        stored = await store.get_key(key_id)
        assert (stored.key.tenant_id, stored.key.roles) == (SYSTEM_TENANT, ("policy_admin",))
        assert verify(secret, stored.secret_hash)
        assert [(c.actor, c.action, c.target) for c in await store.changes()] == [
            ("bootstrap", "key.add", f"key:{key_id}"),
            ("bootstrap", "tenant.create", f"tenant:{SYSTEM_TENANT}"),
        ]


async def test_repeated_roles_are_kept_once(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key_id, _, _ = await create_key(capsys, "--tenant", "t2", "--role", "consumer", "--role", "consumer")
    async with opened(db) as store:
        assert (await store.get_key(key_id)).key.roles == ("consumer",)


async def test_a_scrape_only_metrics_key_of_the_operator_as_the_readme_makes_it(
    db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key_id, _, _ = await create_key(capsys, "--tenant", SYSTEM_TENANT, "--role", "metrics")
    async with opened(db) as store:
        stored = (await store.get_key(key_id)).key
        assert (stored.tenant_id, stored.roles) == (SYSTEM_TENANT, ("metrics",))


async def test_unknown_role_is_refused_and_stores_nothing(
    db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        await asyncio.to_thread(cli.main, ["admin", "create-key", "--role", "root"])
    assert exited.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
    assert not await asyncio.to_thread(db.exists)


async def test_a_tenant_create_key_makes_is_metered_by_the_configured_default(
    db: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Once, a tenant made by create-key had no bucket at all: unmetered until someone set quotas.
    capsys.readouterr()
    code = await asyncio.to_thread(cli.main, ["admin", "create-key", "--tenant", "t2", "--role", "consumer"])
    assert code == 0
    err = capsys.readouterr().err
    assert "created tenant t2 with quotas 5 requests/s (burst 20), 2000 tokens/s (burst 32768)" in err
    async with opened(db) as store:
        quotas = (await store.get_tenant("t2")).quotas
    assert quotas.tenant is not None
    assert (quotas.tenant.requests_per_second, quotas.tenant.token_burst) == (5.0, 32_768.0)
    # Unmetered only when asked for, and said so.
    monkeypatch.setenv("LOCKGATE_QUOTA__DEFAULT_TENANT_LIMITS", "null")
    code = await asyncio.to_thread(cli.main, ["admin", "create-key", "--tenant", "t3", "--role", "consumer"])
    assert code == 0
    assert "no quotas (unmetered" in capsys.readouterr().err
    async with opened(db) as store:
        assert (await store.get_tenant("t3")).quotas.tenant is None

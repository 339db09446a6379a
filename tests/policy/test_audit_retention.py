"""Content retention of the audit trail, on SQLite and a real PostgreSQL: expired content is purged, the
decisions and their hashes stay, and every chain still verifies."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest

from policy.audit import (
    AuditDraft,
    AuditQuery,
    AuditRecord,
    AuditStore,
    AuditUnavailableError,
    PostgresAuditStore,
    SqliteAuditStore,
    content_sha256,
)
from policy.audit.retention import DAY_S, RetainedAuditStore, purge_expired, run_retention
from policy.tenants import SqliteTenantStore, Tenant
from policy.tenants.base import UnavailableError as TenantStoreUnavailableError
from tests.backends import PG_DSN, FakeClock, SqlBackend, sql_backend
from tests.conftest import eventually

NOW = 1_800_000_000.0


def draft(tenant: str, n: int, age_days: float) -> AuditDraft:
    """A decision of `tenant` with its content, `age_days` before NOW."""
    content = f"prompt {n} of {tenant}"
    return AuditDraft(
        tenant=tenant,
        key_id=f"k-{tenant}",
        request_id=f"req-{tenant}-{n}",
        at=NOW - age_days * DAY_S,
        stage="input",
        decision="block" if n % 2 else "allow",
        source="model",
        policy="strict@2",
        content_hash=content_sha256(content),
        content=content,
    )


@pytest.fixture(params=["sqlite", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[AuditStore]:
    """An empty audit store on each database."""

    async def postgres(schema: str) -> AuditStore:
        return await PostgresAuditStore.open(PG_DSN, schema=schema)

    async with sql_backend(request.param, tmp_path, SqliteAuditStore.open, postgres) as backend:
        opened: SqlBackend[AuditStore] = backend
        yield await opened.open()


@pytest.fixture
async def tenants(tmp_path: Path) -> AsyncIterator[SqliteTenantStore]:
    """`keeper` retains prompts for the default period, `brief` for its own 7 days, `private` not at all."""
    tenant_store = await SqliteTenantStore.open(tmp_path / "tenants.sqlite3")
    for tenant_id, retain, days in (("keeper", True, None), ("brief", True, 7.0), ("private", False, None)):
        tenant = Tenant(
            tenant_id=tenant_id, display_name=tenant_id, retain_prompts=retain, content_retention_days=days
        )
        await tenant_store.create_tenant(tenant, actor="test", now=0.0)
    yield tenant_store
    await tenant_store.close()


async def records(store: AuditStore, tenant: str) -> list[AuditRecord]:
    """Every record of `tenant`, in seq order."""
    return await store.query(AuditQuery(tenant=tenant, limit=1000))


def without_content(rows: Sequence[AuditRecord]) -> list[dict[str, Any]]:
    """Every field but the content."""
    return [{k: v for k, v in msgspec.structs.asdict(r).items() if k != "content"} for r in rows]


async def test_expired_content_is_purged_and_the_decisions_and_chain_remain(
    store: AuditStore, tenants: SqliteTenantStore
) -> None:
    ages = [45.0, 31.0, 29.0, 1.0, 0.0]
    await store.append([draft(t, n, age) for n, age in enumerate(ages) for t in ("keeper", "private")])
    before = {t: await records(store, t) for t in ("keeper", "private")}

    purged = await purge_expired(store, tenants, NOW, days=30)
    # `keeper` keeps 30 days of content; `private` (no retain_prompts) keeps none.
    assert purged == {"brief": 0, "keeper": 2, "private": 5}
    for tenant in ("keeper", "private"):
        after = await records(store, tenant)
        assert without_content(after) == without_content(before[tenant])  # hashes and decisions stay
        report = await store.verify(tenant)
        assert (report.ok, report.checked, report.last_seq) == (True, 5, 5)
    assert [r.content for r in await records(store, "keeper")] == [
        None,
        None,
        "prompt 2 of keeper",
        "prompt 3 of keeper",
        "prompt 4 of keeper",
    ]
    assert all(r.content is None for r in await records(store, "private"))

    # Nothing more to purge until time moves on; then the next day's worth.
    assert await purge_expired(store, tenants, NOW, days=30) == {"brief": 0, "keeper": 0, "private": 0}
    assert await purge_expired(store, tenants, NOW + 1.5 * DAY_S, days=30) == {
        "brief": 0,
        "keeper": 1,
        "private": 0,
    }
    assert (await store.verify("keeper")).ok


async def test_a_tenant_with_its_own_shorter_period_is_purged_earlier(
    store: AuditStore, tenants: SqliteTenantStore
) -> None:
    ages = [45.0, 10.0, 6.0, 1.0]
    await store.append([draft(t, n, age) for n, age in enumerate(ages) for t in ("keeper", "brief")])

    # `brief` keeps its own 7 days; `keeper` the default 30.
    assert await purge_expired(store, tenants, NOW, days=30) == {"brief": 2, "keeper": 1, "private": 0}
    assert [r.content for r in await records(store, "brief")] == [
        None,
        None,
        "prompt 2 of brief",
        "prompt 3 of brief",
    ]
    assert [r.content is None for r in await records(store, "keeper")] == [True, False, False, False]
    # A day and a half on, `brief`'s 6-day-old record has expired; nothing of `keeper`'s has.
    later = NOW + 1.5 * DAY_S
    assert await purge_expired(store, tenants, later, days=30) == {"brief": 1, "keeper": 0, "private": 0}
    # Its own period holds whatever the default: a longer default changes nothing for it.
    assert await purge_expired(store, tenants, later, days=365) == {"brief": 0, "keeper": 0, "private": 0}
    for tenant in ("brief", "keeper"):
        report = await store.verify(tenant)
        assert (report.ok, report.checked) == (True, 4)


class Flaky(SqliteAuditStore):
    """The SQLite store, down for one tenant."""

    down_for = ""

    async def purge_content(self, tenant: str, before: float) -> int:
        if tenant == self.down_for:
            raise AuditUnavailableError("down (test)")
        return await super().purge_content(tenant, before)


async def test_a_store_outage_skips_a_tenant_and_the_next_pass_catches_up(
    tmp_path: Path, tenants: SqliteTenantStore
) -> None:
    store = await Flaky.open(tmp_path / "audit.sqlite3")
    assert isinstance(store, Flaky)
    await store.append([draft("keeper", 0, 40.0), draft("private", 1, 0.0)])
    store.down_for = "keeper"
    assert await purge_expired(store, tenants, NOW, days=30) == {"brief": 0, "private": 1}
    store.down_for = ""
    assert await purge_expired(store, tenants, NOW, days=30) == {"brief": 0, "keeper": 1, "private": 0}
    await store.close()


async def test_the_retention_loop_purges_at_start_and_on_every_interval(
    tmp_path: Path, tenants: SqliteTenantStore
) -> None:
    store = await SqliteAuditStore.open(tmp_path / "audit.sqlite3")
    clock = FakeClock(NOW)
    await store.append([draft("keeper", 0, 40.0), draft("keeper", 1, 29.5)])
    task = asyncio.create_task(run_retention(store, tenants, clock, days=30, interval=0.01))

    async def content_is(expected: list[str | None]) -> bool:
        return [r.content for r in await records(store, "keeper")] == expected

    # The first pass runs at once; the next after `interval`, on the (advanced) clock.
    await eventually(lambda: content_is([None, "prompt 1 of keeper"]))
    clock.advance(DAY_S)
    await eventually(lambda: content_is([None, None]))
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert (await store.verify("keeper")).ok
    await store.close()


class DownTenants(SqliteTenantStore):
    """The SQLite tenant store, unreachable while `down`."""

    down = False

    async def get_tenant(self, tenant_id: str) -> Tenant:
        if self.down:
            raise TenantStoreUnavailableError("down (test)")
        return await super().get_tenant(tenant_id)


async def test_reads_show_no_content_past_retention_whether_purged_or_not(
    store: AuditStore, tmp_path: Path
) -> None:
    tenants = await DownTenants.open(tmp_path / "down-tenants.sqlite3")
    assert isinstance(tenants, DownTenants)
    for tenant_id, retain, days in (("keeper", True, None), ("brief", True, 7.0), ("private", False, None)):
        tenant = Tenant(
            tenant_id=tenant_id, display_name=tenant_id, retain_prompts=retain, content_retention_days=days
        )
        await tenants.create_tenant(tenant, actor="test", now=0.0)
    clock = FakeClock(NOW)
    view = RetainedAuditStore(store, tenants, clock, days=30)
    # A tenant that no longer exists (`gone`) shows none either.
    ages = {"keeper": [31.0, 29.0], "brief": [8.0, 6.0], "private": [0.0], "gone": [0.0]}
    await store.append([draft(t, n, age) for t, a in ages.items() for n, age in enumerate(a)])

    async def shown(tenant: str) -> list[str | None]:
        by_query = [r.content for r in await view.query(AuditQuery(tenant=tenant))]
        by_get = [(await view.get(tenant, seq)).content for seq in range(1, len(by_query) + 1)]
        by_find = [(await view.find(tenant, f"req-{tenant}-{n}"))[0].content for n in range(len(by_query))]
        assert by_query == by_get == by_find
        return by_query

    assert await shown("keeper") == [None, "prompt 1 of keeper"]
    assert await shown("brief") == [None, "prompt 1 of brief"]
    assert await shown("private") == [None]
    assert await shown("gone") == [None]
    # Every tenant in one page (a global reviewer's): each by its own retention.
    assert [r.content for r in await view.query(AuditQuery())] == [
        None,
        "prompt 1 of brief",
        None,
        None,
        "prompt 1 of keeper",
        None,
    ]
    # The store still holds it all: hidden at read time, not purged.
    assert all(r.content is not None for r in await store.query(AuditQuery(limit=100)))
    # Time moves on: the rest expires without a purge pass.
    clock.advance(2 * DAY_S)
    assert await shown("keeper") == [None, None]
    assert await shown("brief") == [None, None]
    # Retention that cannot be read (the tenant store is down) shows nothing rather than too much.
    clock.now = NOW
    tenants.down = True
    assert await shown("keeper") == [None, None]
    tenants.down = False
    assert await shown("keeper") == [None, "prompt 1 of keeper"]
    # Writes and checks go through unchanged.
    assert (await view.verify("keeper")).ok
    assert await view.purge_content("keeper", NOW) == 2
    assert [r.content for r in await store.query(AuditQuery(tenant="keeper"))] == [None, None]
    await tenants.close()


class Evidence:
    """An `EvidencePurger` that records the times it was asked at, and fails while `down`."""

    def __init__(self) -> None:
        self.asked: list[float] = []
        self.down = False

    async def purge_evidence(self, now: float) -> int:
        self.asked.append(now)
        if self.down:
            raise AuditUnavailableError("down (test)")
        return 1


async def test_the_retention_loop_purges_content_shared_with_appeals_too(
    tmp_path: Path, tenants: SqliteTenantStore
) -> None:
    store = await SqliteAuditStore.open(tmp_path / "audit.sqlite3")
    clock = FakeClock(NOW)
    evidence = Evidence()
    evidence.down = True  # a pass that cannot reach it fails alone: the loop goes on
    task = asyncio.create_task(
        run_retention(store, tenants, clock, days=30, interval=0.01, evidence=evidence)
    )
    await eventually(lambda: _asked(evidence, 1))
    evidence.down = False
    clock.advance(DAY_S)
    await eventually(lambda: _asked(evidence, 2))
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert evidence.asked[0] == NOW
    assert NOW + DAY_S in evidence.asked
    await store.close()


async def _asked(evidence: Evidence, times: int) -> bool:
    return len(evidence.asked) >= times

"""Retention as promised, through the gateway on both deployments (SQLite, PostgreSQL): content is stored
only when the policy (`retention = "full"`) and the tenant (`retain_prompts`) both allow it; the reviewer API,
its export and the console show none past the tenant's retention, before any purge has run; and the purge
runs on `[audit] purge_interval`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from engines.simulated import SimulatedEngine
from gateway.app import create_app
from gateway.config import AuditConfig, Config
from gateway.generation.prompts import PromptRenderer
from gateway.services import Services
from policy.audit import AuditDraft, AuditRecord, AuditStore, PostgresAuditStore, SqliteAuditStore
from policy.audit.retention import DAY_S
from policy.auth import SYSTEM_TENANT
from policy.safety.defaults import rules_policy
from policy.tenants import Tenant
from tests.backends import DEPLOYMENTS, PG_DSN, Backends, FakeClock, deployment
from tests.conftest import MODEL, OutcomeLog, add_key, eventually, make_config, serving
from tests.gateway.test_console import Console

SECRET = "What is the capital of the secret kingdom of Xanadu?"
# tenant -> (retain_prompts, the policy alias it is bound to)
TENANTS = {
    "keep-full": (True, "full"),
    "keep-hash": (True, "hash"),
    "drop-full": (False, "full"),
    "drop-hash": (False, "hash"),
}


class Bed(Console):
    """A gateway on one deployment, its raw audit store (not the read path's view) and its clock; consumer
    keys by tenant, `rev-<tenant>` reviewer keys and `rev-global` (the operator's reviewer)."""

    def __init__(self, url: str, services: Services, raw: AuditStore, clock: FakeClock) -> None:
        super().__init__(url, services)
        self.raw = raw
        self.clock = clock

    async def get(self, path: str, who: str, **params: Any) -> httpx.Response:
        """GET `path` of the reviewer API with the key of `who`."""
        async with self.client() as http:
            headers = {"authorization": f"Bearer {self.keys[who]}"}
            response = await http.get(path, params=params, headers=headers)
        assert response.status_code == 200, response.text
        return response


async def open_audit(backends: Backends, tmp_path: Path) -> AuditStore:
    """The audit store in the deployment's database."""
    if backends.name == "memory+sqlite":
        return await SqliteAuditStore.open(tmp_path / "lockgate.sqlite3")
    return await PostgresAuditStore.open(PG_DSN, schema=backends.schema)


def config_for(tmp_path: Path, purge_interval: float) -> Config:
    config = make_config()
    storage = msgspec.structs.replace(config.storage, sqlite_path=str(tmp_path / "lockgate.sqlite3"))
    audit = msgspec.structs.replace(config.audit, purge_interval=purge_interval)
    return msgspec.structs.replace(config, storage=storage, audit=audit)


@pytest.fixture
def purge_interval() -> float:
    """Seconds between purge passes (a test parametrizes this name to change it)."""
    return 3600.0


@pytest.fixture(params=DEPLOYMENTS)
async def bed(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    sim_engine: SimulatedEngine,
    renderer: PromptRenderer,
    outcomes: OutcomeLog,
    purge_interval: float,
) -> AsyncIterator[Bed]:
    clock = FakeClock()
    async with deployment(request.param, tmp_path) as backends:
        raw = await open_audit(backends, tmp_path)
        tenants = backends.tenants
        for tenant_id, (retain, policy) in TENANTS.items():
            tenant = Tenant(tenant_id=tenant_id, display_name=tenant_id, retain_prompts=retain, policy=policy)
            await tenants.create_tenant(tenant, actor="test", now=0.0)
        # `brief` keeps content for its own day; the operator tenant's reviewer sees every tenant.
        brief = Tenant(tenant_id="brief", display_name="brief", retain_prompts=True, content_retention_days=1)
        await tenants.create_tenant(brief, actor="test", now=0.0)
        await tenants.create_tenant(Tenant(tenant_id=SYSTEM_TENANT, display_name="op"), actor="test", now=0.0)
        app = create_app(
            config_for(tmp_path, purge_interval),
            engine=sim_engine,
            renderer=renderer,
            tenants=tenants,
            quota=backends.quota,
            registry=backends.registry,
            clock=clock,
            sink=outcomes,
            audit=raw,
        )
        async with serving(app) as url:
            services: Services = app.state.services
            for retention in ("full", "hash"):
                spec = msgspec.structs.replace(rules_policy(), retention=retention)
                await services.registry.publish("policy", retention, "1", spec, actor="test")
                await services.registry.set_alias("policy", retention, "1", actor="test")
            test_bed = Bed(url, services, raw, clock)
            for tenant_id in (*TENANTS, "brief"):
                test_bed.keys[tenant_id] = await add_key(tenants, tenant_id, ("consumer",))
                test_bed.keys[f"rev-{tenant_id}"] = await add_key(tenants, tenant_id, ("reviewer",))
            test_bed.keys["rev-global"] = await add_key(tenants, SYSTEM_TENANT, ("reviewer",))
            yield test_bed
        await raw.close()


async def post(bed: Bed, tenant: str, path: str, body: dict[str, Any], stages: int) -> list[AuditRecord]:
    """POST `body` to `path` as `tenant` (allowed); the request's records as stored, once `stages` are."""
    async with bed.client() as http:
        response = await http.post(path, json=body, headers={"authorization": f"Bearer {bed.keys[tenant]}"})
    assert response.status_code == 200, response.text
    request_id = response.headers["x-request-id"]
    found: list[AuditRecord] = []

    async def recorded() -> bool:
        found[:] = await bed.raw.find(tenant, request_id)
        return len({r.stage for r in found}) == stages

    await eventually(recorded)
    return found


async def test_content_is_stored_only_when_the_policy_and_the_tenant_both_keep_it(bed: Bed) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": SECRET}], "max_tokens": 8}
    for tenant, (retain, policy) in TENANTS.items():
        records = await post(bed, tenant, "/v1/chat/completions", chat, stages=2)  # input and output
        [checked] = [r for r in records if r.stage == "input"]
        if retain and policy == "full":
            assert SECRET in (checked.content or "")
            assert all(r.content for r in records)
        else:
            # Not stored at all (not merely purged later): the hash stands for the text.
            assert [r.content for r in records] == [None, None], tenant
            assert checked.content_hash
        # The moderation endpoint records under the same rule.
        moderated = await post(bed, tenant, "/v1/moderations", {"input": SECRET}, stages=1)
        assert [r.content for r in moderated] == [SECRET if retain and policy == "full" else None], tenant


def draft(tenant: str, n: int, at: float) -> AuditDraft:
    content = f"retained text {n} of {tenant}"
    return AuditDraft(
        tenant=tenant,
        key_id="k",
        request_id=f"req-{tenant}-{n}",
        at=at,
        stage="input",
        decision="flag",
        source="band",
        policy="full@1",
        flagged=True,
        content=content,
    )


def contents(lines: list[dict[str, Any]]) -> dict[str, str | None]:
    return {line["request_id"]: line["content"] for line in lines}


async def test_no_read_shows_content_past_retention_before_any_purge(bed: Bed) -> None:
    now = bed.clock()
    # `brief` keeps a day: one record two days old, one an hour old. `drop-full` retains nothing: its one
    # record holds content as if stored before the tenant turned retention off. No purge runs meanwhile.
    stored = await bed.raw.append(
        [
            draft("brief", 0, now - 2 * DAY_S),
            draft("brief", 1, now - 3600.0),
            draft("drop-full", 0, now - 60.0),
        ]
    )
    old, fresh, dropped = stored
    expected = {old.request_id: None, fresh.request_id: fresh.content}
    for who in ("rev-brief", "rev-global"):
        page = (await bed.get("/audit/decisions", who, tenant="brief")).json()["data"]
        assert contents(page) == expected
        export = (await bed.get("/audit/export", who, tenant="brief")).text.splitlines()
        assert contents([msgspec.json.decode(line) for line in export]) == expected
        one = (await bed.get(f"/audit/decisions/brief/{old.seq}", who)).json()
        assert one["content"] is None
        assert one["content_hash"] == old.content_hash  # the decision and its hash are all still there
        assert (await bed.get(f"/audit/requests/{old.request_id}", who)).json()["data"][0]["content"] is None
        assert (await bed.get(f"/audit/requests/{fresh.request_id}", who)).json()["data"][0]["content"] == (
            fresh.content
        )
    # Every tenant's export at once (the global reviewer): nothing of `drop-full`'s either.
    everything = (await bed.get("/audit/export", "rev-global")).text
    assert str(old.content) not in everything
    assert str(dropped.content) not in everything
    assert str(fresh.content) in everything

    async with bed.client() as http:
        await bed.login(http, "rev-global")
        old_page = await http.get(f"/console/decisions/brief/{old.seq}")
        fresh_page = await http.get(f"/console/decisions/brief/{fresh.seq}")
        dropped_page = await http.get(f"/console/decisions/drop-full/{dropped.seq}")
        assert old_page.status_code == fresh_page.status_code == dropped_page.status_code == 200
        for hidden, page in ((old, old_page), (dropped, dropped_page)):
            assert str(hidden.content) not in page.text
            assert "Not retained" in page.text
        assert str(fresh.content) in fresh_page.text

        # A day on, the fresh one has expired too, on the clock alone.
        bed.clock.advance(DAY_S)
        assert str(fresh.content) not in (await http.get(f"/console/decisions/brief/{fresh.seq}")).text
    assert str(fresh.content) not in (await bed.get("/audit/export", "rev-brief")).text
    # It was hidden, not purged: the purge pass has not run since (its interval is an hour away).
    assert [r.content for r in await bed.raw.find("brief", fresh.request_id)] == [fresh.content]


@pytest.mark.parametrize("purge_interval", [0.05])
async def test_the_purge_runs_on_the_configured_interval(bed: Bed) -> None:
    assert bed.services.config.audit.purge_interval == 0.05
    now = bed.clock()
    [record] = await bed.raw.append([draft("brief", 0, now - 3600.0)])
    bed.clock.advance(DAY_S)  # now past `brief`'s day: the next pass (within 0.05 s) deletes it

    async def purged() -> bool:
        return [r.content for r in await bed.raw.find("brief", record.request_id)] == [None]

    await eventually(purged)
    assert (await bed.raw.verify("brief")).ok


def test_the_purge_interval_is_configured_and_positive() -> None:
    assert AuditConfig().purge_interval == 3600.0
    with pytest.raises(msgspec.ValidationError, match="purge_interval"):
        msgspec.convert({"purge_interval": 0}, AuditConfig)

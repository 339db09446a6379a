"""The reviewer API (`/audit/...`) through the gateway: tenant scoping, filters, pagination, export, chain
verification, roles and parameter errors, over records appended to the app's own audit store."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator
from contextlib import closing
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from engines.simulated import SimulatedEngine
from gateway.app import create_app
from gateway.generation.prompts import PromptRenderer
from gateway.services import Services
from policy.audit import AuditDraft, AuditedStage, AuditRecord, SqliteAuditStore, content_sha256, record_hash
from policy.audit.checkpoints import Checkpointer
from policy.audit.keys import MacKey
from policy.auth import SYSTEM_TENANT
from policy.tenants import SqliteTenantStore, Tenant
from tests.backends import FakeClock
from tests.conftest import OutcomeLog, add_key, make_config, serving

# The MAC key of the test's audit store.
KEY = MacKey(b"r" * 32)

T0 = time.time() - 3600.0  # recent: within the content retention period
DECISIONS = ("allow", "block", "flag")
RUNS = (
    AuditedStage(stage="rules", kind="rules", latency_s=0.001),
    AuditedStage(stage="guard@1", kind="model", model="g@1", score=0.42, allow_below=0.2, block_above=0.7),
)


def draft(tenant: str, n: int) -> AuditDraft:
    """The n-th decision of `tenant`; fields vary with n so that each filter selects a known subset."""
    content = f"prompt {n} of {tenant}"
    return AuditDraft(
        tenant=tenant,
        key_id=f"k-{tenant}",
        request_id="shared" if n == 0 else f"req-{tenant}-{n}",
        at=T0 + n,
        stage="output" if n % 2 else "input",
        decision=DECISIONS[n % 3],  # type: ignore[arg-type]
        source="fail_open" if n % 4 == 3 else "model",
        policy=f"strict@{1 + n % 2}" if n < 6 else "other@1",
        stages=RUNS,
        category="violence" if n % 3 == 1 else None,
        flagged=n % 5 == 2,
        content_hash=content_sha256(content),
        content=content,
    )


def as_json(records: list[AuditRecord]) -> list[dict[str, Any]]:
    """Records as the API sends them."""
    return [msgspec.json.decode(msgspec.json.encode(r)) for r in records]


class Review:
    """A gateway with tenants alpha (9 records) and beta (5), and keys: a reviewer of each, a global reviewer
    (of the operator tenant) and a consumer of alpha."""

    def __init__(self, http: httpx.AsyncClient, services: Services, audit_path: Path) -> None:
        self.http = http
        self.services = services
        self.audit_path = audit_path
        self.keys: dict[str, str] = {}
        self.records: dict[str, list[AuditRecord]] = {}

    async def get(self, path: str, who: str, **params: Any) -> httpx.Response:
        """GET `path` with the key of `who`."""
        return await self.http.get(path, params=params, headers={"authorization": f"Bearer {self.keys[who]}"})

    async def walk(self, who: str, cursor: str | None = None, **params: Any) -> list[dict[str, Any]]:
        """Every record of /audit/decisions (after `cursor`), page by page through next_cursor."""
        seen: list[dict[str, Any]] = []
        while True:
            extra = {} if cursor is None else {"cursor": cursor}
            response = await self.get("/audit/decisions", who, **params, **extra)
            assert response.status_code == 200, response.text
            body = response.json()
            seen.extend(body["data"])
            cursor = body["next_cursor"]
            if cursor is None:
                return seen


@pytest.fixture
async def review(
    tmp_path: Path, sim_engine: SimulatedEngine, renderer: PromptRenderer, outcomes: OutcomeLog
) -> AsyncIterator[Review]:
    """The gateway, its records and keys."""
    tenants = await SqliteTenantStore.open(tmp_path / "tenants.sqlite3")
    for tenant_id in ("alpha", "beta", SYSTEM_TENANT):
        tenant = Tenant(tenant_id=tenant_id, display_name=tenant_id, retain_prompts=True)
        await tenants.create_tenant(tenant, actor="test", now=0.0)
    audit_path = tmp_path / "audit.sqlite3"
    audit = await SqliteAuditStore.open(audit_path, KEY)
    app = create_app(
        make_config(), engine=sim_engine, renderer=renderer, tenants=tenants, sink=outcomes, audit=audit
    )
    async with serving(app) as url, httpx.AsyncClient(base_url=url) as http:
        services: Services = app.state.services
        state = Review(http, services, audit_path)
        state.keys = {
            "alpha": await add_key(tenants, "alpha", ("reviewer",)),
            "beta": await add_key(tenants, "beta", ("reviewer",)),
            "global": await add_key(tenants, SYSTEM_TENANT, ("reviewer",)),
            "consumer": await add_key(tenants, "alpha", ("consumer",)),
        }
        drafts = [draft("beta", n) for n in range(5)] + [draft("alpha", n) for n in range(9)]
        appended = await services.audit.append(drafts)
        state.records = {t: [r for r in appended if r.tenant == t] for t in ("alpha", "beta")}
        yield state
    await audit.close()
    await tenants.close()


async def test_a_tenant_reviewer_sees_only_its_own_tenant(review: Review) -> None:
    alpha, beta = review.records["alpha"], review.records["beta"]
    assert await review.walk("alpha", limit=4) == as_json(alpha)
    assert await review.walk("beta") == as_json(beta)
    # Naming another tenant is refused whatever the name (it says nothing about who exists).
    for name in ("beta", "nobody"):
        refused = await review.get("/audit/decisions", "alpha", tenant=name)
        assert (refused.status_code, refused.json()["error"]["code"]) == (403, "other_tenant")
    assert (await review.get("/audit/decisions", "alpha", tenant="alpha")).status_code == 200

    one = await review.get("/audit/decisions/alpha/3", "alpha")
    assert one.json() == as_json([alpha[2]])[0]
    assert one.json()["stages"][1]["score"] == 0.42
    # Another tenant's record is as absent as a missing one: 404, same message shape.
    other = await review.get("/audit/decisions/beta/1", "alpha")
    missing = await review.get("/audit/decisions/alpha/99", "alpha")
    assert other.status_code == missing.status_code == 404
    assert other.json()["error"]["code"] == missing.json()["error"]["code"] == "not_found"

    shared = await review.get("/audit/requests/shared", "alpha")
    assert shared.json() == {"data": as_json([alpha[0]])}
    assert (await review.get("/audit/requests/req-beta-1", "alpha")).json() == {"data": []}

    lines = (await review.get("/audit/export", "alpha")).text.splitlines()
    assert [msgspec.json.decode(line) for line in lines] == as_json(alpha)


async def test_a_global_reviewer_sees_every_tenant_and_can_filter_by_one(review: Review) -> None:
    alpha, beta = review.records["alpha"], review.records["beta"]
    assert await review.walk("global", limit=3) == as_json(alpha + beta)  # (tenant, seq) order
    assert await review.walk("global", tenant="beta") == as_json(beta)
    assert (await review.get("/audit/decisions/beta/2", "global")).json() == as_json([beta[1]])[0]
    shared = await review.get("/audit/requests/shared", "global")
    assert shared.json() == {"data": as_json([alpha[0], beta[0]])}
    export = await review.get("/audit/export", "global", tenant="alpha")
    assert export.headers["content-type"].startswith("application/x-ndjson")
    assert [msgspec.json.decode(line) for line in export.text.splitlines()] == as_json(alpha)


async def test_each_filter_selects_its_records(review: Review) -> None:
    alpha = review.records["alpha"]
    cases: list[tuple[dict[str, Any], list[AuditRecord]]] = [
        ({"since": T0 + 2, "until": T0 + 5}, [r for r in alpha if T0 + 2 <= r.at < T0 + 5]),
        ({"decision": "block"}, [r for r in alpha if r.decision == "block"]),
        ({"stage": "output"}, [r for r in alpha if r.stage == "output"]),
        ({"category": "violence"}, [r for r in alpha if r.category == "violence"]),
        ({"policy": "strict@2"}, [r for r in alpha if r.policy == "strict@2"]),
        ({"policy": "strict"}, [r for r in alpha if r.policy.startswith("strict@")]),
        ({"fail_open": "true"}, [r for r in alpha if r.source == "fail_open"]),
        ({"flagged": "true"}, [r for r in alpha if r.flagged]),
        ({"flagged": "false"}, alpha),
        (
            {"decision": "allow", "stage": "input"},
            [r for r in alpha if (r.decision, r.stage) == ("allow", "input")],
        ),
    ]
    for params, expected in cases:
        assert expected, params  # every case selects something
        assert await review.walk("alpha", limit=2, **params) == as_json(expected), params
        lines = (await review.get("/audit/export", "alpha", **params)).text.splitlines()
        assert [msgspec.json.decode(line) for line in lines] == as_json(expected), params


async def test_pagination_walks_everything_once_while_records_are_appended(review: Review) -> None:
    first = await review.get("/audit/decisions", "global", limit=5)
    body = first.json()
    assert len(body["data"]) == 5
    # Records appended mid-walk land after the keyset (later seqs) and are seen once too.
    late = await review.services.audit.append([draft("alpha", 9)])
    rest = await review.walk("global", limit=5, cursor=body["next_cursor"])
    everything = review.records["alpha"] + late + review.records["beta"]
    assert body["data"] + rest == as_json(everything)
    # A page that is not full is the last: no cursor.
    assert (await review.get("/audit/decisions", "beta", limit=1000)).json()["next_cursor"] is None


async def test_export_streams_more_than_one_page(review: Review) -> None:
    drafts = [draft("beta", n) for n in range(5, 1205)]
    for start in range(0, len(drafts), 400):
        await review.services.audit.append(drafts[start : start + 400])
    response = await review.get("/audit/export", "beta")
    lines = response.text.splitlines()
    assert len(lines) == 1205
    assert [msgspec.json.decode(line)["seq"] for line in lines] == list(range(1, 1206))


def tamper(path: Path) -> None:
    """Change a stored decision the way someone with database access could (the triggers dropped)."""
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("DROP TRIGGER audit_records_only_purge")
        conn.execute("DROP TRIGGER audit_records_no_delete")
        conn.execute("UPDATE audit_records SET decision = 'deny' WHERE tenant = 'alpha' AND seq = 4")


async def test_verify_reports_the_first_bad_seq_after_tampering(review: Review) -> None:
    ok = await review.get("/audit/verify", "alpha")
    assert ok.status_code == 200
    assert ok.json() == {
        "ok": True,
        "tenants": {
            "alpha": {
                "ok": True,
                "checked": 9,
                "first_bad_seq": None,
                "reason": None,
                "detail": "",
                "last_seq": 9,
                "unkeyed": 0,
            }
        },
    }
    every = (await review.get("/audit/verify", "global")).json()
    assert every["ok"]
    assert set(every["tenants"]) == {"alpha", "beta", SYSTEM_TENANT}

    await asyncio.to_thread(tamper, review.audit_path)
    broken = await review.get("/audit/verify", "alpha")
    assert broken.status_code == 409
    body = broken.json()
    assert body["error"]["code"] == "audit_chain_broken"
    chain = body["tenants"]["alpha"]
    assert (chain["ok"], chain["first_bad_seq"], chain["reason"], chain["last_seq"]) == (False, 4, "hash", 3)
    # A global reviewer: every tenant, only alpha broken; or one named tenant.
    every = await review.get("/audit/verify", "global")
    assert every.status_code == 409
    assert {t: c["ok"] for t, c in every.json()["tenants"].items()} == {
        "alpha": False,
        "beta": True,
        SYSTEM_TENANT: True,
    }
    assert (await review.get("/audit/verify", "global", tenant="beta")).status_code == 200
    assert (await review.get("/audit/verify", "beta")).status_code == 200
    assert (await review.get("/audit/verify", "beta", tenant="alpha")).status_code == 403


async def test_verify_checks_macs_and_the_signed_checkpoints(review: Review, tmp_path: Path) -> None:
    signer = Ed25519PrivateKey.generate()
    checkpoints = Checkpointer(review.services.audit, KEY, signer, tmp_path / "cp.jsonl", FakeClock())
    review.services.audit_checkpoints = checkpoints
    assert {cp.tenant: cp.seq for cp in await checkpoints.once()} == {"alpha": 9, "beta": 5}
    alpha = review.records["alpha"]

    def cut(conn: sqlite3.Connection) -> None:
        # Records cut off the end and the head set back: consistent in itself.
        conn.execute("DROP TRIGGER audit_records_no_delete")
        conn.execute("DROP TRIGGER audit_heads_forward")
        conn.execute("DELETE FROM audit_records WHERE tenant = 'alpha' AND seq > 6")
        conn.execute(f"UPDATE audit_heads SET seq = 6, hash = '{alpha[5].hash}' WHERE tenant = 'alpha'")

    def forge(conn: sqlite3.Connection) -> None:
        # beta's record 5 changed and rehashed (plain sha256, as the chain was before keys): its MAC fails.
        conn.execute("DROP TRIGGER audit_records_only_purge")
        beta = msgspec.structs.replace(review.records["beta"][4], decision="deny")
        digest = record_hash(beta, 5, beta.prev_hash)
        conn.execute(
            f"UPDATE audit_records SET decision = 'deny', hash = '{digest}' WHERE tenant = 'beta' AND seq = 5"
        )
        conn.execute(f"UPDATE audit_heads SET hash = '{digest}' WHERE tenant = 'beta'")

    def attack() -> None:
        with closing(sqlite3.connect(review.audit_path, isolation_level=None)) as conn:
            cut(conn)
            forge(conn)

    await asyncio.to_thread(attack)
    every = await review.get("/audit/verify", "global")
    assert every.status_code == 409
    found = {t: (c["ok"], c["first_bad_seq"], c["reason"]) for t, c in every.json()["tenants"].items()}
    assert found == {
        "alpha": (False, 7, "checkpoint"),
        "beta": (False, 5, "mac"),
        SYSTEM_TENANT: (True, None, None),
    }
    # A forged checkpoint line: nothing verifies against the file.
    lines = (tmp_path / "cp.jsonl").read_bytes().replace(b'"seq":9', b'"seq":6')
    (tmp_path / "cp.jsonl").write_bytes(lines)
    forged = await review.get("/audit/verify", "global")
    assert (forged.status_code, forged.json()["error"]["code"]) == (409, "audit_checkpoints_forged")


ROUTES = [
    "/audit/decisions",
    "/audit/decisions/alpha/1",
    "/audit/requests/shared",
    "/audit/export",
    "/audit/verify",
]


async def test_consumers_are_refused_on_every_reviewer_route(review: Review) -> None:
    for path in ROUTES:
        response = await review.get(path, "consumer")
        assert (response.status_code, response.json()["error"]["code"]) == (403, "missing_role"), path
        assert (await review.http.get(path)).status_code == 401, path


@pytest.mark.parametrize(
    ("path", "param", "value"),
    [
        ("/audit/decisions", "since", "yesterday"),
        ("/audit/decisions", "until", "nan"),
        ("/audit/decisions", "decision", "maybe"),
        ("/audit/decisions", "stage", "nowhere"),
        ("/audit/decisions", "fail_open", "yes"),
        ("/audit/decisions", "flagged", "1"),
        ("/audit/decisions", "limit", "0"),
        ("/audit/decisions", "limit", "1001"),
        ("/audit/decisions", "limit", "ten"),
        ("/audit/decisions", "cursor", "not-a-cursor"),
        ("/audit/decisions", "colour", "red"),
        ("/audit/export", "limit", "10"),
        ("/audit/export", "stage", "nowhere"),
        ("/audit/verify", "since", "1"),
    ],
)
async def test_bad_parameters_are_400_naming_the_parameter(
    review: Review, path: str, param: str, value: str
) -> None:
    response = await review.get(path, "global", **{param: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


async def test_a_repeated_parameter_is_400(review: Review) -> None:
    response = await review.http.get(
        "/audit/decisions?decision=allow&decision=block",
        headers={"authorization": f"Bearer {review.keys['global']}"},
    )
    assert (response.status_code, response.json()["error"]["param"]) == (400, "decision")

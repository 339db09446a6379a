"""The admin API (`/admin/...`) on both deployments, clock injected: tenants, quotas, keys, the change record,
and tenant isolation of policy administrators."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from engines.simulated import SimulatedEngine
from gateway.app import create_app
from gateway.generation.prompts import PromptRenderer
from policy.auth import SYSTEM_TENANT
from policy.safety.defaults import NO_GUARDS as DEFAULT_POLICY_SPEC
from policy.tenants import keys
from policy.tenants.base import TenantStore
from policy.tenants.models import ApiKey, Role, Tenant
from tests.backends import DEPLOYMENTS, FakeClock, deployment
from tests.conftest import MODEL, OutcomeLog, make_config, serving

LIMITS = {"requests_per_second": 2.0, "request_burst": 4.0, "tokens_per_second": 100.0, "token_burst": 1000.0}
ACME: dict[str, Any] = {
    "tenant_id": "acme",
    "display_name": "Acme",
    "weight": 2.5,
    "quotas": {"tenant": LIMITS, "per_key": {**LIMITS, "request_burst": 2.0}, "fail_mode": "open"},
    "policy": "strict",
    "retain_prompts": True,
    "content_retention_days": None,
    "max_priority": "interactive",
    "system_prompt": None,
    "tier": "pro",
}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def mint(store: TenantStore, tenant_id: str, roles: tuple[Role, ...], now: float) -> tuple[str, str]:
    """Create a key directly in the store: (plaintext, key_id)."""
    plaintext, key_id, secret_hash = keys.new_key()
    await store.add_key(
        ApiKey(key_id=key_id, tenant_id=tenant_id, roles=roles), secret_hash, actor="test", now=now
    )
    return plaintext, key_id


def bearer(plaintext: str) -> dict[str, str]:
    return {"authorization": f"Bearer {plaintext}"}


class Admin:
    """A gateway on one deployment, and the operator's policy administrator key."""

    def __init__(
        self, http: httpx.AsyncClient, store: TenantStore, clock: FakeClock, key: str, key_id: str
    ) -> None:
        self.http = http
        self.store = store
        self.clock = clock
        self.key = key
        self.key_id = key_id

    async def request(
        self, method: str, path: str, body: Any = None, key: str | None = None, **params: Any
    ) -> httpx.Response:
        """A request as the operator's administrator (or as `key`)."""
        return await self.http.request(
            method, path, json=body, params=params or None, headers=bearer(key or self.key)
        )

    async def create_tenant(self, tenant_id: str, **fields: Any) -> dict[str, Any]:
        response = await self.request(
            "POST", "/admin/tenants", {"tenant_id": tenant_id, "display_name": tenant_id.title(), **fields}
        )
        assert response.status_code == 201, response.text
        body: dict[str, Any] = response.json()
        return body

    async def create_key(self, tenant_id: str, key: str | None = None, **fields: Any) -> dict[str, Any]:
        response = await self.request("POST", f"/admin/tenants/{tenant_id}/keys", fields, key=key)
        assert response.status_code == 201, response.text
        body: dict[str, Any] = response.json()
        return body


@pytest.fixture(params=DEPLOYMENTS)
async def admin(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    sim_engine: SimulatedEngine,
    renderer: PromptRenderer,
    outcomes: OutcomeLog,
) -> AsyncIterator[Admin]:
    clock = FakeClock()
    async with deployment(request.param, tmp_path) as backends:
        store = backends.tenants
        await store.create_tenant(
            Tenant(tenant_id=SYSTEM_TENANT, display_name="Operator"), actor="test", now=clock()
        )
        key, key_id = await mint(store, SYSTEM_TENANT, ("policy_admin",), clock())
        app = create_app(
            make_config(),
            engine=sim_engine,
            renderer=renderer,
            tenants=store,
            quota=backends.quota,
            registry=backends.registry,
            clock=clock,
            sink=outcomes,
        )
        async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
            # Tenants bind to policies that exist: publish the one the tests bind to.
            strict = msgspec.structs.replace(DEFAULT_POLICY_SPEC, retention="hash")
            await app.state.services.registry.publish("policy", "strict", "1", strict, actor="test")
            await app.state.services.registry.set_alias("policy", "strict", "1", actor="test")
            yield Admin(http, store, clock, key, key_id)


def assert_error(
    response: httpx.Response, status: int, type_: str, code: str | None = None
) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers.get("x-request-id")
    error: dict[str, Any] = response.json()["error"]
    assert error["type"] == type_
    if code is not None:
        assert error["code"] == code
    return error


def assert_403(response: httpx.Response, code: str | None = None) -> None:
    assert_error(response, 403, "permission_error", code)


def assert_400(response: httpx.Response, param: str) -> None:
    error = assert_error(response, 400, "invalid_request_error")
    assert error["param"] == param, error


# Tenants


async def test_create_tenant_echoes_every_field(admin: Admin) -> None:
    created = await admin.request("POST", "/admin/tenants", ACME)
    assert created.status_code == 201, created.text
    assert created.json() == {**ACME, "created_at": admin.clock()}
    assert await admin.store.get_tenant("acme") == msgspec.convert(created.json(), Tenant)


async def test_create_tenant_defaults(admin: Admin) -> None:
    body = await admin.create_tenant("plain")
    assert body == {
        "tenant_id": "plain",
        "display_name": "Plain",
        "weight": 1.0,
        "quotas": {"tenant": None, "per_key": None, "fail_mode": "closed"},
        "policy": "default",
        "retain_prompts": False,
        "content_retention_days": None,
        "max_priority": "interactive",
        "created_at": admin.clock(),
        "system_prompt": None,
        "tier": "",
    }


async def test_duplicate_tenant_is_409(admin: Admin) -> None:
    await admin.create_tenant("acme")
    again = await admin.request("POST", "/admin/tenants", {**ACME, "display_name": "Other"})
    assert_error(again, 409, "conflict_error", "already_exists")
    assert (await admin.store.get_tenant("acme")).display_name == "Acme"
    duplicate = await admin.request(
        "POST", "/admin/tenants", {"tenant_id": SYSTEM_TENANT, "display_name": "Impostor"}
    )
    assert_error(duplicate, 409, "conflict_error", "already_exists")


def _acme(**changes: Any) -> dict[str, Any]:
    return {**ACME, **changes}


def _limits(**changes: Any) -> dict[str, Any]:
    return {**LIMITS, **changes}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (_acme(tenant_id="Acme"), "tenant_id"),
        (_acme(tenant_id=""), "tenant_id"),
        (_acme(tenant_id="-acme"), "tenant_id"),
        (_acme(tenant_id="a" * 64), "tenant_id"),
        (_acme(tenant_id="ac me"), "tenant_id"),
        (_acme(weight=0), "weight"),
        (_acme(weight=-1.5), "weight"),
        (_acme(weight="heavy"), "weight"),
        (_acme(quotas={"tenant": _limits(requests_per_second=0)}), "quotas.tenant.requests_per_second"),
        (_acme(quotas={"tenant": _limits(request_burst=-1)}), "quotas.tenant.request_burst"),
        (_acme(quotas={"per_key": _limits(tokens_per_second=0)}), "quotas.per_key.tokens_per_second"),
        (_acme(quotas={"per_key": _limits(token_burst=-3)}), "quotas.per_key.token_burst"),
        (_acme(quotas={"tenant": {**LIMITS, "burst": 1}}), "quotas.tenant.burst"),
        (_acme(quotas={"fail_mode": "maybe"}), "quotas.fail_mode"),
        (_acme(max_priority="urgent"), "max_priority"),
        (_acme(max_priority="Batch"), "max_priority"),
        (_acme(max_priority=None), "max_priority"),
        (_acme(content_retention_days=0), "content_retention_days"),
        (_acme(content_retention_days=-7), "content_retention_days"),
        (_acme(content_retention_days="week"), "content_retention_days"),
        (_acme(colour="red"), "colour"),
        ({"tenant_id": "acme"}, "display_name"),
    ],
)
async def test_invalid_tenant_is_400_naming_the_field(admin: Admin, body: dict[str, Any], param: str) -> None:
    assert_400(await admin.request("POST", "/admin/tenants", body), param)
    assert [t.tenant_id for t in await admin.store.list_tenants()] == [SYSTEM_TENANT]
    assert [c.action for c in await admin.store.changes()] == ["key.add", "tenant.create"]


async def test_list_get_patch_and_put_quotas(admin: Admin) -> None:
    await admin.request("POST", "/admin/tenants", ACME)
    await admin.create_tenant("globex")

    listed = await admin.request("GET", "/admin/tenants")
    assert listed.status_code == 200
    assert [t["tenant_id"] for t in listed.json()] == ["acme", "globex", SYSTEM_TENANT]
    got = await admin.request("GET", "/admin/tenants/acme")
    assert got.json() == {**ACME, "created_at": admin.clock()}

    admin.clock.advance(10)
    patched = await admin.request("PATCH", "/admin/tenants/acme", {"display_name": "Acme Corp", "weight": 3})
    assert patched.status_code == 200, patched.text
    # Only the fields sent change; created_at stays.
    expected = {**ACME, "display_name": "Acme Corp", "weight": 3.0, "created_at": admin.clock() - 10}
    assert patched.json() == expected
    assert (await admin.request("GET", "/admin/tenants/acme")).json() == expected

    quotas = {"tenant": _limits(request_burst=9.0), "per_key": None, "fail_mode": "closed"}
    put = await admin.request("PUT", "/admin/tenants/acme/quotas", {"tenant": _limits(request_burst=9.0)})
    assert put.status_code == 200, put.text
    assert put.json() == {**expected, "quotas": quotas}
    assert msgspec.to_builtins((await admin.store.get_tenant("acme")).quotas) == quotas

    # PATCH with quotas replaces them whole, and leaves everything else.
    patched = await admin.request("PATCH", "/admin/tenants/acme", {"quotas": {"fail_mode": "open"}})
    assert patched.json() == {
        **expected,
        "quotas": {"tenant": None, "per_key": None, "fail_mode": "open"},
    }
    # The other tenant was not touched.
    assert (await admin.request("GET", "/admin/tenants/globex")).json()["display_name"] == "Globex"


async def test_max_priority_on_create_and_patch(admin: Admin) -> None:
    created = await admin.create_tenant("bulk", max_priority="batch")
    assert created["max_priority"] == "batch"
    assert (await admin.store.get_tenant("bulk")).max_priority == "batch"
    assert (await admin.request("GET", "/admin/tenants/bulk")).json() == created

    # A PATCH of other fields leaves it; a PATCH of it changes only it, and is recorded.
    admin.clock.advance(1)
    renamed = await admin.request("PATCH", "/admin/tenants/bulk", {"display_name": "Bulk Ltd"})
    assert renamed.json() == {**created, "display_name": "Bulk Ltd"}
    admin.clock.advance(1)
    raised = await admin.request("PATCH", "/admin/tenants/bulk", {"max_priority": "interactive"})
    assert raised.status_code == 200, raised.text
    assert raised.json() == {**renamed.json(), "max_priority": "interactive"}
    assert (await admin.store.get_tenant("bulk")).max_priority == "interactive"
    [change] = await admin.store.changes(1, target="tenant:bulk")
    assert (change.actor, change.action, change.at) == (admin.key_id, "tenant.update", admin.clock())
    assert msgspec.json.decode(change.before or "") == renamed.json()
    assert msgspec.json.decode(change.after or "") == raised.json()

    lowered = await admin.request("PATCH", "/admin/tenants/bulk", {"max_priority": "batch"})
    assert lowered.json()["max_priority"] == "batch"
    # Setting what it already is changes and records nothing.
    again = await admin.request("PATCH", "/admin/tenants/bulk", {"max_priority": "batch"})
    assert again.json() == lowered.json()
    assert len(await admin.store.changes(target="tenant:bulk")) == 4

    # A tenant's own administrator may not raise its class.
    own_admin, _ = await mint(admin.store, "bulk", ("policy_admin",), admin.clock())
    refused = await admin.request(
        "PATCH", "/admin/tenants/bulk", {"max_priority": "interactive"}, key=own_admin
    )
    assert_403(refused, "operator_only")
    assert (await admin.store.get_tenant("bulk")).max_priority == "batch"


async def test_content_retention_days_on_create_and_patch(admin: Admin) -> None:
    created = await admin.request("POST", "/admin/tenants", _acme(content_retention_days=90))
    assert created.status_code == 201, created.text
    assert created.json()["content_retention_days"] == 90.0
    assert (await admin.store.get_tenant("acme")).content_retention_days == 90.0

    admin.clock.advance(1)
    patched = await admin.request("PATCH", "/admin/tenants/acme", {"content_retention_days": 7.5})
    assert patched.status_code == 200, patched.text
    assert patched.json() == {**created.json(), "content_retention_days": 7.5}
    assert (await admin.store.get_tenant("acme")).content_retention_days == 7.5
    [change] = await admin.store.changes(1, target="tenant:acme")
    assert (change.action, msgspec.json.decode(change.after or "")) == ("tenant.update", patched.json())
    # A PATCH of other fields leaves it.
    renamed = await admin.request("PATCH", "/admin/tenants/acme", {"display_name": "Acme Ltd"})
    assert renamed.json()["content_retention_days"] == 7.5


ACME_PATH = "/admin/tenants/acme"
QUOTAS_PATH = "/admin/tenants/acme/quotas"


@pytest.mark.parametrize(
    ("method", "path", "body", "param"),
    [
        ("PATCH", ACME_PATH, {"weight": 0}, "weight"),
        ("PATCH", ACME_PATH, {"weight": -2}, "weight"),
        ("PATCH", ACME_PATH, {"quotas": {"tenant": _limits(token_burst=0)}}, "quotas.tenant.token_burst"),
        ("PATCH", ACME_PATH, {"tenant_id": "other"}, "tenant_id"),
        ("PATCH", ACME_PATH, {"created_at": 5}, "created_at"),
        ("PATCH", ACME_PATH, {"max_priority": "realtime"}, "max_priority"),
        ("PATCH", ACME_PATH, {"max_priority": 0}, "max_priority"),
        ("PATCH", ACME_PATH, {"content_retention_days": 0}, "content_retention_days"),
        ("PATCH", ACME_PATH, {"content_retention_days": -0.5}, "content_retention_days"),
        ("PATCH", ACME_PATH, {"content_retention_days": "30"}, "content_retention_days"),
        ("PUT", QUOTAS_PATH, {"tenant": _limits(request_burst=0)}, "tenant.request_burst"),
        ("PUT", QUOTAS_PATH, {"per_key": _limits(requests_per_second=-1)}, "per_key.requests_per_second"),
        ("PUT", QUOTAS_PATH, {"per_key": _limits(token_burst="x")}, "per_key.token_burst"),
        ("PUT", QUOTAS_PATH, {"bogus": 1}, "bogus"),
    ],
)
async def test_invalid_update_is_400_and_changes_nothing(
    admin: Admin, method: str, path: str, body: dict[str, Any], param: str
) -> None:
    await admin.request("POST", "/admin/tenants", ACME)
    assert_400(await admin.request(method, path, body), param)
    assert (await admin.request("GET", ACME_PATH)).json() == {**ACME, "created_at": admin.clock()}
    assert (await admin.store.changes(1))[0].action == "tenant.create"


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/admin/tenants/nobody", None),
        ("PATCH", "/admin/tenants/nobody", {"display_name": "Nobody"}),
        ("PUT", "/admin/tenants/nobody/quotas", {}),
        ("GET", "/admin/tenants/nobody/keys", None),
        ("POST", "/admin/tenants/nobody/keys", {"roles": ["consumer"]}),
        ("POST", "/admin/keys/0123456789ab/revoke", None),
    ],
)
async def test_unknown_tenant_or_key_is_404(admin: Admin, method: str, path: str, body: Any) -> None:
    assert_error(await admin.request(method, path, body), 404, "not_found_error", "not_found")
    assert [t.tenant_id for t in await admin.store.list_tenants()] == [SYSTEM_TENANT]


# Keys


async def test_created_key_is_shown_once_and_works_at_once(admin: Admin) -> None:
    await admin.create_tenant("acme")
    admin.clock.advance(3)
    created = await admin.create_key("acme", roles=["consumer", "reviewer", "consumer"], label="ci")
    plaintext = created.pop("key")
    parsed = keys.parse_key(plaintext)
    assert parsed is not None
    key_id, secret = parsed
    assert created == {
        "key_id": key_id,
        "tenant_id": "acme",
        "roles": ["consumer", "reviewer"],
        "label": "ci",
        "created_at": admin.clock(),
        "expires_at": None,
        "system_prompt": None,
        "trusted_instructions": False,
    }
    models = await admin.http.get("/v1/models", headers=bearer(plaintext))
    assert models.status_code == 200, models.text
    assert MODEL in [m["id"] for m in models.json()["data"]]

    # Listing shows the metadata, never the secret or its hash.
    listed = await admin.request("GET", "/admin/tenants/acme/keys")
    assert listed.status_code == 200
    assert listed.json() == [{**created, "revoked_at": None}]
    stored = await admin.store.get_key(key_id)
    assert keys.verify(secret, stored.secret_hash)
    assert secret not in listed.text
    assert stored.secret_hash not in listed.text
    assert "hash" not in listed.text
    # A key defaults to the consumer role.
    default = await admin.create_key("acme")
    assert default["roles"] == ["consumer"]
    assert default["key"] != plaintext


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"roles": []}, "roles"),
        ({"roles": ["superuser"]}, "roles[0]"),
        ({"expires_in": 0}, "expires_in"),
        ({"expires_in": -5}, "expires_in"),
        ({"secret": "mine"}, "secret"),
    ],
)
async def test_invalid_key_request_is_400(admin: Admin, body: dict[str, Any], param: str) -> None:
    await admin.create_tenant("acme")
    assert_400(await admin.request("POST", "/admin/tenants/acme/keys", body), param)
    assert await admin.store.list_keys("acme") == []


async def test_revoke_is_immediate_and_idempotent(admin: Admin) -> None:
    await admin.create_tenant("acme")
    created = await admin.create_key("acme")
    other = await admin.create_key("acme")
    for key in (created["key"], other["key"]):
        assert (
            await admin.http.post("/v1/chat/completions", json=CHAT, headers=bearer(key))
        ).status_code == 200

    admin.clock.advance(1)
    revoked_at = admin.clock()
    revoked = await admin.request("POST", f"/admin/keys/{created['key_id']}/revoke")
    assert revoked.status_code == 200, revoked.text
    assert revoked.json()["revoked_at"] == revoked_at
    refused = await admin.http.post("/v1/chat/completions", json=CHAT, headers=bearer(created["key"]))
    assert_error(refused, 401, "authentication_error", "invalid_api_key")
    # Only that key.
    assert (await admin.http.get("/v1/models", headers=bearer(other["key"]))).status_code == 200

    admin.clock.advance(60)
    again = await admin.request("POST", f"/admin/keys/{created['key_id']}/revoke")
    assert again.status_code == 200, again.text
    assert again.json()["revoked_at"] == revoked_at  # the first revocation stands
    assert [c.action for c in await admin.store.changes(target=f"key:{created['key_id']}")] == [
        "key.revoke",
        "key.add",
    ]
    listed = {
        k["key_id"]: k["revoked_at"] for k in (await admin.request("GET", "/admin/tenants/acme/keys")).json()
    }
    assert listed == {created["key_id"]: revoked_at, other["key_id"]: None}
    assert (await admin.http.get("/v1/models", headers=bearer(created["key"]))).status_code == 401


async def test_expires_in_follows_the_clock(admin: Admin) -> None:
    await admin.create_tenant("acme")
    created = await admin.create_key("acme", expires_in=30)
    assert created["expires_at"] == admin.clock() + 30
    headers = bearer(created["key"])
    assert (await admin.http.get("/v1/models", headers=headers)).status_code == 200
    admin.clock.advance(29)
    assert (await admin.http.get("/v1/models", headers=headers)).status_code == 200
    admin.clock.advance(1)
    assert_error(await admin.http.get("/v1/models", headers=headers), 401, "authentication_error")


# The change record


async def test_every_change_is_recorded_newest_first(admin: Admin) -> None:
    created = await admin.request("POST", "/admin/tenants", ACME)
    admin.clock.advance(1)
    patched = await admin.request("PATCH", "/admin/tenants/acme", {"weight": 4})
    admin.clock.advance(1)
    put = await admin.request("PUT", "/admin/tenants/acme/quotas", {"fail_mode": "closed"})
    admin.clock.advance(1)
    key = await admin.create_key("acme", label="ci")
    admin.clock.advance(1)
    revoked = await admin.request("POST", f"/admin/keys/{key['key_id']}/revoke")
    # A change that changes nothing is not recorded.
    await admin.request("PATCH", "/admin/tenants/acme", {"weight": 4})

    response = await admin.request("GET", "/admin/changes")
    assert response.status_code == 200, response.text
    changes = response.json()
    now = admin.clock()
    summary = [(c["at"], c["actor"], c["action"], c["target"]) for c in changes[:5]]
    assert summary == [
        (now, admin.key_id, "key.revoke", f"key:{key['key_id']}"),
        (now - 1, admin.key_id, "key.add", f"key:{key['key_id']}"),
        (now - 2, admin.key_id, "tenant.update", "tenant:acme"),
        (now - 3, admin.key_id, "tenant.update", "tenant:acme"),
        (now - 4, admin.key_id, "tenant.create", "tenant:acme"),
    ]
    # The bootstrap of the fixture comes before, by its own actor.
    assert [(c["actor"], c["action"]) for c in changes[5:]] == [
        ("test", "key.add"),
        ("test", "tenant.create"),
    ]
    ids = [c["change_id"] for c in changes]
    assert ids == sorted(ids, reverse=True)

    def obj(text: str | None) -> Any:
        return None if text is None else msgspec.json.decode(text)

    revoke, add, quotas, weight, create = changes[:5]
    assert (obj(create["before"]), obj(create["after"])) == (None, created.json())
    assert (obj(weight["before"]), obj(weight["after"])) == (created.json(), patched.json())
    assert (obj(quotas["before"]), obj(quotas["after"])) == (patched.json(), put.json())
    expected_key = {k: v for k, v in key.items() if k != "key"}
    assert obj(add["before"]) is None
    assert obj(add["after"]) == {**expected_key, "revoked_at": None}
    assert obj(revoke["before"]) == {**expected_key, "revoked_at": None}
    assert obj(revoke["after"]) == revoked.json()

    only = await admin.request("GET", "/admin/changes", target="tenant:acme")
    assert [(c["action"], c["at"]) for c in only.json()] == [
        ("tenant.update", now - 2),
        ("tenant.update", now - 3),
        ("tenant.create", now - 4),
    ]
    limited = await admin.request("GET", "/admin/changes", limit=2)
    assert limited.json() == changes[:2]
    assert (await admin.request("GET", "/admin/changes", limit=1000)).json() == changes
    assert (await admin.request("GET", "/admin/changes", target="tenant:nobody")).json() == []


@pytest.mark.parametrize("limit", [0, -1, 1001, 5000])
async def test_changes_limit_is_bounded(admin: Admin, limit: int) -> None:
    assert_400(await admin.request("GET", "/admin/changes", limit=limit), "limit")


# Tenant isolation


class Tenants:
    """acme and globex, each with a policy administrator key (that is also a consumer) and a consumer key."""

    def __init__(self, admin: Admin) -> None:
        self.admin = admin
        self.acme_admin = ""
        self.acme_admin_id = ""
        self.globex_admin = ""
        self.globex_key = ""
        self.globex_key_id = ""

    async def setup(self) -> Tenants:
        store, now = self.admin.store, self.admin.clock()
        await self.admin.request("POST", "/admin/tenants", ACME)
        await self.admin.create_tenant("globex")
        self.acme_admin, self.acme_admin_id = await mint(store, "acme", ("policy_admin", "consumer"), now)
        self.globex_admin, _ = await mint(store, "globex", ("policy_admin", "consumer"), now)
        self.globex_key, self.globex_key_id = await mint(store, "globex", ("consumer",), now)
        return self


async def test_tenant_admin_manages_only_its_own_keys(admin: Admin) -> None:
    t = await Tenants(admin).setup()
    own = await admin.request("GET", "/admin/tenants/acme", key=t.acme_admin)
    assert own.status_code == 200
    assert own.json()["tenant_id"] == "acme"
    listed = await admin.request("GET", "/admin/tenants", key=t.acme_admin)
    assert [x["tenant_id"] for x in listed.json()] == ["acme"]
    keys_listed = await admin.request("GET", "/admin/tenants/acme/keys", key=t.acme_admin)
    assert [k["key_id"] for k in keys_listed.json()] == [t.acme_admin_id]

    created = await admin.create_key("acme", key=t.acme_admin, roles=["consumer"])
    assert (await admin.http.get("/v1/models", headers=bearer(created["key"]))).status_code == 200
    delegated = await admin.create_key("acme", key=t.acme_admin, roles=["policy_admin", "consumer"])
    assert delegated["roles"] == ["policy_admin", "consumer"]
    revoked = await admin.request("POST", f"/admin/keys/{created['key_id']}/revoke", key=t.acme_admin)
    assert revoked.status_code == 200, revoked.text
    assert (await admin.http.get("/v1/models", headers=bearer(created["key"]))).status_code == 401
    # Recorded under the tenant administrator's own key id.
    [change] = await admin.store.changes(1)
    assert (change.actor, change.action) == (t.acme_admin_id, "key.revoke")


async def test_tenant_admin_is_refused_everything_else(admin: Admin) -> None:
    t = await Tenants(admin).setup()
    before = await admin.store.changes(1000)
    refused = [
        ("GET", "/admin/tenants/globex", None, "other_tenant"),
        ("GET", "/admin/tenants/globex/keys", None, "other_tenant"),
        ("POST", "/admin/tenants/globex/keys", {"roles": ["consumer"]}, "other_tenant"),
        ("POST", f"/admin/keys/{t.globex_key_id}/revoke", None, "other_tenant"),
        # Absent tenants and keys answer the same, so that ids cannot be probed.
        ("GET", "/admin/tenants/nobody", None, "other_tenant"),
        ("POST", "/admin/keys/0123456789ab/revoke", None, "other_tenant"),
        ("POST", "/admin/tenants", {"tenant_id": "initech", "display_name": "Initech"}, "operator_only"),
        ("PATCH", "/admin/tenants/acme", {"weight": 100}, "operator_only"),
        ("PUT", "/admin/tenants/acme/quotas", {}, "operator_only"),
        ("PATCH", "/admin/tenants/globex", {"weight": 100}, "operator_only"),
        ("GET", "/admin/changes", None, "operator_only"),
        ("POST", "/admin/tenants/acme/keys", {"roles": ["reviewer"]}, "role_escalation"),
        ("POST", "/admin/tenants/acme/keys", {"roles": ["consumer", "operator"]}, "role_escalation"),
    ]
    for method, path, body, code in refused:
        response = await admin.request(method, path, body, key=t.acme_admin)
        assert response.status_code == 403, (method, path, response.text)
        assert_403(response, code)
    assert await admin.store.changes(1000) == before
    assert (await admin.store.get_tenant("acme")).weight == ACME["weight"]
    assert (await admin.http.get("/v1/models", headers=bearer(t.globex_key))).status_code == 200
    # The other tenant's administrator is held to its own tenant just the same.
    other = await admin.request("GET", "/admin/tenants/acme", key=t.globex_admin)
    assert_403(other, "other_tenant")


async def test_keys_without_policy_admin_get_403_on_every_admin_route(admin: Admin) -> None:
    t = await Tenants(admin).setup()
    consumers = [
        t.globex_key,
        (await mint(admin.store, SYSTEM_TENANT, ("consumer", "reviewer", "operator"), admin.clock()))[0],
    ]
    routes = [
        ("GET", "/admin/tenants", None),
        ("POST", "/admin/tenants", {"tenant_id": "initech", "display_name": "Initech"}),
        ("GET", "/admin/tenants/globex", None),
        ("PATCH", "/admin/tenants/globex", {"weight": 2}),
        ("PUT", "/admin/tenants/globex/quotas", {}),
        ("GET", "/admin/tenants/globex/keys", None),
        ("POST", "/admin/tenants/globex/keys", {"roles": ["consumer"]}),
        ("POST", f"/admin/keys/{t.globex_key_id}/revoke", None),
        ("POST", "/admin/keys/0123456789ab/revoke", None),
        ("GET", "/admin/changes", None),
    ]
    before = await admin.store.changes(1000)
    for key in consumers:
        assert (await admin.http.get("/v1/models", headers=bearer(key))).status_code == 200
        for method, path, body in routes:
            assert_403(await admin.request(method, path, body, key=key), "missing_role")
    assert await admin.store.changes(1000) == before

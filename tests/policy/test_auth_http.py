"""API key authentication and authorization at the HTTP edge, on both deployments, clock injected.

Every refusal is an OpenAI-shaped 401 (`WWW-Authenticate: Bearer`) or 403; a key revoked on one replica stops
working there at once and on every other replica within `auth.cache_ttl`; secrets are never stored.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from engines.simulated import SimulatedEngine
from gateway.app import create_app
from gateway.config import Config
from gateway.generation.prompts import PromptRenderer
from policy.auth import SYSTEM_TENANT
from policy.tenants import keys
from policy.tenants.base import TenantStore
from policy.tenants.models import ApiKey, Limits, Quotas, Role, Tenant
from tests.backends import DEPLOYMENTS, Backends, FakeClock, deployment
from tests.conftest import MODEL, OutcomeLog, make_config, serving

CHAT = (
    "POST",
    "/v1/chat/completions",
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
)
COMPLETIONS = ("POST", "/v1/completions", {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4})
MODELS = ("GET", "/v1/models", None)
ENDPOINTS = [CHAT, COMPLETIONS, MODELS]
Endpoint = tuple[str, str, dict[str, Any] | None]


async def mint(
    store: TenantStore,
    tenant_id: str,
    roles: tuple[Role, ...],
    now: float,
    expires_at: float | None = None,
) -> tuple[str, str]:
    """Create a key directly in the store: (plaintext, key_id)."""
    plaintext, key_id, secret_hash = keys.new_key()
    key = ApiKey(key_id=key_id, tenant_id=tenant_id, roles=roles, expires_at=expires_at)
    await store.add_key(key, secret_hash, actor="test", now=now)
    return plaintext, key_id


def bearer(plaintext: str) -> dict[str, str]:
    return {"authorization": f"Bearer {plaintext}"}


class Env:
    """One deployment with tenant `acme`, the operator tenant and its policy administrator key."""

    def __init__(
        self,
        backends: Backends,
        clock: FakeClock,
        config: Config,
        engine: SimulatedEngine,
        renderer: PromptRenderer,
        outcomes: OutcomeLog,
        admin: str,
    ) -> None:
        self.backends = backends
        self.store = backends.tenants
        self.clock = clock
        self.config = config
        self.engine = engine
        self.renderer = renderer
        self.outcomes = outcomes
        self.admin = admin

    async def key(self, roles: tuple[Role, ...] = ("consumer",), tenant_id: str = "acme") -> tuple[str, str]:
        return await mint(self.store, tenant_id, roles, self.clock())

    @asynccontextmanager
    async def replica(self) -> AsyncIterator[httpx.AsyncClient]:
        """One gateway process on the shared stores (several may run at once)."""
        app = create_app(
            self.config,
            engine=self.engine,
            renderer=self.renderer,
            tenants=self.backends.tenants,
            quota=self.backends.quota,
            clock=self.clock,
            sink=self.outcomes,
        )
        async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
            yield http


@pytest.fixture(params=DEPLOYMENTS)
async def env(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    sim_engine: SimulatedEngine,
    renderer: PromptRenderer,
    outcomes: OutcomeLog,
) -> AsyncIterator[Env]:
    clock = FakeClock()
    async with deployment(request.param, tmp_path) as backends:
        store = backends.tenants
        await store.create_tenant(Tenant(tenant_id="acme", display_name="Acme"), actor="test", now=clock())
        await store.create_tenant(
            Tenant(tenant_id=SYSTEM_TENANT, display_name="Operator"), actor="test", now=clock()
        )
        admin, _ = await mint(store, SYSTEM_TENANT, ("policy_admin",), clock())
        yield Env(backends, clock, make_config(), sim_engine, renderer, outcomes, admin)


@pytest.fixture
async def http(env: Env) -> AsyncIterator[httpx.AsyncClient]:
    async with env.replica() as client:
        yield client


async def call(http: httpx.AsyncClient, endpoint: Endpoint, headers: dict[str, str]) -> httpx.Response:
    method, path, body = endpoint
    return await http.request(method, path, json=body, headers=headers)


def assert_401(response: httpx.Response) -> None:
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.headers.get("x-request-id")
    error = response.json()["error"]
    assert error["type"] == "authentication_error"
    assert error["code"] == "invalid_api_key"
    assert error["message"]


def assert_403(response: httpx.Response, code: str) -> None:
    assert response.status_code == 403, response.text
    assert response.headers.get("x-request-id")
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("permission_error", code)


# Each returns the headers of a request that must be refused with 401.
async def _no_header(env: Env) -> dict[str, str]:
    return {}


async def _empty_header(env: Env) -> dict[str, str]:
    return {"authorization": ""}


async def _basic_scheme(env: Env) -> dict[str, str]:
    plaintext, _ = await env.key()  # a valid key, sent under the wrong scheme
    return {"authorization": f"Basic {plaintext}"}


async def _bearer_without_key(env: Env) -> dict[str, str]:
    return {"authorization": "Bearer"}


async def _malformed_key(env: Env) -> dict[str, str]:
    plaintext, _ = await env.key()
    return bearer(plaintext + "x")  # one character too many: no longer a well-formed key


async def _unknown_key_id(env: Env) -> dict[str, str]:
    plaintext, _, _ = keys.new_key()  # well formed, never stored
    return bearer(plaintext)


async def _wrong_secret(env: Env) -> dict[str, str]:
    _, key_id = await env.key()
    other, _, _ = keys.new_key()
    parsed = keys.parse_key(other)
    assert parsed is not None
    return bearer(f"lg-{key_id}-{parsed[1]}")


async def _expired_key(env: Env) -> dict[str, str]:
    plaintext, _ = await mint(env.store, "acme", ("consumer",), env.clock(), expires_at=env.clock() - 1)
    return bearer(plaintext)


async def _revoked_key(env: Env) -> dict[str, str]:
    plaintext, key_id = await env.key()
    await env.store.revoke_key(key_id, actor="test", now=env.clock())
    return bearer(plaintext)


REFUSED: dict[str, Callable[[Env], Awaitable[dict[str, str]]]] = {
    "no-header": _no_header,
    "empty-header": _empty_header,
    "basic-scheme": _basic_scheme,
    "bearer-without-key": _bearer_without_key,
    "malformed-key": _malformed_key,
    "unknown-key-id": _unknown_key_id,
    "wrong-secret": _wrong_secret,
    "expired-key": _expired_key,
    "revoked-key": _revoked_key,
}


@pytest.mark.parametrize("case", list(REFUSED))
async def test_refused_keys_get_401_in_openai_shape(env: Env, http: httpx.AsyncClient, case: str) -> None:
    headers = await REFUSED[case](env)
    good, _ = await env.key()
    for endpoint in ENDPOINTS:
        assert_401(await call(http, endpoint, headers))
        # The same request with a valid key is served: only the key was wrong.
        control = await call(http, endpoint, bearer(good))
        assert control.status_code == 200, (endpoint[1], control.text)


async def test_key_expires_when_the_clock_passes_its_expiry(env: Env, http: httpx.AsyncClient) -> None:
    plaintext, _ = await mint(env.store, "acme", ("consumer",), env.clock(), expires_at=env.clock() + 60)
    for endpoint in ENDPOINTS:
        assert (await call(http, endpoint, bearer(plaintext))).status_code == 200
    env.clock.advance(59)
    assert (await call(http, MODELS, bearer(plaintext))).status_code == 200  # cached, still valid
    env.clock.advance(1)  # exactly at expires_at
    for endpoint in ENDPOINTS:
        assert_401(await call(http, endpoint, bearer(plaintext)))


async def test_health_probes_need_no_key(http: httpx.AsyncClient) -> None:
    healthz = await http.get("/healthz")
    assert (healthz.status_code, healthz.json()) == (200, {"status": "ok"})
    readyz = await http.get("/readyz")
    assert readyz.status_code == 200
    assert readyz.json()["status"] == "ready"


async def test_key_without_consumer_role_gets_403_on_the_api(env: Env, http: httpx.AsyncClient) -> None:
    reviewer, _ = await env.key(("reviewer", "policy_admin"))
    for endpoint in ENDPOINTS:
        assert_403(await call(http, endpoint, bearer(reviewer)), "missing_role")
    assert env.outcomes.items == []  # nothing reached the engine


async def test_consumer_key_gets_403_on_admin_routes(env: Env, http: httpx.AsyncClient) -> None:
    consumer, _ = await env.key()
    assert_403(await http.get("/admin/tenants", headers=bearer(consumer)), "missing_role")
    assert (await http.get("/admin/tenants", headers=bearer(env.admin))).status_code == 200


async def test_revocation_is_immediate_here_and_bounded_by_the_cache_ttl_elsewhere(env: Env) -> None:
    ttl = env.config.auth.cache_ttl
    consumer, key_id = await env.key()
    async with env.replica() as a, env.replica() as b:
        # Both replicas have verified (and cached) the key.
        assert (await a.get("/v1/models", headers=bearer(consumer))).status_code == 200
        assert (await b.get("/v1/models", headers=bearer(consumer))).status_code == 200

        revoked = await a.post(f"/admin/keys/{key_id}/revoke", headers=bearer(env.admin))
        assert revoked.status_code == 200, revoked.text
        assert revoked.json()["revoked_at"] == env.clock()

        for endpoint in ENDPOINTS:
            assert_401(await call(a, endpoint, bearer(consumer)))
        # B has not looked again: its cached verification stands for less than the TTL...
        assert (await b.get("/v1/models", headers=bearer(consumer))).status_code == 200
        env.clock.advance(ttl / 2)
        assert (await b.get("/v1/models", headers=bearer(consumer))).status_code == 200
        # ...and no longer.
        env.clock.advance(ttl / 2)
        for endpoint in ENDPOINTS:
            assert_401(await call(b, endpoint, bearer(consumer)))
        assert_401(await a.get("/v1/models", headers=bearer(consumer)))


async def test_tenant_changes_apply_at_once_on_the_replica_that_made_them(env: Env) -> None:
    ttl = env.config.auth.cache_ttl
    consumer, _ = await env.key()
    one_request = Limits(requests_per_second=0.001, request_burst=1, tokens_per_second=1000, token_burst=1e6)
    async with env.replica() as a, env.replica() as b:
        # No quotas yet: unmetered, and the key's tenant is cached on both replicas.
        for replica in (a, b):
            before = await call(replica, CHAT, bearer(consumer))
            assert before.status_code == 200, before.text
            assert "RateLimit-Policy" not in before.headers

        quotas = msgspec.to_builtins(Quotas(tenant=one_request))
        changed = await a.patch("/admin/tenants/acme", json={"quotas": quotas}, headers=bearer(env.admin))
        assert changed.status_code == 200, changed.text

        first = await call(a, CHAT, bearer(consumer))
        assert first.status_code == 200, first.text
        assert re.search(r'"tenant-requests";q=1;', first.headers["RateLimit-Policy"])
        second = await call(a, CHAT, bearer(consumer))
        assert second.status_code == 429, second.text

        # The other replica takes the new quotas within the TTL (the shared bucket is empty by now).
        env.clock.advance(ttl)
        late = await call(b, CHAT, bearer(consumer))
        assert late.status_code == 429, late.text
        assert re.search(r'"tenant-requests";q=1;', late.headers["RateLimit-Policy"])


async def test_the_secret_of_a_key_is_never_stored(env: Env, http: httpx.AsyncClient, tmp_path: Path) -> None:
    created = await http.post(
        "/admin/tenants/acme/keys", json={"roles": ["consumer"], "label": "ci"}, headers=bearer(env.admin)
    )
    assert created.status_code == 201, created.text
    plaintext = created.json()["key"]
    parsed = keys.parse_key(plaintext)
    assert parsed is not None
    key_id, secret = parsed
    assert (await http.get("/v1/models", headers=bearer(plaintext))).status_code == 200

    listed = await env.store.list_keys("acme")
    assert key_id in [k.key_id for k in listed]
    stored = await env.store.get_key(key_id)
    assert keys.verify(secret, stored.secret_hash)
    for text in (msgspec.json.encode(listed).decode(), msgspec.json.encode(stored).decode()):
        assert secret not in text
        assert plaintext not in text

    changes = await http.get("/admin/changes", headers=bearer(env.admin))
    assert changes.status_code == 200
    assert f"key:{key_id}" in [c["target"] for c in changes.json()]
    assert secret not in changes.text
    assert stored.secret_hash not in changes.text
    for change in await env.store.changes(1000):
        assert secret not in (change.after or "")
        assert stored.secret_hash not in (change.after or "")

    if env.backends.name == "memory+sqlite":
        # Nor anywhere in the database files (the main file and its write-ahead log).
        assert await asyncio.to_thread(files_containing, tmp_path, key_id.encode())  # the scan sees the key
        assert await asyncio.to_thread(files_containing, tmp_path, secret.encode()) == []


def files_containing(folder: Path, needle: bytes) -> list[Path]:
    return [path for path in folder.iterdir() if path.is_file() and needle in path.read_bytes()]

"""The authenticator when the tenant store is down or hangs, and under a flood of unknown keys.

The store is a real SQLite store behind a switch (up, down, hanging) that counts lookups; the cache clock is
injected. `store_timeout` is real time, kept short: nothing here asserts how long anything took, only that
every call ends (a hang fails the test through its own bound).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal, cast

import httpx
import pytest

from engines.simulated import SimulatedEngine
from gateway.app import create_app
from gateway.generation.prompts import PromptRenderer
from policy.auth import SYSTEM_TENANT, Authenticator, AuthError, StoreUnavailableError
from policy.tenants import keys
from policy.tenants.base import TenantStore, UnavailableError
from policy.tenants.models import ApiKey, Role, StoredKey, Tenant
from policy.tenants.sqlite import SqliteTenantStore
from tests.backends import FakeClock
from tests.conftest import MODEL, make_config, serving

TTL = 5.0
GRACE = 60.0
NEGATIVE_TTL = 2.0
# A bound on any one call: only a hang can reach it. Also the store timeout of an authenticator whose store
# answers or fails fast: a real SQLite lookup on a loaded machine can take far longer than a short timeout.
NO_HANG = 30.0
# Real seconds: the store timeout of the tests whose store hangs, short so that waiting it out stays quick.
TIMEOUT = 0.05

Mode = Literal["up", "down", "hang"]


class SwitchedStore:
    """A tenant store that answers, fails as unreachable, or hangs, as the test says; counts key lookups."""

    def __init__(self, inner: TenantStore) -> None:
        self.inner = inner
        self.mode: Mode = "up"
        self.key_lookups = 0
        self.in_flight = 0
        self.most_in_flight = 0
        self._resume = asyncio.Event()

    def set(self, mode: Mode) -> None:
        """Switch; leaving "hang" lets the hanging calls go on."""
        self.mode = mode
        if mode == "hang":
            self._resume.clear()
        else:
            self._resume.set()

    async def _gate(self) -> None:
        if self.mode == "hang":
            await self._resume.wait()
        if self.mode == "down":
            raise UnavailableError("the tenant database is unreachable: test")

    async def get_key(self, key_id: str) -> StoredKey:
        self.key_lookups += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await self._gate()
            return await self.inner.get_key(key_id)
        finally:
            self.in_flight -= 1

    async def get_tenant(self, tenant_id: str) -> Tenant:
        await self._gate()
        return await self.inner.get_tenant(tenant_id)

    async def list_tenants(self) -> list[Tenant]:
        await self._gate()
        return await self.inner.list_tenants()


class Setup:
    """An authenticator on a switched store, with tenant `acme`."""

    def __init__(self, inner: SqliteTenantStore, store: SwitchedStore, clock: FakeClock) -> None:
        self.inner = inner
        self.store = store
        self.clock = clock
        self.auth = self.authenticator()

    def authenticator(self, max_entries: int = 10_000, store_timeout: float = NO_HANG) -> Authenticator:
        return Authenticator(
            cast(TenantStore, self.store),
            self.clock,
            TTL,
            max_entries,
            store_timeout=store_timeout,
            stale_grace=GRACE,
            negative_ttl=NEGATIVE_TTL,
        )

    async def key(self, tenant_id: str = "acme", roles: tuple[Role, ...] = ("consumer",)) -> str:
        plaintext, key_id, secret_hash = keys.new_key()
        key = ApiKey(key_id=key_id, tenant_id=tenant_id, roles=roles)
        await self.inner.add_key(key, secret_hash, actor="test", now=self.clock())
        return f"Bearer {plaintext}"

    async def check(self, header: str, auth: Authenticator | None = None) -> None:
        """Authenticate within the no-hang bound."""
        async with asyncio.timeout(NO_HANG):
            await (auth or self.auth).authenticate(header)


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[Setup]:
    inner = await SqliteTenantStore.open(tmp_path / "tenants.sqlite3")
    clock = FakeClock()
    await inner.create_tenant(Tenant(tenant_id="acme", display_name="Acme"), actor="test", now=clock())
    store = SwitchedStore(inner)
    yield Setup(inner, store, clock)
    store.set("up")  # lets any lookup still hanging end before the store closes
    await inner.close()


def outages(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What the authenticator said of the tenant store: "down" and "up" in order (its warnings)."""
    said = {"tenant store unreachable": "down", "tenant store reachable again": "up"}
    return [
        word
        for record in caplog.records
        if record.name == "lockgate.auth"
        for prefix, word in said.items()
        if record.getMessage().startswith(prefix)
    ]


def timed_for(setup: Setup, mode: Mode) -> Authenticator:
    """An authenticator whose store timeout a test in `mode` can wait out (short only for a hang)."""
    return setup.authenticator(store_timeout=TIMEOUT if mode == "hang" else NO_HANG)


@pytest.mark.parametrize("mode", ["down", "hang"])
async def test_an_uncached_key_gets_store_unavailable_and_a_cached_one_works(
    setup: Setup, mode: Mode, caplog: pytest.LogCaptureFixture
) -> None:
    auth = timed_for(setup, mode)
    cached = await setup.key()
    uncached = await setup.key()
    await setup.check(cached, auth)
    setup.store.set(mode)
    with pytest.raises(StoreUnavailableError) as info:
        await setup.check(uncached, auth)
    assert info.value.retry_after >= 1
    assert outages(caplog) == ["down"]
    await setup.check(cached, auth)  # within its TTL: the store is not asked at all
    setup.store.set("up")
    await setup.check(uncached, auth)  # back by itself
    assert outages(caplog) == ["down", "up"]


@pytest.mark.parametrize("mode", ["down", "hang"])
async def test_a_cached_key_is_served_past_its_ttl_only_while_the_store_is_out(
    setup: Setup, mode: Mode, caplog: pytest.LogCaptureFixture
) -> None:
    auth = timed_for(setup, mode)
    header = await setup.key()
    await setup.check(header, auth)
    setup.store.set(mode)
    setup.clock.advance(TTL + 1)
    await setup.check(header, auth)  # stale but within the grace: served
    assert outages(caplog) == ["down"]
    lookups = setup.store.key_lookups
    await setup.check(header, auth)  # the outage is known: served at once, one renewal in flight at most
    assert setup.store.key_lookups <= lookups + 1
    setup.clock.advance(GRACE)  # now past cache_ttl + stale_grace
    with pytest.raises(StoreUnavailableError):
        await setup.check(header, auth)


async def test_the_outage_is_known_so_a_stale_key_does_not_wait_for_the_store(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    # A timeout far longer than the no-hang bound: a request that waited for it would fail the test.
    auth = setup.authenticator(store_timeout=NO_HANG * 10)
    header = await setup.key()
    await setup.check(header, auth)
    setup.store.set("down")
    setup.clock.advance(TTL + 1)
    await setup.check(header, auth)  # learns of the outage (the store fails fast)
    setup.store.set("hang")
    lookups = setup.store.key_lookups
    for _ in range(5):
        await setup.check(header, auth)  # the store now hangs, and nobody waits on it
    async with asyncio.timeout(NO_HANG):
        while setup.store.in_flight == 0:  # noqa: ASYNC110 - the renewal task starts on its own
            await asyncio.sleep(0)
    assert setup.store.key_lookups == lookups + 1  # one renewal shared by all of them
    setup.store.set("up")
    async with asyncio.timeout(NO_HANG):
        while outages(caplog) != ["down", "up"]:  # noqa: ASYNC110 - the renewal ends on its own and says so
            await asyncio.sleep(0.01)


async def test_a_revocation_is_seen_once_the_store_answers_again(setup: Setup) -> None:
    header = await setup.key()
    key_id = header.split("-")[1]
    await setup.check(header)
    setup.store.set("down")
    setup.clock.advance(TTL + 1)
    await setup.check(header)
    await setup.inner.revoke_key(key_id, actor="test", now=setup.clock())  # made on another replica
    setup.store.set("up")
    setup.clock.advance(1)
    # The first request may still be served stale (it starts the renewal); the renewal sees the revocation.
    async with asyncio.timeout(NO_HANG):
        while True:
            try:
                await setup.auth.authenticate(header)
            except AuthError:
                break
            await asyncio.sleep(0.01)


async def test_store_bugs_are_not_outages(setup: Setup, caplog: pytest.LogCaptureFixture) -> None:
    async def broken(key_id: str) -> StoredKey:
        raise RuntimeError("a bug")

    setup.store.get_key = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="a bug"):
        await setup.check(await setup.key())
    assert outages(caplog) == []


async def test_a_flood_of_one_unknown_key_costs_one_lookup_per_negative_ttl(setup: Setup) -> None:
    unknown, _, _ = keys.new_key()
    header = f"Bearer {unknown}"
    good = await setup.key()

    async def refused() -> None:
        with pytest.raises(AuthError):
            await setup.check(header)

    # Concurrent: one store call shared by all of them.
    await asyncio.gather(*(refused() for _ in range(200)))
    assert setup.store.key_lookups == 1
    # Sequential, within negative_ttl: remembered.
    for _ in range(200):
        await refused()
    assert setup.store.key_lookups == 1
    await setup.check(good)  # a real key is still looked up
    assert setup.store.key_lookups == 2
    setup.clock.advance(NEGATIVE_TTL)
    await refused()
    assert setup.store.key_lookups == 3


async def test_the_negative_cache_is_bounded(setup: Setup) -> None:
    auth = setup.authenticator(max_entries=8)
    unknown = [f"Bearer {keys.new_key()[0]}" for _ in range(100)]
    for header in unknown:
        with pytest.raises(AuthError):
            await setup.check(header, auth)
    assert setup.store.key_lookups == 100
    assert setup.store.most_in_flight == 1
    # The newest are remembered, the oldest were dropped to keep the bound.
    with pytest.raises(AuthError):
        await setup.check(unknown[-1], auth)
    assert setup.store.key_lookups == 100
    with pytest.raises(AuthError):
        await setup.check(unknown[0], auth)
    assert setup.store.key_lookups == 101


async def test_http_store_outage_is_a_503_in_openai_shape(
    setup: Setup, sim_engine: SimulatedEngine, renderer: PromptRenderer
) -> None:
    cached, uncached = await setup.key(), await setup.key()
    await setup.inner.create_tenant(
        Tenant(tenant_id=SYSTEM_TENANT, display_name="Operator"), actor="test", now=setup.clock()
    )
    admin = {"authorization": await setup.key(SYSTEM_TENANT, ("policy_admin",))}
    app = create_app(
        make_config(),
        engine=sim_engine,
        renderer=renderer,
        tenants=cast(TenantStore, setup.store),
        clock=setup.clock,
    )
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=NO_HANG) as http:
        assert (
            await http.post("/v1/chat/completions", json=body, headers={"authorization": cached})
        ).is_success
        assert (await http.get("/admin/tenants", headers=admin)).status_code == 200
        setup.store.set("down")
        # The admin API needs the store itself: the same 503, not a 500, for a key that is cached.
        listed = await http.get("/admin/tenants", headers=admin)
        assert listed.status_code == 503, listed.text
        assert listed.headers["retry-after"] == "1"
        assert listed.json()["error"]["code"] == "store_unavailable"
        refused = await http.post("/v1/chat/completions", json=body, headers={"authorization": uncached})
        assert refused.status_code == 503, refused.text
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.headers.get("x-request-id")
        assert refused.json()["error"]["type"] == "service_unavailable"
        assert refused.json()["error"]["code"] == "store_unavailable"
        served = await http.post("/v1/chat/completions", json=body, headers={"authorization": cached})
        assert served.status_code == 200, served.text
        setup.store.set("up")
        again = await http.post("/v1/chat/completions", json=body, headers={"authorization": uncached})
        assert again.status_code == 200, again.text

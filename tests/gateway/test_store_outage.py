"""PostgreSQL outages under load, with real processes: the gateway (in-process, simulated engine) keeps its
tenants and registry on a private PostgreSQL server that the test pauses (SIGSTOP: slow, not dead) or stops
(`pg_ctl stop -m immediate`) while clients of the `openai` SDK keep sending requests.

Held throughout: keys already cached keep working (past their TTL, within `auth.stale_grace`); a key that is
not cached gets 503 `store_unavailable` with Retry-After, never a 500 and never a hang; `/readyz` reports the
registry stale, with its age, once no refresh has succeeded for `registry.max_staleness`; and when PostgreSQL
is back everything resumes by itself. The cache clock is injected (the test moves it); time limits are real
seconds but nothing asserts how long anything took.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import openai
import pytest

from engines.simulated import SimulatedEngine
from gateway.app import create_app
from gateway.config import (
    AuthConfig,
    Config,
    GuardConfig,
    ModelConfig,
    RegistryConfig,
    ServerConfig,
    StorageConfig,
)
from gateway.generation.prompts import PromptRenderer
from policy.tenants import keys
from policy.tenants.models import ApiKey, Tenant
from policy.tenants.postgres import PostgresTenantStore
from tests.backends import FakeClock
from tests.conftest import DATA_DIR, MODEL, operator_headers, serving
from tests.postgres_server import PrivatePostgres, private_postgres  # noqa: F401 - the fixture

CACHE_TTL = 5.0
MAX_STALENESS = 30.0
# A healthy lookup must never reach it (the test process can stall for a second in a loaded full suite);
# a paused store costs this much per refused lookup.
STORE_TIMEOUT = 2.0
# Far above every time limit configured here: only a hang reaches it.
NO_HANG = 20.0
# Recovery after PostgreSQL returns: reconnecting pools, a refresher tick. Bounded polls, never a sleep.
RECOVER_WITHIN = 60.0
WORKERS = 6
CACHED_KEYS = 3

Fault = Literal["pause", "stop"]


@dataclass
class Gateway:
    """A served app on the private server, its clock, and keys: cached by the load, or never used yet."""

    url: str
    clock: FakeClock
    cached: list[str]
    uncached: list[str]
    # Headers of an operator key, which `/readyz` answers in detail (cached by the first probe).
    operator: dict[str, str]


@dataclass
class Load:
    """Chat completions from `openai` SDK clients, round robin over the cached keys, until stopped."""

    url: str
    keys: list[str]
    ok: int = 0
    unexpected: list[str] = field(default_factory=list)
    progress: asyncio.Event = field(default_factory=asyncio.Event)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def worker(self, index: int) -> None:
        client = openai.AsyncOpenAI(
            base_url=f"{self.url}/v1",
            api_key=self.keys[index % len(self.keys)],
            max_retries=0,
            timeout=NO_HANG,
        )
        async with client:
            while not self.stop.is_set():
                try:
                    reply = await client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
                    )
                    assert reply.choices
                    self.ok += 1
                    self.progress.set()
                except openai.APIStatusError as exc:
                    self.unexpected.append(f"{exc.status_code}: {exc.message}")
                except openai.APIError as exc:  # a timeout or a dropped connection: a hang or a crash
                    self.unexpected.append(repr(exc))

    async def served(self, more: int) -> None:
        """Wait until `more` further requests succeeded (the load is alive and served)."""
        target = self.ok + more
        async with asyncio.timeout(RECOVER_WITHIN):
            while self.ok < target:
                assert not self.unexpected, self.unexpected
                self.progress.clear()
                await self.progress.wait()


async def until(check: Callable[[], Awaitable[bool]]) -> None:
    """Poll `check` (state of another process: no event to wait on) until it holds, bounded."""
    async with asyncio.timeout(RECOVER_WITHIN):
        while not await check():  # noqa: ASYNC110 - polling another process's state
            await asyncio.sleep(0.05)


@pytest.fixture
async def gateway(
    private_postgres: PrivatePostgres,  # noqa: F811 - the imported fixture
    sim_engine: SimulatedEngine,
    renderer: PromptRenderer,
) -> AsyncIterator[Gateway]:
    pg = private_postgres
    schema = f"outage_{secrets.token_hex(4)}"
    clock = FakeClock()
    # Setting up is not under test: generous limits, so a busy machine cannot fail it.
    seed = await PostgresTenantStore.open(pg.dsn, schema=schema, connect_timeout=120.0, command_timeout=120.0)
    try:
        await seed.create_tenant(Tenant(tenant_id="acme", display_name="Acme"), actor="test", now=clock())
        plaintexts = []
        for _ in range(CACHED_KEYS + 2):
            plaintext, key_id, secret_hash = keys.new_key()
            key = ApiKey(key_id=key_id, tenant_id="acme", roles=("consumer",))
            await seed.add_key(key, secret_hash, actor="test", now=clock())
            plaintexts.append(plaintext)
        operator = await operator_headers(seed)
    finally:
        await seed.close()
    config = Config(
        # Each probe checks again: the clock only moves when the test moves it.
        server=ServerConfig(readiness_cache=0.0),
        model=ModelConfig(data_dir=str(DATA_DIR)),
        storage=StorageConfig(
            backend="postgres",
            postgres_dsn=pg.dsn,
            postgres_schema=schema,
            postgres_connect_timeout=2.0,
            postgres_command_timeout=5.0,
        ),
        auth=AuthConfig(cache_ttl=CACHE_TTL, store_timeout=STORE_TIMEOUT, stale_grace=60.0, negative_ttl=2.0),
        registry=RegistryConfig(refresh_interval=0.1, refresh_timeout=0.5, max_staleness=MAX_STALENESS),
        guard=GuardConfig(default_policy="rules"),
    )
    app = create_app(config, engine=sim_engine, renderer=renderer, clock=clock)
    async with serving(app) as url:
        try:
            yield Gateway(url, clock, plaintexts[:CACHED_KEYS], plaintexts[CACHED_KEYS:], operator)
        finally:
            # Whatever the test left: the app closes its pools on a server that answers.
            await pg.ensure_running()


async def refused_for_the_store(http: httpx.AsyncClient, key: str) -> None:
    """`key` is not cached: a 503 store_unavailable in the OpenAI shape, with Retry-After."""
    response = await http.get("/v1/models", headers={"authorization": f"Bearer {key}"})
    assert response.status_code == 503, response.text
    assert int(response.headers["retry-after"]) >= 1
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("service_unavailable", "store_unavailable")


async def readyz(http: httpx.AsyncClient, gateway: Gateway) -> tuple[int, dict[str, Any]]:
    response = await http.get("/readyz", headers=gateway.operator)
    body: dict[str, Any] = response.json()
    return response.status_code, body


@pytest.mark.parametrize("fault", ["pause", "stop"])
async def test_postgres_outage_under_load(
    gateway: Gateway,
    private_postgres: PrivatePostgres,  # noqa: F811 - the imported fixture
    fault: Fault,
) -> None:
    pg = private_postgres
    load = Load(gateway.url, gateway.cached)
    workers = [asyncio.create_task(load.worker(i)) for i in range(WORKERS)]
    async with httpx.AsyncClient(base_url=gateway.url, timeout=NO_HANG) as http:
        try:
            await load.served(4 * WORKERS)  # every cached key verified and cached
            status, body = await readyz(http, gateway)
            assert (status, body["registry"]["status"]) == (200, "fresh"), body

            if fault == "pause":
                pg.pause()
            else:
                await pg.stop()
            try:
                # Past the TTL: every cached key needs the store now, and it cannot answer.
                gateway.clock.advance(CACHE_TTL + 1)
                await load.served(4 * WORKERS)
                for key in gateway.uncached:
                    await refused_for_the_store(http, key)
                # Several at once, as a burst of new clients would come: each a 503, none a hang or a 500.
                await asyncio.gather(*(refused_for_the_store(http, gateway.uncached[0]) for _ in range(8)))

                gateway.clock.advance(MAX_STALENESS)

                async def stale() -> bool:
                    status, body = await readyz(http, gateway)
                    return status == 503 and body["registry"]["status"] == "stale"

                await until(stale)
                status, body = await readyz(http, gateway)
                registry = body["registry"]
                assert body["status"] == "not_ready"
                assert registry["age_s"] > MAX_STALENESS
                assert registry["refresher"] == "running"
                assert registry["consecutive_failures"] >= 1
                assert registry["last_error"]
                assert body["engines"] == {gateway_engine(body): True}
                await load.served(4 * WORKERS)  # still served, stale and all
            finally:
                if fault == "pause":
                    pg.resume()
                else:
                    await pg.start()

            # Back by itself: new keys are looked up, the registry is fresh again.
            async def key_served() -> bool:
                response = await http.get(
                    "/v1/models", headers={"authorization": f"Bearer {gateway.uncached[0]}"}
                )
                assert response.status_code in (200, 503), response.text
                return response.status_code == 200

            await until(key_served)

            async def fresh() -> bool:
                # A refresh that began before the store came back dates the view from its start, which can
                # be MAX_STALENESS old on the test clock: wait for one that began after.
                status, body = await readyz(http, gateway)
                registry = body["registry"]
                return status == 200 and registry["status"] == "fresh" and registry["age_s"] < MAX_STALENESS

            await until(fresh)
            _, body = await readyz(http, gateway)
            assert body["registry"]["consecutive_failures"] == 0
            assert body["registry"]["age_s"] < MAX_STALENESS
            await load.served(4 * WORKERS)
        finally:
            load.stop.set()
            await asyncio.gather(*workers)
    assert load.unexpected == [], Counter(load.unexpected).most_common(5)


def gateway_engine(body: dict[str, Any]) -> str:
    """The one engine replica named in a readyz body."""
    (replica,) = body["engines"]
    return str(replica)

"""A flood of made-up keys: failures are limited per source before any store lookup, a legitimate key keeps
working (from elsewhere, or cached), and a key created after its id was remembered as unknown works once the
negative cache forgets it. The limit's bucket itself, and the 429 it answers over HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import httpx
import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engines.simulated import SimulatedEngine
from gateway.app import create_app
from gateway.config import AuthConfig
from gateway.generation.prompts import PromptRenderer
from policy.auth import Authenticator, AuthError, ThrottledError
from policy.auth_limit import FailedAuthLimit, source_of
from policy.tenants import keys
from policy.tenants.base import TenantStore
from policy.tenants.models import ApiKey, Tenant
from policy.tenants.sqlite import SqliteTenantStore
from tests.backends import FakeClock
from tests.conftest import MODEL, make_config, serving
from tests.policy.test_auth_outage import SwitchedStore

BURST = 10
PER_SECOND = 0.5
NEGATIVE_TTL = 2.0


def made_up() -> str:
    return f"Bearer {keys.new_key()[0]}"


class Flood:
    """An authenticator with a failed-auth limit on a store that counts lookups, with tenant `acme`."""

    def __init__(self, inner: SqliteTenantStore, clock: FakeClock) -> None:
        self.inner = inner
        self.store = SwitchedStore(inner)
        self.clock = clock
        self.limit = FailedAuthLimit(clock, burst=BURST, per_second=PER_SECOND)
        self.auth = Authenticator(
            cast(TenantStore, self.store), clock, 5.0, negative_ttl=NEGATIVE_TTL, failures=self.limit
        )

    async def key(self, plaintext: str | None = None) -> str:
        """A consumer key of `acme` (the given plaintext's id and secret, or a new one)."""
        plaintext = plaintext or keys.new_key()[0]
        parsed = keys.parse_key(plaintext)
        assert parsed is not None
        key_id, secret = parsed
        key = ApiKey(key_id=key_id, tenant_id="acme", roles=("consumer",))
        await self.inner.add_key(key, keys.hash_secret(secret), actor="test", now=self.clock())
        return f"Bearer {plaintext}"


@pytest.fixture
async def flood(tmp_path: Path) -> AsyncIterator[Flood]:
    inner = await SqliteTenantStore.open(tmp_path / "tenants.sqlite3")
    clock = FakeClock()
    await inner.create_tenant(Tenant(tenant_id="acme", display_name="Acme"), actor="test", now=clock())
    yield Flood(inner, clock)
    await inner.close()


async def test_many_requests_of_one_new_key_at_once_share_one_lookup_and_one_token(flood: Flood) -> None:
    # A client opening many connections with a key not yet cached: one store lookup, which they all join;
    # joining it costs the store nothing, so none of them is throttled however small the budget.
    key = await flood.key()
    flood.store.set("hang")
    attempts = [asyncio.create_task(flood.auth.authenticate(key, "203.0.113.9")) for _ in range(5 * BURST)]
    # The one lookup starts after every attempt asked for the key (they were all scheduled first).
    while flood.store.in_flight == 0:  # noqa: ASYNC110 - the store offers no event to wait on
        await asyncio.sleep(0)
    flood.store.set("up")
    principals = await asyncio.gather(*attempts)
    assert {p.tenant.tenant_id for p in principals} == {"acme"}
    assert flood.store.key_lookups == 1


async def test_a_flood_of_random_key_ids_costs_a_bounded_number_of_lookups(flood: Flood) -> None:
    cached = await flood.key()
    await flood.auth.authenticate(cached, "203.0.113.7")
    lookups = flood.store.key_lookups
    waits: list[float] = []
    for _ in range(1_000):
        try:
            await flood.auth.authenticate(made_up(), "203.0.113.7")
        except ThrottledError as exc:
            waits.append(exc.retry_after)
        except AuthError:
            pass
    assert flood.store.key_lookups - lookups == BURST
    assert waits == [pytest.approx(1 / PER_SECOND)] * (1_000 - BURST)
    # During the flood: a key from another address is looked up and works; the flooding address is still
    # served a key it has cached, but nothing that would need the store.
    await flood.auth.authenticate(await flood.key(), "198.51.100.1")
    await flood.auth.authenticate(cached, "203.0.113.7")
    with pytest.raises(ThrottledError):
        await flood.auth.authenticate(await flood.key(), "203.0.113.7")
    # A wrong secret for a cached id costs no lookup, and is still a failure (no secret guessing for free).
    with pytest.raises(AuthError):
        await flood.auth.authenticate(cached[:-1] + ("A" if cached[-1] != "A" else "B"), "203.0.113.7")
    assert flood.store.key_lookups - lookups == BURST + 1  # the other address's key only
    # The bucket refills: one more try after 1 / PER_SECOND.
    flood.clock.advance(1 / PER_SECOND)
    with pytest.raises(AuthError):
        await flood.auth.authenticate(made_up(), "203.0.113.7")
    with pytest.raises(ThrottledError):
        await flood.auth.authenticate(made_up(), "203.0.113.7")
    assert flood.store.key_lookups - lookups == BURST + 2


async def test_concurrent_lookups_of_one_source_cannot_outrun_its_bucket(flood: Flood) -> None:
    """Lookups take their token as they start: 300 made-up keys sent at once (before any has failed) make
    BURST lookups, not 300; a good key's token is given back."""
    good = await flood.key()
    await flood.auth.authenticate(good, "203.0.113.9")
    assert flood.store.key_lookups == 1

    async def attempt() -> str:
        try:
            await flood.auth.authenticate(made_up(), "203.0.113.9")
        except ThrottledError:
            return "throttled"
        except AuthError:
            return "refused"
        return "served"

    outcomes = await asyncio.gather(*(attempt() for _ in range(300)))
    assert flood.store.key_lookups == 1 + BURST
    assert sorted(set(outcomes)) == ["refused", "throttled"]
    assert outcomes.count("refused") == BURST


async def test_one_ipv6_subscriber_is_one_source(flood: Flood) -> None:
    for n in range(BURST):
        with pytest.raises(AuthError):
            await flood.auth.authenticate(made_up(), source_of(f"2001:db8:1:2::{n:x}"))
    with pytest.raises(ThrottledError):
        await flood.auth.authenticate(made_up(), source_of("2001:db8:1:2:ffff::1"))
    with pytest.raises(AuthError):  # another /64
        await flood.auth.authenticate(made_up(), source_of("2001:db8:1:3::1"))


async def test_a_key_created_after_its_id_was_remembered_unknown_works_after_the_ttl(flood: Flood) -> None:
    plaintext = keys.new_key()[0]
    with pytest.raises(AuthError):
        await flood.auth.authenticate(f"Bearer {plaintext}", "192.0.2.1")
    header = await flood.key(plaintext)  # created on another replica: this one was not told
    with pytest.raises(AuthError):
        await flood.auth.authenticate(header, "192.0.2.1")  # still remembered as unknown
    flood.clock.advance(NEGATIVE_TTL)
    principal = await flood.auth.authenticate(header, "192.0.2.1")
    assert principal.tenant.tenant_id == "acme"


def test_source_of_groups_ipv6_by_64_and_unwraps_mapped_ipv4() -> None:
    assert source_of("203.0.113.7") == "203.0.113.7"
    assert source_of("2001:db8:1:2:aaaa::1") == source_of("2001:db8:1:2::ffff") == "2001:db8:1:2::/64"
    assert source_of("::ffff:203.0.113.7") == "203.0.113.7"
    assert source_of(None) == source_of("") == ""
    assert source_of("unix-socket") == "unix-socket"


def test_the_source_table_is_bounded() -> None:
    clock = FakeClock()
    limit = FailedAuthLimit(clock, burst=1, per_second=0.0, max_sources=4)
    for n in range(100):
        limit.failed(f"10.0.0.{n}")
    assert limit.retry_after("10.0.0.99") is not None
    assert limit.retry_after("10.0.0.0") is None  # dropped to keep the bound: starts again


@given(steps=st.lists(st.tuples(st.booleans(), st.floats(min_value=0, max_value=30)), max_size=60))
def test_failures_never_pass_the_bucket(steps: list[tuple[bool, float]]) -> None:
    """Whatever the timing, a source gets at most burst + per_second x elapsed failures through."""
    clock = FakeClock()
    limit = FailedAuthLimit(clock, burst=3, per_second=0.25)
    start, through = clock(), 0
    for fail, wait in steps:
        clock.advance(wait)
        if fail and limit.retry_after("s") is None:
            limit.failed("s")
            through += 1
        assert through <= 3 + 0.25 * (clock() - start) + 1e-9


def test_a_zero_burst_turns_the_limit_off() -> None:
    limit = FailedAuthLimit(FakeClock(), burst=0, per_second=0)
    for _ in range(100):
        limit.failed("s")
    assert limit.retry_after("s") is None


async def test_http_a_flooding_address_gets_429_in_openai_shape(
    tmp_path: Path, sim_engine: SimulatedEngine, renderer: PromptRenderer
) -> None:
    store = await SqliteTenantStore.open(tmp_path / "tenants.sqlite3")
    clock = FakeClock()
    await store.create_tenant(Tenant(tenant_id="acme", display_name="Acme"), actor="test", now=clock())
    plaintext, key_id, secret_hash = keys.new_key()
    await store.add_key(
        ApiKey(key_id=key_id, tenant_id="acme", roles=("consumer",)), secret_hash, actor="t", now=0
    )
    config = msgspec.structs.replace(make_config(), auth=AuthConfig(failed_burst=3, failed_per_second=0.5))
    app = create_app(config, engine=sim_engine, renderer=renderer, tenants=store, clock=clock)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        good = {"authorization": f"Bearer {plaintext}"}
        assert (await http.post("/v1/chat/completions", json=body, headers=good)).status_code == 200
        for _ in range(3):
            bad = {"authorization": made_up()}
            assert (await http.post("/v1/chat/completions", json=body, headers=bad)).status_code == 401
        refused = await http.post("/v1/chat/completions", json=body, headers={"authorization": made_up()})
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"] == "2"
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_exceeded", "auth_rate_limited")
        # Other routes share the limit (the models list too), and the cached key is still served.
        assert (await http.get("/v1/models", headers={"authorization": made_up()})).status_code == 429
        assert (await http.post("/v1/chat/completions", json=body, headers=good)).status_code == 200
    await store.close()

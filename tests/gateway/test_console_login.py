"""Signing in to the reviewer console (`gateway.console.login`), as an attacker would try it: the sign-in
form's CSRF token, the attempt limit per client address and per key id (an injected clock, clients at chosen
addresses through httpx's ASGI transport on the running app), the cookies' `Secure` and `__Host-` default
whatever scheme the gateway sees, and a full session store refusing rather than signing others out."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import httpx
import msgspec
import pytest
from litestar import Litestar

from engines.simulated import SimulatedEngine
from gateway.app import create_app
from gateway.config import ConsoleConfig
from gateway.console.login import LOGIN_COOKIE
from gateway.console.plumbing import COOKIE
from gateway.generation.prompts import PromptRenderer
from tests.backends import FakeClock
from tests.conftest import OutcomeLog, Tenancy, add_key, make_config, serving
from tests.gateway.test_console import csrf_of, form_token

INSECURE = ConsoleConfig(insecure_cookie=True)


class Gateway(msgspec.Struct, kw_only=True):
    """A running gateway: its URL, app, clock and a reviewer key of tenant acme."""

    url: str
    app: Litestar
    clock: FakeClock
    reviewer: str
    tenancy: Tenancy

    async def sign_in(self, http: httpx.AsyncClient, key: str) -> httpx.Response:
        """Fill in the sign-in form `http` fetches first."""
        return await http.post("/console/login", data={"key": key, "csrf": await form_token(http)})

    def client(self, address: str = "") -> httpx.AsyncClient:
        """A client over HTTP, or (given an address) one that reaches the app from that peer address."""
        if not address:
            return httpx.AsyncClient(base_url=self.url, timeout=30)
        transport = httpx.ASGITransport(app=self.app, client=(address, 40000))  # type: ignore[arg-type]
        return httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=30)


Start = Callable[[ConsoleConfig], AbstractAsyncContextManager["Gateway"]]


@pytest.fixture
def start(
    tmp_path: Path,
    sim_engine: SimulatedEngine,
    renderer: PromptRenderer,
    outcomes: OutcomeLog,
    tenancy: Tenancy,
) -> Start:
    """`start(console)`: a gateway with that `[console]` section on an injected clock."""

    @asynccontextmanager
    async def running(console: ConsoleConfig) -> AsyncIterator[Gateway]:
        config = make_config()
        storage = msgspec.structs.replace(config.storage, sqlite_path=str(tmp_path / "lockgate.sqlite3"))
        config = msgspec.structs.replace(config, storage=storage, console=console)
        clock = FakeClock()
        app = create_app(
            config, engine=sim_engine, renderer=renderer, tenants=tenancy.store, sink=outcomes, clock=clock
        )
        reviewer = await add_key(tenancy.store, "acme", ("reviewer",), now=clock.now)
        async with serving(app) as url:
            yield Gateway(url=url, app=app, clock=clock, reviewer=reviewer, tenancy=tenancy)

    return running


def set_cookies(response: httpx.Response) -> dict[str, set[str]]:
    """Each cookie the response sets: its name -> its lowercased attributes (`name=value` left out)."""
    cookies = {}
    for line in response.headers.get_list("set-cookie"):
        name, *attributes = (part.strip() for part in line.split(";"))
        cookies[name.split("=", 1)[0]] = {a.lower() for a in attributes}
    return cookies


async def test_a_cross_site_sign_in_is_refused_and_the_form_works(start: Start) -> None:
    async with start(INSECURE) as gw, gw.client() as victim, gw.client() as attacker:
        key = gw.reviewer
        # A form on another site posts the key straight away: no login cookie, no token.
        for data in ({"key": key}, {"key": key, "csrf": ""}, {"key": key, "csrf": "0" * 64}):
            refused = await victim.post("/console/login", data=data)
            assert refused.status_code == 403, refused.text
            assert "CSRF" in refused.text
            assert COOKIE not in refused.cookies
        # The attacker's own token (from its own visit) does not match the victim's login cookie.
        stolen = await form_token(attacker)
        await form_token(victim)
        assert (await victim.post("/console/login", data={"key": key, "csrf": stolen})).status_code == 403
        # Nor does the victim's token help a client without the victim's cookie.
        token = await form_token(victim)
        assert (
            await attacker.post("/console/login", data={"key": key, "csrf": token + "x"})
        ).status_code == 403
        fresh = gw.client()
        async with fresh:
            assert (await fresh.post("/console/login", data={"key": key, "csrf": token})).status_code == 403
        # The refusals showed a fresh form; the form, filled in, signs in and retires the login cookie.
        signed = await victim.post("/console/login", data={"key": key, "csrf": token})
        assert signed.status_code == 303, signed.text
        assert "max-age=0" in set_cookies(signed)[LOGIN_COOKIE]
        assert 'id="flagged"' in (await victim.get("/console")).text


async def test_a_flood_of_sign_ins_is_cut_and_a_reviewer_gets_in_after_the_wait(start: Start) -> None:
    console = ConsoleConfig(insecure_cookie=True, login_burst=3, login_per_minute=6.0)
    async with start(console) as gw, gw.client() as http:
        for _ in range(3):
            bad = await gw.sign_in(http, "guess")
            assert bad.status_code == 401
        # Even the right key waits now: the address spent its burst.
        limited = await gw.sign_in(http, gw.reviewer)
        assert limited.status_code == 429
        assert limited.headers["retry-after"] == "10"  # one attempt back every 60 / 6 s
        assert COOKIE not in limited.cookies
        assert csrf_of(limited.text)  # the page is still a usable form
        gw.clock.advance(9.0)
        early = await gw.sign_in(http, gw.reviewer)
        assert early.status_code == 429
        gw.clock.advance(1.0)
        signed = await gw.sign_in(http, gw.reviewer)
        assert signed.status_code == 303, signed.text


async def test_a_key_id_is_limited_from_every_address_and_an_ipv6_host_by_its_64(start: Start) -> None:
    console = ConsoleConfig(insecure_cookie=True, login_burst=2, login_per_minute=1.0)
    async with start(console) as gw:
        # A wrong secret for the reviewer's key id, from a new address each time.
        wrong = gw.reviewer[:-1] + ("A" if gw.reviewer[-1] != "A" else "B")
        statuses = []
        for n in range(3):
            async with gw.client(f"10.0.0.{n + 1}") as http:
                statuses.append((await gw.sign_in(http, wrong)).status_code)
        assert statuses == [401, 401, 429]
        # Another key id from those addresses is not held back by it.
        async with gw.client("10.0.0.1") as http:
            other = await gw.sign_in(http, "guess")
            assert other.status_code == 401
        # Addresses of one IPv6 /64 share a bucket; another /64 has its own.
        statuses = []
        for address in ("2001:db8:1:1::1", "2001:db8:1:1::2", "2001:db8:1:1:ffff::3", "2001:db8:1:2::1"):
            async with gw.client(address) as http:
                statuses.append((await gw.sign_in(http, "guess")).status_code)
        assert statuses == [401, 401, 429, 401]


async def test_cookies_are_secure_with_the_host_prefix_even_over_plain_http(start: Start) -> None:
    async with start(ConsoleConfig()) as gw, gw.client() as http:
        form = await http.get("/console")
        [(name, login)] = set_cookies(form).items()
        assert name == f"__Host-{LOGIN_COOKIE}"
        nonce = form.headers["set-cookie"].split(";", 1)[0].split("=", 1)[1]
        # A client over plain HTTP keeps no Secure cookie: send it by hand, as a browser over TLS would.
        headers = {"cookie": f"{name}={nonce}"}
        data = {"key": gw.reviewer, "csrf": csrf_of(form.text)}
        signed = await http.post("/console/login", data=data, headers=headers)
        assert signed.status_code == 303, signed.text
        session = set_cookies(signed)[f"__Host-{COOKIE}"]
        for attributes in (login, session):
            assert {"secure", "httponly", "path=/", "samesite=strict"} <= attributes
            assert not any(a.startswith("domain") for a in attributes)
        sid = signed.cookies[f"__Host-{COOKIE}"]
        assert (
            'id="flagged"' in (await http.get("/console", headers={"cookie": f"__Host-{COOKIE}={sid}"})).text
        )
        # The unprefixed name (which a sibling subdomain or plain-HTTP page could set) is not read.
        page = await http.get("/console", headers={"cookie": f"{COOKIE}={sid}"})
        assert 'action="/console/login"' in page.text
    async with start(INSECURE) as gw, gw.client() as http:
        signed = await gw.sign_in(http, gw.reviewer)
        assert signed.status_code == 303
        assert "secure" not in set_cookies(signed)[COOKIE]


async def test_a_full_session_store_refuses_a_sign_in_and_signs_nobody_out(start: Start) -> None:
    console = ConsoleConfig(insecure_cookie=True, max_sessions=1)
    async with start(console) as gw, gw.client() as first, gw.client() as second:
        other = await add_key(gw.tenancy.store, "acme", ("reviewer",), now=gw.clock.now)
        assert (await gw.sign_in(first, gw.reviewer)).status_code == 303
        full = await gw.sign_in(second, other)
        assert full.status_code == 503
        assert COOKIE not in full.cookies
        assert 'id="flagged"' in (await first.get("/console")).text

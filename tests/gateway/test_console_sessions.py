"""Console session stores: one contract suite for every `SessionStore` backend (memory and real Redis, on an
injected clock), then what only Redis does (sessions shared by gateway processes, ciphertext at rest, bounded
round trips), the builder, and two gateway apps on one Redis: a reviewer signed in on one is signed in on the
other, as with `lockgate serve --workers 2`.

Redis must run on 127.0.0.1:6379: without it the redis cases fail; they never skip. Every Redis store of the
suite writes under a key prefix of its own, deleted afterwards."""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path

import httpx
import msgspec
import pytest
import redis.asyncio
import redis.exceptions

import gateway.console.sessions
from engines.simulated import SimulatedEngine
from gateway.app import create_app
from gateway.config import Config, ConsoleConfig
from gateway.console.plumbing import COOKIE, PageError, session_call
from gateway.console.sessions import (
    MemorySessionStore,
    RedisSessionStore,
    Session,
    SessionStore,
    SessionStoreFullError,
    SessionStoreUnavailableError,
    open_session_store,
)
from gateway.console.sessions.redis import NONCE_BYTES, PREFIX, key_name
from gateway.generation.prompts import PromptRenderer
from tests.backends import REDIS_URL, FakeClock
from tests.conftest import OutcomeLog, Tenancy, add_key, free_port, make_config, serving
from tests.gateway.test_console import form_token

TTL = 60.0
PER_KEY = 3
MAX_SESSIONS = 100


class RedisSpace:
    """A private key prefix on the shared Redis: stores opened on it see each other's sessions."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.prefix = f"lockgate:test:{uuid.uuid4().hex}:console:session:"
        self.client = redis.asyncio.Redis.from_url(REDIS_URL)
        self._stores: list[RedisSessionStore] = []

    def store(self) -> RedisSessionStore:
        """Another store on the same keys (another gateway process), closed with the space."""
        self._stores.append(
            RedisSessionStore.from_url(
                REDIS_URL, self.clock, ttl=TTL, per_key=PER_KEY, op_timeout=5.0, prefix=self.prefix
            )
        )
        return self._stores[-1]

    async def keys(self) -> list[bytes]:
        """The keys under the prefix."""
        return [key async for key in self.client.scan_iter(match=f"{self.prefix}*")]

    async def session_keys(self) -> list[bytes]:
        """The keys of sessions (not the owners' lists of them)."""
        owners = f"{self.prefix}owner:".encode()
        return [key for key in await self.keys() if not key.startswith(owners)]

    async def drop(self) -> None:
        """Delete every key under the prefix and close every client."""
        keys = await self.keys()
        if keys:
            await self.client.delete(*keys)
        for store in self._stores:
            await store.aclose()
        await self.client.aclose()


@pytest.fixture
def clock() -> FakeClock:
    """The stores' clock."""
    return FakeClock()


async def open_space(clock: FakeClock) -> RedisSpace:
    """A fresh key prefix on Redis; fails the test (never skips) if Redis is unreachable."""
    space = RedisSpace(clock)
    try:
        await space.client.ping()
    except redis.exceptions.ConnectionError as exc:
        await space.client.aclose()
        pytest.fail(f"the Redis session store contract needs Redis at {REDIS_URL}: {exc}")
    return space


@pytest.fixture
async def space(clock: FakeClock) -> AsyncIterator[RedisSpace]:
    """A fresh key prefix on Redis, dropped afterwards."""
    space = await open_space(clock)
    yield space
    await space.drop()


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest, clock: FakeClock) -> AsyncIterator[SessionStore]:
    """Every backend, each test starting from no sessions."""
    if request.param == "memory":
        memory = MemorySessionStore(clock, ttl=TTL, max_sessions=MAX_SESSIONS, per_key=PER_KEY)
        yield memory
        await memory.aclose()
        return
    space = await open_space(clock)
    yield space.store()
    await space.drop()


def test_the_package_exports_exactly_its_public_names() -> None:
    assert set(gateway.console.sessions.__all__) == {
        "MemorySessionStore",
        "RedisSessionStore",
        "Session",
        "SessionStore",
        "SessionStoreError",
        "SessionStoreFullError",
        "SessionStoreUnavailableError",
        "open_session_store",
    }
    assert all(hasattr(gateway.console.sessions, name) for name in gateway.console.sessions.__all__)


# The contract: every backend.


async def test_open_then_get_then_close(store: SessionStore, clock: FakeClock) -> None:
    sid, session = await store.open("Bearer lg_abc", "lg_abc")
    assert session.authorization == "Bearer lg_abc"
    assert session.expires_at == clock.now + TTL
    # 32 random bytes, urlsafe base64.
    assert len(sid) >= 43
    assert len(session.csrf) >= 43
    assert await store.get(sid) == session
    await store.close(sid)
    assert await store.get(sid) is None
    await store.close(sid)  # Closing again (or an unknown id) is no error.


async def test_sessions_are_distinct_and_closed_one_by_one(store: SessionStore) -> None:
    first, one = await store.open("Bearer a", "a")
    second, two = await store.open("Bearer a", "a")
    assert first != second
    assert one.csrf != two.csrf
    await store.close(first)
    assert await store.get(first) is None
    assert await store.get(second) == two


async def test_unknown_missing_and_empty_ids_are_no_session(store: SessionStore) -> None:
    sid, _session = await store.open("Bearer a", "a")
    assert await store.get(sid + "x") is None
    assert await store.get("not-a-session") is None
    assert await store.get(None) is None
    assert await store.get("") is None
    await store.close(None)
    await store.close("")
    assert await store.get(sid) is not None


async def test_a_session_expires_by_the_injected_clock(store: SessionStore, clock: FakeClock) -> None:
    sid, session = await store.open("Bearer a", "a")
    clock.advance(TTL - 0.001)
    assert await store.get(sid) == session
    clock.advance(0.001)
    assert await store.get(sid) is None
    clock.now -= 1.0  # An expired session is gone for good, even if the clock steps back.
    assert await store.get(sid) is None


async def test_a_key_holds_at_most_per_key_sessions_its_oldest_ending_first(
    store: SessionStore, clock: FakeClock
) -> None:
    other, other_session = await store.open("Bearer b", "b")
    mine = []
    for _ in range(PER_KEY):
        mine.append((await store.open("Bearer a", "a"))[0])
        clock.advance(1.0)
    newest, _session = await store.open("Bearer a", "a")
    assert await store.get(mine[0]) is None
    assert all([await store.get(sid) is not None for sid in (*mine[1:], newest)])
    # Another key's session is never what makes room.
    assert await store.get(other) == other_session


async def test_signing_in_many_times_never_signs_another_key_out(store: SessionStore) -> None:
    # The attack of issue 42: one reviewer key logging in over and over evicted every other session.
    victims = [await store.open(f"Bearer v{n}", f"v{n}") for n in range(3)]
    for _ in range(MAX_SESSIONS + 20):
        await store.open("Bearer attacker", "attacker")
    for sid, session in victims:
        assert await store.get(sid) == session


async def test_closed_and_expired_sessions_free_their_keys_places(
    store: SessionStore, clock: FakeClock
) -> None:
    first = [(await store.open("Bearer a", "a"))[0] for _ in range(PER_KEY)]
    await store.close(first[-1])
    kept, _session = await store.open("Bearer a", "a")
    # The closed one made room: nothing still open was ended.
    assert all([await store.get(sid) is not None for sid in (*first[:-1], kept)])
    clock.advance(TTL)
    fresh = [(await store.open("Bearer a", "a"))[0] for _ in range(PER_KEY)]
    assert all([await store.get(sid) is not None for sid in fresh])


# Memory only.


async def test_a_full_memory_store_refuses_rather_than_evicts(clock: FakeClock) -> None:
    sessions = MemorySessionStore(clock, ttl=TTL, max_sessions=2, per_key=1)
    first, one = await sessions.open("Bearer a", "a")
    second, two = await sessions.open("Bearer b", "b")
    with pytest.raises(SessionStoreFullError):
        await sessions.open("Bearer c", "c")
    assert await sessions.get(first) == one
    assert await sessions.get(second) == two
    # A key at its own bound replaces its own session even in a full store.
    third, _session = await sessions.open("Bearer a", "a")
    assert await sessions.get(third) is not None
    assert await sessions.get(first) is None
    assert await sessions.get(second) == two
    # Expired sessions make room.
    clock.advance(TTL)
    assert await sessions.get(second) is None
    fourth, _session = await sessions.open("Bearer c", "c")
    assert await sessions.get(fourth) is not None


# Redis only.


async def test_two_stores_on_one_redis_share_sessions(space: RedisSpace) -> None:
    worker1, worker2 = space.store(), space.store()
    sid, session = await worker1.open("Bearer lg_shared", "lg_shared")
    assert await worker2.get(sid) == session
    await worker2.close(sid)
    assert await worker1.get(sid) is None
    assert await space.session_keys() == []


async def test_redis_holds_ciphertext_under_a_hash_of_the_id(space: RedisSpace) -> None:
    authorization = "Bearer lg_k1_" + "s3cr3t" * 8
    sid, session = await space.store().open(authorization, "k1")
    name = space.prefix + hashlib.sha256(sid.encode()).hexdigest()
    owner = space.prefix + "owner:" + hashlib.sha256(b"k1").hexdigest()
    assert sorted(await space.keys()) == sorted([name.encode(), owner.encode()])
    assert await space.client.lrange(owner, 0, -1) == [name.encode()]
    value = await space.client.get(name)
    assert isinstance(value, bytes)
    for clear in (authorization, authorization.removeprefix("Bearer "), session.csrf, sid):
        assert clear.encode() not in value
    assert msgspec.msgpack.encode(session) not in value
    # Each write draws a fresh nonce: the same session never encrypts to the same bytes twice.
    other, _ = await space.store().open(authorization, "k1")
    other_value = await space.client.get(key_name(other, space.prefix))
    assert isinstance(other_value, bytes)
    assert other_value[:NONCE_BYTES] != value[:NONCE_BYTES]
    # Redis forgets it when the session ends: its expiry is the session's remaining lifetime.
    assert 0 < await space.client.pttl(name) <= TTL * 1000


async def test_a_tampered_or_misplaced_value_is_no_session(space: RedisSpace) -> None:
    store = space.store()
    sid, _session = await store.open("Bearer a", "a")
    name = key_name(sid, space.prefix)
    value = await space.client.get(name)
    assert isinstance(value, bytes)
    for bad in (
        value[:-1] + bytes([value[-1] ^ 1]),  # one bit of the tag
        value[:NONCE_BYTES] + bytes([value[NONCE_BYTES] ^ 1]) + value[NONCE_BYTES + 1 :],  # of the text
        value[:20],
        b"",
        b"Bearer a",
    ):
        await space.client.set(name, bad)
        assert await store.get(sid) is None
    # A genuine value copied under another session's name does not open there (its key and AAD differ).
    other, _ = await store.open("Bearer b", "b")
    await space.client.set(key_name(other, space.prefix), value)
    assert await store.get(other) is None


async def test_an_expired_session_is_deleted_from_redis(space: RedisSpace, clock: FakeClock) -> None:
    store = space.store()
    sid, _session = await store.open("Bearer a", "a")
    clock.advance(TTL)
    # Redis' own expiry runs on real time and has not fired yet; the injected clock decides.
    assert await space.session_keys() != []
    assert await store.get(sid) is None
    assert await space.session_keys() == []


async def _unavailable_within(store: RedisSessionStore, bound: float) -> None:
    """Every operation of `store` fails as SessionStoreUnavailableError, each within `bound` seconds."""
    operations: list[Callable[[], Awaitable[object]]] = [
        lambda: store.open("Bearer a", "a"),
        lambda: store.get("some-session"),
        lambda: store.close("some-session"),
    ]
    for operation in operations:
        started = time.monotonic()
        with pytest.raises(SessionStoreUnavailableError):
            await operation()
        assert time.monotonic() - started < bound


async def test_unreachable_redis_is_unavailable_not_a_hang(clock: FakeClock) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    store = RedisSessionStore.from_url(url, clock, ttl=TTL, per_key=PER_KEY, op_timeout=0.5)
    await _unavailable_within(store, 0.5 + 0.5)
    await store.aclose()


async def test_a_stalled_redis_times_out_within_the_op_timeout(clock: FakeClock) -> None:
    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # Accept the connection and never answer.
        writer.close()

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    store = RedisSessionStore.from_url(
        f"redis://127.0.0.1:{port}/0", clock, ttl=TTL, per_key=PER_KEY, op_timeout=0.2
    )
    # op_timeout (and one resend after a dropped connection), not the OS's TCP timeout.
    await _unavailable_within(store, 2.0)
    await store.aclose()
    server.close()
    await server.wait_closed()


# The builder and the console's mapping of an outage.


async def test_the_builder_follows_the_console_config(clock: FakeClock) -> None:
    config = ConsoleConfig(session_ttl=5.0, max_sessions=2, sessions_per_key=1)
    memory = open_session_store(config, clock, REDIS_URL)
    assert isinstance(memory, MemorySessionStore)
    first, session = await memory.open("Bearer a", "a")
    assert session.expires_at == clock.now + 5.0
    await memory.open("Bearer a", "a")
    assert await memory.get(first) is None  # sessions_per_key = 1
    await memory.open("Bearer b", "b")
    with pytest.raises(SessionStoreFullError):  # max_sessions = 2
        await memory.open("Bearer c", "c")
    # An empty redis_url is the quota store's.
    shared = open_session_store(ConsoleConfig(session_store="redis"), clock, REDIS_URL)
    assert isinstance(shared, RedisSessionStore)
    sid, session = await shared.open("Bearer a", "a")
    try:
        assert await shared.get(sid) == session
        assert session.expires_at == clock.now + ConsoleConfig().session_ttl
    finally:
        await shared.close(sid)
        await shared.aclose()
    dead = ConsoleConfig(session_store="redis", redis_url=f"redis://127.0.0.1:{free_port()}/0")
    unreachable = open_session_store(dead, clock, REDIS_URL)
    with pytest.raises(SessionStoreUnavailableError):
        await unreachable.get("some-session")
    await unreachable.aclose()


async def test_a_store_outage_is_a_503_page() -> None:
    async def failing() -> Session | None:
        raise SessionStoreUnavailableError("down at 10.0.0.7:6379")

    with pytest.raises(PageError) as raised:
        await session_call(failing())
    assert raised.value.status == 503
    assert "10.0.0.7" not in str(raised.value)  # The page is shown before sign-in.


# Two gateway processes (here: two apps in one process) on one Redis.


def app_config(tmp_path: Path, console: ConsoleConfig) -> Config:
    """The tests' app config with its own SQLite file and `console`."""
    config = make_config()
    storage = msgspec.structs.replace(config.storage, sqlite_path=str(tmp_path / "lockgate.sqlite3"))
    return msgspec.structs.replace(config, storage=storage, console=console)


async def test_a_reviewer_signed_in_on_one_worker_is_signed_in_on_the_other(
    tmp_path: Path,
    sim_engine: SimulatedEngine,
    renderer: PromptRenderer,
    outcomes: OutcomeLog,
    tenancy: Tenancy,
) -> None:
    config = app_config(
        tmp_path, ConsoleConfig(session_store="redis", redis_url=REDIS_URL, insecure_cookie=True)
    )
    key = await add_key(tenancy.store, "acme", ("reviewer",))
    async with AsyncExitStack() as stack:
        urls = []
        for _worker in range(2):
            app = create_app(
                config, engine=sim_engine, renderer=renderer, tenants=tenancy.store, sink=outcomes
            )
            urls.append(await stack.enter_async_context(serving(app)))
        one = await stack.enter_async_context(httpx.AsyncClient(base_url=urls[0], timeout=30))
        two = await stack.enter_async_context(httpx.AsyncClient(base_url=urls[1], timeout=30))
        signed_in = await one.post("/console/login", data={"key": key, "csrf": await form_token(one)})
        assert signed_in.status_code == 303, signed_in.text
        sid = signed_in.cookies[COOKIE]
        two.cookies.set(COOKIE, sid, path="/")
        raw = redis.asyncio.Redis.from_url(REDIS_URL)
        stack.push_async_callback(raw.aclose)
        stack.push_async_callback(raw.delete, key_name(sid, PREFIX))
        page = await two.get("/console")
        assert page.status_code == 200
        assert 'id="flagged"' in page.text
        csrf = page.text.split('name="csrf" value="', 1)[1].split('"', 1)[0]
        # Signed out on the second worker: the first no longer knows the session either.
        assert (await two.post("/console/logout", data={"csrf": csrf})).status_code == 303
        assert 'action="/console/login"' in (await one.get("/console")).text
        assert await raw.exists(key_name(sid, PREFIX)) == 0


async def test_an_unreachable_session_store_is_a_503_page_not_a_crash(
    tmp_path: Path,
    sim_engine: SimulatedEngine,
    renderer: PromptRenderer,
    outcomes: OutcomeLog,
    tenancy: Tenancy,
) -> None:
    dead = ConsoleConfig(
        session_store="redis",
        redis_url=f"redis://127.0.0.1:{free_port()}/0",
        op_timeout=0.2,
        insecure_cookie=True,
    )
    config = app_config(tmp_path, dead)
    key = await add_key(tenancy.store, "acme", ("reviewer",))
    app = create_app(config, engine=sim_engine, renderer=renderer, tenants=tenancy.store, sink=outcomes)
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        # No cookie: the sign-in form needs no store.
        assert 'action="/console/login"' in (await http.get("/console")).text
        refused = await http.post("/console/login", data={"key": key, "csrf": await form_token(http)})
        assert refused.status_code == 503
        assert "try again shortly" in refused.text
        assert COOKIE not in refused.cookies
        http.cookies.set(COOKIE, "some-session", path="/")
        assert (await http.get("/console")).status_code == 503

"""Session stores: one contract suite for every `SessionStore` backend (memory, real Redis and real
PostgreSQL), then what each does alone (the memory store's clock and bound, Redis' expiry, key layout and
failures, PostgreSQL's forgetting, table layout and failures).

Redis must run on 127.0.0.1:6379 and PostgreSQL at `PG_DSN`: without them their cases fail; they never skip.
Every Redis store here writes under a key prefix of its own, deleted afterwards; every PostgreSQL store in a
fresh schema, dropped afterwards."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import msgspec
import pytest
import redis.asyncio

from gateway.keeping import StoredAnswer
from gateway.schemas import ChatMessage, FunctionCall, ToolCall
from gateway.sessions.base import (
    Bound,
    Ended,
    IndexEntry,
    Migration,
    Pending,
    SessionRecord,
    SessionStore,
    SessionStoreUnavailableError,
    Step,
    Usage,
    Versioned,
)
from gateway.sessions.memory import MemorySessionStore
from gateway.sessions.postgres import SWEEP_LIMIT, PostgresSessionStore
from gateway.sessions.redis import RedisSessionStore
from tests.backends import PG_DSN, REDIS_URL, FakeClock, postgres_schema

KEEP = 3600.0
NOW = 1_800_000_000.0
BOUND = Bound(model="m@1", tokenizer="tok@1", chat_template="tpl@1", policy="default@3", prompt="support@2")

Opener = Callable[[], SessionStore]


def record(session_id: str = "s1", tenant: str = "acme", **changes: object) -> SessionRecord:
    """A fresh session (no steps) of `tenant`, with `changes` applied."""
    fresh = SessionRecord(
        id=session_id,
        tenant=tenant,
        key_id="key-1",
        model="m",
        bound=BOUND,
        created_at=NOW,
        expires_at=NOW + 86_400,
        idle_timeout=1_800.0,
        last_used=NOW,
        metadata={"ticket": "T-1"},
    )
    return msgspec.structs.replace(fresh, **changes)


def full_record() -> SessionRecord:
    """A session with everything a record holds: steps, a pending step, a migration, and its end."""
    answer = StoredAnswer(
        status=200,
        media_type="text/event-stream",
        headers=[("x-lockgate-model", "m@1"), ("x-lockgate-session", "s1")],
        body=b'data: {"choices": []}\n\n\x00\xff',
    )
    call = ToolCall(id="call_1", function=FunctionCall(name="lookup", arguments='{"q": "order 7"}'))
    step = Step(
        step=1,
        fingerprint="fp-1",
        messages=[
            ChatMessage(role="system", content="Be brief."),
            ChatMessage(role="user", content="Where is order 7? \u00e9\u4e2d"),
        ],
        reply=ChatMessage(role="assistant", content=None, tool_calls=[call]),
        usage=Usage(prompt_tokens=40, completion_tokens=12, cached_tokens=32),
        answer=answer,
        at=NOW + 5.25,
    )
    after = msgspec.structs.replace(BOUND, model="m@2", prompt=None)
    return record(
        steps=[step],
        history_tokens=52,
        last_used=NOW + 5.25,
        pending=Pending(step=2, fingerprint="fp-2", token="tok-abc", until=NOW + 65),
        migrations=[Migration(before=BOUND, after=after, at=NOW + 6, at_step=1)],
        on_retire="migrate",
        ended=Ended(reason="model_version_retired", at=NOW + 7),
    )


class RedisSpace:
    """A private key prefix on the shared Redis: stores opened on it share sessions (gateway replicas)."""

    def __init__(self) -> None:
        self.prefix = f"lockgate:test:{uuid.uuid4().hex}:session:"
        self.client = redis.asyncio.Redis.from_url(REDIS_URL)
        self.stores: list[RedisSessionStore] = []

    def store(self) -> RedisSessionStore:
        store = RedisSessionStore.from_url(REDIS_URL, op_timeout=5.0, prefix=self.prefix)
        self.stores.append(store)
        return store

    async def drop(self) -> None:
        keys = [key async for key in self.client.scan_iter(match=f"{self.prefix}*")]
        if keys:
            await self.client.delete(*keys)
        for store in self.stores:
            await store.aclose()
        await self.client.aclose()


class PostgresSpace:
    """A fresh schema on the shared PostgreSQL, one pool on it, and an admin connection: stores made on it
    share sessions (gateway replicas) and the clock `clock`."""

    def __init__(self, schema: str, pool: Any, admin: Any, clock: FakeClock, op_timeout: float) -> None:
        self.schema = schema
        self.pool = pool
        self.admin = admin
        self.clock = clock
        self.op_timeout = op_timeout

    def store(self) -> PostgresSessionStore:
        # Stores on one pool: the pool holds a connection per store saving at once, as replicas would.
        return PostgresSessionStore(self.pool, self.clock, op_timeout=self.op_timeout)

    async def rows(self) -> dict[str, tuple[Any, ...]]:
        """The table's rows by id (every column but the id), forgotten ones included."""
        found = await self.admin.fetch(
            "SELECT id, tenant, version, body, live, last_used, history_tokens, forget_at"
            f" FROM {self.schema}.gateway_sessions"
        )
        return {row[0]: tuple(row[1:]) for row in found}


@asynccontextmanager
async def postgres_space(op_timeout: float = 5.0) -> AsyncIterator[PostgresSpace]:
    """A `PostgresSpace` on a fresh schema, created and migrated as `open` does; dropped afterwards."""
    async with postgres_schema() as (schema, admin):
        pool = await PostgresSessionStore.open_pool(PG_DSN, schema=schema)
        try:
            yield PostgresSpace(schema, pool, admin, FakeClock(), op_timeout)
        finally:
            await pool.close()


@pytest.fixture(params=["memory", "redis", "postgres"])
async def opener(request: pytest.FixtureRequest) -> AsyncIterator[Opener]:
    """Opens stores of one backend that share their sessions (one process's, one Redis prefix's, or one
    PostgreSQL schema's)."""
    if request.param == "memory":
        memory = MemorySessionStore(FakeClock(), max_entries=100)
        yield lambda: memory
        return
    if request.param == "postgres":
        async with postgres_space() as pg:
            yield pg.store
        return
    space = RedisSpace()
    try:
        yield space.store
    finally:
        await space.drop()


@pytest.fixture
def store(opener: Opener) -> SessionStore:
    """A store of one backend."""
    return opener()


async def test_a_session_is_created_once(store: SessionStore) -> None:
    assert await store.load("s1") is None
    assert await store.save(record(), None, KEEP)
    assert not await store.save(record(metadata={"other": "x"}), None, KEEP)  # the id is taken
    assert await store.load("s1") == Versioned(record(), 1)
    assert not await store.save(record("s2"), 3, KEEP)  # no record: only a create (None) stores it
    assert await store.load("s2") is None


async def test_saves_compare_and_set_the_version(opener: Opener) -> None:
    store = opener()
    assert await store.save(record(), None, KEEP)
    second = record(last_used=NOW + 10, history_tokens=7)
    assert await store.save(second, 1, KEEP)
    assert await opener().load("s1") == Versioned(second, 2)
    assert not await opener().save(record(last_used=NOW + 20), 1, KEEP)  # stale: nothing changes
    assert await store.load("s1") == Versioned(second, 2)
    assert await store.index("acme") == {"s1": IndexEntry(NOW + 10, 7)}
    third = record(last_used=NOW + 30, history_tokens=9)
    assert await opener().save(third, 2, KEEP)
    assert await store.load("s1") == Versioned(third, 3)


async def test_a_full_record_round_trips_byte_for_byte(store: SessionStore) -> None:
    full = full_record()
    assert await store.save(full, None, KEEP)
    loaded = await store.load("s1")
    assert loaded is not None
    assert loaded.record == full
    assert msgspec.msgpack.encode(loaded.record) == msgspec.msgpack.encode(full)
    assert msgspec.json.encode(loaded.record) == msgspec.json.encode(full)


async def test_the_index_lists_a_tenants_live_sessions(store: SessionStore) -> None:
    assert await store.index("acme") == {}
    assert await store.save(record("s1", last_used=NOW + 1, history_tokens=10), None, KEEP)
    assert await store.save(record("s2", last_used=NOW + 2, history_tokens=20), None, KEEP)
    assert await store.save(record("s3", tenant="globex", last_used=NOW + 3), None, KEEP)
    assert await store.index("acme") == {"s1": IndexEntry(NOW + 1, 10), "s2": IndexEntry(NOW + 2, 20)}
    assert await store.index("globex") == {"s3": IndexEntry(NOW + 3, 0)}
    # Each save updates the entry; an ended session leaves the index (its record stays, for the 410).
    assert await store.save(record("s1", last_used=NOW + 4, history_tokens=30), 1, KEEP)
    ended = record("s2", last_used=NOW + 2, history_tokens=20, ended=Ended(reason="deleted", at=NOW + 5))
    assert await store.save(ended, 1, KEEP)
    assert await store.index("acme") == {"s1": IndexEntry(NOW + 4, 30)}
    assert await store.load("s2") == Versioned(ended, 2)
    assert await store.index("globex") == {"s3": IndexEntry(NOW + 3, 0)}
    # A stale save changes no index either.
    assert not await store.save(record("s1", last_used=NOW + 9, history_tokens=99), 1, KEEP)
    assert await store.index("acme") == {"s1": IndexEntry(NOW + 4, 30)}


async def test_concurrent_saves_of_one_version_store_one(opener: Opener) -> None:
    stores = [opener() for _ in range(8)]
    assert await stores[0].save(record(), None, KEEP)
    tries = [record(last_used=NOW + i, history_tokens=i) for i in range(8)]
    saved = await asyncio.gather(*(s.save(r, 1, KEEP) for s, r in zip(stores, tries, strict=True)))
    assert sum(saved) == 1
    winner = tries[saved.index(True)]
    assert await stores[0].load("s1") == Versioned(winner, 2)
    assert await stores[0].index("acme") == {"s1": IndexEntry(winner.last_used, winner.history_tokens)}


async def test_concurrent_creates_of_one_id_store_one(opener: Opener) -> None:
    stores = [opener() for _ in range(8)]
    tries = [record(key_id=f"key-{i}") for i in range(8)]
    saved = await asyncio.gather(*(s.save(r, None, KEEP) for s, r in zip(stores, tries, strict=True)))
    assert sum(saved) == 1
    assert await stores[0].load("s1") == Versioned(tries[saved.index(True)], 1)


async def test_the_memory_store_forgets_a_record_after_its_keep() -> None:
    clock = FakeClock()
    store = MemorySessionStore(clock, max_entries=10)
    assert await store.save(record("s1"), None, 60)
    assert await store.save(record("s2"), None, 120)
    clock.advance(59)
    assert await store.load("s1") == Versioned(record("s1"), 1)
    clock.advance(1)
    assert await store.load("s1") is None
    assert await store.index("acme") == {"s2": IndexEntry(NOW, 0)}
    assert not await store.save(record("s1"), 1, 60)  # forgotten: the id is unknown
    assert await store.save(record("s1"), None, 60)  # and may be created again
    clock.advance(60)
    assert await store.index("acme") == {}
    assert len(store) == 0


async def test_the_memory_store_makes_room_from_ended_sessions_and_refuses_when_full_of_live_ones() -> None:
    clock = FakeClock()
    store = MemorySessionStore(clock, max_entries=3)
    assert await store.save(record("live"), None, KEEP)
    assert await store.save(record("ended-old"), None, 100)
    assert await store.save(record("ended-old", ended=Ended(reason="expired", at=NOW)), 1, 100)
    assert await store.save(record("ended-new"), None, 200)
    assert await store.save(record("ended-new", ended=Ended(reason="deleted", at=NOW)), 1, 200)
    assert await store.save(record("new-1"), None, KEEP)  # the ended one forgotten soonest makes room
    assert len(store) == 3
    assert await store.load("ended-old") is None
    assert await store.load("ended-new") is not None
    assert await store.save(record("new-2"), None, KEEP)
    assert await store.load("ended-new") is None
    with pytest.raises(SessionStoreUnavailableError):
        await store.save(record("new-3"), None, KEEP)
    assert await store.load("new-3") is None
    assert set(await store.index("acme")) == {"live", "new-1", "new-2"}
    assert await store.save(record("live", history_tokens=5), 1, KEEP)  # an existing record still saves
    clock.advance(KEEP)  # lapsed records make room first
    assert await store.save(record("new-3"), None, KEEP)


async def test_redis_keeps_records_for_their_keep_and_the_index_as_long_as_any() -> None:
    space = RedisSpace()
    try:
        store = space.store()
        assert await store.save(record("s1"), None, 60)
        ttl = await space.client.pttl(f"{space.prefix}s:s1")
        assert 60_000 - 5_000 < ttl <= 60_000
        index_ttl = await space.client.pttl(f"{space.prefix}t:acme")
        assert 60_000 - 5_000 < index_ttl <= 60_000
        assert await store.save(record("s2"), None, 0.0001)  # rounds up to 1 ms, never 0 (kept forever)
        await asyncio.sleep(0.01)
        assert await store.load("s2") is None
        assert await store.index("acme") == {"s1": IndexEntry(NOW, 0)}
        assert await store.save(record("s1"), 1, 7200)
        assert 7_200_000 - 5_000 < await space.client.pttl(f"{space.prefix}s:s1") <= 7_200_000
        assert 7_200_000 - 5_000 < await space.client.pttl(f"{space.prefix}t:acme") <= 7_200_000
        assert await store.save(record("s1"), 2, 30)  # a shorter keep never shortens the index's
        assert 0 < await space.client.pttl(f"{space.prefix}s:s1") <= 30_000
        assert 7_200_000 - 5_000 < await space.client.pttl(f"{space.prefix}t:acme") <= 7_200_000
    finally:
        await space.drop()


async def test_redis_drops_forgotten_records_from_the_index() -> None:
    space = RedisSpace()
    try:
        store = space.store()
        assert await store.save(record("s1"), None, KEEP)
        assert await store.save(record("s2", history_tokens=4), None, KEEP)
        await space.client.delete(f"{space.prefix}s:s1")  # as Redis does once its PX passes
        assert await store.load("s1") is None
        assert await store.index("acme") == {"s2": IndexEntry(NOW, 4)}
        assert not await space.client.hexists(f"{space.prefix}t:acme", "s1")
        assert await store.save(record("s1"), None, KEEP)  # the id may be created again
        assert set(await store.index("acme")) == {"s1", "s2"}
    finally:
        await space.drop()


async def test_redis_stores_the_layout_its_docstring_describes() -> None:
    space = RedisSpace()
    try:
        store = space.store()
        assert await store.save(record("s1"), None, KEEP)
        assert await store.save(record("s1", history_tokens=3), 1, KEEP)
        stored = await space.client.hgetall(f"{space.prefix}s:s1")
        assert stored[b"v"] == b"2"
        assert stored[b"tenant"] == b"acme"
        assert stored[b"body"] == msgspec.msgpack.encode(record("s1", history_tokens=3))
        assert await space.client.hgetall(f"{space.prefix}t:acme") == {
            b"s1": msgspec.msgpack.encode(IndexEntry(NOW, 3))
        }
        assert await store.save(record("s1", ended=Ended(reason="expired", at=NOW)), 2, KEEP)
        assert not await space.client.exists(f"{space.prefix}t:acme")  # its last live session ended
    finally:
        await space.drop()


async def test_a_record_redis_holds_that_no_store_wrote_is_an_unavailable_store() -> None:
    space = RedisSpace()
    try:
        await space.client.hset(f"{space.prefix}s:s1", mapping={"v": "1", "body": b"\xc1junk"})
        store = space.store()
        with pytest.raises(SessionStoreUnavailableError, match="does not decode"):
            await store.load("s1")
        assert not await store.save(record("s1"), None, KEEP)  # never started afresh over it
        await space.client.set(f"{space.prefix}s:s2", "not a hash")
        with pytest.raises(SessionStoreUnavailableError):
            await store.load("s2")
    finally:
        await space.drop()


async def test_an_unreachable_redis_is_an_unavailable_store() -> None:
    store = RedisSessionStore.from_url("redis://127.0.0.1:1/0", op_timeout=0.2)
    try:
        with pytest.raises(SessionStoreUnavailableError, match="the session store is unavailable"):
            await store.load("s1")
        with pytest.raises(SessionStoreUnavailableError):
            await store.save(record(), None, KEEP)
        with pytest.raises(SessionStoreUnavailableError):
            await store.index("acme")
    finally:
        await store.aclose()


async def test_postgres_forgets_a_record_after_its_keep_and_creates_delete_the_forgotten() -> None:
    async with postgres_space() as pg:
        store = pg.store()
        assert await store.save(record("s1"), None, 60)
        assert await store.save(record("s2"), None, 120)
        pg.clock.advance(59)
        assert await store.load("s1") == Versioned(record("s1"), 1)
        pg.clock.advance(1)
        assert await store.load("s1") is None
        assert await store.index("acme") == {"s2": IndexEntry(NOW, 0)}
        assert not await store.save(record("s1"), 1, 60)  # forgotten: the id is unknown
        assert await store.save(record("s1", history_tokens=4), None, 60)  # and may be created again
        assert await store.load("s1") == Versioned(record("s1", history_tokens=4), 1)
        pg.clock.advance(60)
        assert await store.index("acme") == {}
        assert set(await pg.rows()) == {"s1", "s2"}  # reading deletes nothing
        assert await store.save(record("s3", tenant="globex"), None, 60)  # a create deletes them
        assert set(await pg.rows()) == {"s3"}


async def test_postgres_deletes_a_bounded_number_of_forgotten_rows_per_create() -> None:
    async with postgres_space() as pg:
        await pg.admin.executemany(
            f"INSERT INTO {pg.schema}.gateway_sessions"
            " (id, tenant, version, body, live, last_used, history_tokens, forget_at)"
            " VALUES ($1, 'acme', 1, '\\x00'::bytea, true, 0, 0, $2)",
            [(f"old-{i}", NOW - 1000 + i) for i in range(SWEEP_LIMIT + 5)],
        )
        store = pg.store()
        assert await store.index("acme") == {}
        assert await store.save(record("s1"), None, KEEP)
        left = set(await pg.rows())
        assert left == {"s1"} | {f"old-{i}" for i in range(SWEEP_LIMIT, SWEEP_LIMIT + 5)}  # oldest first
        assert await store.save(record("s2"), None, KEEP)
        assert set(await pg.rows()) == {"s1", "s2"}


async def test_postgres_stores_the_layout_its_docstring_describes() -> None:
    async with postgres_space() as pg:
        store = pg.store()
        assert await store.save(record("s1"), None, KEEP)
        pg.clock.advance(10)
        assert await store.save(record("s1", history_tokens=3, last_used=NOW + 10), 1, 60)
        body = msgspec.msgpack.encode(record("s1", history_tokens=3, last_used=NOW + 10))
        assert (await pg.rows())["s1"] == ("acme", 2, body, True, NOW + 10, 3, NOW + 70)
        ended = record("s1", ended=Ended(reason="expired", at=NOW))
        assert await store.save(ended, 2, KEEP)
        assert (await pg.rows())["s1"][:4] == ("acme", 3, msgspec.msgpack.encode(ended), False)
        assert await store.index("acme") == {}
        indexes = {
            row[0]: row[1]
            for row in await pg.admin.fetch(
                "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = $1", pg.schema
            )
        }
        assert indexes["gateway_sessions_live_by_tenant"].endswith("(tenant) WHERE live")
        assert indexes["gateway_sessions_by_forget_at"].endswith("(forget_at)")


async def test_a_record_postgres_holds_that_no_store_wrote_is_an_unavailable_store() -> None:
    async with postgres_space() as pg:
        await pg.admin.execute(
            f"INSERT INTO {pg.schema}.gateway_sessions"
            " (id, tenant, version, body, live, last_used, history_tokens, forget_at)"
            " VALUES ('s1', 'acme', 1, $1, true, 0, 0, $2)",
            b"\xc1junk",
            NOW + KEEP,
        )
        store = pg.store()
        with pytest.raises(SessionStoreUnavailableError, match="does not decode"):
            await store.load("s1")
        assert not await store.save(record("s1"), None, KEEP)  # never started afresh over it


async def test_an_unreachable_postgres_is_an_unavailable_store() -> None:
    # No connection is opened until an operation needs one (min_size 0): each finds the server gone.
    pool = await asyncpg.create_pool(
        "postgresql://postgres@127.0.0.1:1/test", min_size=0, max_size=1, timeout=0.2
    )
    store = PostgresSessionStore(pool, FakeClock(), op_timeout=0.5)
    try:
        with pytest.raises(SessionStoreUnavailableError, match="the session database is unreachable"):
            await store.load("s1")
        with pytest.raises(SessionStoreUnavailableError):
            await store.save(record(), None, KEEP)
        with pytest.raises(SessionStoreUnavailableError):
            await store.index("acme")
    finally:
        await store.aclose()


async def test_a_postgres_operation_past_its_op_timeout_is_an_unavailable_store() -> None:
    async with postgres_space(op_timeout=0.3) as pg:
        store = pg.store()
        assert await store.save(record(), None, KEEP)
        # Another transaction holds the row: the save waits on its lock until the bound.
        holder = await asyncpg.connect(PG_DSN, timeout=10)
        try:
            async with holder.transaction():
                await holder.execute(f"SELECT 1 FROM {pg.schema}.gateway_sessions WHERE id = 's1' FOR UPDATE")
                started = time.monotonic()
                with pytest.raises(SessionStoreUnavailableError, match=r"did not answer within 0\.3s"):
                    await store.save(record(history_tokens=1), 1, KEEP)
                assert time.monotonic() - started < 2.0
        finally:
            await holder.close()
        # The lock is gone: the store answers again, and the timed-out save wrote nothing.
        assert await store.load("s1") == Versioned(record(), 1)
        assert await store.save(record(history_tokens=1), 1, KEEP)

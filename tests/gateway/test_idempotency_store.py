"""Idempotency stores: one contract suite for every `IdempotencyStore` backend (memory, and real Redis), then
what each does alone (the memory store's bound and clock, Redis' expiry and sharing between processes), and
the builder.

Redis must run on 127.0.0.1:6379: without it the redis cases fail; they never skip. Every Redis store here
writes under a key prefix of its own, deleted afterwards."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable

import msgspec
import pytest
import redis.asyncio

from gateway.config import Config, IdempotencyConfig
from gateway.idempotency import open_idempotency
from gateway.idempotency.base import (
    Fresh,
    IdempotencyStore,
    IdempotencyStoreUnavailableError,
    InFlight,
    Mismatch,
    Replay,
    StoredAnswer,
)
from gateway.idempotency.memory import MemoryIdempotencyStore
from gateway.idempotency.redis import RedisIdempotencyStore
from tests.backends import REDIS_URL, FakeClock

WINDOW = 600.0
PENDING = 60.0
ANSWER = StoredAnswer(
    status=200,
    media_type="application/json",
    headers=[("x-lockgate-model", "m@1")],
    body=b'{"ok": 1}\x00\xff',
)

Opener = Callable[[], IdempotencyStore]


class RedisSpace:
    """A private key prefix on the shared Redis: stores opened on it share entries (gateway processes)."""

    def __init__(self) -> None:
        self.prefix = f"lockgate:test:{uuid.uuid4().hex}:idempotency:"
        self.client = redis.asyncio.Redis.from_url(REDIS_URL)
        self.stores: list[RedisIdempotencyStore] = []

    def store(self) -> RedisIdempotencyStore:
        store = RedisIdempotencyStore.from_url(
            REDIS_URL, window=WINDOW, pending_timeout=PENDING, op_timeout=5.0, prefix=self.prefix
        )
        self.stores.append(store)
        return store

    async def drop(self) -> None:
        keys = [key async for key in self.client.scan_iter(match=f"{self.prefix}*")]
        if keys:
            await self.client.delete(*keys)
        for store in self.stores:
            await store.aclose()
        await self.client.aclose()


@pytest.fixture(params=["memory", "redis"])
async def opener(request: pytest.FixtureRequest) -> AsyncIterator[Opener]:
    """Opens stores of one backend that share their entries (one process's, or one Redis prefix's)."""
    if request.param == "memory":
        store = MemoryIdempotencyStore(
            FakeClock(), window=WINDOW, pending_timeout=PENDING, max_entries=100, max_bytes=1 << 20
        )
        yield lambda: store
        return
    space = RedisSpace()
    try:
        yield space.store
    finally:
        await space.drop()


async def test_the_first_claim_is_fresh_and_the_same_request_then_waits(opener: Opener) -> None:
    store = opener()
    claim = await store.claim("e1", "fp-a")
    assert isinstance(claim, Fresh)
    assert await opener().claim("e1", "fp-a") == InFlight()
    assert await opener().claim("e1", "fp-b") == Mismatch()
    assert isinstance(await store.claim("e2", "fp-a"), Fresh)  # another entry is another key


async def test_a_completed_claim_replays_its_answer_byte_for_byte(opener: Opener) -> None:
    store = opener()
    claim = await store.claim("e1", "fp-a")
    assert isinstance(claim, Fresh)
    await store.complete("e1", claim.token, ANSWER)
    assert await opener().claim("e1", "fp-a") == Replay(ANSWER)
    assert await opener().claim("e1", "fp-b") == Mismatch()  # a different request never gets it


async def test_a_released_claim_lets_a_retry_run_afresh(opener: Opener) -> None:
    store = opener()
    first = await store.claim("e1", "fp-a")
    assert isinstance(first, Fresh)
    await store.release("e1", first.token)
    again = await opener().claim("e1", "fp-b")  # released: any request may take the key
    assert isinstance(again, Fresh)
    assert again.token != first.token


async def test_only_the_claims_holder_completes_or_releases_it(opener: Opener) -> None:
    store = opener()
    claim = await store.claim("e1", "fp-a")
    assert isinstance(claim, Fresh)
    await store.complete("e1", "not-the-token", ANSWER)
    await store.release("e1", "not-the-token")
    assert await store.claim("e1", "fp-a") == InFlight()
    await store.complete("e1", claim.token, ANSWER)
    # Completed: neither a late release nor a second completion changes the answer.
    await store.release("e1", claim.token)
    other = msgspec.structs.replace(ANSWER, body=b"other")
    await store.complete("e1", claim.token, other)
    assert await store.claim("e1", "fp-a") == Replay(ANSWER)


async def test_concurrent_claims_of_one_key_give_one_fresh_claim(opener: Opener) -> None:
    stores = [opener() for _ in range(8)]
    claims = await asyncio.gather(*(s.claim("e1", "fp-a") for s in stores))
    assert sum(isinstance(c, Fresh) for c in claims) == 1
    assert sum(c == InFlight() for c in claims) == 7


async def test_the_memory_store_lapses_claims_and_answers_on_its_clock() -> None:
    clock = FakeClock()
    store = MemoryIdempotencyStore(
        clock, window=WINDOW, pending_timeout=PENDING, max_entries=10, max_bytes=1 << 20
    )
    claim = await store.claim("e1", "fp-a")
    assert isinstance(claim, Fresh)
    clock.advance(PENDING - 1)
    assert await store.claim("e1", "fp-a") == InFlight()
    clock.advance(1)  # its process died: the claim lapses and a retry runs
    retry = await store.claim("e1", "fp-a")
    assert isinstance(retry, Fresh)
    await store.complete("e1", claim.token, ANSWER)  # the lapsed holder cannot overwrite the retry's
    assert await store.claim("e1", "fp-a") == InFlight()
    await store.complete("e1", retry.token, ANSWER)
    clock.advance(WINDOW - 1)
    assert await store.claim("e1", "fp-a") == Replay(ANSWER)
    clock.advance(1)
    assert isinstance(await store.claim("e1", "fp-a"), Fresh)


async def test_the_memory_store_forgets_its_oldest_answers_first_at_its_bound() -> None:
    store = MemoryIdempotencyStore(
        FakeClock(), window=WINDOW, pending_timeout=PENDING, max_entries=3, max_bytes=1 << 20
    )
    running = await store.claim("running", "fp")
    assert isinstance(running, Fresh)
    for name in ("old", "new"):
        claim = await store.claim(name, "fp")
        assert isinstance(claim, Fresh)
        await store.complete(name, claim.token, ANSWER)
    assert isinstance(await store.claim("fourth", "fp"), Fresh)
    assert len(store) == 3
    assert await store.claim("running", "fp") == InFlight()  # a running claim outlives older answers
    assert await store.claim("new", "fp") == Replay(ANSWER)
    assert isinstance(await store.claim("old", "fp"), Fresh)  # forgotten: it runs again


async def test_the_memory_store_bounds_the_bytes_it_keeps() -> None:
    size = len(ANSWER.body)
    store = MemoryIdempotencyStore(
        FakeClock(), window=WINDOW, pending_timeout=PENDING, max_entries=100, max_bytes=2 * size
    )
    for name in ("a", "b", "c"):
        claim = await store.claim(name, "fp")
        assert isinstance(claim, Fresh)
        await store.complete(name, claim.token, ANSWER)
        assert store.bytes <= 2 * size
    assert isinstance(await store.claim("a", "fp"), Fresh)  # the oldest was forgotten for the third
    assert await store.claim("c", "fp") == Replay(ANSWER)
    big = msgspec.structs.replace(ANSWER, body=b"x" * (2 * size + 1))
    claim = await store.claim("big", "fp")
    assert isinstance(claim, Fresh)
    await store.complete("big", claim.token, big)  # larger than the whole store: never kept
    assert isinstance(await store.claim("big", "fp"), Fresh)
    assert store.bytes <= 2 * size


async def test_redis_entries_expire_on_the_server_after_their_timeouts() -> None:
    space = RedisSpace()
    try:
        store = space.store()
        claim = await store.claim("e1", "fp")
        assert isinstance(claim, Fresh)
        ttl = await space.client.pttl(f"{space.prefix}e1")
        assert PENDING * 1000 - 5_000 < ttl <= PENDING * 1000
        await store.complete("e1", claim.token, ANSWER)
        ttl = await space.client.pttl(f"{space.prefix}e1")
        assert WINDOW * 1000 - 5_000 < ttl <= WINDOW * 1000
    finally:
        await space.drop()


async def test_a_value_redis_holds_that_no_store_wrote_is_never_replayed() -> None:
    space = RedisSpace()
    try:
        await space.client.hset(
            f"{space.prefix}e1", mapping={"fp": "fp", "token": "t", "answer": b"\xc1junk"}
        )
        assert await space.store().claim("e1", "fp") == Mismatch()
    finally:
        await space.drop()


async def test_an_unreachable_redis_is_an_unavailable_store() -> None:
    store = RedisIdempotencyStore.from_url(
        "redis://127.0.0.1:1/0", window=WINDOW, pending_timeout=PENDING, op_timeout=0.5
    )
    try:
        with pytest.raises(IdempotencyStoreUnavailableError):
            await store.claim("e1", "fp")
    finally:
        await store.aclose()


async def test_the_builder_follows_the_configuration() -> None:
    assert open_idempotency(Config(idempotency=IdempotencyConfig(enabled=False)), FakeClock()) is None
    memory = open_idempotency(Config(), FakeClock())
    assert memory is not None
    assert isinstance(memory.store, MemoryIdempotencyStore)
    shared = open_idempotency(Config(idempotency=IdempotencyConfig(backend="redis")), FakeClock())
    assert shared is not None
    assert isinstance(shared.store, RedisIdempotencyStore)
    await shared.store.aclose()

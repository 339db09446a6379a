"""The Redis store's own connections (policy/quota/redis_direct.py): reused after a reply, replaced when Redis
closed them, and scripts sent whole when Redis lost its script cache. Needs Redis on 127.0.0.1:6379."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio

from policy.quota import BucketSpec, RedisQuotaStore
from tests.backends import REDIS_URL

SPEC = BucketSpec(key="{acme}:tok", capacity=100.0, rate=0.0)  # no refill: levels are exact sums
T0 = 1_700_000_000.0


@pytest.fixture
async def named() -> AsyncIterator[tuple[RedisQuotaStore, redis.asyncio.Redis, str]]:
    """A store whose connections carry a client name of their own, an admin client, and the key prefix."""
    name = f"lockgate-test-{uuid.uuid4().hex[:12]}"
    prefix = f"lockgate:test:{uuid.uuid4().hex}:"
    store = RedisQuotaStore(
        redis.asyncio.Redis.from_url(REDIS_URL, client_name=name),
        prefix=prefix,
        op_timeout=10.0,
        pool_size=4,
        server_time=False,
    )
    admin = redis.asyncio.Redis.from_url(REDIS_URL)
    yield store, admin, name
    keys = [key async for key in admin.scan_iter(match=f"{prefix}*")]
    if keys:
        await admin.delete(*keys)
    await store.close()
    await admin.aclose()


async def connections(admin: redis.asyncio.Redis, name: str) -> list[str]:
    """The ids of the server's client connections named `name`."""
    listed = await admin.client_list()
    return [str(c["id"]) for c in listed if c.get("name") == name]


async def test_one_connection_serves_calls_one_after_another(
    named: tuple[RedisQuotaStore, redis.asyncio.Redis, str],
) -> None:
    store, admin, name = named
    for _ in range(5):
        await store.reserve([SPEC], [1.0], T0)
    assert len(await connections(admin, name)) == 1
    assert await store.levels([SPEC], T0) == (95.0,)


async def test_connections_redis_closed_are_replaced_and_the_call_debits_once(
    named: tuple[RedisQuotaStore, redis.asyncio.Redis, str],
) -> None:
    store, admin, name = named
    assert await store.warm() == 4
    before = await connections(admin, name)
    assert len(before) == 4
    for client_id in before:  # as a restart of Redis would: every idle connection is dead
        await admin.client_kill_filter(_id=client_id)
    reservation = await store.reserve([SPEC], [30.0], T0)
    assert reservation.levels == (70.0,)
    assert await store.reconcile(reservation, [10.0], T0)
    assert await store.levels([SPEC], T0) == (90.0,)
    after = await connections(admin, name)
    assert after
    assert not set(after) & set(before)


async def test_a_script_cache_redis_lost_is_filled_again(
    named: tuple[RedisQuotaStore, redis.asyncio.Redis, str],
) -> None:
    store, admin, _ = named
    first = await store.reserve([SPEC], [10.0], T0)
    await admin.script_flush()
    second = await store.reserve([SPEC], [10.0], T0)  # NOSCRIPT, then the script whole
    assert second.levels == (80.0,)
    assert await store.reconcile(first, [0.0], T0)
    assert await store.reconcile(second, [0.0], T0)
    assert await store.levels([SPEC], T0) == (100.0,)


async def read_command(reader: asyncio.StreamReader) -> list[bytes] | None:
    """One RESP command (an array of bulk strings) from a client; None at its end."""
    line = await reader.readline()
    if not line:
        return None
    args = []
    for _ in range(int(line[1:])):
        size = int((await reader.readline())[1:])
        args.append((await reader.readexactly(size + 2))[:-2])
    return args


async def test_a_call_in_flight_when_the_store_closes_leaves_no_connection_open() -> None:
    # A stand-in server that holds the script's reply until told: the store closes meanwhile.
    asked, release, gone = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (command := await read_command(reader)) is not None:
            if command[0].upper() == b"EVALSHA":
                asked.set()
                await release.wait()
                writer.write(b"*4\r\n:1\r\n:0\r\n$1\r\n0\r\n$2\r\n99\r\n")  # granted, level 99
            else:
                writer.write(b"+OK\r\n")  # the connection's set-up commands
            await writer.drain()
        gone.set()  # the client closed its end
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    store = RedisQuotaStore.from_url(f"redis://127.0.0.1:{port}/0", pool_size=2, op_timeout=30.0)
    try:
        call = asyncio.create_task(store.reserve([SPEC], [1.0], T0))
        await asyncio.wait_for(asked.wait(), 30)
        await store.close()
        release.set()
        assert (await call).levels == (99.0,)
        await asyncio.wait_for(gone.wait(), 30)  # closed after its reply, not kept idle
    finally:
        server.close()
        await server.wait_closed()

"""The Redis store's own pipelined connection (policy/quota/redis_direct.py): one for calls one after another
and for calls in flight together, each reply to its own caller (also when a caller gave up), replaced when
Redis closed it or stopped answering, and scripts sent whole when Redis lost its script cache. Needs Redis on
127.0.0.1:6379."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio

from policy.quota import BucketSpec, QuotaBackendError, RedisQuotaStore
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


async def test_calls_in_flight_together_share_one_connection_and_each_gets_its_own_reply(
    named: tuple[RedisQuotaStore, redis.asyncio.Redis, str],
) -> None:
    store, admin, name = named
    # Four in flight at most (the store's pool_size): the rest wait for a slot, on the same connection.
    granted = await asyncio.gather(*(store.reserve([SPEC], [float(n)], T0) for n in range(1, 11)))
    assert len(await connections(admin, name)) == 1
    assert await store.levels([SPEC], T0) == (45.0,)  # 100 - (1 + ... + 10)
    # Each caller got the reply to its own script: in the order Redis ran them (falling levels), each level
    # is the one before less that caller's own amount (all amounts differ, so a crossed reply would show).
    level = 100.0
    for reservation in sorted(granted, key=lambda r: -r.levels[0]):
        assert level - reservation.levels[0] == reservation.amounts[0]
        level = reservation.levels[0]
    settled = await asyncio.gather(*(store.reconcile(r, [0.0], T0) for r in granted))
    assert all(settled)
    assert await store.levels([SPEC], T0) == (100.0,)


async def test_connections_redis_closed_are_replaced_and_the_call_debits_once(
    named: tuple[RedisQuotaStore, redis.asyncio.Redis, str],
) -> None:
    store, admin, name = named
    assert await store.warm() == 1
    before = await connections(admin, name)
    assert len(before) == 1
    for client_id in before:  # as a restart of Redis would: the connection is dead
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


def setup_reply(command: list[bytes]) -> bytes:
    """What Redis answers to the commands redis-py sends as it sets a connection up: HELLO (a map with the
    protocol, as redis-py checks it) and OK to the rest."""
    if command[0].upper() == b"HELLO":
        return b"%1\r\n$5\r\nproto\r\n:" + (command[1] if len(command) > 1 else b"2") + b"\r\n"
    return b"+OK\r\n"


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
                writer.write(setup_reply(command))
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


class StandIn:
    """A stand-in Redis: answers the set-up commands; each EVALSHA waits until `release(n)` and is answered
    with a granted reservation at level n; on connections listed in `mute` scripts are never answered."""

    def __init__(self, mute: tuple[int, ...] = ()) -> None:
        self.mute = mute
        self.connections = 0
        self.asked = 0
        self.asked_event = asyncio.Event()
        self._levels: asyncio.Queue[int] = asyncio.Queue()

    def release(self, level: int) -> None:
        self._levels.put_nowait(level)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = self.connections
        self.connections += 1
        while (command := await read_command(reader)) is not None:
            if command[0].upper() != b"EVALSHA":
                writer.write(setup_reply(command))
            elif number not in self.mute:
                self.asked += 1
                self.asked_event.set()
                level = await self._levels.get()
                writer.write(b"*4\r\n:1\r\n:0\r\n$1\r\n0\r\n$%d\r\n%d\r\n" % (len(str(level)), level))
            await writer.drain()
        writer.close()


async def test_a_caller_that_gives_up_leaves_the_next_reply_to_the_next_caller() -> None:
    stand_in = StandIn()
    server = await asyncio.start_server(stand_in.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    store = RedisQuotaStore.from_url(f"redis://127.0.0.1:{port}/0", pool_size=4, op_timeout=30.0)
    try:
        first = asyncio.create_task(store.reserve([SPEC], [1.0], T0))
        await asyncio.wait_for(stand_in.asked_event.wait(), 30)
        first.cancel()  # its client left while its script was in flight
        await asyncio.gather(first, return_exceptions=True)
        second = asyncio.create_task(store.reserve([SPEC], [1.0], T0))
        stand_in.release(11)  # the reply to the first call: nobody waits for it any more
        stand_in.release(22)
        assert (await asyncio.wait_for(second, 30)).levels == (22.0,)
        assert stand_in.connections == 1
    finally:
        await store.close()
        server.close()
        await server.wait_closed()


async def test_a_connection_that_stops_answering_is_replaced() -> None:
    # No RST ever comes (a partition): the first connection takes scripts and answers none.
    stand_in = StandIn(mute=(0,))
    server = await asyncio.start_server(stand_in.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    store = RedisQuotaStore.from_url(f"redis://127.0.0.1:{port}/0", pool_size=4, op_timeout=0.2)
    try:
        with pytest.raises(QuotaBackendError):
            await store.reserve([SPEC], [1.0], T0)
        stand_in.release(42)
        assert (await store.reserve([SPEC], [1.0], T0)).levels == (42.0,)
        assert stand_in.connections == 2
    finally:
        await store.close()
        server.close()
        await server.wait_closed()

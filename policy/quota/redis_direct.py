"""Scripts run on connections of the store's own to one Redis server, without redis-py's client layers.

`Redis.execute_command` passes each call through the client's retry wrapper, its blocking pool (an
`asyncio.timeout` and a condition per checkout) and the script object's NOSCRIPT handling: about 110 us of
CPU per round trip on a fast core against about 70 us for the same EVALSHA on one `Connection` (connect,
AUTH/SELECT, TLS and reply parsing stay redis-py's). The quota store already bounds how many scripts are in
flight and how long each may take, so here a connection is simply taken from a list of idle ones (or opened)
and put back after a reply.

Failures: redis-py closes a connection on any error but an error reply, so a failed one is dropped. After
Redis restarts every idle connection is dead: a connection error on a reused one sends the command once more
on a new connection (both scripts are idempotent by reservation id, so a resend never debits or refunds
twice), as the client's `Retry` did. A Redis that lost its script cache (restarted, or `SCRIPT FLUSH`)
answers NOSCRIPT: the script is then sent whole with EVAL, which caches it again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis.asyncio
import redis.exceptions
from redis.asyncio.connection import AbstractConnection
from redis.commands.core import AsyncScript


class DirectConnections:
    """Idle connections of one server's pool settings; at most as many open as scripts were ever in flight
    at once (the store's `pool_size` bounds that)."""

    def __init__(self, pool: redis.asyncio.ConnectionPool) -> None:
        self._pool = pool
        self._idle: list[AbstractConnection] = []
        self._closed = False

    def __len__(self) -> int:
        return len(self._idle)

    async def open(self, count: int) -> int:
        """Open connections until `count` are idle; how many are idle (stops at the first failure, raising
        it)."""
        while len(self._idle) < count:
            connection = self._new()
            await connection.connect()  # type: ignore[no-untyped-call]
            self._idle.append(connection)
        return len(self._idle)

    async def evalsha(self, script: AsyncScript, keys: Sequence[str], args: Sequence[float | str]) -> Any:
        """Run `script` by its digest; by its text if the server does not know it."""
        try:
            return await self._round_trip(("EVALSHA", script.sha, len(keys), *keys, *args))
        except redis.exceptions.NoScriptError:
            return await self._round_trip(("EVAL", script.script, len(keys), *keys, *args))

    async def close(self) -> None:
        """Close the idle connections (one in use is closed when its round trip ends)."""
        self._closed = True
        idle, self._idle = self._idle, []
        for connection in idle:
            await connection.disconnect()

    def _new(self) -> AbstractConnection:
        connection: AbstractConnection = self._pool.make_connection()  # type: ignore[no-untyped-call]
        return connection

    async def _round_trip(self, command: tuple[Any, ...]) -> Any:
        if self._idle:
            try:
                return await self._exchange(self._idle.pop(), command)
            except redis.exceptions.ConnectionError:
                pass  # dead since it was last used (a restart): once more on a new connection
        return await self._exchange(self._new(), command)

    async def _exchange(self, connection: AbstractConnection, command: tuple[Any, ...]) -> Any:
        """Send `command` and read its reply; the connection goes back idle unless redis-py closed it."""
        try:
            await connection.send_packed_command(connection.pack_command(*command), check_health=False)
            reply = await connection.read_response()
        except redis.exceptions.ResponseError:
            await self._put_back(connection)  # an error reply: the connection is in step still
            raise
        await self._put_back(connection)
        return reply

    async def _put_back(self, connection: AbstractConnection) -> None:
        if self._closed:
            await connection.disconnect()
        else:
            self._idle.append(connection)

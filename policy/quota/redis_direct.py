"""Scripts run on one pipelined connection of the store's own to one Redis server, without redis-py's client
layers.

`Redis.execute_command` passes each call through the client's retry wrapper, its blocking pool (an
`asyncio.timeout` and a condition per checkout) and the script object's NOSCRIPT handling, and even a bare
redis-py `Connection` encodes every argument in Python, awaits a write and a read per command, and holds the
connection until its reply is back, so N requests in flight need N connections and pay N writes, N reads and
N wake-ups. Here redis-py only opens the connection (address, TLS, AUTH, SELECT, client name); then its
transport is ours (`_Pipe`, an asyncio protocol): each command is packed by hiredis in C and written as it
comes, the commands of one pass of the event loop in one write, and every reply is matched to its command in
the order they were sent (Redis answers a connection's commands in order), parsed by hiredis as the bytes
arrive, and handed to its caller's future. One connection serves every request of the process.

A caller that gives up (its `op_timeout`, or its client left) leaves its future cancelled; its reply, when
it comes, is dropped, so the connection stays in step. A connection on which nothing has been answered for
`stale_after` seconds while a command waited is taken for dead when such a caller gives up: it is closed,
the commands still waiting on it fail with ConnectionError, and the next command opens a new one (after a
network partition no RST may ever arrive).

Failures: Redis closing the connection (a restart) fails every command waiting on it. A command that fails
so on a connection opened before it was sent is sent once more on a new connection (both scripts are
idempotent by reservation id, so a resend never debits or refunds twice), as the client's `Retry` did. A
Redis that lost its script cache (restarted, or `SCRIPT FLUSH`) answers NOSCRIPT: the script is then sent
whole with EVAL, which caches it again. An error reply fails only its own command.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from typing import Any

import hiredis
import redis.asyncio
import redis.exceptions
from redis._parsers.base import BaseParser
from redis.asyncio.connection import AbstractConnection
from redis.commands.core import AsyncScript


class _Pipe(asyncio.Protocol):
    """One connection's transport, taken over from redis-py once it is set up: commands written in order,
    replies matched to them in the same order."""

    def __init__(self, connection: AbstractConnection) -> None:
        writer = connection._writer  # redis-py keeps the stream it set up here
        if writer is None or writer.transport.is_closing():
            raise redis.exceptions.ConnectionError("the connection closed while it was set up")
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport = writer.transport  # type: ignore[assignment]
        # redis-py's connection object no longer owns the stream; the writer is kept, since it closes the
        # transport when collected.
        connection._writer = connection._reader = None
        self._writer = writer
        self._replies = hiredis.Reader(replyError=BaseParser.parse_error)
        self._waiting: deque[asyncio.Future[Any]] = deque()
        self._out: list[bytes] = []
        self.lost = False
        self._closing = False
        # Loop time of the last reply, or of the send that found nothing waiting.
        self._progress = 0.0
        self._transport.set_protocol(self)

    def send(self, packed: bytes) -> asyncio.Future[Any]:
        """Queue one packed command; its reply (or error) resolves the future returned."""
        if self.lost:
            raise redis.exceptions.ConnectionError("the Redis connection is closed")
        future = self._loop.create_future()
        if not self._waiting:
            self._progress = self._loop.time()
        self._waiting.append(future)
        if not self._out:
            self._loop.call_soon(self._flush)
        self._out.append(packed)
        return future

    def stalled(self, seconds: float) -> bool:
        """Whether a command has waited `seconds` with no reply meanwhile."""
        return bool(self._waiting) and self._loop.time() - self._progress >= seconds

    def close(self) -> None:
        """Close once every command sent is answered."""
        self._closing = True
        if not self._waiting:
            self._transport.close()

    def abort(self) -> None:
        """Close now: the commands waiting fail with ConnectionError."""
        self._transport.abort()

    def _flush(self) -> None:
        out, self._out = self._out, []
        if not self.lost:
            self._transport.writelines(out)

    def data_received(self, data: bytes) -> None:
        replies = self._replies
        replies.feed(data)
        waiting = self._waiting
        try:
            while (reply := replies.gets()) is not False:
                future = waiting.popleft()  # IndexError: a reply nothing asked for
                if future.done():
                    continue  # its caller gave up
                if isinstance(reply, Exception):
                    future.set_exception(reply)
                else:
                    future.set_result(reply)
        except (hiredis.ProtocolError, IndexError) as exc:
            self._fail(f"Redis sent what is not a reply to a command: {exc!r}")
            self._transport.abort()
            return
        self._progress = self._loop.time()
        if self._closing and not waiting:
            self._transport.close()

    def eof_received(self) -> bool:
        return False  # close our end too

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(f"Redis closed the connection ({exc!r})" if exc else "the Redis connection was closed")

    def _fail(self, why: str) -> None:
        self.lost = True
        waiting = self._waiting
        while waiting:
            future = waiting.popleft()
            if not future.done():
                future.set_exception(redis.exceptions.ConnectionError(why))


class DirectConnections:
    """The one pipelined connection to a server of the pool's settings (the pool only makes connections),
    opened when first needed and again after it is lost."""

    def __init__(self, pool: redis.asyncio.ConnectionPool, *, stale_after: float) -> None:
        self._pool = pool
        self._stale_after = stale_after
        self._pipe: _Pipe | None = None
        self._opening: asyncio.Task[_Pipe] | None = None
        self._closed = False

    def __len__(self) -> int:
        """Connections open: 0 or 1."""
        return int(self._pipe is not None and not self._pipe.lost)

    async def open(self) -> int:
        """Open the connection now unless it is open; how many are open (raises what opening raised)."""
        if not len(self):
            await self._fresh()
        return len(self)

    async def evalsha(self, script: AsyncScript, keys: Sequence[str], args: Sequence[float | str]) -> Any:
        """Run `script` by its digest; by its text if the server does not know it."""
        try:
            return await self._call(("EVALSHA", script.sha, len(keys), *keys, *args))
        except redis.exceptions.NoScriptError:
            return await self._call(("EVAL", script.script, len(keys), *keys, *args))

    async def close(self) -> None:
        """Close the connection once the commands in flight are answered; open none after."""
        self._closed = True
        if self._pipe is not None:
            self._pipe.close()

    async def _call(self, command: tuple[Any, ...]) -> Any:
        packed = hiredis.pack_command(command)
        pipe = self._pipe
        if pipe is not None and not pipe.lost:
            try:
                return await self._exchange(pipe, packed)
            except redis.exceptions.ConnectionError:
                pass  # lost since it was opened (a restart): once more on a new connection
        return await self._exchange(await self._fresh(), packed)

    async def _exchange(self, pipe: _Pipe, packed: bytes) -> Any:
        future = pipe.send(packed)
        try:
            return await future
        except asyncio.CancelledError:
            if pipe.stalled(self._stale_after):
                pipe.abort()  # nothing answered for that long: taken for dead
            raise

    async def _fresh(self) -> _Pipe:
        """A new connection, opened once for every caller that asks while it opens (those a lost connection
        failed wake together, before the new one is open)."""
        if self._closed:
            raise redis.exceptions.ConnectionError("the quota store is closed")
        opening = self._opening
        if opening is None or opening.done():
            opening = self._opening = asyncio.get_running_loop().create_task(self._connect())
            opening.add_done_callback(_retrieved)
        return await asyncio.shield(opening)

    async def _connect(self) -> _Pipe:
        connection: AbstractConnection = self._pool.make_connection()  # type: ignore[no-untyped-call]
        await connection.connect()  # type: ignore[no-untyped-call]
        pipe = _Pipe(connection)
        if self._closed:  # closed while it opened
            pipe.close()
            raise redis.exceptions.ConnectionError("the quota store is closed")
        self._pipe = pipe
        return pipe


def _retrieved(task: asyncio.Task[_Pipe]) -> None:
    """Mark an opening's failure seen: the callers that waited for it got it (or gave up)."""
    if not task.cancelled():
        task.exception()

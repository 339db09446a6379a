"""A lean HTTP/1.1 keep-alive client for `ops.bench.overhead`: POST a JSON body, time the answer.

httpx (`ops.bench.load.client`) spends about a millisecond of CPU per request, so on the one core the load
generator gets it cannot offer the rates the gateway is asked to reach, and its own queueing would blur the
latencies being compared. This client writes the request bytes itself and reads the response with asyncio
streams: a fixed-length body, or a chunked one (a stream) whose SSE events are counted as they arrive.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec


class Timed(msgspec.Struct, frozen=True, kw_only=True):
    """One request as the client saw it; times in seconds from sending."""

    status: int  # HTTP status; 0 for a transport failure or a timeout
    error: str = ""
    first: float | None = None  # first SSE event with text (streams only)
    total: float | None = None  # the whole answer read
    chunks: int = 0  # SSE events with text
    closed: bool = False  # the client closed the stream itself (`close_after`), before its end


# Servers close a keep-alive connection idle past a timeout (uvicorn's default is 5 s); one idle longer than
# this is dropped rather than risk a request on a connection the server is closing.
_MAX_IDLE_S = 2.0


class _Conn:
    __slots__ = ("idle_since", "reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0


class Pool:
    """Keep-alive connections to one host, opened on demand and reused; at most `limit` at once."""

    def __init__(self, host: str, port: int, limit: int = 1000) -> None:
        """A pool for `host:port`; nothing is opened until a request needs it."""
        self.host = host
        self.port = port
        self._idle: list[_Conn] = []
        self._slots = asyncio.Semaphore(limit)

    async def close(self) -> None:
        """Close every idle connection."""
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.writer.close()
        for conn in idle:
            try:
                await conn.writer.wait_closed()
            except OSError:
                continue

    def _take(self, now: float) -> _Conn | None:
        while self._idle:
            conn = self._idle.pop()
            if now - conn.idle_since < _MAX_IDLE_S:
                return conn
            conn.writer.close()
        return None

    async def post(
        self,
        head: bytes,
        body: bytes,
        clock: Callable[[], float],
        *,
        within: float = 30.0,
        close_after: int | None = None,
    ) -> Timed:
        """Send `head` (request line and headers without Content-Length) and `body`; never raises for what
        the server or the network does. `close_after`: a stream is closed (the connection with it) once that
        many events with text have come, as a client that leaves mid-stream."""
        async with self._slots:
            sent = clock()
            conn = self._take(sent)
            try:
                if conn is None:
                    conn = _Conn(*await asyncio.open_connection(self.host, self.port))
                async with asyncio.timeout(within):
                    conn.writer.write(b"%sContent-Length: %d\r\n\r\n%s" % (head, len(body), body))
                    timed, reusable = await _read(conn.reader, clock, sent, close_after)
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
                if conn is not None:
                    conn.writer.close()
                return Timed(status=0, error=type(exc).__name__)
            except TimeoutError:
                if conn is not None:
                    conn.writer.close()
                return Timed(status=0, error="timeout")
            if reusable:
                conn.idle_since = clock()
                self._idle.append(conn)
            else:
                conn.writer.close()
            return timed


def request_head(path: str, host: str, api_key: str | None) -> bytes:
    """The request line and headers of a JSON POST, ending before Content-Length."""
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{auth}").encode()


def _has_text(event: bytes) -> bool:
    return b'"content":"' in event and b'"content":""' not in event


async def _read(
    reader: asyncio.StreamReader, clock: Callable[[], float], sent: float, close_after: int | None = None
) -> tuple[Timed, bool]:
    """The response on `reader`; and whether the connection may carry another request (not once a stream
    was left after `close_after` events with text)."""
    raw = await reader.readuntil(b"\r\n\r\n")
    lines = raw.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip().lower()
    reusable = headers.get(b"connection") != b"close"
    if headers.get(b"transfer-encoding") == b"chunked":
        first, chunks, ended = await _read_chunked(reader, clock, sent, close_after)
        timed = Timed(status=status, first=first, total=clock() - sent, chunks=chunks, closed=not ended)
        return timed, reusable and ended
    length = int(headers.get(b"content-length", b"0"))
    body = await reader.readexactly(length)
    error = "" if status == 200 else body[:200].decode(errors="replace")
    return Timed(status=status, error=error, total=clock() - sent), reusable


async def _read_chunked(
    reader: asyncio.StreamReader, clock: Callable[[], float], sent: float, close_after: int | None = None
) -> tuple[float | None, int, bool]:
    """The first text event's time, the text events, and whether the body was read to its end (False: left
    after `close_after` text events)."""
    first: float | None = None
    chunks = 0
    pending = b""
    while True:
        if close_after is not None and chunks >= close_after:
            return first, chunks, False
        size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")  # no trailers are sent: the empty line that ends the body
            return first, chunks, True
        pending += (await reader.readexactly(size + 2))[:-2]
        *events, pending = pending.split(b"\n\n")
        for event in events:
            if _has_text(event):
                chunks += 1
                if first is None:
                    first = clock() - sent

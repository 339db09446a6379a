"""Server-sent events with a stall guard: clients that stop reading are cut off.

`SSEResponse` sends the chunks; when one `send` cannot complete within the stall timeout because the client
stopped reading (the server's write buffer stays full), it stops sending, closes the stream (which aborts the
engine request) and ends the response, so the server closes the connection. A client that disconnects cancels
the same way, through the request's `ClientWatch`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from litestar import Request, Response
from litestar.enums import MediaType
from litestar.response.streaming import ASGIStreamingResponse
from litestar.types import Receive, Send

from gateway.generation.flow import ClientDisconnectedError, ClientWatch


class _StallGuardedResponse(ASGIStreamingResponse):
    """Litestar's streaming response, with a time limit on each send, sent in the request's own task: the
    request's watcher of a disconnect (`ClientWatch`) and one timer for stalls (`_StallWatch`) per stream,
    instead of an anyio task group and a timeout per chunk."""

    __slots__ = ("on_stall", "stall_timeout", "watch")

    def __init__(
        self, *, stall_timeout: float, on_stall: Callable[[], None], watch: ClientWatch, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.stall_timeout = stall_timeout
        self.on_stall = on_stall
        self.watch = watch

    async def _guarded_stream(self, send: Send) -> None:
        iterator = self.iterator
        watch = _StallWatch(self.stall_timeout, self.on_stall)
        try:
            async for chunk in iterator:
                body = chunk if isinstance(chunk, bytes) else chunk.encode(self.encoding)
                watch.since = watch.loop.time()
                await send({"type": "http.response.body", "body": body, "more_body": True})
                watch.since = None
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not watch.stalled:
                raise
            watch.task.uncancel()  # the watch's own cancellation: the response ends here, unfinished
        finally:
            watch.close()
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                await aclose()

    async def send_body(self, send: Send, receive: Receive) -> None:
        """Stream the body until it ends, the client disconnects, or the client stops reading."""
        with contextlib.suppress(ClientDisconnectedError):
            await self.watch.race(self._guarded_stream(send))


class _StallWatch:
    """One timer for a stream's sends: a send still in progress `limit` seconds after it began (`since`, on
    the loop's clock; None between sends) is a stall, which calls `on_stall` and cancels the sending task.
    The timer looks once per `limit` while the stream runs, not once per chunk."""

    __slots__ = ("_handle", "_limit", "_on_stall", "loop", "since", "stalled", "task")

    def __init__(self, limit: float, on_stall: Callable[[], None]) -> None:
        self.loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None, "a stream is sent from a task"
        self.task = task
        self._limit = limit
        self._on_stall = on_stall
        self.since: float | None = None
        self.stalled = False
        self._handle = self.loop.call_at(self.loop.time() + limit, self._look)

    def _look(self) -> None:
        since, now = self.since, self.loop.time()
        if since is not None and now - since >= self._limit:
            self.stalled = True
            self._on_stall()
            self.task.cancel()
            return
        self._handle = self.loop.call_at((now if since is None else since) + self._limit, self._look)

    def close(self) -> None:
        """Stop looking (the stream ended)."""
        self._handle.cancel()


class SSEResponse(Response[AsyncIterator[bytes]]):
    """A `text/event-stream` response whose client is cut off after `stall_timeout` seconds of not reading."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        stall_timeout: float,
        on_stall: Callable[[], None],
        watch: ClientWatch,
        headers: dict[str, str] | None = None,
    ) -> None:
        """`watch`: the request's (whose client leaving ends the stream)."""
        super().__init__(content=content, media_type=MediaType.TEXT, headers=headers)
        self.media_type = "text/event-stream"
        self._stall_timeout = stall_timeout
        self._on_stall = on_stall
        self._watch = watch

    def to_asgi_response(
        self, app: Any, request: Request[Any, Any, Any], **kwargs: Any
    ) -> ASGIStreamingResponse:
        """Build the stall-guarded ASGI response."""
        extra = kwargs.get("headers") or {}
        return _StallGuardedResponse(
            stall_timeout=self._stall_timeout,
            on_stall=self._on_stall,
            watch=self._watch,
            iterator=self.content,
            content_length=0,
            headers={**extra, **self.headers, "cache-control": "no-cache", "x-accel-buffering": "no"},
            media_type=self.media_type,
            status_code=self.status_code,
            encoded_headers=kwargs.get("encoded_headers"),
            is_head_response=kwargs.get("is_head_response", False),
            background=self.background or kwargs.get("background"),
            cookies=self.cookies,
        )

"""Server-sent events with a stall guard: clients that stop reading are cut off.

`SSEResponse` sends the chunks; when one `send` cannot complete within the stall timeout because the client
stopped reading (the server's write buffer stays full), it stops sending, closes the stream (which aborts the
engine request) and ends the response, so the server closes the connection. A client that disconnects cancels
the same way, through Litestar's disconnect listener.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

import anyio
from litestar import Request, Response
from litestar.enums import MediaType
from litestar.response.streaming import ASGIStreamingResponse
from litestar.types import Receive, Send


class _StallGuardedResponse(ASGIStreamingResponse):
    """Litestar's streaming response, with a time limit on each send."""

    __slots__ = ("on_stall", "stall_timeout")

    def __init__(self, *, stall_timeout: float, on_stall: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stall_timeout = stall_timeout
        self.on_stall = on_stall

    async def _guarded_stream(self, send: Send, scope: anyio.CancelScope) -> None:
        iterator = self.iterator
        try:
            async for chunk in iterator:
                body = chunk if isinstance(chunk, bytes) else chunk.encode(self.encoding)
                try:
                    # asyncio's own timeout, not anyio.fail_after: the same limit at a third of the CPU, once
                    # per chunk (the server runs on asyncio, where anyio's cancel scopes compose with it).
                    async with asyncio.timeout(self.stall_timeout):
                        await send({"type": "http.response.body", "body": body, "more_body": True})
                except TimeoutError:
                    self.on_stall()
                    scope.cancel()
                    return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()

    async def send_body(self, send: Send, receive: Receive) -> None:
        """Stream the body until it ends, the client disconnects, or the client stops reading."""
        async with anyio.create_task_group() as group:
            group.start_soon(partial(self._guarded_stream, send, group.cancel_scope))
            await self._listen_for_disconnect(cancel_scope=group.cancel_scope, receive=receive)


class SSEResponse(Response[AsyncIterator[bytes]]):
    """A `text/event-stream` response whose client is cut off after `stall_timeout` seconds of not reading."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        stall_timeout: float,
        on_stall: Callable[[], None],
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(content=content, media_type=MediaType.TEXT, headers=headers)
        self.media_type = "text/event-stream"
        self._stall_timeout = stall_timeout
        self._on_stall = on_stall

    def to_asgi_response(
        self, app: Any, request: Request[Any, Any, Any], **kwargs: Any
    ) -> ASGIStreamingResponse:
        """Build the stall-guarded ASGI response."""
        extra = kwargs.get("headers") or {}
        return _StallGuardedResponse(
            stall_timeout=self._stall_timeout,
            on_stall=self._on_stall,
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

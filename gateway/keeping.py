"""Keeping an answer as it was sent, for whoever answers the same request again without the engine
(`Idempotency-Key` replays, a session's retried step).

`kept(response, settle, state, max_bytes)` returns the response to send and calls `settle` once: with the
answer as sent (`StoredAnswer`: status, headers, media type, the body's bytes) when it was a 200 that all
went out, or with None when it was not kept (another status, over `max_bytes`, a stream that ended with an
error event or that its client left, a stream never sent). A whole answer is settled at once; a stream
when it ends. A client gone before a stream's first byte never starts the stream: the request's end
(`gateway.edge.fastpath`) settles whatever `unsettled(state)` finds with None.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from litestar import Response


class StoredAnswer(msgspec.Struct, frozen=True, kw_only=True):
    """A response as it was sent: status, headers, media type and whole body (an event stream's bytes)."""

    status: int
    media_type: str
    headers: list[tuple[str, str]]
    body: bytes


Settle = Callable[[StoredAnswer | None], Awaitable[None]]
# How a stream that completed ends (one ended by an error event has no [DONE]).
STREAM_END = b"data: [DONE]"
# Where a streamed answer's settlement waits in the request's scope state until the stream is over.
_HELD = "lockgate_kept_answers"
_JSON = msgspec.json.Encoder().encode


class Held:
    """A streamed answer's settlement, done once."""

    __slots__ = ("_settle", "settled")

    def __init__(self, settle: Settle) -> None:
        self._settle = settle
        self.settled = False

    async def settle(self, answer: StoredAnswer | None) -> None:
        """`settle(answer)`, unless settled already."""
        if not self.settled:
            self.settled = True
            await self._settle(answer)


async def kept(
    response: Response[Any], settle: Settle, state: dict[str, Any], max_bytes: int
) -> Response[Any]:
    """`response` as it will be sent; `settle` gets its answer once all of it has gone (module docstring)."""
    if (response.status_code or 200) != 200:
        await settle(None)
        return response
    if isinstance(response.content, msgspec.Struct):
        # Encoded here as the response would be (msgspec JSON), so the kept bytes are the sent ones.
        response.content = _JSON(response.content)
    if isinstance(response.content, bytes):
        body = response.content
        await settle(stored(response, body) if len(body) <= max_bytes else None)
        return response
    if isinstance(response.content, AsyncIterator):
        held = Held(settle)
        state.setdefault(_HELD, []).append(held)
        response.content = _recorded(held, response, response.content, max_bytes)
        return response
    await settle(None)  # nothing this module knows how to keep
    return response


def stored(response: Response[Any], body: bytes) -> StoredAnswer:
    """`response` with `body`, as kept."""
    return StoredAnswer(
        status=response.status_code or 200,
        media_type=str(response.media_type),
        headers=[(k, v) for k, v in response.headers.items() if k.lower() != "content-length"],
        body=body,
    )


async def _recorded(
    held: Held, response: Response[Any], events: AsyncIterator[bytes], max_bytes: int
) -> AsyncIterator[bytes]:
    """`events` as sent, kept once they have all gone out; not kept if the stream ends otherwise."""
    sent: list[bytes] = []
    size = 0
    try:
        async for chunk in events:
            if size <= max_bytes:
                sent.append(chunk)
                size += len(chunk)
            yield chunk
    except BaseException:
        await held.settle(None)
        raise
    body = b"".join(sent) if size <= max_bytes else None
    if body is not None and not body.rstrip().endswith(STREAM_END):
        body = None  # it ended with an error event (an engine failure, a guard block): a retry runs
    await held.settle(None if body is None else stored(response, body))


def unsettled(state: dict[str, Any] | None) -> list[Held]:
    """The request is over: its streamed answers' settlements that no stream did (the caller settles them
    with None). A dict lookup for every other request."""
    held = state.pop(_HELD, None) if state else None
    return [h for h in held if not h.settled] if isinstance(held, list) else []


def replayed(answer: StoredAnswer, header: str) -> Response[bytes]:
    """The kept answer, sent again, marked with `header: true`."""
    headers = dict(answer.headers)
    headers[header] = "true"
    return Response(
        content=answer.body, status_code=answer.status, media_type=answer.media_type, headers=headers
    )

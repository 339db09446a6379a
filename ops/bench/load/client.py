"""One streamed chat completion against `{base_url}/v1/chat/completions`, timed as the client sees it.

TTFT runs from sending the request to the first SSE chunk that carries text (a role-only opening chunk does
not count); inter-token latencies are the gaps between successive chunks with text; end-to-end runs to
`[DONE]`. 429, 503 and 504 are rejections (admission, quota, deadlines), with the error's `code`; any
other status, an error event inside the stream, a stream cut short or a transport failure is an error. A
planned cancellation closes the stream after `cancel_after` chunks with text, as a client that goes away.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import httpx
import msgspec
from msgspec.structs import replace

from ops.bench.load.plan import Planned
from ops.bench.load.workload import Priority

Status = Literal["completed", "cancelled", "rejected", "error"]
REJECTION_STATUSES = frozenset({429, 503, 504})


class Sample(msgspec.Struct, frozen=True, kw_only=True):
    """What happened to one request; times in seconds, `scheduled` and `sent` from the start of the run."""

    index: int
    tenant: str
    priority: Priority
    scheduled: float
    sent: float  # later than `scheduled` when the client could not keep up: the lag is visible
    status: Status
    http_status: int | None = None
    code: str | None = None  # the error's code, or the exception's class for a transport failure
    message: str = ""
    ttft: float | None = None
    itl: tuple[float, ...] = ()
    e2e: float | None = None
    chunks: int = 0  # chunks with text
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _ErrorBody(msgspec.Struct):
    message: str = ""
    code: str | None = None


class _Error(msgspec.Struct):
    error: _ErrorBody


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    text: str | None = None  # legacy completions


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: _ErrorBody | None = None


_chunk_decoder = msgspec.json.Decoder(_Chunk)
_error_decoder = msgspec.json.Decoder(_Error)
_encoder = msgspec.json.Encoder()


def _has_text(chunk: _Chunk) -> bool:
    return any((c.delta is not None and c.delta.content) or c.text for c in chunk.choices)


def request_body(planned: Planned, model: str, extra: dict[str, Any]) -> bytes:
    """The JSON body of a planned request."""
    return _encoder.encode(
        {
            "model": model,
            "messages": [{"role": "user", "content": planned.prompt()}],
            "max_tokens": planned.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            **extra,
        }
    )


def _error_of(raw: bytes) -> tuple[str | None, str]:
    try:
        body = _error_decoder.decode(raw).error
    except msgspec.DecodeError:
        return None, raw[:200].decode(errors="replace")
    return body.code, body.message


async def send(
    http: httpx.AsyncClient,
    url: str,
    planned: Planned,
    body: bytes,
    clock: Callable[[], float],
    origin: float,
) -> Sample:
    """Send one request and stream its answer; never raises for what the server or network does."""
    headers = {
        "authorization": f"Bearer {planned.api_key}",
        "content-type": "application/json",
        "x-lockgate-priority": planned.priority,
    }
    sent = clock()
    head = Sample(
        index=planned.index,
        tenant=planned.tenant,
        priority=planned.priority,
        scheduled=planned.at,
        sent=sent - origin,
        status="error",
    )
    try:
        async with http.stream("POST", url, content=body, headers=headers) as response:
            if response.status_code != 200:
                code, message = _error_of(await response.aread())
                status: Status = "rejected" if response.status_code in REJECTION_STATUSES else "error"
                return replace(
                    head, status=status, http_status=response.status_code, code=code, message=message
                )
            return await _read(response, planned, clock, sent, head)
    except httpx.HTTPError as exc:
        return replace(head, status="error", code=type(exc).__name__, message=str(exc))


async def _read(
    response: httpx.Response, planned: Planned, clock: Callable[[], float], sent: float, head: Sample
) -> Sample:
    last: float | None = None
    ttft: float | None = None
    gaps: list[float] = []
    usage: _Usage | None = None

    def sample(
        status: Status, code: str | None = None, message: str = "", end: float | None = None
    ) -> Sample:
        return replace(
            head,
            status=status,
            http_status=200,
            code=code,
            message=message,
            ttft=ttft,
            itl=tuple(gaps),
            e2e=None if end is None else end - sent,
            chunks=len(gaps) + (ttft is not None),
            prompt_tokens=usage.prompt_tokens if usage else None,
            completion_tokens=usage.completion_tokens if usage else None,
        )

    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return sample("completed", end=clock())
        try:
            chunk = _chunk_decoder.decode(data)
        except msgspec.DecodeError as exc:
            return sample("error", code="bad_chunk", message=str(exc))
        if chunk.error is not None:
            return sample("error", code=chunk.error.code, message=chunk.error.message)
        usage = chunk.usage or usage
        if not _has_text(chunk):
            continue
        now = clock()
        if ttft is None:
            ttft = now - sent
        elif last is not None:
            gaps.append(now - last)
        last = now
        if planned.cancel_after is not None and len(gaps) + 1 >= planned.cancel_after:
            # Leaving the `stream` block closes the connection: the server sees the client go.
            return sample("cancelled", end=None)
    return sample("error", code="truncated", message="the stream ended without [DONE]")

"""`Idempotency-Key` on the generation routes: the first request with a key runs and its answer is kept; a
retry with the same key and the same body gets that answer back (header `idempotent-replayed: true`) with no
engine call and no charge.

- Scope: an entry is named by the tenant, the API key, the route and the client's key (`entry_name`), so no
  other caller, and no other route, ever reads it.
- Sameness: the request body's sha256 (`fingerprint`). The same key with another body is 409
  `idempotency_key_reused` (`x-should-retry: false`: the SDKs would otherwise retry it in vain).
- Concurrency: while the first request runs, the same request again is 409 `idempotency_key_in_use` with
  `Retry-After` (the openai SDKs retry a 409, and then find the answer).
- What is kept: a 200 answer, whole or streamed, once it is all sent (an event stream's bytes as they went
  out, so a retry replays the same events; only a stream that completed, with `[DONE]`). Anything else (an
  error, a stream that ended with an error event or that its client left, an answer over
  `max_answer_bytes`) releases the key: a retry runs afresh and is charged as any request.
- A store that cannot answer refuses the request (503 `idempotency_unavailable`): running it could charge
  the caller twice, which is what the key is for.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from litestar import Response

from gateway.errors import APIError, InvalidRequestError, retry_after_headers
from gateway.idempotency.base import (
    Fresh,
    IdempotencyStore,
    IdempotencyStoreUnavailableError,
    InFlight,
    Mismatch,
    Replay,
    StoredAnswer,
)

HEADER = "idempotency-key"
# What became of a request with a key: it ran (and its answer was kept, or not), it was answered from the
# store, it was refused (the same request running, the key used for another, the store unreachable).
OUTCOMES = ("ran", "kept", "replayed", "in_use", "reused", "unavailable")
REPLAYED_HEADER = "idempotent-replayed"
MAX_KEY_CHARS = 255
log = logging.getLogger("lockgate.idempotency")
_JSON = msgspec.json.Encoder().encode
# Where a streamed answer's claim waits in the request's scope state until the stream is over.
_HELD = "lockgate_idempotency_claim"
# How a stream that completed ends (one ended by an error event has no [DONE]).
STREAM_END = b"data: [DONE]"


class IdempotencyConflictError(APIError):
    """The key is in use by a running request, or was used with another request."""

    status_code = 409
    error_type = "invalid_request_error"


class IdempotencyUnavailableError(APIError):
    """The idempotency store cannot answer now."""

    status_code = 503
    error_type = "service_unavailable"


def key_of(headers: Any) -> str | None:
    """The request's `Idempotency-Key` (None: absent); InvalidRequestError unless it is 1 to 255 printable
    ASCII characters."""
    key: str | None = headers.get(HEADER)
    if key is None:
        return None
    if not 0 < len(key) <= MAX_KEY_CHARS or not all(" " <= c <= "~" for c in key) or not key.strip():
        raise InvalidRequestError(
            f"Idempotency-Key must be 1 to {MAX_KEY_CHARS} printable ASCII characters",
            param="Idempotency-Key",
            code="invalid_idempotency_key",
        )
    return key


def entry_name(tenant: str, key_id: str, route: str, key: str) -> str:
    """The store's name for `key` sent by API key `key_id` of `tenant` to `route` (a digest)."""
    return hashlib.sha256(msgspec.json.encode([tenant, key_id, route, key])).hexdigest()


def fingerprint(body: bytes) -> str:
    """What makes two requests with one key the same request: their bodies, byte for byte."""
    return hashlib.sha256(body).hexdigest()


class Idempotency:
    """Runs requests that carry a key through the store (built in the lifespan)."""

    def __init__(self, store: IdempotencyStore, *, max_answer_bytes: int) -> None:
        self.store = store
        self._max_answer_bytes = max_answer_bytes
        # Requests with a key by what became of them (OUTCOMES): `lockgate:idempotency_requests_total`.
        self.counts: Counter[str] = Counter()

    async def run(
        self,
        name: str,
        print_: str,
        request: Callable[[], Awaitable[Response[Any]]],
        state: dict[str, Any],
    ) -> Response[Any]:
        """The stored answer for entry `name` with fingerprint `print_`, or `request()`'s response, kept for
        retries (see the module docstring). `state`: the request's scope state, where a streamed answer's
        claim waits until the stream is over (`unsettled` finds it if the stream was never sent)."""
        try:
            claim = await self.store.claim(name, print_)
        except IdempotencyStoreUnavailableError as exc:
            self.counts["unavailable"] += 1
            log.warning("idempotency store unavailable: %s", exc)
            raise IdempotencyUnavailableError(
                "the idempotency store is unavailable; retry later",
                code="idempotency_unavailable",
                headers=retry_after_headers(1),
            ) from exc
        if isinstance(claim, Replay):
            self.counts["replayed"] += 1
            return replayed(claim.answer)
        if isinstance(claim, InFlight):
            self.counts["in_use"] += 1
            raise IdempotencyConflictError(
                "a request with this Idempotency-Key is still running; retry to get its answer",
                param="Idempotency-Key",
                code="idempotency_key_in_use",
                headers=retry_after_headers(1),
            )
        if isinstance(claim, Mismatch):
            self.counts["reused"] += 1
            raise IdempotencyConflictError(
                "this Idempotency-Key was used with another request body",
                param="Idempotency-Key",
                code="idempotency_key_reused",
                headers={"x-should-retry": "false"},
            )
        assert isinstance(claim, Fresh)
        self.counts["ran"] += 1
        try:
            response = await request()
        except BaseException:
            await self._release(name, claim.token)
            raise
        if (response.status_code or 200) != 200:
            await self._release(name, claim.token)
            return response
        if isinstance(response.content, msgspec.Struct):
            # Encoded here as the response would be (msgspec JSON), so the kept bytes are the sent ones.
            response.content = _JSON(response.content)
        if isinstance(response.content, bytes):
            await self._keep(name, claim.token, response, response.content)
            return response
        if isinstance(response.content, AsyncIterator):
            claim_held = _Held(self, name, claim.token)
            state[_HELD] = claim_held
            response.content = self._recorded(claim_held, response, response.content)
            return response
        await self._release(name, claim.token)  # nothing this module knows how to keep
        return response

    async def _recorded(
        self, held: _Held, response: Response[Any], events: AsyncIterator[bytes]
    ) -> AsyncIterator[bytes]:
        """`events` as sent, kept once they have all gone out; released if the stream ends otherwise."""
        sent: list[bytes] = []
        size = 0
        try:
            async for chunk in events:
                if size <= self._max_answer_bytes:
                    sent.append(chunk)
                    size += len(chunk)
                yield chunk
        except BaseException:
            await held.settle(None)
            raise
        body = b"".join(sent) if size <= self._max_answer_bytes else None
        if body is not None and not body.rstrip().endswith(STREAM_END):
            body = None  # it ended with an error event (an engine failure, a guard block): a retry runs
        await held.settle(response, body)

    async def _keep(self, name: str, token: str, response: Response[Any], body: bytes | None) -> None:
        if body is None or len(body) > self._max_answer_bytes:
            await self._release(name, token)
            return
        answer = StoredAnswer(
            status=response.status_code or 200,
            media_type=str(response.media_type),
            headers=[(k, v) for k, v in response.headers.items() if k.lower() != "content-length"],
            body=body,
        )
        try:
            await self.store.complete(name, token, answer)
            self.counts["kept"] += 1
        except IdempotencyStoreUnavailableError as exc:
            # The answer is sent anyway; the claim lapses after pending_timeout and a retry then runs again.
            log.warning("idempotency store unavailable, answer not kept: %s", exc)

    async def _release(self, name: str, token: str) -> None:
        try:
            await self.store.release(name, token)
        except IdempotencyStoreUnavailableError as exc:
            log.warning("idempotency store unavailable, claim left to lapse: %s", exc)


class _Held:
    """A streamed answer's claim, settled once: kept or released."""

    __slots__ = ("_idempotency", "_name", "_token", "settled")

    def __init__(self, idempotency: Idempotency, name: str, token: str) -> None:
        self._idempotency = idempotency
        self._name = name
        self._token = token
        self.settled = False

    async def settle(self, response: Response[Any] | None, body: bytes | None = None) -> None:
        """Keep `body` as `response`'s answer (None: release the claim), unless settled already."""
        if self.settled:
            return
        self.settled = True
        if response is None:
            await self._idempotency._release(self._name, self._token)
        else:
            await self._idempotency._keep(self._name, self._token, response, body)


def unsettled(state: dict[str, Any] | None) -> _Held | None:
    """The request is over: its streamed answer's claim if no stream settled it (a client gone before the
    first byte was sent never starts the stream, so nothing else would); the caller releases it with
    `settle(None)`. A dict lookup for every other request."""
    held = state.pop(_HELD, None) if state else None
    return held if isinstance(held, _Held) and not held.settled else None


def replayed(answer: StoredAnswer) -> Response[bytes]:
    """The stored answer, sent again, marked as a replay."""
    headers = dict(answer.headers)
    headers[REPLAYED_HEADER] = "true"
    return Response(
        content=answer.body, status_code=answer.status, media_type=answer.media_type, headers=headers
    )

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
from collections.abc import Awaitable, Callable
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
from gateway.keeping import kept
from gateway.keeping import replayed as kept_replayed

HEADER = "idempotency-key"
# What became of a request with a key: it ran (and its answer was kept, or not), it was answered from the
# store, it was refused (the same request running, the key used for another, the store unreachable).
OUTCOMES = ("ran", "kept", "replayed", "in_use", "reused", "unavailable")
REPLAYED_HEADER = "idempotent-replayed"
MAX_KEY_CHARS = 255
log = logging.getLogger("lockgate.idempotency")


class IdempotencyConflictError(APIError):
    """The key is in use by a running request, or was used with another request."""

    status_code = 409
    error_type = "invalid_request_error"
    default_code = "idempotency_conflict"


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
        claim waits until the stream is over (`gateway.keeping`)."""
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

        async def settle(answer: StoredAnswer | None) -> None:
            if answer is None:
                await self._release(name, claim.token)
            else:
                await self._keep(name, claim.token, answer)

        return await kept(response, settle, state, self._max_answer_bytes)

    async def _keep(self, name: str, token: str, answer: StoredAnswer) -> None:
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


def replayed(answer: StoredAnswer) -> Response[bytes]:
    """The stored answer, sent again, marked as a replay."""
    return kept_replayed(answer, REPLAYED_HEADER)

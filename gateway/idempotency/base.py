"""The `IdempotencyStore` protocol: answers kept by `Idempotency-Key`, so that a retry is answered without a
second engine call and without a second charge.

A key is named per tenant and API key (`gateway.idempotency.replay.entry_name`: another caller's equal key
is another entry) and bound to the fingerprint of the request that first used it. Its life::

    claim(name, fingerprint) -> Fresh(token)      nobody holds it: the caller runs the request, then
                                                  complete(name, token, answer) or release(name, token)
                             -> Replay(answer)    answered before, with this fingerprint: send the answer
                             -> InFlight()        a request with this fingerprint is running now
                             -> Mismatch()        the key was used for another request

A claim nobody completes or releases (its process died) lapses after `pending_timeout`; an answer after
`window`. Only the holder of a claim's token completes or releases it, so a request whose claim lapsed and
was taken by a retry cannot overwrite the retry's.

Exceptions: `IdempotencyStoreUnavailableError` (the store cannot be reached in time: the request is refused
with 503, since running it could charge the caller twice).
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from gateway.keeping import StoredAnswer as StoredAnswer  # kept answers are the keeping module's


class Fresh(msgspec.Struct, frozen=True):
    """The caller holds the claim: it runs the request and completes or releases it with `token`."""

    token: str


class Replay(msgspec.Struct, frozen=True):
    """The stored answer to the same request."""

    answer: StoredAnswer


class InFlight(msgspec.Struct, frozen=True):
    """The same request is running now (another caller holds the claim)."""


class Mismatch(msgspec.Struct, frozen=True):
    """The key was first used with another request."""


Claim = Fresh | Replay | InFlight | Mismatch


class IdempotencyStoreUnavailableError(Exception):
    """The idempotency store cannot be reached in time."""


class IdempotencyStore(Protocol):
    """Answers by entry name, each bound to the fingerprint of the request that claimed it first."""

    async def claim(self, name: str, fingerprint: str) -> Claim:
        """Claim `name` for a request with `fingerprint`, or say why not (see the module docstring)."""
        ...

    async def complete(self, name: str, token: str, answer: StoredAnswer) -> None:
        """Keep `answer` under `name` for the store's window, if `token` still holds its claim."""
        ...

    async def release(self, name: str, token: str) -> None:
        """Give up the claim (the request failed: a retry runs it again), if `token` still holds it."""
        ...

    async def aclose(self) -> None:
        """Release the store's connections."""
        ...

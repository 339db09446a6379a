"""The `Engine` protocol and the messages that cross it.

The gateway renders and tokenizes prompts itself, so an engine receives token ids and always an explicit
`max_tokens` (vLLM defaults to 16 otherwise). Closing the iterator that `generate()` returns aborts the
request inside the engine and frees its KV cache: that is how cancellation flows back from the client.

Exceptions::

    EngineError                  base of every engine failure
    ├── EngineRequestError       this request failed; the engine is fine (retry or fail over)
    ├── EngineOverloadedError    the engine cannot take the request now (queue or KV capacity)
    └── EngineDeadError          the engine is gone; every request on it fails until it is replaced
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Literal, Protocol, runtime_checkable

import msgspec

FinishReason = Literal["stop", "length", "abort", "error"]


class EngineError(Exception):
    """Base of every engine failure; `retry_after` (seconds) when the engine knows when to try again."""

    def __init__(self, message: str = "", *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineRequestError(EngineError):
    """One request failed; the engine keeps serving others."""


class EngineOverloadedError(EngineError):
    """The engine refuses the request for lack of capacity."""


class EngineDeadError(EngineError):
    """The engine has died; it serves nothing until replaced."""


class SamplingSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Sampling settings of one request. `max_tokens` is always explicit."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # Number of top alternatives to return per generated token; None = no logprobs at all.
    logprobs: int | None = None
    # Generate `max_tokens` even past an end-of-sequence token (benchmarks and step tests need exact lengths).
    ignore_eos: bool = False


class EngineRequest(msgspec.Struct, frozen=True, kw_only=True):
    """What the gateway asks an engine to generate."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingSpec
    # Lower runs earlier (vLLM's convention).
    priority: int = 0
    # Per-tenant salt so that one tenant never hits another tenant's prefix cache.
    cache_salt: str | None = None
    # Absolute time (engine clock, seconds) after which the request is worthless; None = no deadline.
    deadline: float | None = None


class TopLogprob(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One alternative token with its log-probability."""

    token_id: int
    token: str
    logprob: float


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Log-probability of one generated token and its top alternatives."""

    token_id: int
    token: str
    logprob: float
    top: tuple[TopLogprob, ...]


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    """Token counts of one request, as far as it got."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class EngineDelta(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """New output since the previous delta. The last delta has `finish_reason` and `usage` set."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None


class EngineLoad(msgspec.Struct, frozen=True, kw_only=True):
    """What the engine itself reports about its load."""

    running: int
    waiting: int
    kv_tokens_used: int
    kv_tokens_capacity: int
    # Engine steps run so far: a supervisor sees a stuck engine (work in hand, no step) by this not moving.
    steps: int = 0


class Health(msgspec.Struct, frozen=True, kw_only=True):
    """Readiness of one engine replica."""

    ready: bool
    detail: str = ""


@runtime_checkable
class Engine(Protocol):
    """One engine replica that generates tokens from token ids."""

    replica_id: str
    model_name: str
    max_model_len: int

    def generate(self, req: EngineRequest) -> AsyncGenerator[EngineDelta, None]:
        """Stream the request's output. Closing the iterator early aborts the request in the engine."""
        ...

    async def score_next_token(
        self, prompt_token_ids: Sequence[int], token_ids: Sequence[int], *, priority: int = 0
    ) -> dict[int, float]:
        """The log-probability of exactly each of `token_ids` as the first token generated after the prompt
        (greedy, one token): the one-token classifier's primitive.

        Every named id is a key of the result (duplicates once); an engine that cannot report one raises
        EngineRequestError rather than leave it out. `priority` orders the request against others waiting
        in the engine (lower runs earlier): guard calls pass a negative one to go ahead of batch generation.
        """
        ...

    async def load(self) -> EngineLoad:
        """Current load as the engine reports it."""
        ...

    async def health(self) -> Health:
        """Whether the engine can serve requests now."""
        ...

    async def start(self) -> None:
        """Bring the engine up; `health()` is ready once this returns."""
        ...

    async def shutdown(self) -> None:
        """Abort everything in flight and release the engine's processes and memory."""
        ...

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


class EngineDrainingError(EngineDeadError):
    """The engine refused a new request because it is shutting down: it finishes what it runs, then exits."""


class OutputConstraint(msgspec.Struct, frozen=True, kw_only=True):
    """Constrained decoding: the output must be JSON (`json_object`) or JSON valid against `schema`
    (`json_schema`, the schema as canonical JSON text). Engines enforce it while decoding (vLLM's structured
    outputs); a tool call the client requires is a `json_schema` constraint too."""

    kind: Literal["json_object", "json_schema"]
    schema: str = ""


class SamplingSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Sampling settings of one request. `max_tokens` is always explicit; the others default to "off"."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # Number of top alternatives to return per generated token; None = no logprobs at all.
    logprobs: int | None = None
    # Generate `max_tokens` even past an end-of-sequence token (benchmarks and step tests need exact lengths).
    ignore_eos: bool = False
    # OpenAI's penalties (-2..2) and vLLM's extensions; 0 / 1.0 / 0.0 mean off.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    # No end of sequence (EOS or stop strings) before this many tokens.
    min_tokens: int = 0
    # Added to the logits of these token ids (-100 bans a token, +100 forces it), as (token id, bias) pairs.
    logit_bias: tuple[tuple[int, float], ...] = ()
    constraint: OutputConstraint | None = None


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
    # Independent choices to generate. An engine generates one sequence per request: `engines.choices`
    # splits a request with n > 1 into n requests (ids `<id>-<i>`) and merges their deltas by `index`.
    n: int = 1
    # W3C trace context of the gateway request it serves ("" = none): a remote engine passes it on as the
    # `traceparent` header, so the server's spans join the request's trace.
    traceparent: str = ""


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
    # Generated tokens the gateway's output guard scored for this request (engines leave it 0): charged to
    # the tenant as a line of its own (`gateway.generation.settlement`) and reported as `usage.guard_tokens`.
    guard_tokens: int = 0


class EngineDelta(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """New output since the previous delta. The last delta has `finish_reason` and `usage` set.

    `index` is the choice (0 unless the request asked for n > 1 choices; each choice ends with its own
    finish_reason and usage)."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    index: int = 0


class EngineLoad(msgspec.Struct, frozen=True, kw_only=True):
    """What the engine itself reports about its load."""

    running: int
    waiting: int
    kv_tokens_used: int
    kv_tokens_capacity: int
    # Engine steps run so far: a supervisor sees a stuck engine (work in hand, no step) by this not moving.
    steps: int = 0
    # Most sequences the engine runs at once (vLLM's `max_num_seqs`); more wait in the engine's own queue,
    # in its order, not the gateway's. 0 = not known.
    max_running: int = 0


class Health(msgspec.Struct, frozen=True, kw_only=True):
    """Readiness of one engine replica."""

    ready: bool
    detail: str = ""
    # The longest step the engine takes at its token budget, by its measured profile (None where not
    # measured): how slow this host runs the model, for an operator reading `/readyz`.
    step_seconds: float | None = None


class Scorer(Protocol):
    """What a one-token guard needs of its engine pool: an engine, or replicas that share the calls."""

    @property
    def max_model_len(self) -> int:
        """The longest prompt plus one token it scores."""
        ...

    async def score_next_token(
        self,
        prompt_token_ids: Sequence[int],
        token_ids: Sequence[int],
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> dict[int, float]:
        """As `Engine.score_next_token`."""
        ...


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
        self,
        prompt_token_ids: Sequence[int],
        token_ids: Sequence[int],
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> dict[int, float]:
        """The log-probability of exactly each of `token_ids` as the first token generated after the prompt
        (greedy, one token): the one-token classifier's primitive.

        Every named id is a key of the result (duplicates once); an engine that cannot report one raises
        EngineRequestError rather than leave it out. `priority` orders the request against others waiting
        in the engine (lower runs earlier): guard calls pass a negative one to go ahead of batch generation.
        `cache_salt`, as on `EngineRequest`: the prompt shares cached prefixes only with requests carrying
        the same salt (guard calls pass the tenant's, as its generation requests do).
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

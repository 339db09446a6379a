"""From a decoded OpenAI request to an `EngineRequest`: semantic checks, prompt rendering, exact token counts.

Every refusal is an `InvalidRequestError` naming the field. Nothing is truncated silently: a prompt that does
not fit the context, or a `max_tokens` that would overflow it, is refused with `context_length_exceeded`.
"""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Literal

import msgspec

from engines.base import EngineRequest, OutputConstraint, SamplingSpec
from gateway.errors import InvalidRequestError
from gateway.generation.bounds import check_request
from gateway.generation.constraints import PendingSchema, compile_schema, constraint_of
from gateway.generation.messages import message_texts
from gateway.generation.prompts import PromptRenderer
from gateway.generation.tools import ToolUse, template_messages, tool_use
from gateway.requestid import engine_request_id
from gateway.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from guard.base import Span
from registry.view import ResolvedModel, ResolvedPrompt

# OpenAI's default for the legacy completions endpoint.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_STOP_SEQUENCES = 4
# OpenAI's limits.
MAX_LOGIT_BIAS = 300
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
# Roles whose messages hold instructions: trusted by the guard only from a key an operator granted
# `trusted_instructions` (a client's own role choice never makes text trusted).
INSTRUCTION_ROLES = frozenset({"system", "developer"})


class Limits(msgspec.Struct, frozen=True, kw_only=True):
    """What the resolved model version, its engine and the configuration allow."""

    max_model_len: int
    default_max_tokens: int
    max_logprobs: int
    max_choices: int = 1
    max_tool_calls: int = 1


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    """A validated request, ready for the engine, plus what the response needs to know."""

    kind: Literal["chat", "completion"]
    # The gateway's request id (x-request-id); the engine request has a unique id derived from it.
    request_id: str
    # The model as the client named it, and the exact versions it resolved to.
    model_name: str
    model: ResolvedModel
    engine_request: EngineRequest
    stream: bool
    include_usage: bool
    # Whether the client asked for logprobs (chat: logprobs=true; completions: logprobs=N).
    logprobs: bool
    # The input as the guard sees it: every client-supplied text that reaches the prompt. Only the system
    # prompt the gateway prepends from the registry is trusted (and, for a key granted trusted instructions,
    # its own system and developer messages); whatever else a client sends, in any role, is not.
    spans: tuple[Span, ...]
    # Chat: the tools offered and how calls come out of the output (None: no tools).
    tools: ToolUse | None = None
    # Chat: the client's `metadata`, kept with the outcome.
    metadata: dict[str, str] | None = None
    # The client's `user` (session affinity when it sends no x-session-id).
    user: str | None = None
    # Chat: a schema the output is constrained to, compiled into `engine_request` only after the quota is
    # reserved (`constraints.compile_pending`); None once compiled, or when there is none.
    pending_schema: PendingSchema | None = None

    @property
    def choices(self) -> int:
        """How many choices the response has."""
        return self.engine_request.n


def _check_range(value: float | None, field: str, low: float, high: float, *, open_low: bool = False) -> None:
    if value is None:
        return
    ok = (low < value if open_low else low <= value) and value <= high
    if not ok:  # written so that NaN fails too
        bound = "(" if open_low else "["
        raise InvalidRequestError(
            f"{field} must be in {bound}{low:g}, {high:g}]", param=field, code="invalid_value"
        )


def _check_common(req: ChatCompletionRequest | CompletionRequest, limits: Limits) -> None:
    n = 1 if req.n is None else req.n
    if not 1 <= n <= limits.max_choices:
        raise InvalidRequestError(
            f"n must be between 1 and {limits.max_choices}", param="n", code="invalid_value"
        )
    _check_range(req.temperature, "temperature", 0.0, 2.0)
    _check_range(req.top_p, "top_p", 0.0, 1.0, open_low=True)
    _check_range(req.frequency_penalty, "frequency_penalty", -2.0, 2.0)
    _check_range(req.presence_penalty, "presence_penalty", -2.0, 2.0)
    _check_range(req.repetition_penalty, "repetition_penalty", 0.0, 2.0, open_low=True)
    _check_range(req.min_p, "min_p", 0.0, 1.0)
    if req.top_k is not None and not (req.top_k in (-1, 0) or req.top_k >= 1):
        raise InvalidRequestError(
            "top_k must be -1 or 0 (off) or at least 1", param="top_k", code="invalid_value"
        )
    if req.min_tokens is not None and req.min_tokens < 0:
        raise InvalidRequestError("min_tokens must be at least 0", param="min_tokens", code="invalid_value")
    if req.seed is not None and not 0 <= req.seed < 2**63:
        raise InvalidRequestError("seed must be in [0, 2**63)", param="seed", code="invalid_value")
    if req.stream_options is not None and not req.stream:
        raise InvalidRequestError(
            "stream_options is only allowed when stream is true", param="stream_options", code="invalid_value"
        )


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequestError(
            f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens", param="logit_bias", code="invalid_value"
        )
    out = []
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < vocab_size:
            raise InvalidRequestError(
                f"logit_bias key {key!r} is not a token id of this model (0..{vocab_size - 1})",
                param=f"logit_bias.{key}",
                code="invalid_value",
            )
        _check_range(value, f"logit_bias.{key}", -100.0, 100.0)
        out.append((token, float(value)))
    return tuple(out)


def _stop(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > MAX_STOP_SEQUENCES:
        raise InvalidRequestError(
            f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed", param="stop", code="invalid_value"
        )
    if any(not s for s in stops):
        raise InvalidRequestError("stop sequences must not be empty", param="stop", code="invalid_value")
    return tuple(stops)


def _max_tokens(
    asked: int | None, field: str, prompt_len: int, default: int, limits: Limits, where: str
) -> int:
    room = limits.max_model_len - prompt_len
    if room <= 0:
        raise InvalidRequestError(
            f"the prompt has {prompt_len} tokens; this model's context is {limits.max_model_len} tokens, "
            "which leaves no room for a completion",
            param=where,
            code="context_length_exceeded",
        )
    if asked is None:
        return min(default, room)
    if asked < 1:
        raise InvalidRequestError(f"{field} must be at least 1", param=field, code="invalid_value")
    if asked > room:
        raise InvalidRequestError(
            f"the prompt has {prompt_len} tokens and {field} is {asked}; together they exceed this model's "
            f"context of {limits.max_model_len} tokens (at most {room} completion tokens fit)",
            param=field,
            code="context_length_exceeded",
        )
    return asked


def _sampling(
    req: ChatCompletionRequest | CompletionRequest,
    max_tokens: int,
    logprobs: int | None,
    vocab_size: int,
    constraint: OutputConstraint | None = None,
) -> SamplingSpec:
    min_tokens = req.min_tokens or 0
    if min_tokens > max_tokens:
        raise InvalidRequestError(
            f"min_tokens ({min_tokens}) is more than max_tokens ({max_tokens})",
            param="min_tokens",
            code="invalid_value",
        )
    return SamplingSpec(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        seed=req.seed,
        stop=_stop(req.stop),
        logprobs=logprobs,
        frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        top_k=max(0, req.top_k or 0),
        min_p=req.min_p or 0.0,
        min_tokens=min_tokens,
        logit_bias=_logit_bias(req.logit_bias, vocab_size),
        constraint=constraint,
    )


def _include_usage(req: ChatCompletionRequest | CompletionRequest) -> bool:
    return req.stream_options is not None and bool(req.stream_options.include_usage)


def _metadata(metadata: dict[str, str] | None) -> dict[str, str] | None:
    if metadata is None:
        return None
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidRequestError(
            f"metadata holds at most {MAX_METADATA_PAIRS} pairs", param="metadata", code="invalid_value"
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise InvalidRequestError(
                f"metadata keys are at most {MAX_METADATA_KEY} characters and values at most "
                f"{MAX_METADATA_VALUE}",
                param=f"metadata.{key[:MAX_METADATA_KEY]}",
                code="invalid_value",
            )
    return metadata


async def plan_chat(
    req: ChatCompletionRequest,
    request_id: str,
    model: ResolvedModel,
    renderer: PromptRenderer,
    limits: Limits,
    *,
    instructions: ResolvedPrompt | None = None,
    trusted_instructions: bool = False,
) -> Plan:
    """Validate a chat request and render its messages (and tools) with the model's chat template.

    `instructions`: the key's or tenant's system prompt, prepended as the first system message (trusted).
    `trusted_instructions`: the key's own system and developer messages are trusted too.
    """
    check_request(req)
    _check_common(req, limits)
    client = req.messages
    texts = message_texts(client)
    trusted = [trusted_instructions and m.role in INSTRUCTION_ROLES for m in client]
    messages: list[ChatMessage] = list(client)
    if instructions is not None:
        messages.insert(0, ChatMessage(role="system", content=instructions.text))
        texts.insert(0, instructions.text)
        trusted.insert(0, True)
    if req.modalities is not None and req.modalities != ["text"]:
        raise InvalidRequestError(
            'this model answers in text only: modalities must be ["text"]',
            param="modalities",
            code="unsupported_value",
        )
    top: int | None = None
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise InvalidRequestError(
                "top_logprobs requires logprobs to be true", param="top_logprobs", code="invalid_value"
            )
        if not 0 <= req.top_logprobs <= limits.max_logprobs:
            raise InvalidRequestError(
                f"top_logprobs must be between 0 and {limits.max_logprobs}", param="top_logprobs"
            )
        top = req.top_logprobs
    elif req.logprobs:
        top = 0
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    use = tool_use(req)
    metadata = _metadata(req.metadata)
    # A schema is only checked for size here; it is compiled once the quota is reserved.
    constraint = constraint_of(req, use, limits.max_tool_calls)
    pending = constraint if isinstance(constraint, PendingSchema) else None
    ready = None if isinstance(constraint, PendingSchema) else constraint
    rendered = template_messages(messages, texts, use, renderer.supports_tools, trusted)
    prompt = await renderer.chat(rendered.messages, rendered.tools)
    max_tokens = _max_tokens(asked, field, len(prompt), limits.default_max_tokens, limits, "messages")
    return Plan(
        kind="chat",
        request_id=request_id,
        model_name=req.model,
        model=model,
        engine_request=EngineRequest(
            request_id=engine_request_id(request_id),
            prompt_token_ids=tuple(prompt),
            sampling=_sampling(req, max_tokens, top, renderer.vocab_size, ready),
            n=req.n or 1,
        ),
        stream=bool(req.stream),
        include_usage=_include_usage(req),
        logprobs=bool(req.logprobs),
        spans=rendered.spans,
        tools=use,
        metadata=metadata,
        user=req.user,
        pending_schema=pending,
    )


async def _completion_prompt(prompt: str | list[int | str], renderer: PromptRenderer) -> list[int]:
    if isinstance(prompt, str):
        ids = await renderer.text(prompt)
    elif len(prompt) == 1 and isinstance(prompt[0], str):
        ids = await renderer.text(prompt[0])
    elif all(isinstance(t, int) for t in prompt):
        ids = [t for t in prompt if isinstance(t, int)]
        bad = [t for t in ids if not 0 <= t < renderer.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]} is outside this model's vocabulary (0..{renderer.vocab_size - 1})",
                param="prompt",
                code="invalid_value",
            )
    else:
        raise InvalidRequestError(
            "prompt must be one string or one list of token ids; batches of prompts are not supported",
            param="prompt",
            code="unsupported_value",
        )
    if not ids:
        raise InvalidRequestError("prompt must not be empty", param="prompt", code="invalid_value")
    return ids


async def plan_completion(
    req: CompletionRequest, request_id: str, model: ResolvedModel, renderer: PromptRenderer, limits: Limits
) -> Plan:
    """Validate a legacy completion request and tokenize its prompt."""
    check_request(req)
    _check_common(req, limits)
    if req.echo:
        raise InvalidRequestError("echo is not supported", param="echo", code="unsupported_value")
    if req.suffix is not None:
        raise InvalidRequestError("suffix is not supported", param="suffix", code="unsupported_value")
    if req.best_of not in (None, 1):
        raise InvalidRequestError(
            "best_of is not supported (only 1); ask for n choices instead",
            param="best_of",
            code="unsupported_value",
        )
    if req.logprobs is not None and not 0 <= req.logprobs <= limits.max_logprobs:
        raise InvalidRequestError(f"logprobs must be between 0 and {limits.max_logprobs}", param="logprobs")
    prompt = await _completion_prompt(req.prompt, renderer)
    text = req.prompt if isinstance(req.prompt, str) else await renderer.decode(prompt)
    max_tokens = _max_tokens(
        req.max_tokens, "max_tokens", len(prompt), COMPLETIONS_DEFAULT_MAX_TOKENS, limits, "prompt"
    )
    return Plan(
        kind="completion",
        request_id=request_id,
        model_name=req.model,
        model=model,
        engine_request=EngineRequest(
            request_id=engine_request_id(request_id),
            prompt_token_ids=tuple(prompt),
            sampling=_sampling(req, max_tokens, req.logprobs, renderer.vocab_size),
            n=req.n or 1,
        ),
        stream=bool(req.stream),
        include_usage=_include_usage(req),
        logprobs=req.logprobs is not None,
        spans=(Span(text=text, source="user"),),
        user=req.user,
    )


async def compile_pending(plan: Plan, executor: Executor) -> Plan:
    """`plan` with its pending schema compiled into the engine request's constraint (itself if it has none);
    400 naming the field if the schema is refused (`constraints.compile_schema`, in `executor`)."""
    pending = plan.pending_schema
    if pending is None:
        return plan
    constraint = await compile_schema(pending, executor)
    req = plan.engine_request
    sampling = msgspec.structs.replace(req.sampling, constraint=constraint)
    return msgspec.structs.replace(
        plan, engine_request=msgspec.structs.replace(req, sampling=sampling), pending_schema=None
    )

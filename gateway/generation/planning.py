"""From a decoded OpenAI request to an `EngineRequest`: semantic checks, prompt rendering, exact token counts.

Every refusal is an `InvalidRequestError` naming the field. Nothing is truncated silently: a prompt that does
not fit the context, or a `max_tokens` that would overflow it, is refused with `context_length_exceeded`.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from engines.base import EngineRequest, SamplingSpec
from gateway.errors import InvalidRequestError
from gateway.generation.prompts import PromptRenderer
from gateway.requestid import engine_request_id
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from guard.base import Source, Span
from registry.view import ResolvedModel

# OpenAI's default for the legacy completions endpoint.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_STOP_SEQUENCES = 4
# Roles whose messages the tenant itself configures: the guard treats them as trusted.
TRUSTED_ROLES = frozenset({"system", "developer"})
_SOURCES: dict[str, Source] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


class Limits(msgspec.Struct, frozen=True, kw_only=True):
    """What the resolved model version, its engine and the configuration allow."""

    max_model_len: int
    default_max_tokens: int
    max_logprobs: int


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
    # The input as the guard sees it: system and developer messages are the tenant's own (trusted); what
    # users, earlier turns and tools supplied is not.
    spans: tuple[Span, ...]


def _check_common(req: ChatCompletionRequest | CompletionRequest) -> None:
    if req.n != 1:
        raise InvalidRequestError("only n=1 is supported", param="n", code="unsupported_value")
    if req.temperature is not None and not 0.0 <= req.temperature <= 2.0:
        raise InvalidRequestError(
            "temperature must be between 0 and 2", param="temperature", code="invalid_value"
        )
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise InvalidRequestError("top_p must be in (0, 1]", param="top_p", code="invalid_value")
    if req.seed is not None and not 0 <= req.seed < 2**63:
        raise InvalidRequestError("seed must be in [0, 2**63)", param="seed", code="invalid_value")
    if req.stream_options is not None and not req.stream:
        raise InvalidRequestError(
            "stream_options is only allowed when stream is true", param="stream_options", code="invalid_value"
        )


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
    req: ChatCompletionRequest | CompletionRequest, max_tokens: int, logprobs: int | None
) -> SamplingSpec:
    return SamplingSpec(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        seed=req.seed,
        stop=_stop(req.stop),
        logprobs=logprobs,
    )


def _include_usage(req: ChatCompletionRequest | CompletionRequest) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


async def plan_chat(
    req: ChatCompletionRequest,
    request_id: str,
    model: ResolvedModel,
    renderer: PromptRenderer,
    limits: Limits,
) -> Plan:
    """Validate a chat request and render its messages with the model's chat template."""
    _check_common(req)
    if not req.messages:
        raise InvalidRequestError("messages must contain at least one message", param="messages")
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
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    prompt = await renderer.chat(messages)
    max_tokens = _max_tokens(asked, field, len(prompt), limits.default_max_tokens, limits, "messages")
    return Plan(
        kind="chat",
        request_id=request_id,
        model_name=req.model,
        model=model,
        engine_request=EngineRequest(
            request_id=engine_request_id(request_id),
            prompt_token_ids=tuple(prompt),
            sampling=_sampling(req, max_tokens, top),
        ),
        stream=req.stream,
        include_usage=_include_usage(req),
        logprobs=req.logprobs,
        spans=tuple(
            Span(text=m.text(), source=_SOURCES[m.role], trusted=m.role in TRUSTED_ROLES)
            for m in req.messages
        ),
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
    _check_common(req)
    if req.echo:
        raise InvalidRequestError("echo is not supported", param="echo", code="unsupported_value")
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
            sampling=_sampling(req, max_tokens, req.logprobs),
        ),
        stream=req.stream,
        include_usage=_include_usage(req),
        logprobs=req.logprobs is not None,
        spans=(Span(text=text, source="user"),),
    )

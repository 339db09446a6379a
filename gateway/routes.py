"""HTTP routes: the OpenAI-compatible API and the health probes."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get, post
from litestar.di import NamedDependency
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import Example
from litestar.status_codes import HTTP_200_OK, HTTP_503_SERVICE_UNAVAILABLE

from gateway.decoding import body_limit, read_body
from gateway.errors import AuthenticationError, PermissionDeniedError, StoreUnavailableError
from gateway.fastpath import generate
from gateway.moderations import run_moderation
from gateway.openapi import (
    BEARER,
    ChatStreamingOperation,
    CompletionStreamingOperation,
    errors,
    public,
    request_body,
    secured,
)
from gateway.schemas import (
    AliasTargetCard,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelCard,
    ModelList,
    ModerationRequest,
    ModerationResponse,
)
from gateway.security import allow, allow_operator, principal_of
from gateway.service import Services
from policy.auth import Principal
from registry.models import ModelSpec

# What generation can answer besides 401/403/503: invalid fields, unknown model, body too large, quota,
# a failed engine.
_GENERATION_ERRORS = (400, 404, 413, 429, 502)


@post(
    "/v1/chat/completions",
    status_code=HTTP_200_OK,
    dependencies=request_body(
        ChatCompletionRequest,
        {
            "model": "SmolLM2-135M-Instruct",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16,
        },
    ),
    responses={
        HTTP_200_OK: ResponseSpec(
            ChatCompletion,
            generate_examples=False,
            description="The whole completion (JSON), or with `stream: true` server-sent events.",
            examples=[
                Example(
                    summary="whole",
                    value={
                        "id": "chatcmpl-1",
                        "created": 1767225600,
                        "model": "SmolLM2-135M-Instruct",
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": "Paris."},
                                "finish_reason": "stop",
                                "logprobs": None,
                            }
                        ],
                        "usage": {"prompt_tokens": 36, "completion_tokens": 3, "total_tokens": 39},
                        "object": "chat.completion",
                    },
                )
            ],
        ),
        **errors(*_GENERATION_ERRORS),
    },
    operation_class=ChatStreamingOperation,
)
async def chat_completions(
    request: Request[Any, Any, Any],
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
) -> Response[Any]:
    """OpenAI chat completions, whole or streamed (served by `gateway.fastpath`; this handler documents the
    route and answers only if the fast path is not in front, e.g. behind a root path)."""
    return await generate("chat", services, request, principal, body_limit(request.route_handler))


@post(
    "/v1/completions",
    status_code=HTTP_200_OK,
    dependencies=request_body(
        CompletionRequest,
        {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 8},
    ),
    responses={
        HTTP_200_OK: ResponseSpec(
            Completion,
            generate_examples=False,
            description="The whole completion (JSON), or with `stream: true` server-sent events.",
        ),
        **errors(*_GENERATION_ERRORS),
    },
    operation_class=CompletionStreamingOperation,
)
async def completions(
    request: Request[Any, Any, Any],
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
) -> Response[Any]:
    """OpenAI legacy completions, whole or streamed (served by `gateway.fastpath`, as chat is)."""
    return await generate("completion", services, request, principal, body_limit(request.route_handler))


@post(
    "/v1/moderations",
    status_code=HTTP_200_OK,
    dependencies=request_body(
        ModerationRequest,
        {"input": "I want to hurt them."},
        {"model": "omni-moderation-latest", "input": ["first text", "second text"]},
    ),
    responses={
        HTTP_200_OK: ResponseSpec(
            ModerationResponse,
            generate_examples=False,
            description=(
                "One result per input, in order, in OpenAI's `ModerationCreateResponse` shape: every OpenAI "
                "category key (false and 0.0 where the policy has no such category), the policy's other "
                "categories under their own names, and `lockgate` (what the policy decided, and how)."
            ),
        ),
        # Invalid input, a quota that can never fit, body over the limit, quota short.
        **errors(400, 413, 429),
    },
)
async def moderations(
    request: Request[Any, Any, Any],
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
) -> Response[ModerationResponse]:
    """OpenAI moderations, answered by the tenant's own safety policy: each input is checked as a request's
    input is (recorded in the audit trail, metered), and nothing is generated."""
    allow(principal, "consumer")
    body = await read_body(request)
    return await run_moderation(services, services.moderation_decoder.decode(body), request, principal)


@get("/v1/models", responses=errors())
async def list_models(
    services: NamedDependency[Services], principal: NamedDependency[Principal]
) -> ModelList:
    """The served models."""
    allow(principal, "consumer")
    view = services.registry.view
    # Guard models run on guard pools and are not served for generation: not listed.
    aliases = [
        alias
        for alias in view.aliases("model")
        if view.spec("model", alias.name, alias.targets[0].version, ModelSpec).engine_pool
        not in services.guard_pools
    ]
    cards = [
        ModelCard(
            id=alias.name,
            created=int(alias.updated_at),
            kind="alias",
            targets=[
                AliasTargetCard(model=f"{alias.name}@{t.version}", weight=t.weight) for t in alias.targets
            ],
        )
        for alias in aliases
    ]
    for alias in aliases:
        for version in view.versions("model", alias.name):
            model = view.resolve_model(version.ref, key="")
            cards.append(
                ModelCard(
                    id=model.ref,
                    created=int(version.published_at),
                    kind="version",
                    max_model_len=model.spec.arch.max_context,
                    tokenizer=model.tokenizer.ref,
                    chat_template=model.chat_template.ref,
                    weights_sha256=model.spec.weights_sha256,
                    kv_bytes_per_token=model.kv_bytes_per_token,
                )
            )
    return ModelList(data=cards)


@get(
    "/healthz",
    responses={
        HTTP_503_SERVICE_UNAVAILABLE: ResponseSpec(
            dict[str, str],
            generate_examples=False,
            description='The gateway cannot recover by itself: `{"status": "dead", "detail": ...}`.',
        )
    },
)
async def healthz(services: NamedDependency[Services]) -> Response[dict[str, str]]:
    """Liveness: 200 while the gateway can serve or recover by itself; 503 once it cannot (its engine
    supervisor gave up), so that a process supervisor restarts it."""
    detail = services.unrecoverable()
    if detail:
        return Response(
            content={"status": "dead", "detail": detail}, status_code=HTTP_503_SERVICE_UNAVAILABLE
        )
    return Response(content={"status": "ok"}, status_code=HTTP_200_OK)


@get(
    "/readyz",
    # No key (a load balancer's probe), or an `operator` key of the operating organisation for the detail.
    security=[{}, *BEARER],
    responses={
        HTTP_503_SERVICE_UNAVAILABLE: ResponseSpec(
            dict[str, Any],
            generate_examples=False,
            description="Not ready: `status: not_ready` (for an operator key, the same body as ready's, with "
            "the `detail` of the engines down).",
        )
    },
)
async def readyz(
    request: Request[Any, Any, Any], services: NamedDependency[Services]
) -> Response[dict[str, Any]]:
    """Readiness: 200 `{"status": "ready"}` while every pool has a ready engine and the registry view is
    fresh, else 503 `{"status": "not_ready"}`, as checked within the last `[server] readiness_cache`
    seconds. For an `operator` key of the operating organisation, the detail: each engine replica, pool and
    the registry view (any other caller, or a key that fails, gets the status alone: replica ids and error
    text stay inside)."""
    readiness = await services.readiness.check()
    body = readiness.body if await _is_operator(request, services) else {"status": readiness.body["status"]}
    status = HTTP_200_OK if readiness.ready else HTTP_503_SERVICE_UNAVAILABLE
    return Response(content=body, status_code=status)


async def _is_operator(request: Request[Any, Any, Any], services: Services) -> bool:
    """Whether the request carries a key with the `operator` role of the operating organisation. Never an
    error: a probe is answered whatever its key (a bad one just gets no detail)."""
    if "authorization" not in request.headers:
        return False
    try:
        allow_operator(await principal_of(request, services), "operator")
    except (AuthenticationError, PermissionDeniedError, StoreUnavailableError):
        return False
    return True


ROUTES = [
    secured("openai", [chat_completions, completions, moderations, list_models]),
    public("health", [healthz, readyz]),
]

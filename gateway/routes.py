"""HTTP routes: the OpenAI-compatible API and the health probes."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get, post
from litestar.di import NamedDependency
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import Example
from litestar.status_codes import HTTP_200_OK, HTTP_503_SERVICE_UNAVAILABLE

from gateway.decoding import body_limit, read_body
from gateway.fastpath import generate
from gateway.moderations import run_moderation
from gateway.openapi import (
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
from gateway.security import allow
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
    responses={
        HTTP_503_SERVICE_UNAVAILABLE: ResponseSpec(
            dict[str, Any],
            generate_examples=False,
            description="Not ready: the same body, `status: not_ready`, and the `detail` of engines down.",
        )
    },
)
async def readyz(services: NamedDependency[Services]) -> Response[dict[str, Any]]:
    """Every pool has a ready engine (the generation replicas and the guards' pools), and the registry view is
    fresh (refreshed within `registry.max_staleness` seconds, its refresher running)."""
    engines = [(r.pool, r.engine) for r in services.scheduler.replicas]
    engines += [(pool, services.pools[pool]) for pool in sorted(services.guard_pools)]
    healths = [(pool, engine.replica_id, await engine.health()) for pool, engine in engines]
    pools: dict[str, bool] = {}
    for pool, _, health in healths:
        pools[pool] = pools.get(pool, False) or health.ready
    # The registry part: "stale" with the view's age while refreshes keep failing (the last view is still
    # served, but a replica that cannot see rollouts should leave the load balancer's rotation).
    registry = services.registry.health(services.config.registry.max_staleness)
    engines_ready = all(pools.values())
    ready = engines_ready and registry.ready
    body = {
        "status": "ready" if ready else "not_ready",
        "engines": {replica_id: health.ready for _, replica_id, health in healths},
        "pools": pools,
        "registry": {
            "status": "fresh" if registry.ready else "stale",
            "age_s": round(registry.age_s, 3),
            "generation": registry.generation,
            "refresher": registry.refresher,
            "consecutive_failures": registry.consecutive_failures,
            "last_error": registry.last_error,
        },
    }
    down = [f"{pool} {replica_id}: {h.detail}" for pool, replica_id, h in healths if not h.ready]
    if down:
        body["detail"] = "; ".join(down)
    return Response(content=body, status_code=HTTP_200_OK if ready else HTTP_503_SERVICE_UNAVAILABLE)


ROUTES = [
    secured("openai", [chat_completions, completions, moderations, list_models]),
    public("health", [healthz, readyz]),
]

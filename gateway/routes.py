"""HTTP routes: the OpenAI-compatible API and the health probes."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get, post
from litestar.di import NamedDependency
from litestar.status_codes import HTTP_200_OK, HTTP_503_SERVICE_UNAVAILABLE

from gateway.decoding import read_body
from gateway.planning import plan_chat, plan_completion
from gateway.requestid import request_id_of
from gateway.schemas import ModelCard, ModelList
from gateway.security import allow
from gateway.service import Services
from policy.auth import Principal


@post("/v1/chat/completions", status_code=HTTP_200_OK)
async def chat_completions(
    request: Request[Any, Any, Any],
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
) -> Response[Any]:
    """OpenAI chat completions, whole or streamed."""
    allow(principal, "consumer")
    req = services.chat_decoder.decode(await read_body(request))
    plan = await plan_chat(req, request_id_of(request), services.renderer, services.limits)
    return await services.run(plan, request, principal)


@post("/v1/completions", status_code=HTTP_200_OK)
async def completions(
    request: Request[Any, Any, Any],
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
) -> Response[Any]:
    """OpenAI legacy completions, whole or streamed."""
    allow(principal, "consumer")
    req = services.completion_decoder.decode(await read_body(request))
    plan = await plan_completion(req, request_id_of(request), services.renderer, services.limits)
    return await services.run(plan, request, principal)


@get("/v1/models")
async def list_models(
    services: NamedDependency[Services], principal: NamedDependency[Principal]
) -> ModelList:
    """The served models."""
    allow(principal, "consumer")
    limits = services.limits
    return ModelList(
        data=[ModelCard(id=limits.model_name, created=services.started, max_model_len=limits.max_model_len)]
    )


@get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@get("/readyz")
async def readyz(services: NamedDependency[Services]) -> Response[dict[str, Any]]:
    """Every engine is ready to serve."""
    health = await services.engine.health()
    body = {
        "status": "ready" if health.ready else "not_ready",
        "engines": {services.engine.replica_id: health.ready},
    }
    if not health.ready:
        body["detail"] = health.detail
    return Response(content=body, status_code=HTTP_200_OK if health.ready else HTTP_503_SERVICE_UNAVAILABLE)


ROUTES = [chat_completions, completions, list_models, healthz, readyz]

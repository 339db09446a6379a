"""`GET /v1/models`: the served models, their aliases and versions (OpenAI tag `openai`)."""

from __future__ import annotations

from litestar import get
from litestar.di import NamedDependency

from gateway.api.openapi import errors, secured
from gateway.edge.security import allow
from gateway.schemas import AliasTargetCard, ModelCard, ModelList
from gateway.services import Services
from policy.auth import Principal
from registry.models import ModelSpec


@get("/v1/models", responses=errors())
async def list_models(
    services: NamedDependency[Services], principal: NamedDependency[Principal]
) -> ModelList:
    """The served models: aliases, their versions, and routes."""
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
    for alias in view.aliases("route"):
        route = view.resolve_route(alias.name, key="")
        cards.append(
            ModelCard(
                id=alias.name,
                created=int(alias.updated_at),
                kind="route",
                route=route.ref,
                models=list(dict.fromkeys(route.spec.targets)),
            )
        )
    return ModelList(data=cards)


ROUTES = [secured("openai", [list_models])]

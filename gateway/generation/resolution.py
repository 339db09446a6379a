"""The resolution stage of a request: which model version, renderer, safety policy and system prompt serve
it, from the current registry view and the caller's key.

While an alias splits (canary), a model or prompt is picked per API key and a policy per tenant, each by a
keyed hash (`ServerSecret`): nothing a client chooses moves it to another version.
"""

from __future__ import annotations

import msgspec

from gateway.errors import EngineUnavailableError, InvalidRequestError, NotFoundError
from gateway.generation.context import Generation
from gateway.generation.planning import Limits
from gateway.generation.prompts import PromptRenderer
from policy.auth import Principal
from registry.errors import InvalidError as RegistryInvalidError
from registry.errors import NotFoundError as RegistryNotFoundError
from registry.view import ResolvedModel, ResolvedPolicy, ResolvedPrompt, ResolvedRoute


class Binding(msgspec.Struct, frozen=True, kw_only=True):
    """The versions a session fixed at its creation (`gateway.sessions`): its requests resolve these instead
    of the caller's current bindings, and route by the session (replica affinity)."""

    session: str  # the routing session key (`routing.router.session_key`)
    model: str  # name@version
    policy: str  # name@version
    prompt: str | None  # name@version; None: no system prompt


def target(gen: Generation, model_name: str, principal: Principal) -> tuple[ResolvedModel, Limits]:
    """The model version `model_name` means for the caller's API key (one registry view: an alias in canary
    serves one key from one version), and its limits."""
    key = gen.secret.model_key(principal.tenant.tenant_id, principal.key.key_id)
    try:
        model = gen.registry.view.resolve_model(model_name, key)
    except RegistryNotFoundError as exc:
        raise NotFoundError(
            f"model `{model_name}` does not exist: {exc}", param="model", code="model_not_found"
        ) from exc
    except RegistryInvalidError as exc:
        raise InvalidRequestError(f"bad model reference: {exc}", param="model", code="invalid_value") from exc
    if model.spec.engine_pool in gen.guard_pools:
        # A guard pool's capacity is the guards': generation there would queue ahead of safety checks.
        raise NotFoundError(
            f"model `{model_name}` ({model.ref}) is a guard model and is not served for generation",
            param="model",
            code="model_not_found",
        )
    engine = gen.pools.get(model.spec.engine_pool)
    if engine is None:
        raise EngineUnavailableError(
            f"no engine serves pool `{model.spec.engine_pool}` of {model.ref}", code="no_engine_for_pool"
        )
    config = gen.config
    limits = Limits(
        max_model_len=min(config.model.max_model_len, engine.max_model_len, model.spec.arch.max_context),
        default_max_tokens=config.model.default_max_tokens,
        max_logprobs=config.engine.max_logprobs,
        max_choices=config.server.max_choices,
        max_tool_calls=config.server.max_tool_calls,
    )
    return model, limits


def route_for(gen: Generation, name: str, principal: Principal) -> ResolvedRoute:
    """The route version `name` means for the caller's API key (picked as a model is)."""
    key = gen.secret.model_key(principal.tenant.tenant_id, principal.key.key_id)
    try:
        return gen.registry.view.resolve_route(name, key)
    except RegistryNotFoundError as exc:
        raise NotFoundError(
            f"model `{name}` does not exist: {exc}", param="model", code="model_not_found"
        ) from exc


async def renderer_for(gen: Generation, model: ResolvedModel) -> PromptRenderer:
    """The renderer of `model`'s tokenizer and chat template versions."""
    if gen.renderers is None:
        return gen.renderer
    try:
        return await gen.renderers.get(model)
    except RegistryInvalidError as exc:
        # Checked when published: files that changed or vanished since are the operator's to fix.
        raise EngineUnavailableError(
            f"the tokenizer or chat template of {model.ref} cannot be loaded: {exc}",
            code="renderer_unavailable",
        ) from exc


def policy_for(gen: Generation, principal: Principal, binding: Binding | None = None) -> ResolvedPolicy:
    """The safety policy version the caller's tenant is bound to (or the session's `binding`), from the
    current registry view: while its alias splits, one version for all of the tenant's requests, whatever
    their id or API key (a blocked request retried is decided under the same version)."""
    key = gen.secret.policy_key(principal.tenant.tenant_id)
    try:
        return gen.registry.view.resolve_policy(binding.policy if binding else principal.tenant.policy, key)
    except (RegistryNotFoundError, RegistryInvalidError) as exc:
        # A binding that does not resolve is an operator error; no request goes unguarded because of it.
        raise EngineUnavailableError(
            f"the safety policy `{principal.tenant.policy}` of this tenant cannot be resolved: {exc}",
            code="policy_unavailable",
        ) from exc


def prompt_for(
    gen: Generation, principal: Principal, session: Binding | None = None
) -> ResolvedPrompt | None:
    """The system prompt the caller's key, or else its tenant, is bound to (or the `session`'s; None: none);
    while its alias splits, one version per API key, as for models."""
    if session is not None:
        binding = session.prompt
    else:
        binding = principal.key.system_prompt or principal.tenant.system_prompt
    if binding is None:
        return None
    key = gen.secret.model_key(principal.tenant.tenant_id, principal.key.key_id)
    try:
        return gen.registry.view.resolve_prompt(binding, key)
    except (RegistryNotFoundError, RegistryInvalidError) as exc:
        # Serving without the tenant's instructions would change what the model is told: refuse instead.
        raise EngineUnavailableError(
            f"the system prompt `{binding}` of this key or tenant cannot be resolved: {exc}",
            code="prompt_unavailable",
        ) from exc

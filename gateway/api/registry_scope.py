"""What of the registry a policy administrator may read.

Administrators of the operating organisation read all of it. A tenant's administrator reads the public
catalogue (models, tokenizers, chat templates, embedding models, routes: every tenant may ask for any model)
and what its tenant is bound to: the policy it names (an alias, or the name of a pinned `name@version`: every
version of that name), the guard models those policy versions run, and the system prompts set for the tenant
and for its keys. Anything else (another tenant's policy with its block patterns and thresholds, its guard
prompts, its canary splits) reads exactly as a name nobody published: an empty list, so a tenant cannot tell
the two apart.
"""

from __future__ import annotations

import msgspec

from gateway.edge.security import allow
from gateway.services import Services
from policy.auth import Principal
from registry.models import Kind, PolicySpec
from registry.view import RegistryView

# Kinds every policy administrator reads in full.
CATALOGUE: frozenset[Kind] = frozenset({"model", "tokenizer", "chat_template", "embedding_model", "route"})


class RegistryScope(msgspec.Struct, frozen=True, kw_only=True):
    """The names outside the catalogue a caller may read, by kind (None: everything)."""

    names: dict[Kind, frozenset[str]] | None

    def shows(self, kind: Kind, name: str) -> bool:
        """Whether the caller may read `name` of `kind` (its versions, alias and history)."""
        return self.names is None or kind in CATALOGUE or name in self.names.get(kind, frozenset())


def _name(binding: str) -> str:
    """The name of an alias or of a pinned `name@version`."""
    return binding.partition("@")[0]


def _guards(view: RegistryView, policy: str) -> frozenset[str]:
    """The guard model names run by any version of the policy `policy`."""
    return frozenset(
        _name(stage.guard)
        for p in view.versions("policy", policy)
        for stage in view.spec("policy", p.name, p.version, PolicySpec).stages
        if stage.kind == "model"
    )


async def registry_scope(services: Services, principal: Principal) -> RegistryScope:
    """What `principal` may read of the registry; 403 without the `policy_admin` role."""
    allow(principal, "policy_admin")
    if principal.is_operator_admin:
        return RegistryScope(names=None)
    tenant = principal.tenant
    policy = _name(tenant.policy)
    keys = await services.tenants.list_keys(tenant.tenant_id)
    bindings = [tenant.system_prompt, *(k.system_prompt for k in keys)]
    prompts = frozenset(_name(b) for b in bindings if b)
    return RegistryScope(
        names={
            "policy": frozenset({policy}),
            "guard_model": _guards(services.registry.view, policy),
            "prompt": prompts,
        }
    )

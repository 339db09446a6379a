"""The built-in `default` policy that every tenant is bound to until an administrator binds another.

It has no categories and no guard stages yet (the guard cascade comes with the safety issues); what it fixes
now is that a tenant's binding always resolves to a real, versioned, content-hashed policy, so answers and
audit records can name it.
"""

from __future__ import annotations

from registry.models import PolicySpec
from registry.service import Registry

DEFAULT_POLICY = "default"
DEFAULT_POLICY_VERSION = "1"
DEFAULT_POLICY_SPEC = PolicySpec(
    categories=(),
    stages=(),
    past_last_stage="escalate",
    fail_modes={},
    hold_back_tokens=0,
    retention="none",
)


async def register_default_policy(registry: Registry, *, actor: str) -> None:
    """Publish `default@1` (idempotent) and create the `default` alias if there is none yet."""
    await registry.publish("policy", DEFAULT_POLICY, DEFAULT_POLICY_VERSION, DEFAULT_POLICY_SPEC, actor=actor)
    if not registry.view.has_alias("policy", DEFAULT_POLICY):
        await registry.set_alias("policy", DEFAULT_POLICY, DEFAULT_POLICY_VERSION, actor=actor)

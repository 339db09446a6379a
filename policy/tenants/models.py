"""Tenants, API keys, roles and admin change records (msgspec Structs stored and sent as they are)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

# `metrics`: scrapes `GET /metrics` and nothing else (a key for Prometheus), in the operating organisation.
Role = Literal["consumer", "policy_admin", "reviewer", "operator", "metrics"]
ROLES: tuple[Role, ...] = ("consumer", "policy_admin", "reviewer", "operator", "metrics")
FailMode = Literal["open", "closed"]
# Admission classes, highest first: `interactive` requests are admitted ahead of `batch` ones.
PriorityClass = Literal["interactive", "batch"]


class Limits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Token-bucket limits of one scope (a tenant, or each of its keys). Bursts are bucket capacities."""

    requests_per_second: float
    request_burst: float
    tokens_per_second: float
    token_burst: float


class Quotas(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A tenant's buckets: shared by all its keys, and per key. None = no bucket at that scope."""

    tenant: Limits | None = None
    per_key: Limits | None = None
    # While the quota store (Redis) is unreachable: "open" admits unmetered, "closed" refuses with 503.
    fail_mode: FailMode = "closed"


class Tenant(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An API consumer organisation."""

    tenant_id: str
    display_name: str
    # Fairness weight in admission (a tenant of weight 2 gets twice the share of a tenant of weight 1).
    weight: float = 1.0
    quotas: Quotas = msgspec.field(default_factory=Quotas)
    # Name of the safety policy the tenant is bound to (versioned by the registry later).
    policy: str = "default"
    # Whether checked prompts and completions may be kept in audit records (only where the policy's retention
    # is also `full`, for content_retention_days). Never in logs.
    retain_prompts: bool = False
    # Days the audit trail keeps this tenant's checked content (with retain_prompts); None = the configured
    # `[audit] content_retention_days`. Must be > 0 when set.
    content_retention_days: float | None = None
    # The highest admission class this tenant's requests may use. A request may ask for a lower class with a
    # header, never a higher one, so a `batch` tenant only ever runs as batch.
    max_priority: PriorityClass = "interactive"
    created_at: float = 0.0
    # A registry `prompt` (an alias, or a pinned `name@version`) the gateway prepends to this tenant's chat
    # requests as their first system message: the tenant's own instructions, which the guard trusts. None: no
    # prompt. Operator administrators set it; a client's own system messages are never trusted by default.
    system_prompt: str | None = None
    # The tenant's plan ("free", "pro", ...: any label up to 32 characters; "" none), which model routes may
    # choose the model by (`registry.models.RouteRule.tiers`).
    tier: Annotated[str, msgspec.Meta(max_length=32)] = ""


class ApiKey(msgspec.Struct, frozen=True, kw_only=True):
    """An API key's metadata. The secret itself is never stored; only its hash is."""

    key_id: str
    tenant_id: str
    roles: tuple[Role, ...]
    label: str = ""
    created_at: float = 0.0
    expires_at: float | None = None
    revoked_at: float | None = None
    # The registry `prompt` this key's chat requests get instead of its tenant's (None: the tenant's).
    system_prompt: str | None = None
    # Granted by an operator administrator only: this key's own system and developer messages are trusted
    # instructions (the guard's injection rules and model stages do not score them as user text).
    trusted_instructions: bool = False

    def active(self, now: float) -> bool:
        """Not revoked and not expired at `now`."""
        return self.revoked_at is None and (self.expires_at is None or now < self.expires_at)


class StoredKey(msgspec.Struct, frozen=True, kw_only=True):
    """A key as stored: metadata plus the hash of its secret."""

    key: ApiKey
    secret_hash: str


class AdminChange(msgspec.Struct, frozen=True, kw_only=True):
    """One recorded admin change: who did what to which object, and the object before and after."""

    change_id: int
    at: float
    actor: str
    action: str
    target: str
    before: str | None
    after: str | None

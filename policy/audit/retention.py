"""Content retention of the audit trail: the checked text of old records is purged, their decisions stay.

A record keeps its content only while the tenant's retention allows. `purge_expired` nulls what has expired
(`AuditStore.purge_content`), which leaves every hash valid: `content_hash` stands for the content, so the
chain still verifies and the decision, its stages and the content's sha256 remain. `run_retention` does that
for every tenant, at start and then every `interval` seconds, in the app's lifespan.

Retention per tenant: a tenant that retains prompts (`Tenant.retain_prompts`) keeps content for its own
`Tenant.content_retention_days` when set, else for `[audit] content_retention_days` (the `days` passed here);
one that does not keeps none, and whatever content a policy with retention `full` stored for it is purged
at the next pass.
"""

from __future__ import annotations

import asyncio
import logging
import math

from policy.audit.base import AuditStore, AuditUnavailableError
from policy.auth import Clock
from policy.tenants.base import TenantStore
from policy.tenants.base import UnavailableError as TenantStoreUnavailableError
from policy.tenants.models import Tenant

log = logging.getLogger("lockgate.audit.retention")

DAY_S = 86_400.0
# Seconds between two purge passes; content lives at most this long past its retention.
PURGE_INTERVAL_S = 3600.0


def expiry(tenant: Tenant, now: float, days: float) -> float:
    """The `at` before which `tenant`'s content has expired at `now`; `days` is the default period."""
    if not tenant.retain_prompts:
        # All of it, records stamped ahead of this clock (another replica's) included.
        return math.inf
    if tenant.content_retention_days is not None:
        days = tenant.content_retention_days
    return now - max(0.0, days) * DAY_S


async def purge_expired(store: AuditStore, tenants: TenantStore, now: float, days: float) -> dict[str, int]:
    """Null the expired content of every tenant's records; the number of records purged, by tenant.

    `days` is the default period, for tenants without their own `content_retention_days`.

    A tenant whose purge fails (the audit store is down) is skipped and logged; the next pass retries it,
    and the others are purged all the same.
    """
    purged: dict[str, int] = {}
    for tenant in await tenants.list_tenants():
        try:
            count = await store.purge_content(tenant.tenant_id, expiry(tenant, now, days))
        except AuditUnavailableError as exc:
            log.warning("audit content of %s not purged (retried next pass): %s", tenant.tenant_id, exc)
            continue
        purged[tenant.tenant_id] = count
        if count:
            log.info("audit content of %d records of tenant %s purged", count, tenant.tenant_id)
    return purged


async def run_retention(
    store: AuditStore,
    tenants: TenantStore,
    clock: Clock,
    days: float,
    interval: float = PURGE_INTERVAL_S,
) -> None:
    """Purge expired content now and then every `interval` seconds, until cancelled.

    A store that cannot answer fails only this pass: the next one retries.
    """
    while True:
        try:
            await purge_expired(store, tenants, clock(), days)
        except TenantStoreUnavailableError as exc:
            log.warning("audit retention pass skipped: the tenant store is unavailable: %s", exc)
        await asyncio.sleep(interval)

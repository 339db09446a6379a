"""Content retention of the audit trail: the checked text of old records is purged, their decisions stay.

A record keeps its content only while the tenant's retention allows. `purge_expired` nulls what has expired
(`AuditStore.purge_content`), which leaves every hash valid: `content_hash` stands for the content, so the
chain still verifies and the decision, its stages and the content's sha256 remain. `run_retention` does that
for every tenant, at start and then every `interval` seconds (`[audit] purge_interval`), in the app's
lifespan. Between two passes, `RetainedAuditStore` (what the reviewer API and console read through) shows
no content past retention either: it hides, at read time, what the next pass will purge. Each pass also
tells the audit writer's spool (`ContentShredder`, the `AuditWriter`) each tenant's cutoff, and the spool
deletes the keys of the content it holds past it (`policy.audit.spool_keys`): drafts still waiting for the
store then replay without their content.

Retention per tenant: a tenant that retains prompts (`Tenant.retain_prompts`) keeps content for its own
`Tenant.content_retention_days` when set, else for `[audit] content_retention_days` (the `days` passed here);
one that does not keeps none, and whatever content a policy with retention `full` stored for it is purged
at the next pass.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Protocol

import msgspec

from policy.audit.base import AuditQuery, AuditStore, AuditUnavailableError, BadRow
from policy.audit.records import AuditDraft, AuditRecord, ChainReport, Checkpoint
from policy.clock import Clock
from policy.tenants.base import NotFoundError as TenantNotFoundError
from policy.tenants.base import TenantStore
from policy.tenants.base import UnavailableError as TenantStoreUnavailableError
from policy.tenants.models import Tenant

log = logging.getLogger("lockgate.audit.retention")

DAY_S = 86_400.0
# Seconds between two purge passes; content lives at most this long past its retention.
PURGE_INTERVAL_S = 3600.0


class ContentShredder(Protocol):
    """What else holds content: told each tenant's cutoff, it makes what it holds before it unreadable."""

    async def shred_content(self, cutoffs: Mapping[str, float]) -> int:
        """Forget content of a tenant in `cutoffs` from before its cutoff (an `at`); how much. OSError."""
        ...


class EvidencePurger(Protocol):
    """What holds content under its own retention (the appeals' shared content, `AppealStore`)."""

    async def purge_evidence(self, now: float) -> int:
        """Delete what expired by `now`; how much. AuditUnavailableError when the database is down."""
        ...


def expiry(tenant: Tenant, now: float, days: float) -> float:
    """The `at` before which `tenant`'s content has expired at `now`; `days` is the default period."""
    if not tenant.retain_prompts:
        # All of it, records stamped ahead of this clock (another replica's) included.
        return math.inf
    if tenant.content_retention_days is not None:
        days = tenant.content_retention_days
    return now - max(0.0, days) * DAY_S


async def purge_expired(
    store: AuditStore,
    tenants: TenantStore,
    now: float,
    days: float,
    spool: ContentShredder | None = None,
) -> dict[str, int]:
    """Null the expired content of every tenant's records, and shred what `spool` holds of it; the number
    of records purged, by tenant.

    `days` is the default period, for tenants without their own `content_retention_days`.

    A tenant whose purge fails (the audit store is down) is skipped and logged; the next pass retries it,
    and the others are purged all the same. The spool is shredded whatever the store does (it holds
    content most when the store is down); a spool that fails (OSError) is logged and retried next pass.
    """
    purged: dict[str, int] = {}
    cutoffs = {tenant.tenant_id: expiry(tenant, now, days) for tenant in await tenants.list_tenants()}
    if spool is not None:
        try:
            await spool.shred_content(cutoffs)
        except OSError as exc:
            log.error("spooled audit content not shredded (retried next pass): %s", exc)
    for tenant_id, cutoff in cutoffs.items():
        try:
            count = await store.purge_content(tenant_id, cutoff)
        except AuditUnavailableError as exc:
            log.warning("audit content of %s not purged (retried next pass): %s", tenant_id, exc)
            continue
        purged[tenant_id] = count
        if count:
            log.info("audit content of %d records of tenant %s purged", count, tenant_id)
    return purged


async def run_retention(
    store: AuditStore,
    tenants: TenantStore,
    clock: Clock,
    days: float,
    interval: float = PURGE_INTERVAL_S,
    spool: ContentShredder | None = None,
    evidence: EvidencePurger | None = None,
) -> None:
    """Purge expired content (from `store`, `spool`'s, and the content shared with appeals, `evidence`)
    now and then every `interval` seconds, until cancelled.

    A store that cannot answer fails only this pass: the next one retries.
    """
    while True:
        try:
            await purge_expired(store, tenants, clock(), days, spool)
        except TenantStoreUnavailableError as exc:
            log.warning("audit retention pass skipped: the tenant store is unavailable: %s", exc)
        if evidence is not None:
            try:
                if count := await evidence.purge_evidence(clock()):
                    log.info("content shared with %d appeals purged", count)
            except AuditUnavailableError as exc:
                log.warning("content shared with appeals not purged (retried next pass): %s", exc)
        await asyncio.sleep(interval)


class RetainedAuditStore:
    """An `AuditStore` whose reads (`get`, `find`, `query`) show a record's content only while its tenant's
    retention keeps it at the injected clock's now (`expiry`), whether or not a purge pass has run since it
    expired. Writes, `verify` and `purge_content` go to `inner` as they are.

    A tenant that cannot be read (gone, or the tenant store down) shows no content: hiding it for a while
    costs a reviewer a look, showing it past retention would break the promise.
    """

    def __init__(self, inner: AuditStore, tenants: TenantStore, clock: Clock, days: float) -> None:
        self.inner = inner
        self._tenants = tenants
        self._clock = clock
        self._days = days

    async def append(self, drafts: Sequence[AuditDraft]) -> list[AuditRecord]:
        """`inner.append` (the records just written, as written)."""
        return await self.inner.append(drafts)

    async def get(self, tenant: str, seq: int) -> AuditRecord:
        """One record, its content only within retention."""
        [record] = await self._retained([await self.inner.get(tenant, seq)])
        return record

    async def find(self, tenant: str | None, request_id: str) -> list[AuditRecord]:
        """The records of one request, their content only within retention."""
        return await self._retained(await self.inner.find(tenant, request_id))

    async def query(self, q: AuditQuery) -> list[AuditRecord]:
        """A page of records, their content only within retention."""
        return await self._retained(await self.inner.query(q))

    async def verify(self, tenant: str, checkpoints: Sequence[Checkpoint] = ()) -> ChainReport:
        """`inner.verify` (the chain never covers content)."""
        return await self.inner.verify(tenant, checkpoints)

    async def heads(self, tenant: str | None = None) -> dict[str, tuple[int, str]]:
        """`inner.heads`."""
        return await self.inner.heads(tenant)

    async def chain_page(
        self, tenant: str, after_seq: int, through_seq: int, limit: int
    ) -> list[AuditRecord | BadRow]:
        """`inner.chain_page`, content and all: verification reads what is stored (the chain never covers
        content, and content that does not match its content_hash is evidence)."""
        return await self.inner.chain_page(tenant, after_seq, through_seq, limit)

    async def purge_content(self, tenant: str, before: float) -> int:
        """`inner.purge_content`."""
        return await self.inner.purge_content(tenant, before)

    async def close(self) -> None:
        """`inner.close`."""
        await self.inner.close()

    async def _retained(self, records: list[AuditRecord]) -> list[AuditRecord]:
        now = self._clock()
        cutoffs: dict[str, float] = {}
        for tenant in {r.tenant for r in records if r.content is not None}:
            cutoffs[tenant] = await self._expiry(tenant, now)
        return [
            msgspec.structs.replace(r, content=None)
            if r.content is not None and r.at < cutoffs[r.tenant]
            else r
            for r in records
        ]

    async def _expiry(self, tenant_id: str, now: float) -> float:
        try:
            tenant = await self._tenants.get_tenant(tenant_id)
        except TenantNotFoundError:
            return math.inf
        except TenantStoreUnavailableError as exc:
            log.warning("audit content of %s hidden: its retention cannot be read: %s", tenant_id, exc)
            return math.inf
        return expiry(tenant, now, self._days)

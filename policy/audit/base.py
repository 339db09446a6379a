"""The `AuditStore` protocol: an append-only, hash-chained log of every gate decision, per tenant.

`append` gives each record the tenant's next seq (1, 2, 3, ... without gaps) and chains it to the previous
record's hash (`policy.audit.records`). Records are never updated or deleted, in the database itself
(triggers refuse it), with one exception: `purge_content` nulls the `content` of old records when the
tenant's retention ends, which leaves every hash valid. Each store also keeps a head per tenant (its last
seq and hash), so cutting records off the end of a chain shows in `verify` too.

Exceptions::

    AuditStoreError             base
    ├── NotFoundError           no record at that tenant and seq
    └── AuditUnavailableError   the database cannot be reached now (down, restarting, out of connections,
                                a statement over its time limit); retrying later may succeed. Other driver
                                errors are bugs.

A draft that cannot be recorded (wrong field types, a non-finite number, content that does not match its
content_hash) is the caller's bug: `records.InvalidDraftError`, a ValueError, raised before anything is
written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Protocol

import msgspec

from policy.audit.records import AuditDraft, AuditRecord, ChainReport, Checkpoint, Decision, Stage

# The most records one `query` returns; a larger `limit` is cut to this.
MAX_QUERY_LIMIT = 1000


class BadRow(msgspec.Struct, frozen=True, kw_only=True):
    """A stored row of a chain that does not decode as a record (only a row changed behind the store's
    back): `chain_page` returns it in its place, so verification reports it instead of crashing."""

    seq: int
    detail: str


class AuditStoreError(Exception):
    """Base of audit store failures."""


class NotFoundError(AuditStoreError):
    """No record at that tenant and seq."""


class AuditUnavailableError(AuditStoreError):
    """The database cannot be reached now; the same call may succeed later."""


class AuditRecordError(AuditStoreError):
    """The database refused what a record holds, not for being unreachable: the same append fails again, so
    the writer sets the record apart (`policy.audit.writer`) instead of retrying it."""


class AuditQuery(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which records `AuditStore.query` returns: every filter given must hold (None / False: any).

    Results are ordered by (tenant, seq), tenants by code point. Pages are keyset-paginated: pass the last
    record of a page to `after` for the next one, which is stable while records are appended.
    """

    tenant: str | None = None  # None: all tenants (global reviewers only)
    since: float | None = None  # at >= since
    until: float | None = None  # at < until
    decision: Decision | None = None
    stage: Stage | None = None
    category: str | None = None
    # "name@version" matches exactly; a bare "name" (no "@") matches every version of that policy.
    policy: str | None = None
    fail_open_only: bool = False  # source == "fail_open"
    flagged_only: bool = False
    # Keyset: only records after (after_tenant, after_seq). With `tenant` set, after_tenant may stay None.
    after_tenant: str | None = None
    after_seq: int = 0
    limit: Annotated[int, msgspec.Meta(ge=1)] = 100  # at most MAX_QUERY_LIMIT

    def after(self, record: AuditRecord) -> AuditQuery:
        """The same query, for the page after `record` (the last of the current page)."""
        return msgspec.structs.replace(self, after_tenant=record.tenant, after_seq=record.seq)

    def page_size(self) -> int:
        """`limit` within 1..MAX_QUERY_LIMIT."""
        return max(1, min(int(self.limit), MAX_QUERY_LIMIT))


class AuditStore(Protocol):
    """The audit log, in SQLite (embedded default) or PostgreSQL (shared by replicas)."""

    async def append(self, drafts: Sequence[AuditDraft]) -> list[AuditRecord]:
        """Record `drafts` atomically and in order, each as its tenant's next seq chained to the previous one.

        Appends from several tasks or processes at once never fork a chain: each tenant's chain is extended
        by one transaction at a time.
        """
        ...

    async def get(self, tenant: str, seq: int) -> AuditRecord:
        """One record, or NotFoundError."""
        ...

    async def find(self, tenant: str | None, request_id: str) -> list[AuditRecord]:
        """The records of one request (of one tenant, or of any), ordered by (tenant, seq)."""
        ...

    async def query(self, q: AuditQuery) -> list[AuditRecord]:
        """At most `q.page_size()` records matching `q`, ordered by (tenant, seq), after `q`'s keyset."""
        ...

    async def verify(self, tenant: str, checkpoints: Sequence[Checkpoint] = ()) -> ChainReport:
        """Verify the tenant's chain up to its head (`policy.audit.verify.verify_tenant`, in pages, off the
        connection appends use), with the MAC key the store was opened with, against `checkpoints`."""
        ...

    async def heads(self, tenant: str | None = None) -> dict[str, tuple[int, str]]:
        """Each tenant's head (last seq and hash), or only `tenant`'s (none: an empty chain)."""
        ...

    async def chain_page(
        self, tenant: str, after_seq: int, through_seq: int, limit: int
    ) -> list[AuditRecord | BadRow]:
        """At most `limit` of the tenant's records with after_seq < seq <= through_seq, in seq order; read
        through a connection of its own (SQLite: a read-only one), never the one appends use."""
        ...

    async def purge_content(self, tenant: str, before: float) -> int:
        """Null the content of the tenant's records with `at < before`; the number of records changed."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...

"""The audit log: the `AuditStore` protocol, its SQLite and PostgreSQL backends, and the hash chain.
Appeals of recorded decisions live in the same database (`policy.appeals`). `AUDIT_STORE` names both
backends for `registry.db.stores.open_store`."""

from policy.audit.base import (
    MAX_QUERY_LIMIT,
    AuditQuery,
    AuditStore,
    AuditStoreError,
    AuditUnavailableError,
    NotFoundError,
)
from policy.audit.migrations import MIGRATIONS
from policy.audit.postgres import PostgresAuditStore
from policy.audit.records import (
    GENESIS_HASH,
    AuditDraft,
    AuditedStage,
    AuditRecord,
    ChainFault,
    ChainReport,
    ChainVerifier,
    Decision,
    InvalidDraftError,
    Stage,
    content_sha256,
    record_hash,
    verify_chain,
)
from policy.audit.sqlite import SqliteAuditStore
from registry.db.stores import StoreKind

AUDIT_STORE: StoreKind[AuditStore] = StoreKind(
    "audit", sqlite=SqliteAuditStore.open, postgres=PostgresAuditStore.open
)

__all__ = [
    "AUDIT_STORE",
    "GENESIS_HASH",
    "MAX_QUERY_LIMIT",
    "MIGRATIONS",
    "AuditDraft",
    "AuditQuery",
    "AuditRecord",
    "AuditStore",
    "AuditStoreError",
    "AuditUnavailableError",
    "AuditedStage",
    "ChainFault",
    "ChainReport",
    "ChainVerifier",
    "Decision",
    "InvalidDraftError",
    "NotFoundError",
    "PostgresAuditStore",
    "SqliteAuditStore",
    "Stage",
    "content_sha256",
    "record_hash",
    "verify_chain",
]

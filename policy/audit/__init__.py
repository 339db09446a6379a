"""The audit log: the `AuditStore` protocol, its SQLite and PostgreSQL backends, and the hash chain."""

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
    AuditRecord,
    ChainFault,
    ChainReport,
    ChainVerifier,
    Decision,
    InvalidDraftError,
    Stage,
    StageRun,
    content_sha256,
    record_hash,
    verify_chain,
)
from policy.audit.sqlite import SqliteAuditStore

__all__ = [
    "GENESIS_HASH",
    "MAX_QUERY_LIMIT",
    "MIGRATIONS",
    "AuditDraft",
    "AuditQuery",
    "AuditRecord",
    "AuditStore",
    "AuditStoreError",
    "AuditUnavailableError",
    "ChainFault",
    "ChainReport",
    "ChainVerifier",
    "Decision",
    "InvalidDraftError",
    "NotFoundError",
    "PostgresAuditStore",
    "SqliteAuditStore",
    "Stage",
    "StageRun",
    "content_sha256",
    "record_hash",
    "verify_chain",
]

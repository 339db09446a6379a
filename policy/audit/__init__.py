"""The audit log: the `AuditStore` protocol, its SQLite and PostgreSQL backends, and the hash chain; and
appeals of recorded decisions (`AppealStore`, in the same database)."""

from policy.audit.appeals import (
    APPEAL_STATES,
    MAX_APPEAL_LIMIT,
    TRANSITIONS,
    UNDECIDED,
    Appeal,
    AppealConflictError,
    AppealError,
    AppealEvent,
    AppealNotFoundError,
    AppealState,
    AppealStore,
    InvalidTransitionError,
    OwnAppealError,
)
from policy.audit.appeals_postgres import PostgresAppealStore
from policy.audit.appeals_sqlite import SqliteAppealStore
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
    "APPEAL_STATES",
    "GENESIS_HASH",
    "MAX_APPEAL_LIMIT",
    "MAX_QUERY_LIMIT",
    "MIGRATIONS",
    "TRANSITIONS",
    "UNDECIDED",
    "Appeal",
    "AppealConflictError",
    "AppealError",
    "AppealEvent",
    "AppealNotFoundError",
    "AppealState",
    "AppealStore",
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
    "InvalidTransitionError",
    "NotFoundError",
    "OwnAppealError",
    "PostgresAppealStore",
    "PostgresAuditStore",
    "SqliteAppealStore",
    "SqliteAuditStore",
    "Stage",
    "StageRun",
    "content_sha256",
    "record_hash",
    "verify_chain",
]

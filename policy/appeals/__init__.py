"""Appeals of recorded gate decisions: the review state machine and the `AppealStore` (`base`), and its
SQLite and PostgreSQL backends, in the audit store's database and migrations (`policy.audit.migrations`).
`APPEAL_STORE` names both for `registry.db.stores.open_store`."""

from policy.appeals.base import (
    APPEAL_STATES,
    MAX_APPEAL_LIMIT,
    TRANSITIONS,
    UNDECIDED,
    Appeal,
    AppealConflictError,
    AppealError,
    AppealEvent,
    AppealEvidence,
    AppealNotFoundError,
    AppealState,
    AppealStore,
    InvalidTransitionError,
    OwnAppealError,
    SharedContent,
)
from policy.appeals.postgres import PostgresAppealStore
from policy.appeals.sqlite import SqliteAppealStore
from registry.db.stores import StoreKind

APPEAL_STORE: StoreKind[AppealStore] = StoreKind(
    "appeals", sqlite=SqliteAppealStore.open, postgres=PostgresAppealStore.open
)

__all__ = [
    "APPEAL_STATES",
    "APPEAL_STORE",
    "MAX_APPEAL_LIMIT",
    "TRANSITIONS",
    "UNDECIDED",
    "Appeal",
    "AppealConflictError",
    "AppealError",
    "AppealEvent",
    "AppealEvidence",
    "AppealNotFoundError",
    "AppealState",
    "AppealStore",
    "InvalidTransitionError",
    "OwnAppealError",
    "PostgresAppealStore",
    "SharedContent",
    "SqliteAppealStore",
]

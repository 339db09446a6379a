"""Appeals of recorded gate decisions: the review state machine and the `AppealStore` (`base`), and its
SQLite and PostgreSQL backends, in the audit store's database and migrations (`policy.audit.migrations`).
`APPEAL_STORE` names both for `registry.db.stores.open_store`."""

from policy.appeals.base import (
    APPEAL_STATES,
    FACETS,
    MAX_APPEAL_LIMIT,
    NO_FILTER,
    TRANSITIONS,
    UNDECIDED,
    Appeal,
    AppealClaim,
    AppealClaimedError,
    AppealConflictError,
    AppealError,
    AppealEvent,
    AppealEvidence,
    AppealFacets,
    AppealFilter,
    AppealNotFoundError,
    AppealState,
    AppealStore,
    InvalidTransitionError,
    OwnAppealError,
    SharedContent,
)
from policy.appeals.postgres import PostgresAppealStore
from policy.appeals.reasons import DEFAULT_REASONS, ReasonCode, ReasonError, reason_for
from policy.appeals.sqlite import SqliteAppealStore
from policy.appeals.statement import StatementOfReasons, statement
from registry.db.stores import StoreKind

APPEAL_STORE: StoreKind[AppealStore] = StoreKind(
    "appeals", sqlite=SqliteAppealStore.open, postgres=PostgresAppealStore.open
)

__all__ = [
    "APPEAL_STATES",
    "APPEAL_STORE",
    "DEFAULT_REASONS",
    "FACETS",
    "MAX_APPEAL_LIMIT",
    "NO_FILTER",
    "TRANSITIONS",
    "UNDECIDED",
    "Appeal",
    "AppealClaim",
    "AppealClaimedError",
    "AppealConflictError",
    "AppealError",
    "AppealEvent",
    "AppealEvidence",
    "AppealFacets",
    "AppealFilter",
    "AppealNotFoundError",
    "AppealState",
    "AppealStore",
    "InvalidTransitionError",
    "OwnAppealError",
    "PostgresAppealStore",
    "ReasonCode",
    "ReasonError",
    "SharedContent",
    "SqliteAppealStore",
    "StatementOfReasons",
    "reason_for",
    "statement",
]

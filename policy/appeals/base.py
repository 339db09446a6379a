"""Appeals of gate decisions: the `Appeal` and its events, the review state machine, and the `AppealStore`.

A tenant appeals one recorded decision (an audit record: a block, refusal or flag); a reviewer moves the
appeal through its states::

    open ──> in_review ──> upheld
                      └──> overturned

Nothing else: an appeal is decided once, and a decided appeal stays decided. Every step appends an
`AppealEvent` (filing is event 1), in the same transaction that changes the appeal's state. The events table
is append-only and the appeal row may only change its state along the arrows above, in the database itself
(triggers, `policy.audit.migrations`). The decision itself is never edited: the routes record the outcome of
a review as a new audit record (`stage="review"`, decision `reversal` or `uphold`, `reverses` = its seq).

The store lives in the audit store's database (SQLite file or PostgreSQL schema) and migrations. Filing and
each step are planned here (`filing`, `step`), once for both backends; the backends only run the SQL
(`policy.appeals.sql`).

Exceptions::

    AuditStoreError                 (policy.audit.base)
    ├── AppealError                 base of appeal failures
    │   ├── AppealNotFoundError     no such appeal, or it belongs to a tenant the caller may not see
    │   ├── AppealConflictError     the decision already has an appeal
    │   └── InvalidTransitionError  the appeal's state does not allow that step
    └── AuditUnavailableError       the database cannot be reached now
"""

from __future__ import annotations

import builtins
import secrets
from collections.abc import Collection
from typing import Literal, Protocol

import msgspec

from policy.appeals.reasons import ReasonCode
from policy.audit.base import MAX_QUERY_LIMIT, AuditStoreError

AppealState = Literal["open", "in_review", "upheld", "overturned"]
APPEAL_STATES: tuple[AppealState, ...] = ("open", "in_review", "upheld", "overturned")
# The states of an appeal that still waits for a reviewer (the review queue lists these only).
UNDECIDED: tuple[AppealState, ...] = ("open", "in_review")
# The only steps an appeal may take (from, to); the database triggers allow exactly these.
TRANSITIONS: frozenset[tuple[AppealState, AppealState]] = frozenset(
    {("open", "in_review"), ("in_review", "upheld"), ("in_review", "overturned")}
)
# The most appeals one `list` returns; a larger limit is cut to this.
MAX_APPEAL_LIMIT = MAX_QUERY_LIMIT


class AppealError(AuditStoreError):
    """Base of appeal failures."""


class AppealNotFoundError(AppealError):
    """No such appeal in the caller's view (another tenant's appeal is not found, never forbidden)."""


class AppealConflictError(AppealError):
    """The decision already has an appeal (one appeal per decision)."""


class AppealClaimedError(AppealError):
    """Another reviewer holds a live claim on the appeal: it is theirs to review until the claim expires."""

    def __init__(self, claim: AppealClaim) -> None:
        super().__init__(
            f"appeal {claim.appeal_id} is claimed by {claim.reviewer} until {claim.expires_at:.0f} (unix s)"
        )
        self.claim = claim


class InvalidTransitionError(AppealError):
    """The appeal's current state does not allow the requested step."""


class OwnAppealError(AppealError):
    """A reviewer may not decide a decision of its own key, nor an appeal its key filed (a key holding both
    the consumer and the reviewer role could otherwise appeal and overturn its own block)."""


class Appeal(msgspec.Struct, frozen=True, kw_only=True):
    """One appeal of one recorded decision."""

    appeal_id: str  # random and unguessable ("apl_" + 32 hex digits)
    tenant: str  # the tenant of the decision (and of the key that filed it)
    request_id: str
    decision_seq: int  # seq of the appealed audit record in the tenant's chain
    reason: str
    state: AppealState
    filed_by: str  # key id
    filed_at: float
    updated_at: float
    # The appealed decision's facets, copied at filing so that the queue filters and counts by them ("" for
    # appeals filed before they were kept, until the migration that added them filled them in).
    decision: str = ""
    stage: str = ""
    source: str = ""
    category: str = ""
    severity: str = ""
    policy: str = ""  # name@version


class AppealClaim(msgspec.Struct, frozen=True, kw_only=True):
    """A reviewer's claim on an undecided appeal: others see who has it, and may not decide it, until
    `expires_at` (a lease the holder renews by claiming again)."""

    appeal_id: str
    reviewer: str  # key id
    expires_at: float


# The facets a queue filters and counts appeals by (besides their age).
FACETS: tuple[str, ...] = ("tenant", "decision", "stage", "source", "category", "severity", "policy")


class AppealFacets(msgspec.Struct, frozen=True, kw_only=True):
    """The appealed decision's facets, given when filing (`Appeal` keeps them)."""

    decision: str = ""
    stage: str = ""
    source: str = ""
    category: str = ""
    severity: str = ""
    policy: str = ""


class AppealFilter(msgspec.Struct, frozen=True, kw_only=True):
    """Which appeals a `list` or `counts` selects besides tenant and state: every facet given must match
    (`policy` as the audit queries match it: "name@version" exactly, a bare name every version), filed in
    [filed_from, filed_to) when given; `newest_first` reverses the order (and the keyset)."""

    decision: str | None = None
    stage: str | None = None
    source: str | None = None
    category: str | None = None
    severity: str | None = None
    policy: str | None = None
    filed_from: float | None = None
    filed_to: float | None = None
    newest_first: bool = False


NO_FILTER = AppealFilter()


class AppealEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One step of an appeal: n = 1 is the filing (from_state None), then one per transition."""

    appeal_id: str
    n: int
    at: float
    actor: str  # key id of the filer or reviewer
    from_state: AppealState | None
    to_state: AppealState
    note: str = ""  # the actor's free text, internal
    # A decision (to upheld or overturned): the reason given, whole, and the facts relied on (both public:
    # the consumer's statement of reasons, `policy.appeals.statement`).
    reason: ReasonCode | None = None
    facts: str = ""


EvidenceSource = Literal["retained", "consumer"]


class SharedContent(msgspec.Struct, frozen=True, kw_only=True):
    """Content a consumer shares with the appeal it files (evidence by consent): the text the gate checked,
    whose sha256 the caller has matched to the appealed decision's `content_hash`, kept until `expires_at`
    (the appeals' own retention, not the audit trail's)."""

    content: str
    content_hash: str
    # `retained`: copied from the decision's record (the tenant's retention kept it); `consumer`: the text the
    # consumer attached (nothing was retained).
    source: EvidenceSource
    expires_at: float
    # For an appeal of an answer: the request's input as its own check read it (its sha256 matched to that
    # record's content_hash too), so the reviewer reads the answer in context. None: not shared.
    request_content: str | None = None


class AppealEvidence(SharedContent, frozen=True, kw_only=True):
    """The content shared with one appeal, as stored (deleted once `expires_at` is past)."""

    appeal_id: str
    tenant: str
    attached_at: float


def new_appeal_id() -> str:
    """A fresh appeal id: 128 random bits, so ids of other tenants cannot be guessed."""
    return f"apl_{secrets.token_hex(16)}"


def check_claim(holder: AppealClaim | None, actor: str, now: float) -> None:
    """AppealClaimedError when `holder` is a live claim (at `now`) of another reviewer than `actor`."""
    if holder is not None and holder.expires_at >= now and holder.reviewer != actor:
        raise AppealClaimedError(holder)


def check_claimable(appeal: Appeal) -> None:
    """InvalidTransitionError for a decided appeal: there is nothing left to claim."""
    if appeal.state not in UNDECIDED:
        raise InvalidTransitionError(f"appeal {appeal.appeal_id} is {appeal.state}: it cannot be claimed")


def check_transition(appeal: Appeal, to_state: str) -> AppealState:
    """`to_state` if the appeal may step there now, else InvalidTransitionError."""
    for state in APPEAL_STATES:
        if state == to_state and (appeal.state, state) in TRANSITIONS:
            return state
    raise InvalidTransitionError(
        f"appeal {appeal.appeal_id} is {appeal.state}; it cannot move to {to_state!r}"
    )


def filing(
    *,
    tenant: str,
    request_id: str,
    decision_seq: int,
    reason: str,
    filed_by: str,
    now: float,
    shared: SharedContent | None = None,
    facets: AppealFacets | None = None,
) -> tuple[Appeal, AppealEvent, AppealEvidence | None]:
    """A new open appeal of the tenant's decision `decision_seq`, its filing event (n = 1), and the
    evidence shared with it (None: none)."""
    appeal = Appeal(
        appeal_id=new_appeal_id(),
        tenant=tenant,
        request_id=request_id,
        decision_seq=decision_seq,
        reason=reason,
        state="open",
        filed_by=filed_by,
        filed_at=float(now),
        updated_at=float(now),
        **msgspec.structs.asdict(facets or AppealFacets()),
    )
    event = AppealEvent(
        appeal_id=appeal.appeal_id, n=1, at=appeal.filed_at, actor=filed_by, from_state=None, to_state="open"
    )
    evidence = None
    if shared is not None:
        fields = msgspec.structs.asdict(shared)
        evidence = AppealEvidence(**fields, appeal_id=appeal.appeal_id, tenant=tenant, attached_at=float(now))
    return appeal, event, evidence


def conflict(tenant: str, decision_seq: int) -> AppealConflictError:
    """The error for a second appeal of one decision."""
    return AppealConflictError(f"decision {decision_seq} of tenant {tenant!r} has already been appealed")


def step(
    appeal: Appeal,
    to_state: str,
    *,
    n: int,
    actor: str,
    note: str,
    now: float,
    reason: ReasonCode | None = None,
    facts: str = "",
) -> tuple[Appeal, AppealEvent]:
    """The appeal moved to `to_state` and its event number `n` (InvalidTransitionError for a step
    TRANSITIONS lacks; ValueError for a reason given to another outcome)."""
    target = check_transition(appeal, to_state)
    if reason is not None and reason.outcome != target:
        raise ValueError(f"reason {reason.code} is a reason for {reason.outcome}, not {target}")
    event = AppealEvent(
        appeal_id=appeal.appeal_id,
        n=int(n),
        at=float(now),
        actor=actor,
        from_state=appeal.state,
        to_state=target,
        note=note,
        reason=reason,
        facts=facts,
    )
    return msgspec.structs.replace(appeal, state=target, updated_at=float(now)), event


def states_of(state: AppealState | tuple[AppealState, ...] | None) -> tuple[AppealState, ...] | None:
    """The states a `list` selects: one, several, or None for any."""
    return (state,) if isinstance(state, str) else state


def page_size(limit: int) -> int:
    """`limit` within 1..MAX_APPEAL_LIMIT."""
    return max(1, min(int(limit), MAX_APPEAL_LIMIT))


class AppealStore(Protocol):
    """Appeals and their events, in SQLite or PostgreSQL. `tenant=None` is a global reviewer's view; with a
    tenant, another tenant's appeal is AppealNotFoundError."""

    async def file(
        self,
        *,
        tenant: str,
        request_id: str,
        decision_seq: int,
        reason: str,
        filed_by: str,
        now: float,
        shared: SharedContent | None = None,
        facets: AppealFacets | None = None,
    ) -> Appeal:
        """Open an appeal of the tenant's decision `decision_seq` (with the decision's `facets`; and append
        its filing event, and store the content `shared` with it), in one transaction. AppealConflictError
        if that decision already has one."""
        ...

    async def evidence(self, tenant: str | None, appeal_id: str) -> AppealEvidence | None:
        """The content shared with the appeal (None: none, or it expired and was purged), or
        AppealNotFoundError for an appeal outside the caller's view."""
        ...

    async def purge_evidence(self, now: float) -> int:
        """Delete the shared content whose `expires_at` is past `now`; how many appeals lost theirs."""
        ...

    async def get(self, tenant: str | None, appeal_id: str) -> Appeal:
        """One appeal, or AppealNotFoundError."""
        ...

    async def list(
        self,
        tenant: str | None,
        state: AppealState | tuple[AppealState, ...] | None = None,
        limit: int = 100,
        after: str | None = None,
        filters: AppealFilter = NO_FILTER,
    ) -> builtins.list[Appeal]:
        """At most `page_size(limit)` appeals (of one tenant or of all; in `state`, one of several states
        such as UNDECIDED, or any; matching `filters`), oldest filed first (newest with
        `filters.newest_first`), ordered by (filed_at, appeal_id). Keyset: `after` is the last appeal id of
        the previous page (an id the caller cannot see gives an empty page), so a page costs one index
        range however many appeals were filed or decided before it."""
        ...

    async def counts(
        self,
        tenant: str | None,
        state: AppealState | tuple[AppealState, ...] | None = None,
        filters: AppealFilter = NO_FILTER,
    ) -> dict[str, dict[str, int]]:
        """How many appeals `list` would select, by the value of each facet of FACETS (one GROUP BY each)."""
        ...

    async def for_decisions(self, tenant: str, seqs: Collection[int]) -> builtins.list[Appeal]:
        """The appeals of the tenant's decisions `seqs` (at most one each; none for an unappealed one), in
        no particular order."""
        ...

    async def transition(
        self,
        tenant: str | None,
        appeal_id: str,
        to_state: str,
        *,
        actor: str,
        note: str,
        now: float,
        reason: ReasonCode | None = None,
        facts: str = "",
    ) -> Appeal:
        """Move the appeal to `to_state` and append the event (with the reason and facts of a decision), in
        one transaction; the appeal as it is now. AppealNotFoundError, InvalidTransitionError (nothing
        changes) for a step TRANSITIONS lacks, AppealClaimedError while another reviewer than `actor`
        holds a live claim on it (at `now`)."""
        ...

    async def events(self, tenant: str | None, appeal_id: str) -> builtins.list[AppealEvent]:
        """The appeal's events in order (n = 1, 2, ...), or AppealNotFoundError."""
        ...

    async def claim(
        self, tenant: str | None, appeal_id: str, reviewer: str, *, now: float, lease: float
    ) -> AppealClaim:
        """Claim an undecided appeal for `reviewer` until now + lease (renewing the reviewer's own claim),
        atomically: AppealClaimedError while another reviewer's claim is live, InvalidTransitionError for a
        decided appeal, AppealNotFoundError outside the caller's view."""
        ...

    async def release(self, tenant: str | None, appeal_id: str, reviewer: str) -> bool:
        """Drop `reviewer`'s claim on the appeal; whether there was one. AppealNotFoundError outside the
        caller's view."""
        ...

    async def claims(self, appeal_ids: Collection[str], now: float) -> dict[str, AppealClaim]:
        """The live claims (expires_at >= now) on these appeals, by appeal id (the caller has read the
        appeals in its own view)."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...

"""The `AppealStore` contract, run on SQLite (a file) and on a real PostgreSQL: the review state machine, its
events, append-only tables, tenant scoping and one appeal per decision."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest

import policy.appeals
import policy.audit
from policy.appeals import (
    APPEAL_STATES,
    DEFAULT_REASONS,
    TRANSITIONS,
    UNDECIDED,
    Appeal,
    AppealClaimedError,
    AppealConflictError,
    AppealFacets,
    AppealFilter,
    AppealNotFoundError,
    AppealStore,
    InvalidTransitionError,
    PostgresAppealStore,
    SharedContent,
    SqliteAppealStore,
    statement,
)
from policy.audit import GENESIS_HASH, AuditDraft, SqliteAuditStore
from policy.audit.migrations import RECORD_FIELDS, record_row
from policy.audit.records import chain
from tests.audit_versions import write_at_migration
from tests.backends import PG_DSN, SqlBackend, sql_backend

Backend = SqlBackend[AppealStore]
RECORD_COLUMNS = f"audit_records ({', '.join(RECORD_FIELDS)})"
# The appeals table as migration 1 made it (before migration 9 added the decision's facets).
OLD_APPEAL_COLUMNS = (
    "appeals (appeal_id, tenant, request_id, decision_seq, reason, state, filed_by, filed_at, updated_at)"
)
REFUSED = (sqlite3.DatabaseError, asyncpg.PostgresError)


async def _sqlite(path: Path) -> AppealStore:
    return await SqliteAppealStore.open(path)


async def _postgres(schema: str) -> AppealStore:
    return await PostgresAppealStore.open(PG_DSN, schema=schema)


@pytest.fixture(params=["sqlite", "postgres"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    async with sql_backend(request.param, tmp_path, _sqlite, _postgres) as b:
        yield b


@pytest.fixture
async def store(backend: Backend) -> AppealStore:
    return await backend.open()


async def file(store: AppealStore, tenant: str = "acme", seq: int = 1, now: float = 100.0) -> Appeal:
    return await store.file(
        tenant=tenant,
        request_id=f"req-{tenant}-{seq}",
        decision_seq=seq,
        reason="this was a false positive",
        filed_by=f"k-{tenant}",
        now=now,
    )


async def test_filing_opens_an_appeal_with_its_first_event(store: AppealStore) -> None:
    appeal = await file(store)
    assert appeal.state == "open"
    assert appeal.appeal_id.startswith("apl_")
    assert len(appeal.appeal_id) == 36
    assert (appeal.tenant, appeal.decision_seq, appeal.filed_by) == ("acme", 1, "k-acme")
    assert appeal.filed_at == appeal.updated_at == 100.0
    assert await store.get("acme", appeal.appeal_id) == appeal
    assert await store.get(None, appeal.appeal_id) == appeal
    [filed] = await store.events("acme", appeal.appeal_id)
    assert (filed.n, filed.from_state, filed.to_state, filed.actor, filed.at) == (
        1,
        None,
        "open",
        "k-acme",
        100.0,
    )
    # Ids are random: a second appeal never gets a guessable neighbour.
    assert (await file(store, seq=2)).appeal_id != appeal.appeal_id


async def test_one_appeal_per_decision(store: AppealStore) -> None:
    first = await file(store)
    with pytest.raises(AppealConflictError):
        await file(store, now=200.0)
    # The same seq of another tenant is another decision.
    await file(store, tenant="beta")
    assert [a.appeal_id for a in await store.list("acme")] == [first.appeal_id]
    assert len(await store.events("acme", first.appeal_id)) == 1


async def test_the_state_machine_and_its_events(store: AppealStore) -> None:
    overturn = await file(store, seq=1)
    step = await store.transition(
        "acme", overturn.appeal_id, "in_review", actor="rev", note="looking", now=110.0
    )
    assert (step.state, step.updated_at, step.filed_at) == ("in_review", 110.0, 100.0)
    done = await store.transition(
        None, overturn.appeal_id, "overturned", actor="boss", note="wrong", now=120.0
    )
    assert done.state == "overturned"
    assert await store.get("acme", overturn.appeal_id) == done
    events = await store.events(None, overturn.appeal_id)
    assert [(e.n, e.from_state, e.to_state, e.actor, e.note, e.at) for e in events] == [
        (1, None, "open", "k-acme", "", 100.0),
        (2, "open", "in_review", "rev", "looking", 110.0),
        (3, "in_review", "overturned", "boss", "wrong", 120.0),
    ]
    uphold = await file(store, seq=2)
    await store.transition("acme", uphold.appeal_id, "in_review", actor="rev", note="", now=130.0)
    assert (
        await store.transition("acme", uphold.appeal_id, "upheld", actor="rev", note="", now=131.0)
    ).state == ("upheld")


async def test_every_other_transition_is_invalid_and_changes_nothing(store: AppealStore) -> None:
    # One appeal in each state, then every (from, to) pair TRANSITIONS lacks.
    paths: dict[str, list[str]] = {
        "open": [],
        "in_review": ["in_review"],
        "upheld": ["in_review", "upheld"],
        "overturned": ["in_review", "overturned"],
    }
    appeals: dict[str, Appeal] = {}
    for seq, (state, steps) in enumerate(paths.items(), start=1):
        appeal = await file(store, seq=seq)
        for to in steps:
            appeal = await store.transition("acme", appeal.appeal_id, to, actor="rev", note="", now=150.0)
        assert appeal.state == state
        appeals[state] = appeal
    tried = 0
    for state, appeal in appeals.items():
        before = await store.events("acme", appeal.appeal_id)
        for to in (*APPEAL_STATES, "closed", ""):
            if (state, to) in TRANSITIONS:
                continue
            with pytest.raises(InvalidTransitionError):
                await store.transition("acme", appeal.appeal_id, to, actor="rev", note="x", now=160.0)
            tried += 1
        assert await store.get("acme", appeal.appeal_id) == appeal
        assert await store.events("acme", appeal.appeal_id) == before
    assert tried == 4 * 6 - len(TRANSITIONS)


async def test_concurrent_reviewers_decide_an_appeal_once(store: AppealStore, backend: Backend) -> None:
    appeal = await file(store)
    await store.transition("acme", appeal.appeal_id, "in_review", actor="rev", note="", now=110.0)
    other = await backend.open()
    results = await asyncio.gather(
        *(
            s.transition("acme", appeal.appeal_id, to, actor=to, note="", now=120.0)
            for s, to in ((store, "upheld"), (other, "overturned"), (store, "overturned"), (other, "upheld"))
        ),
        return_exceptions=True,
    )
    decided = [r for r in results if isinstance(r, Appeal)]
    assert len(decided) == 1, results
    assert all(isinstance(r, InvalidTransitionError) for r in results if not isinstance(r, Appeal))
    events = await store.events(None, appeal.appeal_id)
    assert [e.n for e in events] == [1, 2, 3]
    assert events[-1].to_state == decided[0].state == (await other.get(None, appeal.appeal_id)).state


async def test_tenants_see_only_their_own_appeals(store: AppealStore) -> None:
    acme = await file(store, "acme", 1, now=100.0)
    beta = await file(store, "beta", 1, now=101.0)
    for call in (
        store.get("acme", beta.appeal_id),
        store.events("acme", beta.appeal_id),
        store.transition("acme", beta.appeal_id, "in_review", actor="rev", note="", now=110.0),
        store.get("acme", "apl_" + "0" * 32),
    ):
        with pytest.raises(AppealNotFoundError):
            await call
    assert (await store.get("beta", beta.appeal_id)).state == "open"
    assert [a.appeal_id for a in await store.list("acme")] == [acme.appeal_id]
    assert [a.appeal_id for a in await store.list(None)] == [acme.appeal_id, beta.appeal_id]
    # Another tenant's id as a keyset is unseen: an empty page, not a probe.
    assert await store.list("beta", after=acme.appeal_id) == []


async def test_the_queue_filters_by_state_and_pages(store: AppealStore) -> None:
    filed = [await file(store, "acme" if i % 2 else "beta", i, now=100.0 + i // 3) for i in range(1, 13)]
    for appeal in filed[:4]:
        await store.transition(None, appeal.appeal_id, "in_review", actor="rev", note="", now=200.0)
    expected = sorted(filed, key=lambda a: (a.filed_at, a.appeal_id))
    pages: list[Appeal] = []
    after: str | None = None
    while page := await store.list(None, limit=5, after=after):
        assert len(page) <= 5
        pages.extend(page)
        after = page[-1].appeal_id
    assert [a.appeal_id for a in pages] == [a.appeal_id for a in expected]
    open_ids = [a.appeal_id for a in await store.list(None, "open")]
    assert open_ids == [a.appeal_id for a in expected if a not in filed[:4]]
    in_review = await store.list("acme", "in_review")
    assert {a.appeal_id for a in in_review} == {a.appeal_id for a in filed[:4] if a.tenant == "acme"}
    assert len(await store.list(None, limit=0)) == 1  # cut to 1..MAX_APPEAL_LIMIT
    assert await store.list(None, ()) == []  # no state selected: nothing, on both backends


async def test_the_undecided_queue_pages_past_decided_appeals(store: AppealStore) -> None:
    # The review queue once read every appeal, decided ones included, up to a cap: past it, new appeals never
    # showed. A page of undecided appeals is an index range after the keyset, however many were decided.
    filed = [await file(store, "acme" if i % 3 else "beta", i, now=100.0 + i // 4) for i in range(1, 31)]
    decided = {a.appeal_id for a in filed if a.decision_seq % 2 == 0}
    for appeal in filed:
        if appeal.appeal_id in decided or appeal.decision_seq % 5 == 0:
            await store.transition(None, appeal.appeal_id, "in_review", actor="rev", note="", now=200.0)
        if appeal.appeal_id in decided:
            to = "upheld" if appeal.decision_seq % 4 else "overturned"
            await store.transition(None, appeal.appeal_id, to, actor="rev", note="", now=201.0)
    expected = [a.appeal_id for a in sorted(filed, key=lambda a: (a.filed_at, a.appeal_id))]

    async def walk(tenant: str | None, limit: int) -> list[Appeal]:
        seen: list[Appeal] = []
        after: str | None = None
        while page := await store.list(tenant, UNDECIDED, limit=limit, after=after):
            assert len(page) <= limit
            seen.extend(page)
            after = page[-1].appeal_id
        return seen

    for tenant in (None, "acme", "beta"):
        for limit in (1, 4, 7):
            seen = await walk(tenant, limit)
            assert [a.appeal_id for a in seen] == [
                i for i in expected if i not in decided and tenant in (None, _tenant_of(filed, i))
            ]
            assert {a.state for a in seen} <= {"open", "in_review"}
    # A decided appeal as the keyset still pages on (its position stands), and one filed later shows up.
    cursor = next(i for i in reversed(expected) if i in decided)
    late = await file(store, "acme", 99, now=500.0)
    assert [a.appeal_id for a in await store.list(None, UNDECIDED, after=cursor)][-1] == late.appeal_id
    assert [a.appeal_id for a in await store.list(None, ("upheld", "overturned"))] == [
        i for i in expected if i in decided
    ]


def _tenant_of(filed: list[Appeal], appeal_id: str) -> str:
    return next(a.tenant for a in filed if a.appeal_id == appeal_id)


async def test_the_appeals_of_given_decisions(store: AppealStore) -> None:
    acme = [await file(store, "acme", seq, now=100.0 + seq) for seq in (1, 2, 700)]
    beta = await file(store, "beta", 2, now=104.0)
    found = await store.for_decisions("acme", [2, 3, 700, 2])
    assert sorted(a.appeal_id for a in found) == sorted(a.appeal_id for a in (acme[1], acme[2]))
    assert await store.for_decisions("beta", [1, 2, 700]) == [beta]
    assert await store.for_decisions("gamma", [1, 2]) == []
    assert await store.for_decisions("acme", []) == []
    # More seqs than one statement takes.
    many = await store.for_decisions("acme", range(1, 1200))
    assert sorted(a.decision_seq for a in many) == [1, 2, 700]


async def test_the_database_enforces_append_only_and_the_state_machine(
    store: AppealStore, backend: Backend
) -> None:
    appeal = await file(store)
    await store.transition("acme", appeal.appeal_id, "in_review", actor="rev", note="", now=110.0)
    where = f"WHERE appeal_id = '{appeal.appeal_id}'"
    forbidden = [
        f"UPDATE {{schema}}.appeal_events SET note = 'rewritten' {where}",
        f"DELETE FROM {{schema}}.appeal_events {where}",
        f"DELETE FROM {{schema}}.appeals {where}",
        f"UPDATE {{schema}}.appeals SET reason = 'changed' {where}",
        f"UPDATE {{schema}}.appeals SET decision_seq = 9 {where}",
        f"UPDATE {{schema}}.appeals SET tenant = 'beta' {where}",
        # Skipping or reversing a step, even behind the store's back.
        f"UPDATE {{schema}}.appeals SET state = 'open' {where}",
        f"UPDATE {{schema}}.appeals SET state = 'in_review' {where}",
        f"UPDATE {{schema}}.appeals SET state = 'closed' {where}",
    ]
    if backend.name == "postgres":
        forbidden += ["TRUNCATE {schema}.appeal_events", "TRUNCATE {schema}.appeals CASCADE"]
    for sql in forbidden:
        with pytest.raises(REFUSED):
            await backend.raw(sql)
    assert await store.get("acme", appeal.appeal_id) == await store.get(None, appeal.appeal_id)
    assert (await store.get(None, appeal.appeal_id)).state == "in_review"
    assert len(await store.events(None, appeal.appeal_id)) == 2
    # An allowed step is allowed in SQL too (the triggers are the state machine, not a lock).
    await backend.raw(f"UPDATE {{schema}}.appeals SET state = 'upheld', updated_at = 1.0 {where}")


async def test_shares_the_audit_database_and_its_migrations(backend: Backend, tmp_path: Path) -> None:
    store = await backend.open()
    again = await backend.open()
    appeal = await file(store)
    assert await again.get(None, appeal.appeal_id) == appeal
    rows = await backend.raw("SELECT version FROM {schema}.audit_schema_migrations ORDER BY version")
    assert [row[0] for row in rows] == [m.version for m in policy.audit.MIGRATIONS]
    if backend.name == "sqlite":
        audit = await SqliteAuditStore.open(backend.location)
        try:
            assert (await audit.verify("acme")).ok
        finally:
            await audit.close()


async def test_sqlite_closed(tmp_path: Path) -> None:
    store = await SqliteAppealStore.open(tmp_path / "a.sqlite3")
    await store.close()
    with pytest.raises(policy.audit.AuditStoreError, match="closed"):
        await store.get(None, "apl_x")
    await store.close()


def test_public_names() -> None:
    names: set[Any] = set(policy.appeals.__all__)
    assert names >= {
        *("Appeal", "AppealEvent", "AppealState", "AppealStore", "AppealError", "AppealNotFoundError"),
        *("AppealConflictError", "InvalidTransitionError", "SqliteAppealStore", "PostgresAppealStore"),
        *("APPEAL_STATES", "TRANSITIONS", "MAX_APPEAL_LIMIT", "UNDECIDED", "APPEAL_STORE"),
    }


async def test_content_shared_with_an_appeal_is_kept_until_it_expires(
    store: AppealStore, backend: Backend
) -> None:
    text = "a question about a poem\x00 with a NUL and \ud800 a lone surrogate"
    shared = SharedContent(content=text, content_hash="h" * 64, source="consumer", expires_at=500.0)
    appeal = await store.file(
        tenant="acme",
        request_id="req-1",
        decision_seq=1,
        reason="false positive",
        filed_by="k-acme",
        now=100.0,
        shared=shared,
    )
    bare = await file(store, seq=2)
    evidence = await store.evidence("acme", appeal.appeal_id)
    assert evidence is not None
    assert (evidence.content, evidence.content_hash, evidence.source) == (text, "h" * 64, "consumer")
    assert (evidence.tenant, evidence.appeal_id, evidence.attached_at, evidence.expires_at) == (
        "acme",
        appeal.appeal_id,
        100.0,
        500.0,
    )
    assert await store.evidence(None, appeal.appeal_id) == evidence  # a global reviewer's view
    assert await store.evidence("acme", bare.appeal_id) is None
    # Another tenant's view holds no such appeal: not found, never an empty answer that confirms it.
    with pytest.raises(AppealNotFoundError):
        await store.evidence("beta", appeal.appeal_id)
    # Never rewritten behind the store's back.
    with pytest.raises(REFUSED):
        await backend.raw(
            f"UPDATE {{schema}}.appeal_evidence SET content = 'other' WHERE appeal_id = '{appeal.appeal_id}'"
        )
    assert await store.purge_evidence(499.0) == 0
    assert await store.evidence("acme", appeal.appeal_id) == evidence
    assert await store.purge_evidence(501.0) == 1
    assert await store.evidence("acme", appeal.appeal_id) is None
    # The appeal and its events stay: only the content goes.
    assert (await store.get("acme", appeal.appeal_id)).reason == "false positive"
    assert len(await store.events("acme", appeal.appeal_id)) == 1


async def test_an_appeal_whose_evidence_cannot_be_stored_is_not_filed(store: AppealStore) -> None:
    first = await file(store)
    shared = SharedContent(content="x", content_hash="h", source="consumer", expires_at=1.0)
    with pytest.raises(AppealConflictError):
        await store.file(
            tenant="acme",
            request_id="r",
            decision_seq=1,
            reason="again",
            filed_by="k",
            now=2.0,
            shared=shared,
        )
    assert await store.evidence("acme", first.appeal_id) is None


async def test_a_decision_keeps_its_reason_whole_and_the_consumers_statement_reads_it(
    store: AppealStore,
) -> None:
    appeal = await file(store)
    await store.transition("acme", appeal.appeal_id, "in_review", actor="rev", note="", now=110.0)
    [overturn] = [r for r in DEFAULT_REASONS if r.code == "false_positive"]
    with pytest.raises(ValueError, match="reason for overturned"):  # an overturn's reason cannot uphold
        await store.transition(
            "acme", appeal.appeal_id, "upheld", actor="rev", note="", now=115.0, reason=overturn
        )
    decided = await store.transition(
        "acme",
        appeal.appeal_id,
        "overturned",
        actor="rev",
        note="internal: the rules matched a quote",
        now=120.0,
        reason=overturn,
        facts="the prompt quotes a novel",
    )
    events = await store.events("acme", appeal.appeal_id)
    assert (events[-1].reason, events[-1].facts) == (overturn, "the prompt quotes a novel")
    assert (events[0].reason, events[1].reason, events[1].facts) == (None, None, "")
    said = statement(decided, events, automated_detection=True)
    assert said is not None
    assert (said.outcome, said.reason_code, said.ground, said.text, said.facts, said.decided_at) == (
        "overturned",
        "false_positive",
        "none",
        overturn.text,
        "the prompt quotes a novel",
        120.0,
    )
    assert (said.automated_detection, said.automated_decision) == (True, False)
    assert "internal" not in str(said)
    assert statement(await file(store, seq=2), [], automated_detection=True) is None  # undecided


async def test_a_claim_keeps_other_reviewers_off_an_appeal_until_it_expires(store: AppealStore) -> None:
    appeal = await file(store)
    other = await file(store, seq=2)
    mine = await store.claim("acme", appeal.appeal_id, "rev-1", now=100.0, lease=60.0)
    assert (mine.appeal_id, mine.reviewer, mine.expires_at) == (appeal.appeal_id, "rev-1", 160.0)
    # Another reviewer can neither take it nor step it while the claim is live; the holder renews it.
    with pytest.raises(AppealClaimedError) as info:
        await store.claim("acme", appeal.appeal_id, "rev-2", now=150.0, lease=60.0)
    assert info.value.claim == mine
    with pytest.raises(AppealClaimedError):
        await store.transition("acme", appeal.appeal_id, "in_review", actor="rev-2", note="", now=150.0)
    assert (await store.get("acme", appeal.appeal_id)).state == "open"
    renewed = await store.claim("acme", appeal.appeal_id, "rev-1", now=150.0, lease=60.0)
    assert renewed.expires_at == 210.0
    assert await store.claims([appeal.appeal_id, other.appeal_id], 200.0) == {appeal.appeal_id: renewed}
    # The holder steps it; once the lease lapses another reviewer may take it over.
    await store.transition("acme", appeal.appeal_id, "in_review", actor="rev-1", note="", now=160.0)
    assert await store.claims([appeal.appeal_id], 211.0) == {}
    taken = await store.claim("acme", appeal.appeal_id, "rev-2", now=211.0, lease=60.0)
    assert taken.reviewer == "rev-2"
    # Releasing: only the holder's own claim goes.
    assert await store.release("acme", appeal.appeal_id, "rev-1") is False
    assert await store.release("acme", appeal.appeal_id, "rev-2") is True
    await store.transition("acme", appeal.appeal_id, "upheld", actor="rev-1", note="", now=220.0)
    # A decided appeal cannot be claimed; another tenant's view does not hold it at all.
    with pytest.raises(InvalidTransitionError):
        await store.claim("acme", appeal.appeal_id, "rev-1", now=230.0, lease=60.0)
    with pytest.raises(AppealNotFoundError):
        await store.claim("beta", other.appeal_id, "rev-1", now=230.0, lease=60.0)
    with pytest.raises(AppealNotFoundError):
        await store.release("beta", other.appeal_id, "rev-1")
    assert await store.claims([], 0.0) == {}


async def test_two_reviewers_claiming_at_once_get_one_claim(backend: Backend) -> None:
    stores = [await backend.open() for _ in range(2)]
    appeal = await file(stores[0])

    async def take(store: AppealStore, reviewer: str) -> str:
        try:
            return (await store.claim(None, appeal.appeal_id, reviewer, now=100.0, lease=60.0)).reviewer
        except AppealClaimedError as exc:
            return f"refused, held by {exc.claim.reviewer}"

    for attempt in range(5):
        first, second = f"a{attempt}", f"b{attempt}"
        results = await asyncio.gather(take(stores[0], first), take(stores[1], second))
        winners = [r for r in results if not r.startswith("refused")]
        # The first attempt has a winner; later ones find the live claim of attempt 0's winner.
        if attempt == 0:
            assert len(winners) == 1, results
            holder = winners[0]
        assert all(r in (holder, f"refused, held by {holder}") for r in results), results


def facets(category: str, severity: str = "high", policy: str = "strict@2", **rest: str) -> AppealFacets:
    fields = {"decision": "block", "stage": "input", "source": "rules", **rest}
    return AppealFacets(category=category, severity=severity, policy=policy, **fields)


async def file_with(store: AppealStore, tenant: str, seq: int, now: float, kept: AppealFacets) -> Appeal:
    return await store.file(
        tenant=tenant, request_id=f"r{seq}", decision_seq=seq, reason="r", filed_by="k", now=now, facets=kept
    )


async def test_the_queue_filters_sorts_pages_and_counts_by_the_decisions_facets(store: AppealStore) -> None:
    kinds = [facets("weapons"), facets("hate", "critical"), facets("weapons", policy="strict@3")]
    filed = [await file_with(store, "acme", i + 1, 100.0 + i, kinds[i % 3]) for i in range(9)]
    beta = await file_with(store, "beta", 1, 50.0, facets("weapons"))
    assert (filed[0].category, filed[0].severity, filed[0].decision, filed[0].source) == (
        "weapons",
        "high",
        "block",
        "rules",
    )
    await store.transition("acme", filed[0].appeal_id, "in_review", actor="r", note="", now=200.0)
    await store.transition(
        "acme", filed[0].appeal_id, "upheld", actor="r", note="", now=201.0, reason=DEFAULT_REASONS[0]
    )
    undecided = filed[1:]
    weapons = AppealFilter(category="weapons")
    # Undecided only, of one tenant, by facet: pages of 2 by keyset, oldest first, then newest first.
    pages: list[list[str]] = []
    after = None
    while page := await store.list("acme", UNDECIDED, 2, after, weapons):
        pages.append([a.appeal_id for a in page])
        after = page[-1].appeal_id
    expected = [a.appeal_id for a in undecided if a.category == "weapons"]
    assert [a for p in pages for a in p] == expected
    assert all(len(p) <= 2 for p in pages)
    newest = AppealFilter(category="weapons", newest_first=True)
    first = await store.list("acme", UNDECIDED, 2, None, newest)
    rest = await store.list("acme", UNDECIDED, 100, first[-1].appeal_id, newest)
    assert [a.appeal_id for a in first + rest] == expected[::-1]
    # Every facet filters; a bare policy name takes every version; age is a filing window.
    assert len(await store.list("acme", UNDECIDED, 100, None, AppealFilter(severity="critical"))) == 3
    assert len(await store.list("acme", UNDECIDED, 100, None, AppealFilter(policy="strict@3"))) == 3
    assert len(await store.list("acme", UNDECIDED, 100, None, AppealFilter(policy="strict"))) == 8
    assert await store.list("acme", UNDECIDED, 100, None, AppealFilter(policy="stri")) == []
    window = AppealFilter(filed_from=103.0, filed_to=106.0)
    in_window = await store.list("acme", UNDECIDED, 100, None, window)
    assert [a.filed_at for a in in_window] == [103.0, 104.0, 105.0]
    assert await store.list("acme", UNDECIDED, 100, None, AppealFilter(source="model", category="hate")) == []
    # Counts per facet value, under the same filters; a global view counts every tenant.
    counts = await store.counts("acme", UNDECIDED)
    assert counts["category"] == {"weapons": 5, "hate": 3}
    assert counts["severity"] == {"high": 5, "critical": 3}
    assert counts["policy"] == {"strict@2": 5, "strict@3": 3}
    assert counts["tenant"] == {"acme": 8}
    assert (await store.counts("acme", UNDECIDED, weapons))["policy"] == {"strict@2": 2, "strict@3": 3}
    assert (await store.counts(None, UNDECIDED, weapons))["tenant"] == {"acme": 5, "beta": 1}
    assert (await store.counts("beta", ("upheld",)))["tenant"] == {}
    assert beta.tenant == "beta"


async def test_appeals_filed_before_facets_were_kept_get_them_from_their_decisions(backend: Backend) -> None:
    """A database at migration 8 with a record and its appeal: opening the store fills in the appeal's
    facets from the record it appeals, and the facets are then as fixed as the rest of the row."""
    record = chain(
        AuditDraft(
            tenant="acme", key_id="k", request_id="r1", at=10.0, stage="input", decision="block",
            source="rules", policy="strict@2", category="weapons", severity="critical", content_hash="h",
        ),
        1,
        GENESIS_HASH,
        None,
    )  # fmt: skip
    old = ("apl_" + "0" * 32, "acme", "r1", 1, "too strict", "open", "k", 20.0, 20.0)
    await write_at_migration(backend, 8, [(RECORD_COLUMNS, record_row(record)), (OLD_APPEAL_COLUMNS, old)])
    store = await backend.open()
    appeal = await store.get("acme", old[0])
    kept = (appeal.decision, appeal.stage, appeal.source, appeal.category, appeal.severity, appeal.policy)
    assert kept == ("block", "input", "rules", "weapons", "critical", "strict@2")
    assert (await store.counts("acme", UNDECIDED))["category"] == {"weapons": 1}
    with pytest.raises(REFUSED):
        await backend.raw(f"UPDATE {{schema}}.appeals SET category = 'hate' WHERE appeal_id = '{old[0]}'")


async def test_an_answers_evidence_keeps_the_request_beside_it(store: AppealStore) -> None:
    shared = SharedContent(
        content="the answer", content_hash="h", source="consumer", expires_at=500.0, request_content="a\x00b"
    )
    appeal = await store.file(
        tenant="acme", request_id="r", decision_seq=7, reason="r", filed_by="k", now=1.0, shared=shared
    )
    evidence = await store.evidence("acme", appeal.appeal_id)
    assert evidence is not None
    assert (evidence.content, evidence.request_content) == ("the answer", "a\x00b")

"""The audit store's schema (SQLite and PostgreSQL), its append-only triggers, and the row codecs.

Tables (in the same database as the tenants, with their own migrations table)::

    audit_schema_migrations(version)       one row per applied migration
    audit_records(tenant, seq, ...every AuditRecord field..., stages JSON, flagged 0/1, count >= 1,
                  mac NULL if unkeyed)
        PRIMARY KEY (tenant, seq)          append-only: UPDATE may only null `content`; no DELETE
        UNIQUE (tenant, draft_id) where draft_id <> ''   a draft is recorded once
    audit_heads(tenant PK, seq, hash)      each tenant's last record; the row appends lock per tenant.
                                           seq only grows; no DELETE
    appeals(appeal_id PK, tenant, request_id, decision_seq, reason, state, filed_by, filed_at, updated_at,
            decision, stage, source, category, severity, policy)
        UNIQUE (tenant, decision_seq)      one appeal per decision; UPDATE may only move `state` along an
                                           allowed step (and set updated_at); no DELETE
    appeal_events(appeal_id, n, at, actor, from_state, to_state, note, reason JSON NULL, facts)
        PRIMARY KEY (appeal_id, n)         append-only: no UPDATE, no DELETE
    appeal_evidence(appeal_id PK, tenant, content, content_hash, source, expires_at, attached_at,
                    request_content NULL)
                                           content a consumer shared with its appeal; no UPDATE; deleted
                                           once expires_at is past (`AppealStore.purge_evidence`)
    appeal_claims(appeal_id PK, reviewer, expires_at)
                                           who reviews an undecided appeal, until when (a lease)

The triggers make the log evidence in the database itself, not by convention (as `admin_changes` is for
the tenant store). Never edit a released migration: append a new one.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from policy.audit.base import BadRow
from policy.audit.records import AuditedStage, AuditRecord, unstorable
from registry.db import Row
from registry.db.migrations import Migration

MIGRATIONS_TABLE = "audit_schema_migrations"

# The columns of audit_records as migration 3 left them (released: the triggers of migrations 1 and 3 name
# these, never what is added later).
_V3_FIELDS = (
    "tenant",
    "seq",
    "key_id",
    "request_id",
    "at",
    "stage",
    "decision",
    "source",
    "policy",
    "policy_hash",
    "stages",
    "category",
    "severity",
    "flagged",
    "content_hash",
    "content",
    "detail",
    "reverses",
    "actor",
    "prev_hash",
    "hash",
    "draft_id",
)
_V4_FIELDS = (*_V3_FIELDS, "count", "last_at")
_V5_FIELDS = (*_V4_FIELDS, "mac")
# Column order of audit_records; rows decode by position on both drivers.
RECORD_FIELDS = _V5_FIELDS
RECORD_COLUMNS = ", ".join(RECORD_FIELDS)


def _not_only_content_nulled(columns: tuple[str, ...]) -> str:
    """SQLite's test that an UPDATE of audit_records changed more than nulling `content`."""
    return " OR ".join(
        ["NEW.content IS NOT NULL", *(f"NEW.{c} IS NOT OLD.{c}" for c in columns if c != "content")]
    )


_ONLY_PURGE_TRIGGER = """CREATE TRIGGER audit_records_only_purge BEFORE UPDATE ON audit_records
                WHEN {}
                BEGIN SELECT RAISE(ABORT, 'audit_records is append-only'); END"""

# The appeal state machine (policy.appeals.base.TRANSITIONS) as SQL over OLD and NEW.
_A_TRANSITION = (
    "(OLD.state = 'open' AND NEW.state = 'in_review')"
    " OR (OLD.state = 'in_review' AND NEW.state IN ('upheld', 'overturned'))"
)
_APPEAL_FIXED = ("appeal_id", "tenant", "request_id", "decision_seq", "reason", "filed_by", "filed_at")
# Migration 9 adds the appealed decision's facets, fixed too.
_APPEAL_FACETS = ("decision", "stage", "source", "category", "severity", "policy")


def _not_a_transition(fixed: tuple[str, ...]) -> str:
    return " OR ".join([*(f"NEW.{c} IS NOT OLD.{c}" for c in fixed), f"NOT ({_A_TRANSITION})"])


_APPEALS_TRANSITION_TRIGGER = """CREATE TRIGGER appeals_transition BEFORE UPDATE ON appeals
                WHEN {}
                BEGIN SELECT RAISE(ABORT, 'appeals only change state along open->in_review->decided'); END"""
# The facets of appeals filed before migration 9, from the records they appeal.
_BACKFILL_FACETS = "UPDATE appeals SET " + ", ".join(
    f"{c} = COALESCE((SELECT r.{c} FROM audit_records r"
    " WHERE r.tenant = appeals.tenant AND r.seq = appeals.decision_seq), '')"
    for c in _APPEAL_FACETS
)

MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        version=1,
        summary="audit_records, audit_heads, append-only triggers",
        shared=(
            """CREATE TABLE audit_records (
                tenant TEXT NOT NULL,
                seq BIGINT NOT NULL CHECK (seq >= 1),
                key_id TEXT NOT NULL,
                request_id TEXT NOT NULL,
                at DOUBLE PRECISION NOT NULL,
                stage TEXT NOT NULL,
                decision TEXT NOT NULL,
                source TEXT NOT NULL,
                policy TEXT NOT NULL,
                policy_hash TEXT NOT NULL,
                stages TEXT NOT NULL,
                category TEXT,
                severity TEXT,
                flagged INTEGER NOT NULL,
                content_hash TEXT NOT NULL,
                content TEXT,
                detail TEXT NOT NULL,
                reverses BIGINT,
                actor TEXT NOT NULL,
                prev_hash TEXT NOT NULL,
                hash TEXT NOT NULL,
                PRIMARY KEY (tenant, seq)
            )""",
            "CREATE INDEX audit_records_by_request ON audit_records (request_id)",
            "CREATE INDEX audit_records_by_at ON audit_records (tenant, at)",
            """CREATE TABLE audit_heads (
                tenant TEXT PRIMARY KEY,
                seq BIGINT NOT NULL,
                hash TEXT NOT NULL
            )""",
        ),
        sqlite=(
            # The columns of version 1 (released: never edit), not RECORD_FIELDS as it grows.
            _ONLY_PURGE_TRIGGER.format(_not_only_content_nulled(_V3_FIELDS[:-1])),
            """CREATE TRIGGER audit_records_no_delete BEFORE DELETE ON audit_records
               BEGIN SELECT RAISE(ABORT, 'audit_records is append-only'); END""",
            """CREATE TRIGGER audit_heads_forward BEFORE UPDATE ON audit_heads
               WHEN NEW.tenant IS NOT OLD.tenant OR NEW.seq <= OLD.seq
               BEGIN SELECT RAISE(ABORT, 'audit_heads only move forward'); END""",
            """CREATE TRIGGER audit_heads_no_delete BEFORE DELETE ON audit_heads
               BEGIN SELECT RAISE(ABORT, 'audit_heads only move forward'); END""",
        ),
        postgres=(
            # Everything but `content` must stay, and content may only become NULL (a purge).
            """CREATE FUNCTION audit_records_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
               BEGIN
                 IF TG_OP = 'UPDATE' AND NEW.content IS NULL
                    AND (to_jsonb(NEW) - 'content') = (to_jsonb(OLD) - 'content') THEN
                   RETURN NEW;
                 END IF;
                 RAISE EXCEPTION 'audit_records is append-only';
               END $$""",
            """CREATE TRIGGER audit_records_append_only BEFORE UPDATE OR DELETE ON audit_records
               FOR EACH ROW EXECUTE FUNCTION audit_records_append_only()""",
            """CREATE TRIGGER audit_records_no_truncate BEFORE TRUNCATE ON audit_records
               FOR EACH STATEMENT EXECUTE FUNCTION audit_records_append_only()""",
            """CREATE FUNCTION audit_heads_forward() RETURNS trigger LANGUAGE plpgsql AS $$
               BEGIN
                 IF TG_OP = 'UPDATE' AND NEW.tenant = OLD.tenant AND NEW.seq > OLD.seq THEN
                   RETURN NEW;
                 END IF;
                 RAISE EXCEPTION 'audit_heads only move forward';
               END $$""",
            """CREATE TRIGGER audit_heads_forward BEFORE UPDATE OR DELETE ON audit_heads
               FOR EACH ROW EXECUTE FUNCTION audit_heads_forward()""",
            """CREATE TRIGGER audit_heads_no_truncate BEFORE TRUNCATE ON audit_heads
               FOR EACH STATEMENT EXECUTE FUNCTION audit_heads_forward()""",
        ),
    ),
    Migration(
        version=2,
        summary="appeals, appeal_events (append-only), state-machine and append-only triggers",
        shared=(
            """CREATE TABLE appeals (
                appeal_id TEXT PRIMARY KEY,
                tenant TEXT NOT NULL,
                request_id TEXT NOT NULL,
                decision_seq BIGINT NOT NULL,
                reason TEXT NOT NULL,
                state TEXT NOT NULL CHECK (state IN ('open', 'in_review', 'upheld', 'overturned')),
                filed_by TEXT NOT NULL,
                filed_at DOUBLE PRECISION NOT NULL,
                updated_at DOUBLE PRECISION NOT NULL,
                UNIQUE (tenant, decision_seq)
            )""",
            "CREATE INDEX appeals_by_state ON appeals (state, filed_at, appeal_id)",
            "CREATE INDEX appeals_by_tenant ON appeals (tenant, filed_at, appeal_id)",
            """CREATE TABLE appeal_events (
                appeal_id TEXT NOT NULL REFERENCES appeals (appeal_id),
                n INTEGER NOT NULL CHECK (n >= 1),
                at DOUBLE PRECISION NOT NULL,
                actor TEXT NOT NULL,
                from_state TEXT,
                to_state TEXT NOT NULL,
                note TEXT NOT NULL,
                PRIMARY KEY (appeal_id, n)
            )""",
        ),
        sqlite=(
            _APPEALS_TRANSITION_TRIGGER.format(_not_a_transition(_APPEAL_FIXED)),
            """CREATE TRIGGER appeals_no_delete BEFORE DELETE ON appeals
               BEGIN SELECT RAISE(ABORT, 'appeals are never deleted'); END""",
            """CREATE TRIGGER appeal_events_no_update BEFORE UPDATE ON appeal_events
               BEGIN SELECT RAISE(ABORT, 'appeal_events is append-only'); END""",
            """CREATE TRIGGER appeal_events_no_delete BEFORE DELETE ON appeal_events
               BEGIN SELECT RAISE(ABORT, 'appeal_events is append-only'); END""",
        ),
        postgres=(
            # Only state and updated_at may change, and state only along an allowed step.
            f"""CREATE FUNCTION appeals_transition() RETURNS trigger LANGUAGE plpgsql AS $$
               BEGIN
                 IF TG_OP = 'UPDATE'
                    AND (to_jsonb(NEW) - 'state' - 'updated_at') = (to_jsonb(OLD) - 'state' - 'updated_at')
                    AND ({_A_TRANSITION}) THEN
                   RETURN NEW;
                 END IF;
                 RAISE EXCEPTION 'appeals only change state along open->in_review->decided';
               END $$""",
            """CREATE TRIGGER appeals_transition BEFORE UPDATE OR DELETE ON appeals
               FOR EACH ROW EXECUTE FUNCTION appeals_transition()""",
            """CREATE TRIGGER appeals_no_truncate BEFORE TRUNCATE ON appeals
               FOR EACH STATEMENT EXECUTE FUNCTION appeals_transition()""",
            """CREATE FUNCTION appeal_events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
               BEGIN
                 RAISE EXCEPTION 'appeal_events is append-only';
               END $$""",
            """CREATE TRIGGER appeal_events_append_only BEFORE UPDATE OR DELETE ON appeal_events
               FOR EACH ROW EXECUTE FUNCTION appeal_events_append_only()""",
            """CREATE TRIGGER appeal_events_no_truncate BEFORE TRUNCATE ON appeal_events
               FOR EACH STATEMENT EXECUTE FUNCTION appeal_events_append_only()""",
        ),
    ),
    Migration(
        version=3,
        summary="audit_records.draft_id: a draft appended twice is recorded once",
        shared=(
            "ALTER TABLE audit_records ADD COLUMN draft_id TEXT NOT NULL DEFAULT ''",
            "CREATE UNIQUE INDEX audit_records_by_draft ON audit_records (tenant, draft_id)"
            " WHERE draft_id <> ''",
        ),
        # PostgreSQL's trigger compares whole rows (to_jsonb), so it covers the new column already.
        sqlite=(
            "DROP TRIGGER audit_records_only_purge",
            _ONLY_PURGE_TRIGGER.format(_not_only_content_nulled(_V3_FIELDS)),
        ),
    ),
    Migration(
        version=4,
        summary="audit_records.count, last_at: one record for repeated refusals (policy.audit.refusals)",
        shared=(
            "ALTER TABLE audit_records ADD COLUMN count BIGINT NOT NULL DEFAULT 1 CHECK (count >= 1)",
            "ALTER TABLE audit_records ADD COLUMN last_at DOUBLE PRECISION",
        ),
        sqlite=(
            "DROP TRIGGER audit_records_only_purge",
            _ONLY_PURGE_TRIGGER.format(_not_only_content_nulled(_V4_FIELDS)),
        ),
    ),
    Migration(
        version=5,
        summary="audit_records.mac: each record's HMAC under a key kept outside the database",
        # NULL for the records written before: they verify as unkeyed, up to the chain's first keyed record.
        shared=("ALTER TABLE audit_records ADD COLUMN mac TEXT",),
        sqlite=(
            "DROP TRIGGER audit_records_only_purge",
            _ONLY_PURGE_TRIGGER.format(_not_only_content_nulled(_V5_FIELDS)),
        ),
    ),
    Migration(
        version=6,
        summary="appeal_evidence: content a consumer shares with its appeal, under the appeals' retention",
        shared=(
            """CREATE TABLE appeal_evidence (
                appeal_id TEXT PRIMARY KEY REFERENCES appeals (appeal_id),
                tenant TEXT NOT NULL,
                content TEXT NOT NULL,
                content_hash TEXT NOT NULL,
                source TEXT NOT NULL CHECK (source IN ('retained', 'consumer')),
                expires_at DOUBLE PRECISION NOT NULL,
                attached_at DOUBLE PRECISION NOT NULL
            )""",
            "CREATE INDEX appeal_evidence_by_expiry ON appeal_evidence (expires_at)",
        ),
        sqlite=(
            """CREATE TRIGGER appeal_evidence_no_update BEFORE UPDATE ON appeal_evidence
               BEGIN SELECT RAISE(ABORT, 'shared content is never changed, only deleted'); END""",
        ),
        postgres=(
            """CREATE FUNCTION appeal_evidence_no_update() RETURNS trigger LANGUAGE plpgsql AS $$
               BEGIN RAISE EXCEPTION 'shared content is never changed, only deleted'; END $$""",
            """CREATE TRIGGER appeal_evidence_no_update BEFORE UPDATE ON appeal_evidence
               FOR EACH ROW EXECUTE FUNCTION appeal_evidence_no_update()""",
        ),
    ),
    Migration(
        version=7,
        summary="appeal_events.reason, facts: the structured reason of a decision (policy.appeals.reasons)",
        shared=(
            "ALTER TABLE appeal_events ADD COLUMN reason TEXT",
            "ALTER TABLE appeal_events ADD COLUMN facts TEXT NOT NULL DEFAULT ''",
        ),
    ),
    Migration(
        version=8,
        summary="appeal_claims: which reviewer has an undecided appeal, until when (a lease)",
        shared=(
            """CREATE TABLE appeal_claims (
                appeal_id TEXT PRIMARY KEY REFERENCES appeals (appeal_id),
                reviewer TEXT NOT NULL,
                expires_at DOUBLE PRECISION NOT NULL
            )""",
        ),
    ),
    Migration(
        version=9,
        summary="appeals.decision, stage, source, category, severity, policy: the queue filters by them",
        shared=(
            *(f"ALTER TABLE appeals ADD COLUMN {c} TEXT NOT NULL DEFAULT ''" for c in _APPEAL_FACETS),
            "CREATE INDEX appeals_by_state_category ON appeals (state, category, filed_at, appeal_id)",
            "CREATE INDEX appeals_by_state_severity ON appeals (state, severity, filed_at, appeal_id)",
        ),
        # The existing appeals get their decisions' facets, then the new columns are fixed like the others.
        sqlite=(
            "DROP TRIGGER appeals_transition",
            _BACKFILL_FACETS,
            _APPEALS_TRANSITION_TRIGGER.format(_not_a_transition(_APPEAL_FIXED + _APPEAL_FACETS)),
        ),
        # PostgreSQL's trigger compares whole rows (to_jsonb), so it covers the new columns already.
        postgres=(
            "ALTER TABLE appeals DISABLE TRIGGER appeals_transition",
            _BACKFILL_FACETS,
            "ALTER TABLE appeals ENABLE TRIGGER appeals_transition",
        ),
    ),
    Migration(
        version=10,
        summary="appeal_evidence.request_content: the request's input shared with an appeal of its answer",
        shared=("ALTER TABLE appeal_evidence ADD COLUMN request_content TEXT",),
    ),
)

_stages = msgspec.json.Decoder(tuple[AuditedStage, ...])
_encode = msgspec.json.Encoder()


# Content a store cannot hold as it is (a NUL, which PostgreSQL's text refuses; a lone surrogate, which UTF-8
# cannot encode), and content that begins with this mark, is stored as the mark and the content's ASCII JSON
# string, and read back exactly: the record (and its content_hash) never changes, and no content is a poison
# record that stops the trail.
ESCAPED_CONTENT = "\x01lockgate-escaped\x01"


def stored_content(content: str | None) -> str | None:
    """`content` as the content column holds it."""
    if content is None or not (unstorable(content) or content.startswith(ESCAPED_CONTENT)):
        return content
    return ESCAPED_CONTENT + json.dumps(content, ensure_ascii=True)


def read_content(stored: str | None) -> str | None:
    """The content a content column holds."""
    if stored is None or not stored.startswith(ESCAPED_CONTENT):
        return stored
    content: str = json.loads(stored[len(ESCAPED_CONTENT) :])
    return content


def record_row(record: AuditRecord) -> tuple[Any, ...]:
    """Column values of a (normalized) record, in RECORD_FIELDS order."""
    values: dict[str, Any] = {name: getattr(record, name) for name in RECORD_FIELDS}
    values["stages"] = _encode.encode(record.stages).decode()
    values["flagged"] = int(record.flagged)
    values["content"] = stored_content(record.content)
    return tuple(values[name] for name in RECORD_FIELDS)


def record_from_row(row: Row) -> AuditRecord:
    """A record from a row selected as RECORD_COLUMNS. msgspec.ValidationError if a column holds what no
    record can (only a row changed behind the store's back)."""
    values: dict[str, Any] = dict(zip(RECORD_FIELDS, row, strict=True))
    values["stages"] = _stages.decode(values["stages"])
    values["flagged"] = bool(values["flagged"])
    values["content"] = read_content(values["content"])
    return msgspec.convert(values, AuditRecord)


def record_or_bad_row(row: Row) -> AuditRecord | BadRow:
    """A chain row as its record, or as a `BadRow` when it does not decode (verification reports it)."""
    try:
        return record_from_row(row)
    except msgspec.ValidationError as exc:
        return BadRow(seq=int(row[1]), detail=str(exc))

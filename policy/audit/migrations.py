"""The audit store's schema (SQLite and PostgreSQL), its append-only triggers, and the row codecs.

Tables (in the same database as the tenants, with their own migrations table)::

    audit_schema_migrations(version)       one row per applied migration
    audit_records(tenant, seq, ...every AuditRecord field..., stages JSON, flagged 0/1)
        PRIMARY KEY (tenant, seq)          append-only: UPDATE may only null `content`; no DELETE
    audit_heads(tenant PK, seq, hash)      each tenant's last record; the row appends lock per tenant.
                                           seq only grows; no DELETE

The triggers make the log evidence in the database itself, not by convention (as `admin_changes` is for
the tenant store). Never edit a released migration: append a new one.
"""

from __future__ import annotations

from typing import Any

import msgspec

from policy.audit.records import AuditRecord, StageRun
from registry.db import Row
from registry.db.migrations import Migration

MIGRATIONS_TABLE = "audit_schema_migrations"

# Column order of audit_records; rows decode by position on both drivers.
RECORD_FIELDS = (
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
)
RECORD_COLUMNS = ", ".join(RECORD_FIELDS)

_NOT_ONLY_CONTENT_NULLED = " OR ".join(
    ["NEW.content IS NOT NULL", *(f"NEW.{c} IS NOT OLD.{c}" for c in RECORD_FIELDS if c != "content")]
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
            f"""CREATE TRIGGER audit_records_only_purge BEFORE UPDATE ON audit_records
                WHEN {_NOT_ONLY_CONTENT_NULLED}
                BEGIN SELECT RAISE(ABORT, 'audit_records is append-only'); END""",
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
)

_stages = msgspec.json.Decoder(tuple[StageRun, ...])
_encode = msgspec.json.Encoder()


def record_row(record: AuditRecord) -> tuple[Any, ...]:
    """Column values of a (normalized) record, in RECORD_FIELDS order."""
    values: dict[str, Any] = {name: getattr(record, name) for name in RECORD_FIELDS}
    values["stages"] = _encode.encode(record.stages).decode()
    values["flagged"] = int(record.flagged)
    return tuple(values[name] for name in RECORD_FIELDS)


def record_from_row(row: Row) -> AuditRecord:
    """A record from a row selected as RECORD_COLUMNS. msgspec.ValidationError if a column holds what no
    record can (only a row changed behind the store's back)."""
    values: dict[str, Any] = dict(zip(RECORD_FIELDS, row, strict=True))
    values["stages"] = _stages.decode(values["stages"])
    values["flagged"] = bool(values["flagged"])
    return msgspec.convert(values, AuditRecord)

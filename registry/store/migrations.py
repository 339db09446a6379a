"""The registry's schema: ordered migrations for SQLite and PostgreSQL.

Tables::

    registry_schema_migrations(version)      applied migrations (own table: the tenant store may share the
                                             database, and its version numbers would collide with ours)
    registry_versions(kind, name, version PK, content_hash, spec JSON, published_at, actor)   immutable
    registry_aliases(kind, name PK, targets JSON, revision, updated_at, actor)
    registry_alias_history(id PK, kind, name, action, targets JSON, previous JSON, parent_id, at, actor)
                                             append-only; `revision` of an alias is the id of its entry here
    registry_generation(id = 1 PK, value)    one row: bumped in the same transaction as every change
    registry_secret(id = 1 PK, value)        one row, written once: the deployment's server secret (keys
                                             canary picks and tenants' cache salts; `gateway.secret`)
    registry_figures(kind, name, version, suite_sha256, context PK, figures JSON, error, baseline, forced,
                     at, actor)              append-only: a version's figures on one evaluation suite, as the
                                             publish check measured them (`gateway.publish_check`)

`Migration` (and its `{id_pk}` expansion) and the runners, given this list and table, are the shared ones
of `registry.db`. The statements that use these tables are in `registry.store.sql`. Never edit a released
migration: append a new one.
"""

from __future__ import annotations

from registry.db import migrations as db
from registry.db.migrations import Dialect, Migration

__all__ = ["MIGRATIONS", "Dialect", "Migration"]

MIGRATIONS_TABLE = "registry_schema_migrations"
# The runners of `registry.db` take MIGRATIONS and MIGRATIONS_TABLE; this statement and `pending` stay
# public here for anyone inspecting the schema from this module.
CREATE_MIGRATIONS_TABLE = db.create_table_sql(MIGRATIONS_TABLE)

MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        version=1,
        summary="registry_versions, registry_aliases, registry_alias_history, registry_generation",
        shared=(
            """CREATE TABLE registry_versions (
                kind TEXT NOT NULL,
                name TEXT NOT NULL,
                version TEXT NOT NULL,
                content_hash TEXT NOT NULL,
                spec TEXT NOT NULL,
                published_at DOUBLE PRECISION NOT NULL,
                actor TEXT NOT NULL,
                PRIMARY KEY (kind, name, version)
            )""",
            """CREATE TABLE registry_aliases (
                kind TEXT NOT NULL,
                name TEXT NOT NULL,
                targets TEXT NOT NULL,
                revision BIGINT NOT NULL,
                updated_at DOUBLE PRECISION NOT NULL,
                actor TEXT NOT NULL,
                PRIMARY KEY (kind, name)
            )""",
            """CREATE TABLE registry_alias_history (
                id {id_pk},
                kind TEXT NOT NULL,
                name TEXT NOT NULL,
                action TEXT NOT NULL,
                targets TEXT NOT NULL,
                previous TEXT,
                parent_id BIGINT,
                at DOUBLE PRECISION NOT NULL,
                actor TEXT NOT NULL
            )""",
            "CREATE INDEX registry_alias_history_by_alias ON registry_alias_history (kind, name, id)",
            """CREATE TABLE registry_generation (
                id INTEGER PRIMARY KEY CHECK (id = 1),
                value BIGINT NOT NULL
            )""",
            "INSERT INTO registry_generation (id, value) VALUES (1, 0)",
        ),
        # A published version and the alias history are evidence for audit records: the database refuses
        # to change them, not just the code.
        sqlite=tuple(
            f"""CREATE TRIGGER {table}_no_{op.lower()} BEFORE {op} ON {table}
                BEGIN SELECT RAISE(ABORT, '{table} is {what}'); END"""
            for table, what in (("registry_versions", "immutable"), ("registry_alias_history", "append-only"))
            for op in ("UPDATE", "DELETE")
        ),
        postgres=tuple(
            statement
            for table, what in (("registry_versions", "immutable"), ("registry_alias_history", "append-only"))
            for statement in (
                f"""CREATE FUNCTION {table}_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
                    BEGIN RAISE EXCEPTION '{table} is {what}'; END $$""",
                f"""CREATE TRIGGER {table}_refuse BEFORE UPDATE OR DELETE ON {table}
                    FOR EACH ROW EXECUTE FUNCTION {table}_refuse()""",
            )
        ),
    ),
    Migration(
        version=2,
        summary="registry_secret",
        shared=(
            """CREATE TABLE registry_secret (
                id INTEGER PRIMARY KEY CHECK (id = 1),
                value TEXT NOT NULL
            )""",
        ),
    ),
    Migration(
        version=3,
        summary="registry_figures",
        shared=(
            """CREATE TABLE registry_figures (
                kind TEXT NOT NULL,
                name TEXT NOT NULL,
                version TEXT NOT NULL,
                suite_sha256 TEXT NOT NULL,
                context TEXT NOT NULL,
                figures TEXT NOT NULL,
                error TEXT NOT NULL,
                baseline TEXT NOT NULL,
                forced BOOLEAN NOT NULL,
                at DOUBLE PRECISION NOT NULL,
                actor TEXT NOT NULL,
                PRIMARY KEY (kind, name, version, suite_sha256, context)
            )""",
        ),
        # Evidence of what a publish was measured at (and who forced it): refused to change, as versions are.
        sqlite=tuple(
            f"""CREATE TRIGGER registry_figures_no_{op.lower()} BEFORE {op} ON registry_figures
                BEGIN SELECT RAISE(ABORT, 'registry_figures is append-only'); END"""
            for op in ("UPDATE", "DELETE")
        ),
        postgres=(
            """CREATE FUNCTION registry_figures_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
                BEGIN RAISE EXCEPTION 'registry_figures is append-only'; END $$""",
            """CREATE TRIGGER registry_figures_refuse BEFORE UPDATE OR DELETE ON registry_figures
                FOR EACH ROW EXECUTE FUNCTION registry_figures_refuse()""",
        ),
    ),
)


def pending(applied: set[int]) -> list[Migration]:
    """The migrations not yet applied, in version order."""
    return db.pending(MIGRATIONS, applied)

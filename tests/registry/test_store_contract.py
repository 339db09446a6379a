"""The `RegistryStore` contract, run on SQLite (a file) and on a real PostgreSQL schema."""

from __future__ import annotations

import asyncio
import sqlite3
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest

from registry import (
    Alias,
    AliasTarget,
    ConflictError,
    FiguresRecord,
    InvalidError,
    Kind,
    NotFoundError,
    RegistryStore,
    canonical_json,
    content_hash,
)
from tests.registry import specs
from tests.registry.conftest import Backend
from tests.registry.specs import TOK_A, TOK_B, store_publish


async def test_publish_get_versions(store: RegistryStore) -> None:
    assert await store.generation() == 0
    first = await store.publish("tokenizer", "tok", "1", TOK_A, content_hash(TOK_A), actor="alice", now=10.5)
    assert (first.kind, first.ref, first.content_hash, first.spec_json) == (
        "tokenizer",
        "tok@1",
        content_hash(TOK_A),
        TOK_A,
    )
    assert (first.published_at, first.actor) == (10.5, "alice")
    assert await store.get("tokenizer", "tok", "1") == first
    await store_publish(store, "2", TOK_B, now=11.0)
    # Same name under another kind is another namespace.
    await store.publish("chat_template", "tok", "1", TOK_B, content_hash(TOK_B), actor="a", now=12.0)
    assert [p.version for p in await store.versions("tokenizer", "tok")] == ["1", "2"]
    assert await store.versions("tokenizer", "nothing") == []
    assert first.spec() == specs.tokenizer("a")
    with pytest.raises(NotFoundError, match="tok@3"):
        await store.get("tokenizer", "tok", "3")
    with pytest.raises(NotFoundError):
        await store.get("model", "tok", "1")


async def test_publish_is_idempotent_and_immutable(store: RegistryStore, backend: Backend) -> None:
    first = await store.publish("tokenizer", "tok", "1", TOK_A, content_hash(TOK_A), actor="alice", now=1.0)
    again = await store.publish("tokenizer", "tok", "1", TOK_A, content_hash(TOK_A), actor="bob", now=2.0)
    assert again == first  # the original time and actor stay
    assert await store.generation() == 1
    with pytest.raises(ConflictError, match=r"tokenizer tok@1 is already published") as caught:
        await store_publish(store, "1", TOK_B, now=3.0)
    assert content_hash(TOK_A) in str(caught.value)
    assert await store.get("tokenizer", "tok", "1") == first
    assert await store.generation() == 1
    # The database itself refuses to change a published version.
    for sql in (
        "UPDATE {schema}.registry_versions SET actor = 'x'",
        "DELETE FROM {schema}.registry_versions",
    ):
        with pytest.raises((sqlite3.DatabaseError, asyncpg.PostgresError), match="immutable"):
            await backend.raw(sql)


async def test_concurrent_identical_publishes_agree(store: RegistryStore) -> None:
    results = await asyncio.gather(*(store_publish(store, "1", now=float(t)) for t in range(10)))
    assert results == [None] * 10
    assert await store.generation() == 1
    assert len(await store.versions("tokenizer", "tok")) == 1


async def _alias(store: RegistryStore, name: str) -> Alias | None:
    """The tokenizer alias `name` as the store lists it (None: there is none)."""
    found = [a for a in await store.aliases("tokenizer") if a.name == name]
    return found[0] if found else None


async def test_aliases_history_and_rollback(store: RegistryStore, backend: Backend) -> None:
    for v in ("1", "2", "3"):
        await store_publish(store, v, canonical_json(specs.tokenizer(v)))
    a = await store.set_alias("tokenizer", "tok", specs.one("1"), actor="alice", now=10.0)
    assert (a.targets, a.updated_at, a.actor) == (tuple(specs.one("1")), 10.0, "alice")
    assert await _alias(store, "tok") == a
    canary = [AliasTarget(version="2", weight=0.75), AliasTarget(version="3", weight=0.25)]
    b = await store.set_alias("tokenizer", "tok", canary, actor="bob", now=11.0)
    c = await store.set_alias("tokenizer", "tok", specs.one("3"), actor="carol", now=12.0)
    assert a.revision < b.revision < c.revision
    # Setting the same targets again changes and records nothing.
    assert (
        await store.set_alias("tokenizer", "tok", [AliasTarget(version="3", weight=1)], actor="x", now=13)
        == c
    )

    history = await store.alias_history("tokenizer", "tok")
    assert [(h.action, h.actor, h.targets) for h in history] == [
        ("set", "carol", tuple(specs.one("3"))),
        ("set", "bob", tuple(canary)),
        ("set", "alice", tuple(specs.one("1"))),
    ]
    assert history[0].previous == tuple(canary)
    assert history[-1].previous is None
    assert [h.change_id for h in await store.alias_history("tokenizer", "tok", limit=1)] == [c.revision]

    # One call undoes the last change; repeated calls walk further back, not back and forth.
    back1 = await store.rollback("tokenizer", "tok", actor="ops", now=20.0)
    assert back1.targets == tuple(canary)
    assert (back1.actor, back1.updated_at) == ("ops", 20.0)
    assert await _alias(store, "tok") == back1
    back2 = await store.rollback("tokenizer", "tok", actor="ops", now=21.0)
    assert back2.targets == tuple(specs.one("1"))
    with pytest.raises(InvalidError, match="no earlier targets"):
        await store.rollback("tokenizer", "tok", actor="ops", now=22.0)
    latest = await store.alias_history("tokenizer", "tok", limit=2)
    assert [(h.action, h.targets, h.previous) for h in latest] == [
        ("rollback", tuple(specs.one("1")), tuple(canary)),
        ("rollback", tuple(canary), tuple(specs.one("3"))),
    ]
    # A new set after rollbacks can itself be rolled back.
    await store.set_alias("tokenizer", "tok", specs.one("2"), actor="x", now=23.0)
    assert (await store.rollback("tokenizer", "tok", actor="x", now=24.0)).targets == tuple(specs.one("1"))

    with pytest.raises(NotFoundError):
        await store.rollback("tokenizer", "nope", actor="x", now=1.0)
    assert await _alias(store, "nope") is None
    for sql in ("UPDATE {schema}.registry_alias_history SET actor = 'x'",):
        with pytest.raises((sqlite3.DatabaseError, asyncpg.PostgresError), match="append-only"):
            await backend.raw(sql)


async def test_alias_to_missing_version_changes_nothing(store: RegistryStore) -> None:
    await store_publish(store, "1")
    await store.set_alias("tokenizer", "tok", specs.one("1"), actor="a", now=1.0)
    generation = await store.generation()
    targets = [AliasTarget(version="1", weight=0.5), AliasTarget(version="9", weight=0.5)]
    with pytest.raises(NotFoundError, match=r"tokenizer:tok -> tok@9"):
        await store.set_alias("tokenizer", "tok", targets, actor="a", now=2.0)
    with pytest.raises(NotFoundError):
        await store.set_alias("tokenizer", "other", specs.one("9"), actor="a", now=2.0)
    kept = await _alias(store, "tok")
    assert kept is not None
    assert kept.targets == tuple(specs.one("1"))
    assert len(await store.alias_history("tokenizer", "tok")) == 1
    assert await store.generation() == generation


async def test_aliases_listing(store: RegistryStore) -> None:
    await store_publish(store, "1")
    await store.publish("chat_template", "b", "1", TOK_B, content_hash(TOK_B), actor="a", now=1.0)
    await store.publish("chat_template", "a", "1", TOK_B, content_hash(TOK_B), actor="a", now=1.0)
    pairs: list[tuple[Kind, str]] = [("tokenizer", "tok"), ("chat_template", "b"), ("chat_template", "a")]
    for kind, name in pairs:
        await store.set_alias(kind, name, specs.one("1"), actor="a", now=1.0)
    assert [(a.kind, a.name) for a in await store.aliases()] == [
        ("chat_template", "a"),
        ("chat_template", "b"),
        ("tokenizer", "tok"),
    ]
    assert [a.name for a in await store.aliases("chat_template")] == ["a", "b"]
    assert await store.aliases("policy") == []


async def test_generation_bumps_on_every_change_and_not_on_reads(store: RegistryStore) -> None:
    await store_publish(store, "1")
    await store_publish(store, "2", TOK_B)
    assert await store.generation() == 2
    await store.set_alias("tokenizer", "tok", specs.one("1"), actor="a", now=1.0)
    assert await store.generation() == 3
    await store.set_alias("tokenizer", "tok", specs.one("2"), actor="a", now=1.0)
    await store.rollback("tokenizer", "tok", actor="a", now=1.0)
    assert await store.generation() == 5
    # Reads, no-op writes and failed writes leave it alone.
    await store.get("tokenizer", "tok", "1")
    await store.versions("tokenizer", "tok")
    await store.aliases()
    await store.alias_history("tokenizer", "tok")
    await store.snapshot()
    await store_publish(store, "1")
    await store.set_alias("tokenizer", "tok", specs.one("1"), actor="a", now=1.0)
    with pytest.raises(ConflictError):
        await store_publish(store, "1", TOK_B)
    with pytest.raises(InvalidError):
        await store.rollback("tokenizer", "tok", actor="a", now=1.0)
    assert await store.generation() == 5


async def test_snapshot_is_one_consistent_read(backend: Backend) -> None:
    writer = await backend.open()
    reader = await backend.open()
    await store_publish(writer, "0")
    await writer.set_alias("tokenizer", "tok", specs.one("0"), actor="a", now=0.0)
    snap = await reader.snapshot()
    assert snap.generation == 2
    assert [p.ref for p in snap.versions] == ["tok@0"]
    assert [(a.name, a.targets) for a in snap.aliases] == [("tok", tuple(specs.one("0")))]

    async def write(i: int) -> None:
        # Each step publishes a version and points the alias at it: two generations per step.
        await store_publish(writer, str(i), canonical_json(specs.tokenizer(str(i))))
        await writer.set_alias("tokenizer", "tok", specs.one(str(i)), actor="a", now=float(i))

    async def writes() -> None:
        for i in range(1, 31):
            await write(i)

    async def reads() -> list[tuple[int, int, str]]:
        seen = []
        for _ in range(60):
            s = await reader.snapshot()
            seen.append((s.generation, len(s.versions), s.aliases[0].targets[0].version))
        return seen

    _, seen = await asyncio.gather(writes(), reads())
    # Reads taken deterministically between the two changes of each step, so that both kinds of snapshot
    # are checked whatever the scheduling of the concurrent reads above was.
    for i in range(31, 36):
        await store_publish(writer, str(i), canonical_json(specs.tokenizer(str(i))))
        s = await reader.snapshot()
        seen.append((s.generation, len(s.versions), s.aliases[0].targets[0].version))
        await writer.set_alias("tokenizer", "tok", specs.one(str(i)), actor="a", now=float(i))
        s = await reader.snapshot()
        seen.append((s.generation, len(s.versions), s.aliases[0].targets[0].version))
    # Whatever the interleaving, a snapshot holds exactly the changes up to its generation.
    # Step i makes generation 2i+1 (i+1 versions, alias still at i-1), then 2i+2 (alias at i).
    for generation, count, alias_version in seen:
        if generation % 2 == 0:
            assert (generation, alias_version) == (2 * count, str(count - 1))
        else:
            assert (generation, alias_version) == (2 * count - 1, str(count - 2))
    assert {g % 2 for g, _, _ in seen} == {0, 1}


async def test_figures_are_kept_per_version_suite_and_context(store: RegistryStore, backend: Backend) -> None:
    def record(version: str, suite: str = "s1", context: str = "", **kw: object) -> FiguresRecord:
        fields: dict[str, Any] = {"figures": '{"recall":0.5}', "at": 1.0, "actor": "ops", **kw}
        return FiguresRecord(
            kind="policy", name="p", version=version, suite_sha256=suite, context=context, **fields
        )

    generation = await store.generation()
    await store.record_figures(record("1"))
    await store.record_figures(record("2", forced=True, baseline="p@1", figures="", error="no guard", at=2.0))
    await store.record_figures(record("2", suite="s2", at=3.0))
    await store.record_figures(record("2", context="other@1", at=4.0))
    # The first record of a key stays; figures change nothing a request resolves.
    await store.record_figures(record("1", figures='{"recall":0.9}', at=5.0))
    assert await store.generation() == generation
    kept = await store.figures("policy", "p")
    assert [(r.version, r.suite_sha256, r.context, r.figures) for r in kept] == [
        ("1", "s1", "", '{"recall":0.5}'),
        ("2", "s1", "", ""),
        ("2", "s2", "", '{"recall":0.5}'),
        ("2", "s1", "other@1", '{"recall":0.5}'),
    ]
    assert (kept[1].forced, kept[1].baseline, kept[1].error) == (True, "p@1", "no guard")
    assert kept[0].forced is False
    assert await store.figures("policy") == kept
    assert await store.figures("policy", "q") == [] == await store.figures("guard_model")
    # Evidence of what a publish was measured at: the database itself refuses to change it.
    for statement in (
        "UPDATE {schema}.registry_figures SET forced = TRUE",
        "DELETE FROM {schema}.registry_figures",
    ):
        with pytest.raises((sqlite3.DatabaseError, asyncpg.PostgresError), match="append-only"):
            await backend.raw(statement)

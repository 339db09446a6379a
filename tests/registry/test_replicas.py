"""Two gateway replicas (two `Registry` instances, each with its own store) on one database."""

from __future__ import annotations

from registry import Registry
from tests.backends import FakeClock
from tests.registry import specs
from tests.registry.conftest import Backend


async def test_a_change_on_one_replica_is_seen_by_the_other_after_refresh(backend: Backend) -> None:
    clock = FakeClock()
    a = await Registry.load(await backend.open(), clock)
    b = await Registry.load(await backend.open(), clock)
    await specs.seed(a, "1", "2")
    assert not b.view.has("model", "chat", "1")
    assert await b.refresh() is True
    assert b.view.generation == a.view.generation
    assert b.resolve_model("chat", "r").ref == "chat@1"

    # A rollout on replica a: b serves the old version until its next refresh...
    before = b.view
    await a.set_alias("model", "chat", "2", actor="ops")
    assert a.resolve_model("chat", "r").ref == "chat@2"  # the writer reads its own write at once
    assert b.resolve_model("chat", "r").ref == "chat@1"
    assert await b.refresh() is True
    after = b.resolve_model("chat", "r")
    assert (after.ref, after.tokenizer.ref, after.chat_template.ref) == ("chat@2", "tok@2", "tpl@2")
    # ...and a request that took its view before the change resolves the old versions, all of them.
    old = before.resolve_model("chat", "r")
    assert (old.ref, old.tokenizer.ref, old.chat_template.ref) == ("chat@1", "tok@1", "tpl@1")
    assert old.generation < after.generation

    # Rolled back from the other replica, in one call.
    await b.rollback("model", "chat", actor="ops")
    assert await a.refresh() is True
    assert a.resolve_model("chat", "r").ref == "chat@1"
    assert await a.refresh() is False
    assert a.view.generation == b.view.generation


async def test_replicas_validate_against_the_store_not_a_stale_view(backend: Backend) -> None:
    clock = FakeClock()
    a = await Registry.load(await backend.open(), clock)
    b = await Registry.load(await backend.open(), clock)
    await specs.seed(a, "1", alias=None)
    # b has not refreshed, yet it can alias a version published through a.
    alias = await b.set_alias("model", "chat", "1", actor="ops")
    assert alias.targets[0].version == "1"
    assert b.resolve_model("chat", "r").ref == "chat@1"

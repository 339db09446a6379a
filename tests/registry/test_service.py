"""`Registry` and `RegistryView`: resolution, pinning, canaries, rollback, views, the refresher."""

from __future__ import annotations

import asyncio
import logging

import pytest

import registry as registry_pkg
from registry import (
    AliasTarget,
    InvalidError,
    NotFoundError,
    PolicySpec,
    Registry,
    RegistryStore,
    RegistryView,
    UnavailableError,
    canary_pick,
)
from registry.hashing import unit_interval
from tests.backends import FakeClock
from tests.registry import specs


async def test_resolve_model_by_alias_and_pin(registry: Registry, clock: FakeClock) -> None:
    await specs.seed(registry, "1", "2")
    resolved = registry.resolve_model("chat", key="r1")
    assert (resolved.ref, resolved.tokenizer.ref, resolved.chat_template.ref) == ("chat@1", "tok@1", "tpl@1")
    assert resolved.spec == specs.model("w1", tok="tok@1", tpl="tpl@1")
    assert resolved.template.text == "template 1"
    assert resolved.model.published_at == clock.now
    assert resolved.kv_bytes_per_token == 131072
    assert resolved.generation == registry.view.generation
    # A pinned name@version bypasses the alias.
    pinned = registry.resolve_model("chat@2", key="r1")
    assert (pinned.ref, pinned.tokenizer.ref, pinned.chat_template.ref) == ("chat@2", "tok@2", "tpl@2")
    with pytest.raises(NotFoundError, match="chat@7"):
        registry.resolve_model("chat@7", key="r1")
    with pytest.raises(NotFoundError, match="alias 'other'"):
        registry.resolve_model("other", key="r1")
    with pytest.raises(InvalidError):
        registry.resolve_model("chat@", key="r1")
    assert registry.view.kv_bytes_per_token("chat@2") == 131072


async def test_canary_is_deterministic_and_splits_by_weight(registry: Registry) -> None:
    await specs.seed(registry, "1", "2")
    await registry.set_alias("model", "chat", specs.canary("1", "2", 0.1), actor="ops")
    view = registry.view
    first = {f"req-{i}": view.resolve_model("chat", f"req-{i}").ref for i in range(10_000)}
    # Same request id, same version: on this view, on a later view, on another registry's view.
    for rid in list(first)[:200]:
        assert view.resolve_model("chat", rid).ref == first[rid]
    await registry.publish("tokenizer", "tok", "x", specs.tokenizer("x"), actor="t")
    assert registry.view is not view
    assert all(registry.view.resolve_model("chat", rid).ref == ref for rid, ref in list(first.items())[:200])
    other = await Registry.load(registry.store, FakeClock())
    assert all(other.view.resolve_model("chat", rid).ref == ref for rid, ref in list(first.items())[:200])
    share = sum(ref == "chat@2" for ref in first.values()) / len(first)
    assert abs(share - 0.1) < 0.02, share


def test_canary_pick() -> None:
    targets = specs.canary("a", "b", 0.3)
    assert canary_pick("r", targets) == canary_pick("r", targets)
    assert canary_pick("r", [AliasTarget(version="only", weight=1.0)]) == "only"
    # Raising the canary's weight only moves requests onto it, never off it.
    ids = [f"id{i}" for i in range(2000)]
    before = {i for i in ids if canary_pick(i, specs.canary("a", "b", 0.1)) == "b"}
    after = {i for i in ids if canary_pick(i, specs.canary("a", "b", 0.5)) == "b"}
    assert before < after
    # The salt decorrelates aliases: the canary of one is not the canary of another.
    salted = {i for i in ids if canary_pick(i, specs.canary("a", "b", 0.1), salt="model:x") == "b"}
    assert salted != before
    assert all(0.0 <= unit_interval(i) < 1.0 for i in ids)
    with pytest.raises(ValueError, match="target"):
        canary_pick("r", [])


async def test_rollback_in_one_call(registry: Registry) -> None:
    await specs.seed(registry, "1", "2")
    await registry.set_alias("model", "chat", "2", actor="ops")
    assert registry.resolve_model("chat", "r").ref == "chat@2"
    generation = registry.view.generation
    alias = await registry.rollback("model", "chat", actor="ops")
    assert alias.targets == (AliasTarget(version="1", weight=1.0),)
    assert registry.resolve_model("chat", "r").ref == "chat@1"
    assert registry.view.generation == generation + 1
    with pytest.raises(InvalidError, match="no earlier targets"):
        await registry.rollback("model", "chat", actor="ops")
    with pytest.raises(NotFoundError):
        await registry.rollback("model", "nothing", actor="ops")


async def test_resolve_policy_with_its_guards(registry: Registry) -> None:
    await specs.seed(registry, "1", "2")
    await registry.publish("guard_model", "guard", "1", specs.guard("chat@2"), actor="t")
    await registry.publish("policy", "strict", "1", specs.policy(), actor="t")
    await registry.publish("policy", "strict", "2", specs.policy(block_above=0.5), actor="t")
    await registry.set_alias("policy", "strict", "1", actor="t")
    view = registry.view
    resolved = view.resolve_policy("strict", "r")
    assert (resolved.ref, resolved.spec, resolved.generation) == ("strict@1", specs.policy(), view.generation)
    assert resolved.policy.spec_as(PolicySpec) == specs.policy()
    [g] = resolved.guards
    assert g.model is not None
    assert (g.ref, g.model.ref, g.model.tokenizer.ref, g.spec.unsafe_tokens) == (
        "guard@1",
        "chat@2",
        "tok@2",
        ("unsafe", " unsafe"),
    )
    # A tenant bound to a pinned version keeps it whatever the alias says.
    assert registry.resolve_policy("strict@2", "r").spec.stages[0].block_above == 0.5
    with pytest.raises(InvalidError, match="is not a ModelSpec"):
        resolved.policy.spec_as(registry_pkg.ModelSpec)


async def test_view_is_immutable_and_a_request_never_mixes_versions(registry: Registry) -> None:
    await specs.seed(registry, "1", "2")
    before = registry.view
    await registry.set_alias("model", "chat", "2", actor="ops")
    after = registry.view
    assert before.resolve_model("chat", "r").ref == "chat@1"
    assert before.resolve_model("chat", "r").tokenizer.ref == "tok@1"
    assert after.resolve_model("chat", "r").tokenizer.ref == "tok@2"
    assert after.generation == before.generation + 1
    with pytest.raises(AttributeError, match="immutable"):
        before.generation = 5
    assert [a.name for a in after.aliases("model")] == ["chat"]
    assert [p.version for p in after.versions("model", "chat")] == ["1", "2"]
    assert RegistryView.empty().generation == -1


async def test_refresh_reloads_only_on_a_new_generation(registry: Registry) -> None:
    assert await registry.refresh() is False
    await registry.store.publish(
        "tokenizer", "t", "1", '{"content_hash":"' + "a" * 64 + '"}', "h", actor="x", now=1
    )
    assert not registry.view.has("tokenizer", "t", "1")
    assert await registry.refresh() is True
    assert registry.view.has("tokenizer", "t", "1")


class StepSleep:
    """A `sleep` for the refresher that returns only when the test calls `step()`."""

    def __init__(self) -> None:
        self.calls: list[float] = []
        self._release = asyncio.Queue[None]()
        self._called = asyncio.Event()

    async def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)
        self._called.set()
        await self._release.get()

    async def asleep(self) -> None:
        """Wait until the refresher is in a sleep."""
        await asyncio.wait_for(self._called.wait(), timeout=10)

    async def step(self) -> None:
        """Let one sleep end, and wait until the refresher is asleep again (its refresh done)."""
        self._called.clear()
        self._release.put_nowait(None)
        await self.asleep()


class FlakyStore:
    """A store whose generation() fails while `down` is set."""

    def __init__(self, inner: RegistryStore) -> None:
        self.inner = inner
        self.down = False

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    async def generation(self) -> int:
        if self.down:
            raise UnavailableError("database down")
        return await self.inner.generation()


async def test_refresher_polls_on_its_interval_and_survives_failures(
    registry: Registry, caplog: pytest.LogCaptureFixture
) -> None:
    flaky = FlakyStore(registry.store)
    sleep = StepSleep()
    replica = Registry(flaky, FakeClock(), refresh_interval=0.25, sleep=sleep)  # type: ignore[arg-type]
    task = asyncio.create_task(replica.run_refresher())
    try:
        await sleep.asleep()
        await sleep.step()
        assert replica.view.generation == 0
        await specs.seed(registry, "1")
        assert not replica.view.has("model", "chat", "1")  # not before the next tick
        flaky.down = True
        with caplog.at_level(logging.WARNING, logger="lockgate.registry"):
            await sleep.step()
        assert "database down" in caplog.text
        assert replica.view.generation == 0  # the last view stays in use
        flaky.down = False
        await sleep.step()
        assert replica.resolve_model("chat", "r").ref == "chat@1"
        assert set(sleep.calls) == {0.25}
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    with pytest.raises(ValueError, match="refresh_interval"):
        Registry(registry.store, FakeClock(), refresh_interval=0)


def test_public_names() -> None:
    assert set(registry_pkg.__all__) == {
        *("Registry", "RegistryView", "ResolvedModel", "ResolvedGuard", "ResolvedPolicy", "RegistryStore"),
        "RegistryHealth",
        *("SqliteRegistryStore", "PostgresRegistryStore", "MIGRATIONS", "REGISTRY_STORE"),
        *("RegistryError", "NotFoundError", "ConflictError", "InvalidError", "UnavailableError"),
        *("Kind", "KINDS", "Severity", "Spec", "SPEC_TYPES", "ModelArch", "ModelSpec", "TokenizerSpec"),
        *("ChatTemplateSpec", "GuardModelSpec", "PolicySpec", "PolicyCategory", "CascadeStage"),
        *("RulePattern", "RulesSpec", "PromptSpec", "StageCombination"),
        *("Published", "Alias", "AliasTarget", "AliasChange", "RegistrySnapshot", "parse_ref", "decode_spec"),
        "FiguresRecord",
        *("canonical_json", "content_hash", "spec_hash", "canary_pick", "check_tokenizer"),
        *("register_default_model", "check_model_dir", "arch_from_config"),
        *("Manifest", "ManifestResult", "parse_manifest", "load_manifest", "apply_manifest"),
        "apply_manifest_file",
    }
    assert all(hasattr(registry_pkg, name) for name in registry_pkg.__all__)

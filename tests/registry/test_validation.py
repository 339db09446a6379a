"""The registry's rules: bad aliases, canary weights, references, guards, policies, tokenizers."""

from __future__ import annotations

import msgspec
import pytest

from policy.safety.defaults import rules_policy
from registry import (
    AliasTarget,
    CascadeStage,
    ConflictError,
    GuardModelSpec,
    InvalidError,
    Kind,
    NotFoundError,
    PolicySpec,
    Registry,
    Spec,
    StageCombination,
    check_tokenizer,
    parse_ref,
)
from registry.hashing import canonical_json, spec_hash
from tests.registry import specs
from tests.registry.specs import canary


async def test_alias_validation(registry: Registry) -> None:
    await specs.seed(registry, "1", "2", "3")
    generation = registry.view.generation
    bad: list[tuple[str | list[AliasTarget], type[Exception], str]] = [
        ("9", NotFoundError, r"alias model:chat -> chat@9: no such model version"),
        (canary("1", "9", 0.5), NotFoundError, "chat@9"),
        (
            [AliasTarget(version="1", weight=0.5), AliasTarget(version="2", weight=0.4)],
            InvalidError,
            r"weights 0.5 \+ 0.4 sum to 0.9, not 1",
        ),
        (
            [AliasTarget(version=v, weight=1 / 3) for v in ("1", "2", "3")],
            InvalidError,
            "3 targets; an alias has 1 target, or 2 for a canary",
        ),
        ([], InvalidError, "0 targets"),
        (
            [AliasTarget(version="1", weight=0.0), AliasTarget(version="2", weight=1.0)],
            InvalidError,
            r"\(0, 1\]",
        ),
        ([AliasTarget(version="1", weight=float("nan"))], InvalidError, "nan"),
        ([AliasTarget(version="1", weight=0.5), AliasTarget(version="1", weight=0.5)], InvalidError, "twice"),
    ]
    for targets, error, message in bad:
        with pytest.raises(error, match=message):
            await registry.set_alias("model", "chat", targets, actor="ops")
    with pytest.raises(InvalidError, match="never contain '@'"):
        await registry.set_alias("model", "chat@1", "1", actor="ops")
    # 0.9 + 0.1 is not exactly 1.0 in floating point: accepted within the tolerance.
    await registry.set_alias("model", "chat", canary("1", "2", 0.1), actor="ops")
    assert registry.view.generation == generation + 1


async def test_publish_validation(registry: Registry) -> None:
    await specs.seed(registry, "1")
    cases: list[tuple[Kind, Spec, type[Exception], str]] = [
        ("model", specs.model(tok="tok@9"), NotFoundError, "model chat@5 requires tokenizer tok@9"),
        ("model", specs.model(tpl="tpl@9"), NotFoundError, "requires chat_template tpl@9"),
        ("model", specs.model(tok="tok"), InvalidError, "tokenizer reference 'tok' is not a reference"),
        ("guard_model", specs.guard("chat@9"), NotFoundError, "guard_model chat@5 requires model chat@9"),
        ("guard_model", specs.guard(safe=()), InvalidError, "safe_tokens is empty"),
        ("guard_model", specs.guard(safe=("safe", "unsafe")), InvalidError, r"\['unsafe'\] are both"),
        ("policy", specs.policy("guard@9"), NotFoundError, r"stages\[0\] requires guard_model guard@9"),
        ("tokenizer", specs.template(), InvalidError, "needs a TokenizerSpec, got ChatTemplateSpec"),
        (
            "tokenizer",
            msgspec.structs.replace(specs.tokenizer(), content_hash="xyz"),
            InvalidError,
            r"\$.content_hash",
        ),
    ]
    for kind, spec, error, message in cases:
        with pytest.raises(error, match=message):
            await registry.publish(kind, "chat", "5", spec, actor="t")
    await registry.publish("guard_model", "guard", "1", specs.guard(), actor="t")
    arch = msgspec.structs.replace(specs.LLAMA3_8B, kv_heads=0)
    with pytest.raises(InvalidError, match=r"model chat@5: .*\$.arch.kv_heads"):
        await registry.publish("model", "chat", "5", specs.model(arch=arch), actor="t")
    policies: list[tuple[PolicySpec, str]] = [
        (specs.policy(allow_below=0.9, block_above=0.1), "allow_below <= block_above"),
        (specs.policy(block_above=1.5), r"<= 1.0 - at `\$.stages\[0\].block_above`"),
        (msgspec.structs.replace(specs.policy(), fail_modes={"spam": "open"}), r"no fail mode.*violence"),
        (
            msgspec.structs.replace(
                specs.policy(), fail_modes={"spam": "open", "violence": "open", "x": "open"}
            ),
            r"unknown categories \['x'\]",
        ),
        (msgspec.structs.replace(specs.policy(), hold_back_tokens=-1), "hold_back_tokens"),
    ]
    for policy_spec, message in policies:
        with pytest.raises(InvalidError, match=message):
            await registry.publish("policy", "strict", "1", policy_spec, actor="t")
    with pytest.raises(InvalidError, match="version"):
        await registry.publish("tokenizer", "tok", "1@2", specs.tokenizer(), actor="t")
    with pytest.raises(ConflictError, match="tokenizer tok@1 is already published"):
        await registry.publish("tokenizer", "tok", "1", specs.tokenizer("changed"), actor="t")
    assert not registry.view.has("policy", "strict", "1")


async def test_publish_normalizes_numbers(registry: Registry) -> None:
    await specs.seed(registry, "1")
    await registry.publish("guard_model", "guard", "1", specs.guard(), actor="t")
    first = await registry.publish("policy", "p", "1", specs.policy(allow_below=0, block_above=1), actor="t")
    again = await registry.publish(
        "policy", "p", "1", specs.policy(allow_below=0.0, block_above=1.0), actor="t"
    )
    assert again == first
    assert '"allow_below":0.0' in first.spec_json


def test_parse_ref_and_check_tokenizer() -> None:
    assert parse_ref("meta-llama/Llama-3-8B@2024.1") == ("meta-llama/Llama-3-8B", "2024.1")
    for bad in ("chat", "chat@", "@1", "a@b@c", "a b@1"):
        with pytest.raises(InvalidError):
            parse_ref(bad)
    model = specs.model(tok="tok@1")
    tok = specs.tokenizer("tok1")
    check_tokenizer("chat@1", model, supplied="tok@1", tokenizer=tok, file_sha256=specs.sha("tok1"))
    with pytest.raises(InvalidError, match="tokenizer tok@2 does not match model chat@1, which requires tok"):
        check_tokenizer("chat@1", model, supplied="tok@2")
    with pytest.raises(
        InvalidError, match=r"tokenizer.json \(sha256 [0-9a-f]{64}\) does not match tokenizer tok@1"
    ):
        check_tokenizer("chat@1", model, tokenizer=tok, file_sha256=specs.sha("other"))


async def test_an_ngram_guard_is_published_with_its_pinned_head(registry: Registry) -> None:
    ngram = GuardModelSpec(kind="ngram", artifact="guards/ngram-guard", weights_sha256="ab" * 32)
    for spec, message in (
        (msgspec.structs.replace(ngram, artifact=""), "an ngram guard needs its artifact directory"),
        (msgspec.structs.replace(ngram, weights_sha256=""), "weights_sha256 must be the sha256"),
        (msgspec.structs.replace(ngram, weights_sha256="AB" * 32), "weights_sha256 must be the sha256"),
    ):
        with pytest.raises(InvalidError, match=message):
            await registry.publish("guard_model", "ngram-guard", "1", spec, actor="t")
    published = await registry.publish("guard_model", "ngram-guard", "1", ngram, actor="t")
    # No model version to resolve: it carries its own head.
    resolved = registry.view.resolve_guard(published.ref, key="")
    assert resolved.model is None
    assert resolved.spec == ngram


def _with_output(allow: float | None, block: float | None) -> PolicySpec:
    """specs.policy() whose stage has the given output thresholds (None: unset)."""
    spec = specs.policy()
    fields = {
        name: value
        for name, value in (("output_allow_below", allow), ("output_block_above", block))
        if value is not None
    }
    return msgspec.structs.replace(spec, stages=(msgspec.structs.replace(spec.stages[0], **fields),))


async def test_output_thresholds_are_both_or_neither_ordered_and_named_when_wrong(registry: Registry) -> None:
    await specs.seed(registry, "1")
    await registry.publish("guard_model", "guard", "1", specs.guard(), actor="t")
    cases: list[tuple[PolicySpec, str]] = [
        (_with_output(0.3, None), r"stages\[0\]\.output_block_above is missing"),
        (_with_output(None, 0.9), r"stages\[0\]\.output_allow_below is missing"),
        (_with_output(0.9, 0.3), r"stages\[0\]\.output_allow_below must not exceed output_block_above"),
        # msgspec checks the bounds on decode and names the field.
        (_with_output(0.3, 1.5), r"<= 1.0 - at `\$.stages\[0\].output_block_above`"),
        (_with_output(-0.1, 0.5), r">= 0.0 - at `\$.stages\[0\].output_allow_below`"),
    ]
    for policy_spec, message in cases:
        with pytest.raises(InvalidError, match=message):
            await registry.publish("policy", "strict", "1", policy_spec, actor="t")
    published = await registry.publish("policy", "strict", "1", _with_output(0.1, 0.95), actor="t")
    assert '"output_allow_below":0.1,"output_block_above":0.95' in published.spec_json


def test_a_policy_without_output_thresholds_keeps_its_published_hash() -> None:
    # The hash of the built-in rules policy as published before stages had output thresholds.
    spec = rules_policy()
    assert "output_" not in canonical_json(spec)
    assert spec_hash(spec) == "375119dd22580b6912d8cb8f43d42bbadcaaf55aa11da232ae326f54ea48dc98"
    assert spec.stages[0].thresholds("output") == spec.stages[0].thresholds("input") == (0.25, 0.75)


def _combining(*extra: CascadeStage) -> PolicySpec:
    """specs.policy() with a rules stage after its model stage, then `extra`."""
    spec = specs.policy()
    rules = CascadeStage(kind="rules", allow_below=0.25, block_above=0.75)
    return msgspec.structs.replace(spec, stages=(*spec.stages, rules, *extra))


async def test_a_combine_stage_reads_earlier_stages_with_one_weight_each(registry: Registry) -> None:
    await specs.seed(registry, "1")
    await registry.publish("guard_model", "guard", "1", specs.guard(), actor="t")

    def combine(reads: tuple[int, ...], weights: tuple[float, ...], **kw: object) -> CascadeStage:
        fields: dict[str, object] = {"kind": "combine", "allow_below": 0.5, "block_above": 0.5}
        fields["combine"] = StageCombination(reads=reads, weights=weights, bias=-1.0)
        return CascadeStage(**(fields | kw))  # type: ignore[arg-type]

    cases: list[tuple[PolicySpec, str]] = [
        (_combining(combine((0, 2), (1.0, 1.0))), r"stages\[2\]: combine.reads must name earlier stages"),
        (_combining(combine((0, 0), (1.0, 1.0))), r"must name earlier stages, each once"),
        (_combining(combine((), ())), r"must name earlier stages"),
        (_combining(combine((0, 1), (1.0,))), r"one weight per stage read \(2\), got 1"),
        # JSON has no infinity: the spec's JSON holds null there, which msgspec refuses, naming the field.
        (_combining(combine((0,), (float("inf"),))), r"\$.stages\[2\].combine.weights\[0\]"),
        (_combining(combine((0,), (1.0,), guard="guard@1")), r"a combine stage names no guard"),
        (_combining(CascadeStage(kind="combine", allow_below=0.5, block_above=0.5)), "needs `combine`"),
        (
            _combining(
                CascadeStage(
                    guard="guard@1", allow_below=0.5, block_above=0.5, combine=combine((0,), (1.0,)).combine
                )
            ),
            r"stages\[2\]: only a combine stage has `combine`",
        ),
    ]
    for policy_spec, message in cases:
        with pytest.raises(InvalidError, match=message):
            await registry.publish("policy", "mixed", "1", policy_spec, actor="t")
    published = await registry.publish(
        "policy", "mixed", "1", _combining(combine((0, 1), (0.8, 0.3))), actor="t"
    )
    assert '"combine":{"reads":[0,1],"weights":[0.8,0.3],"bias":-1.0}' in published.spec_json
    # A stage without `combine` keeps its canonical JSON (and so every policy published before, its hash).
    assert "combine" not in canonical_json(specs.policy())

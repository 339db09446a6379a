"""Loading a TOML manifest at start-up: idempotent, validated, and refusing changed content."""

from __future__ import annotations

from pathlib import Path

import pytest

from registry import (
    AliasTarget,
    ConflictError,
    InvalidError,
    NotFoundError,
    Registry,
    apply_manifest,
    apply_manifest_file,
    parse_manifest,
)
from tests.registry.specs import sha

MANIFEST = f"""
[[tokenizer]]
name = "llama3"
version = "1"
content_hash = "{sha("llama3 tokenizer.json")}"

[[chat_template]]
name = "llama3"
version = "1"
text = "{{% for m in messages %}}{{{{ m.content }}}}{{% endfor %}}"

[[model]]
name = "llama3-8b"
version = "1"
artifact = "llama3-8b/model.safetensors"
weights_sha256 = "{sha("weights 1")}"
tokenizer = "llama3@1"
chat_template = "llama3@1"
engine_pool = "gpu-a"
arch = {{ layers = 32, kv_heads = 8, head_dim = 128, kv_dtype_bytes = 2, max_context = 8192 }}

[[model]]
name = "llama3-8b"
version = "2"
artifact = "llama3-8b-v2/model.safetensors"
weights_sha256 = "{sha("weights 2")}"
tokenizer = "llama3@1"
chat_template = "llama3@1"
arch = {{ layers = 32, kv_heads = 8, head_dim = 128, kv_dtype_bytes = 2, max_context = 8192 }}

[[guard_model]]
name = "guard"
version = "1"
model = "llama3-8b@1"
prompt_template = "Is this unsafe? Answer Yes or No. {{{{ content }}}}"
safe_tokens = ["No", " No", "no"]
unsafe_tokens = ["Yes", " Yes", "yes"]

[[policy]]
name = "default"
version = "1"
past_last_stage = "escalate"
hold_back_tokens = 32
retention = "hash"
fail_modes = {{ violence = "closed", spam = "open" }}
categories = [{{ name = "violence", severity = "high" }}, {{ name = "spam", severity = "low" }}]
stages = [{{ guard = "guard@1", allow_below = 0, block_above = 0.9 }}]

[[alias]]
kind = "model"
name = "llama3-8b"
targets = [{{ version = "1", weight = 0.9 }}, {{ version = "2", weight = 0.1 }}]

[[alias]]
kind = "policy"
name = "default"
version = "1"
"""


async def test_apply_is_idempotent(registry: Registry, tmp_path: Path) -> None:
    path = tmp_path / "registry.toml"
    path.write_text(MANIFEST)
    first = await apply_manifest_file(registry, path, actor="manifest")
    assert first.published == (
        "tokenizer llama3@1",
        "chat_template llama3@1",
        "model llama3-8b@1",
        "model llama3-8b@2",
        "guard_model guard@1",
        "policy default@1",
    )
    assert (first.unchanged, first.aliases_set) == ((), ("model:llama3-8b", "policy:default"))
    view = registry.view
    assert view.alias("model", "llama3-8b").targets == (
        AliasTarget(version="1", weight=0.9),
        AliasTarget(version="2", weight=0.1),
    )
    model = view.resolve_model("llama3-8b@1", "r")
    assert (model.spec.engine_pool, model.kv_bytes_per_token * 8192) == ("gpu-a", 2**30)
    assert model.template.text == "{% for m in messages %}{{ m.content }}{% endfor %}"
    policy = view.resolve_policy("default", "r")
    assert policy.guards[0].spec.safe_tokens == ("No", " No", "no")
    assert policy.spec.stages[0].allow_below == 0.0

    second = await apply_manifest(registry, parse_manifest(MANIFEST), actor="manifest")
    assert (second.published, second.aliases_set) == ((), ())
    assert second.unchanged == first.published
    assert registry.view.generation == view.generation


async def test_changed_content_for_an_existing_version_is_a_conflict(registry: Registry) -> None:
    await apply_manifest(registry, parse_manifest(MANIFEST), actor="manifest")
    changed = MANIFEST.replace('engine_pool = "gpu-a"', 'engine_pool = "gpu-b"')
    with pytest.raises(ConflictError, match="model llama3-8b@1 is already published"):
        await apply_manifest(registry, parse_manifest(changed), actor="manifest")
    assert registry.resolve_model("llama3-8b@1", "r").spec.engine_pool == "gpu-a"


async def test_bad_manifests_are_named(registry: Registry) -> None:
    with pytest.raises(
        InvalidError, match=r"ops.toml: Object contains unknown field `colour` - at `\$.model\[0\]`"
    ):
        parse_manifest(MANIFEST.replace('engine_pool = "gpu-a"', 'colour = "red"'), source="ops.toml")
    with pytest.raises(InvalidError, match=r"manifest: .*\$.tokenizer\[0\].content_hash"):
        parse_manifest('[[tokenizer]]\nname = "t"\nversion = "1"\ncontent_hash = "nope"\n')
    with pytest.raises(InvalidError, match="manifest"):
        parse_manifest("[[tokenizer]\n")
    both = (
        MANIFEST + '\n[[alias]]\nkind = "model"\nname = "x"\nversion = "1"\ntargets = [{ version = "1" }]\n'
    )
    with pytest.raises(InvalidError, match="alias model:x: give either version or targets"):
        await apply_manifest(registry, parse_manifest(both), actor="manifest")
    dangling = '[[alias]]\nkind = "policy"\nname = "strict"\nversion = "3"\n'
    with pytest.raises(NotFoundError, match="strict@3"):
        await apply_manifest(registry, parse_manifest(dangling), actor="manifest")
    uneven = MANIFEST.replace("weight = 0.1", "weight = 0.2")
    with pytest.raises(InvalidError, match="sum to"):
        await apply_manifest(registry, parse_manifest(uneven), actor="manifest")

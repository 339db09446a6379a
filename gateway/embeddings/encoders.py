"""`Embedders`: the encoder of each embedding model version, loaded once per process.

An encoder loads on the first request that needs it, in the executor the guards' encoders use (tokenising,
the forward pass and hashing the weights never run on the event loop). Requests for a version being loaded
wait for the same load, shielded: a client that leaves does not cancel it for the others. A failed load is
forgotten, so the next request tries again; it is refused 503 `embedding_model_unavailable` (the spec names
files or weights this process does not have).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from pathlib import Path

from gateway.errors import EngineUnavailableError
from guard.base import GuardError
from guard.embedding import MAX_TOKENS, Encoder
from registry.view import ResolvedEmbeddingModel


class Embedders:
    """Loaded encoders by embedding model version (`name@version`), for the life of the app."""

    def __init__(self, artifacts: Path, executor: Executor) -> None:
        """Artifacts are relative to `artifacts` (the model data directory); encoders run in `executor`."""
        self._artifacts = artifacts
        self._executor = executor
        # One load per version. Looked up and set with no await in between: on one event loop that is the
        # lock, so concurrent first requests share one load.
        self._loads: dict[str, asyncio.Task[Encoder]] = {}

    async def get(self, model: ResolvedEmbeddingModel) -> Encoder:
        """The encoder of `model`, loaded on first use; 503 when it cannot be loaded."""
        task = self._loads.get(model.ref)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._load(model))
            self._loads[model.ref] = task
        try:
            return await asyncio.shield(task)
        except (GuardError, OSError) as exc:
            if self._loads.get(model.ref) is task:
                del self._loads[model.ref]
            raise EngineUnavailableError(
                f"embedding model {model.ref} cannot be loaded: {exc}", code="embedding_model_unavailable"
            ) from exc

    async def _load(self, model: ResolvedEmbeddingModel) -> Encoder:
        spec = model.spec
        if spec.max_input_tokens > MAX_TOKENS:
            # `Encoder.embed` reads the first MAX_TOKENS tokens: a longer input would be cut, silently.
            raise GuardError(f"max_input_tokens {spec.max_input_tokens} is over the encoder's {MAX_TOKENS}")
        path = None
        if spec.artifact:
            artifact = Path(spec.artifact)
            path = artifact if artifact.is_absolute() else self._artifacts / artifact
        encoder = await Encoder.load(path, self._executor)
        if encoder.weights_sha256 != spec.weights_sha256:
            raise GuardError(
                f"its weights have sha256 {encoder.weights_sha256}, the spec names {spec.weights_sha256}"
            )
        if encoder.dim != spec.dimensions:
            raise GuardError(f"its vectors have {encoder.dim} dimensions, the spec names {spec.dimensions}")
        return encoder

    def close(self) -> None:
        """Stop loads still running (shutdown)."""
        for task in self._loads.values():
            task.cancel()

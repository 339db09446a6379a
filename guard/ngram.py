"""The n-gram stage: a logistic model over hashed character n-grams scores text in any language.

A text is NFKC-normalised, lower-cased, its whitespace collapsed to single spaces, and padded with a space
on each side; its features are the set of crc32(n-gram) modulo 2**18 for every character n-gram of 1 to 5
characters, each weighted 1/sqrt(number of features). Characters, not words: the same features exist in
Arabic, Hindi, Japanese or Chinese as in English, with no tokenizer. crc32, not `hash()`: a feature id
must be the same in every process and on every machine, or a trained head means nothing.

P(unsafe) = sigmoid(sum of the features' weights * 1/sqrt(n) + bias), in numpy (torch only trains it:
`ops.guard_training.ngram`). A text longer than WINDOW_CHARS is scored window by window (windows overlapping
by WINDOW_OVERLAP characters) and its most unsafe window decides, so a harmful sentence in a long benign
document is read as it would be alone. Featurising runs in the executor passed in, never in the event loop. A
text of more than MAX_WINDOWS windows is a GuardInputError (the item's failure, never counted on the guard's
breaker): cancelling a classify does not stop work already in the executor, so it is bounded.

A guard's artifact directory holds `ngram.npz` (weights and bias) and `ngram.json` (metadata); the head is
refused unless `ngram.npz` has the sha256 the registry names.
"""

from __future__ import annotations

import asyncio
import time
import unicodedata
import zlib
from collections.abc import Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from guard.base import GuardError, GuardInput, GuardInputError, GuardScore
from guard.pinned import load_arrays, save_arrays
from guard.windows import window_starts
from registry.models import GuardModelSpec

__all__ = [
    "DIM",
    "MAX_WINDOWS",
    "NGRAM_SIZES",
    "WINDOW_CHARS",
    "WINDOW_OVERLAP",
    "NgramClassifier",
    "NgramHead",
    "features",
    "load_ngram_guard",
    "normalize",
]

DIM_BITS = 18
DIM = 1 << DIM_BITS  # feature ids are crc32 & (DIM - 1)
NGRAM_SIZES = (1, 2, 3, 4, 5)
WINDOW_CHARS = 1_000  # of normalised text; the labelled items are shorter, so training saw whole windows
WINDOW_OVERLAP = 200  # a phrase of up to 201 characters lies whole in some window
# Windows one classify may take (~200k characters, a few seconds of one executor thread): past it the
# guard fails (GuardInputError) rather than hold the executor.
MAX_WINDOWS = 256
BATCH_WINDOWS = 16  # windows one call is expected to take in well under its stage's timeout
HEAD_WEIGHTS = "ngram.npz"
HEAD_META = "ngram.json"
METHOD = "char-ngram-logistic"


def normalize(text: str) -> str:
    """NFKC, lower-cased, whitespace runs collapsed to one space (no padding)."""
    return " ".join(unicodedata.normalize("NFKC", text).lower().split())


def features(normalized: str) -> NDArray[np.int64]:
    """The sorted feature ids of an already normalised text (padded here with a space on each side)."""
    padded = f" {normalized} "
    ids: set[int] = set()
    for n in NGRAM_SIZES:
        for i in range(len(padded) - n + 1):
            ids.add(zlib.crc32(padded[i : i + n].encode()) & (DIM - 1))
    return np.array(sorted(ids), dtype=np.int64)


def windows(normalized: str) -> list[str]:
    """The overlapping windows of a normalised text that the guard scores (one for a short text)."""
    return [
        normalized[s : s + WINDOW_CHARS] for s in window_starts(len(normalized), WINDOW_CHARS, WINDOW_OVERLAP)
    ]


class NgramHead:
    """Weights of the DIM feature ids (float32) and a bias: P(unsafe) of a text's features."""

    def __init__(
        self,
        weights: NDArray[np.floating[Any]],
        bias: float,
        *,
        training_data_sha256: str = "",
        created: float = 0.0,
    ) -> None:
        array = np.asarray(weights, dtype=np.float32)
        if array.shape != (DIM,):
            raise ValueError(f"expected {DIM} weights, got shape {array.shape}")
        self.weights = array
        self.bias = float(bias)
        self.training_data_sha256 = training_data_sha256
        self.created = created

    def score(self, ids: NDArray[np.int64]) -> float:
        """P(unsafe) of a text with feature ids `ids` (0.5 at no feature, which no normalised text has)."""
        if ids.size == 0:
            return _sigmoid(self.bias)
        z = float(self.weights[ids].sum(dtype=np.float64)) / float(np.sqrt(ids.size)) + self.bias
        return _sigmoid(z)

    def score_text(self, text: str) -> list[float]:
        """P(unsafe) of each window of `text` (blocking: call it in an executor for a long text)."""
        return [self.score(features(w)) for w in windows(normalize(text))]

    def save(self, directory: Path) -> str:
        """Write `ngram.npz` and `ngram.json` into `directory`; the sha256 of `ngram.npz` (the registry pins
        it). Equal weights give an equal file and an equal hash."""
        arrays = {"weights": self.weights, "bias": np.array([self.bias], dtype=np.float32)}
        meta = {
            "method": METHOD,
            "dim": DIM,
            "ngram_sizes": list(NGRAM_SIZES),
            "training_data_sha256": self.training_data_sha256,
            "created": self.created,
        }
        return save_arrays(directory, HEAD_WEIGHTS, HEAD_META, arrays, meta)

    @classmethod
    def load(cls, directory: Path, expected_sha256: str) -> NgramHead:
        """The head saved in `directory`; GuardError unless its weights file has sha256 `expected_sha256` and
        it was featurised as this module featurises (a head of other n-grams would read meaningless ids)."""
        arrays, meta = load_arrays(directory, HEAD_WEIGHTS, HEAD_META, ("weights", "bias"), expected_sha256)
        if meta.get("dim") != DIM or meta.get("ngram_sizes") != list(NGRAM_SIZES):
            raise GuardError(
                f"{directory}: head of dim {meta.get('dim')} and n-grams {meta.get('ngram_sizes')}, this "
                f"guard featurises dim {DIM} and n-grams {list(NGRAM_SIZES)}"
            )
        if arrays["weights"].shape != (DIM,) or arrays["bias"].shape != (1,):
            raise GuardError(f"malformed head weights in {directory}: shapes do not match dim {DIM}")
        return cls(
            arrays["weights"],
            float(arrays["bias"][0]),
            training_data_sha256=str(meta.get("training_data_sha256", "")),
            created=float(meta.get("created", 0.0)),
        )


def _sigmoid(z: float) -> float:
    """1 / (1 + e^-z) without overflow for large |z|."""
    return float(np.exp(-np.logaddexp(0.0, -z)))


class NgramClassifier:
    """An n-gram guard as a Classifier: P(unsafe) of the most unsafe window of the judged readings.

    Inputs are judged on their untrusted spans (the tenant's trusted system prompt is not the caller's
    text), joined and the longest alone (`GuardInput.readings`); outputs on the output text.
    """

    def __init__(self, name: str, spec: GuardModelSpec, head: NgramHead, executor: Executor) -> None:
        self.name = name
        self.spec = spec
        self._head = head
        self._executor = executor

    def oversized(self, item: GuardInput) -> bool:
        """Whether the judged text is more than BATCH_WINDOWS windows: the item's size may be what takes the
        time (an estimate, for the breaker)."""
        text = item.text(untrusted_only=item.direction == "input")
        return len(text) > WINDOW_CHARS + (BATCH_WINDOWS - 1) * (WINDOW_CHARS - WINDOW_OVERLAP)

    def _scores(self, readings: Sequence[str]) -> list[float]:
        normalized = [normalize(r) for r in readings]
        parts = [windows(n) for n in normalized]
        count = sum(len(p) for p in parts)
        if count > MAX_WINDOWS:
            raise GuardInputError(
                f"{self.name}: text too long ({count} windows of {WINDOW_CHARS} characters, at most "
                f"{MAX_WINDOWS})"
            )
        return [self._head.score(features(w)) for part in parts for w in part]

    async def classify(self, item: GuardInput) -> GuardScore:
        """Score `item`; GuardError if it yields no finite score, GuardInputError if it is too long."""
        start = time.perf_counter()
        readings = item.readings()
        if not readings[0].strip():
            # Nothing the caller wrote to judge (an input of trusted spans only).
            p_unsafe, count = 0.0, 0
        else:
            loop = asyncio.get_running_loop()
            scores = await loop.run_in_executor(self._executor, self._scores, readings)
            if not scores or not all(np.isfinite(scores)):
                raise GuardError(f"{self.name}: no finite score")
            p_unsafe, count = max(scores), len(scores)
        return GuardScore(
            p_unsafe=p_unsafe,
            guard=self.name,
            model=METHOD,
            latency_s=time.perf_counter() - start,
            raw={"windows": count},
        )


async def load_ngram_guard(
    name: str, spec: GuardModelSpec, base_dir: Path, executor: Executor
) -> NgramClassifier:
    """The n-gram guard `spec` describes, its artifact resolved against `base_dir` when relative.

    GuardError when the spec is not an n-gram guard, the head's sha256 is not `spec.weights_sha256`, or the
    head was trained on another data set than the spec names.
    """
    if spec.kind != "ngram" or not spec.artifact:
        raise GuardError(f"{name} is not an ngram guard with an artifact")
    artifact = Path(spec.artifact)
    directory = artifact if artifact.is_absolute() else base_dir / artifact
    loop = asyncio.get_running_loop()
    head = await loop.run_in_executor(executor, NgramHead.load, directory, spec.weights_sha256)
    if spec.training_data_sha256 and head.training_data_sha256 != spec.training_data_sha256:
        raise GuardError(
            f"{name}: head trained on data {head.training_data_sha256 or '(unnamed)'}, "
            f"spec names {spec.training_data_sha256}"
        )
    return NgramClassifier(name, spec, head, executor)

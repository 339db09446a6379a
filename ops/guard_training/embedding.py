"""Train an embedding guard: the packaged MiniLM encoder embeds the training items, a logistic head is fit.

The encoder and the head are guard/embedding.py's, so the head reads exactly the embeddings it will read in
service (the labelled texts are short: one window each). The head is written to the artifact directory as
`head.npz` and `head.json`, and `guard.json` there records the data's sha256, the split, the ids trained on,
the held-out figures and the elapsed time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import numpy as np

from guard.base import GuardError
from guard.embedding import HEAD_WEIGHTS, MODEL_NAME, Encoder, LogisticHead
from ops.guard_training.data import (
    Metrics,
    TrainError,
    TrainingSet,
    describe,
    label_of,
    sample,
    score_metrics,
)

METHOD = "minilm-logistic"
GUARD_JSON = "guard.json"
BATCH = 32  # items embedded between progress lines

Say = Callable[[str], None]


class EmbeddingSettings(msgspec.Struct, frozen=True, kw_only=True):
    """How the embedding head is fit: on at most `train_items` of the training split, measured on at most
    `test_items` of the test split (`data.sample`; 0: all), so that encoding them fits `models prepare`'s
    budget on 2 cores (MiniLM encodes about 40 items/s there)."""

    l2: float = 0.1
    train_items: int = 2_500
    test_items: int = 1_000


class EmbeddingReport(msgspec.Struct, frozen=True, kw_only=True):
    """What was fit and how well it does on held-out items: `guard.json` of the artifact directory."""

    method: str
    encoder: str
    encoder_sha256: str
    training_data_sha256: str
    data_file: str
    split: str
    train_ids: tuple[str, ...]
    test_items: int
    settings: EmbeddingSettings
    metrics: Metrics
    test_scores: dict[str, float]  # P(unsafe) of each held-out item by id, for threshold and cascade studies
    weights_file: str
    weights_sha256: str
    elapsed_s: float


def _embed(encoder: Encoder, texts: Sequence[str], say: Say, total: int, done: int) -> np.ndarray:
    rows = []
    for lo in range(0, len(texts), BATCH):
        rows.append(encoder.embed_sync(texts[lo : lo + BATCH]))
        say(f"embedding {done + min(lo + BATCH, len(texts))}/{total} items")
    return np.concatenate(rows)


def train_embedding(
    data: TrainingSet, out_dir: Path, settings: EmbeddingSettings | None = None, say: Say = print
) -> EmbeddingReport:
    """Fit a logistic head on MiniLM embeddings of `data.train` (at most `settings.train_items` of them,
    measured on at most `settings.test_items` of the test split); write it to `out_dir` (which must not
    exist).

    Blocking and synchronous: it loads the encoder in its own event loop and thread, so call it from a
    worker thread when an event loop is running.
    """
    settings = settings or EmbeddingSettings()
    data = sample(data, settings.train_items, settings.test_items)
    started = time.perf_counter()
    if out_dir.exists():
        raise TrainError(f"{out_dir} already exists")
    with ThreadPoolExecutor(max_workers=1) as executor:
        try:
            encoder = asyncio.run(Encoder.load(None, executor))
        except GuardError as exc:
            raise TrainError(f"no encoder for the embedding guard: {exc}") from exc
        total = len(data.train) + len(data.test)
        train_x = _embed(encoder, [i.text for i in data.train], say, total, 0)
        test_x = _embed(encoder, [i.text for i in data.test], say, total, len(data.train))
    head = LogisticHead.fit(
        train_x,
        [label_of(i) for i in data.train],
        l2=settings.l2,
        training_data_sha256=data.sha256,
        encoder_sha256=encoder.weights_sha256,
    )
    scores = [float(p) for p in head.predict_proba(test_x)]
    metrics = score_metrics(scores, data.test)
    say(f"embedding guard: {describe(metrics)}")
    weights_sha256 = head.save(out_dir)
    report = EmbeddingReport(
        method=METHOD,
        encoder=MODEL_NAME,
        encoder_sha256=encoder.weights_sha256,
        training_data_sha256=data.sha256,
        data_file=Path(data.path).name,
        split=data.split,
        train_ids=tuple(i.id for i in data.train),
        test_items=len(data.test),
        settings=settings,
        metrics=metrics,
        test_scores={i.id: round(p, 6) for i, p in zip(data.test, scores, strict=True)},
        weights_file=HEAD_WEIGHTS,
        weights_sha256=weights_sha256,
        elapsed_s=round(time.perf_counter() - started, 1),
    )
    (out_dir / GUARD_JSON).write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    return report

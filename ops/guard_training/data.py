"""The labelled set a guard is trained on: its items split into train and test, its hash, and the metrics.

Items are read with `guard.labelled.load_items` (the format of ops/eval/data/*.jsonl). The training split
and the held-out split never mix: the training code only ever sees `TrainingSet.train`, and every figure
it reports is computed on `TrainingSet.test`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import msgspec

from guard.labelled import LabelledItem, load_items
from ops.eval.evaluation import auroc, dataset_sha256

# P(unsafe) at or above this flags an item unsafe when F1, precision and recall are counted.
THRESHOLD = 0.5


class TrainError(Exception):
    """A guard cannot be trained from this data or this base model; the message says why."""


class TrainingSet(msgspec.Struct, frozen=True, kw_only=True):
    """A labelled file cut into the items trained on and the items held out for measuring."""

    path: str
    sha256: str  # of the file's bytes: what a trained guard names as its training data
    split: str  # the split trained on
    train: tuple[LabelledItem, ...]
    test: tuple[LabelledItem, ...]  # every item of another split


class Metrics(msgspec.Struct, frozen=True, kw_only=True):
    """How well P(unsafe) scores separate held-out items (unsafe is the positive class)."""

    n: int
    auroc: float | None  # None without both labels
    f1: float | None  # at THRESHOLD; None when there is nothing to count
    precision: float | None
    recall: float | None
    threshold: float = THRESHOLD


def load_training_set(path: Path, split: str = "train") -> TrainingSet:
    """The items of `path` in `split` to train on, the others to test on; ValueError if either is empty."""
    items = load_items(path)
    train = tuple(i for i in items if i.split == split)
    test = tuple(i for i in items if i.split != split)
    if not train:
        raise ValueError(f"{path} has no items in split {split!r}")
    if {i.label for i in train} != {"safe", "unsafe"}:
        raise ValueError(f"{path}: split {split!r} needs both safe and unsafe items to train on")
    if not test:
        raise ValueError(f"{path} has no items outside split {split!r} to measure the guard on")
    return TrainingSet(path=str(path), sha256=dataset_sha256(path), split=split, train=train, test=test)


def sample(data: TrainingSet, train: int, test: int, test_split: str = "test") -> TrainingSet:
    """At most `train` of the items to train on and `test` held-out items of `test_split` (0: all of them),
    chosen by the sha256 of their ids: the same items of the same data on every machine, spread over
    languages, hazards and labels as the whole is (no item's choice depends on its label or text)."""

    def first(items: Sequence[LabelledItem], n: int) -> tuple[LabelledItem, ...]:
        ranked = sorted(items, key=lambda i: hashlib.sha256(i.id.encode()).digest())
        return tuple(ranked[:n] if n else ranked)

    held_out = [i for i in data.test if i.split == test_split]
    return msgspec.structs.replace(data, train=first(data.train, train), test=first(held_out, test))


def label_of(item: LabelledItem) -> int:
    """1 for unsafe, 0 for safe."""
    return 1 if item.label == "unsafe" else 0


def _ratio(num: int, den: int) -> float | None:
    return num / den if den else None


def score_metrics(scores: Sequence[float], items: Sequence[LabelledItem]) -> Metrics:
    """AUROC of `scores` (P(unsafe), one per item) and F1/precision/recall at THRESHOLD."""
    if len(scores) != len(items):
        raise ValueError(f"{len(scores)} scores for {len(items)} items")
    truth = [label_of(i) == 1 for i in items]
    flagged = [s >= THRESHOLD for s in scores]
    tp = sum(1 for f, t in zip(flagged, truth, strict=True) if f and t)
    fp = sum(1 for f, t in zip(flagged, truth, strict=True) if f and not t)
    fn = sum(1 for f, t in zip(flagged, truth, strict=True) if not f and t)
    return Metrics(
        n=len(items),
        auroc=auroc(zip(scores, truth, strict=True)),
        f1=_ratio(2 * tp, 2 * tp + fp + fn),
        precision=_ratio(tp, tp + fp),
        recall=_ratio(tp, tp + fn),
    )


def describe(metrics: Metrics) -> str:
    """`AUROC 0.91, F1 0.83 on 110 held-out items` (n/a where a figure is undefined)."""

    def fmt(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.3f}"

    return f"AUROC {fmt(metrics.auroc)}, F1 {fmt(metrics.f1)} on {metrics.n} held-out items"

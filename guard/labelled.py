"""Labelled items (the format of the evaluation, training and red-team sets), how to read them, how a guard
sees one, and the metrics of a cascade's final decisions on them: what serving needs of evaluation (the
publish-time red-team check, `gateway/publish_check.py`, and the figures a guard version is published with,
`guard.figures`). The offline evaluation (stored scores, threshold replay, reports) is `ops.eval.evaluation`.

How a final decision is counted against the label (unsafe is the positive class):

    block, escalate       flagged unsafe (an escalation is allowed but sent to review: the guard flagged it)
    allow                 safe
    error                 neither: counted in `errors`, left out of precision/recall/F1/FPR/FNR and of
                          calibration, and reported beside them. An error is never read as "safe": what it
                          means is the policy's fail mode, not the guard's answer.
    needs rerun           likewise left out, and counted in `needs_rerun`

A rate whose denominator is zero (recall of a group without unsafe items) is None, not 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal, TypeVar

import msgspec

from guard.base import GuardInput, Span
from guard.cascade import CascadeResult
from guard.dataset import HAZARD_CATEGORY, family_splits, load_data_dir

T = TypeVar("T")

Label = Literal["safe", "unsafe"]

# The development set's categories, then those of the hazard taxonomy of the guard data set
# (`guard.dataset.HAZARD_CATEGORY`).
Category = Literal[
    "violence", "self_harm", "weapons", "malware", "prompt_injection", "hate", "benign",
    "violent_crimes", "nonviolent_crimes", "sex_crimes", "child_exploitation", "defamation",
    "specialized_advice", "privacy", "intellectual_property", "indiscriminate_weapons", "sexual_content",
    "elections", "code_interpreter_abuse", "jailbreak",
]  # fmt: skip

Language = Literal["en", "de", "fr", "es", "it", "pt", "ar", "hi", "ja", "ru", "zh"]

Severity = Literal["none", "low", "medium", "high", "critical"]

Split = Literal["train", "calibration", "test"]


class LabelledItem(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One line of a labelled set.

    `category` is the topic the text touches: a benign look-alike ("how do I kill a stuck process") carries
    the category it resembles with label `safe`; `benign` is for text that resembles no harm category.
    """

    id: str
    text: str
    label: Label
    category: Category
    language: Language
    severity: Severity
    split: Split
    # Where the item comes from a guard data directory (`guard.dataset`): whether it is model input or
    # output, what kind of text it is, and the scenario it renders ("" in a single labelled file).
    shape: Literal["prompt", "output"] = "prompt"
    kind: str = ""
    family: str = ""


class Metrics(msgspec.Struct, frozen=True, kw_only=True):
    """Confusion counts of final decisions against labels (unsafe is positive) and the rates from them."""

    n: int  # every item of the group, errors and needs-rerun included
    tp: int
    fp: int
    tn: int
    fn: int
    errors: int
    needs_rerun: int
    precision: float | None
    recall: float | None
    f1: float | None
    fpr: float | None
    fnr: float | None


_ITEM_DECODER = msgspec.json.Decoder(LabelledItem)


def read_jsonl(path: Path, decoder: msgspec.json.Decoder[T]) -> list[T]:
    """The lines of a JSONL file decoded by `decoder`, blank lines skipped; ValueError naming the line."""
    out: list[T] = []
    for lineno, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append(decoder.decode(line))
        except (
            msgspec.DecodeError
        ) as exc:  # ValidationError included: name the line as msgspec names the field
            raise ValueError(f"{path}:{lineno}: {exc}") from exc
    return out


def load_items(path: str | Path) -> list[LabelledItem]:
    """The labelled items of a JSONL file, or of a guard data directory (`guard.dataset`, splits by family);
    ValueError naming an invalid line or a repeated id."""
    if Path(path).is_dir():
        return _from_data_dir(Path(path))
    items = read_jsonl(Path(path), _ITEM_DECODER)
    seen: set[str] = set()
    for item in items:
        if item.id in seen:
            raise ValueError(f"{path}: item id {item.id!r} appears twice")
        seen.add(item.id)
    return items


def _from_data_dir(directory: Path) -> list[LabelledItem]:
    data = load_data_dir(directory)
    splits = family_splits(data)
    return [
        msgspec.convert(
            {
                "id": d.id,
                "text": d.text,
                "label": d.label,
                "category": HAZARD_CATEGORY[d.hazard],
                "language": d.language,
                "severity": d.severity,
                "split": splits[d.family],
                "shape": d.shape,
                "kind": d.kind,
                "family": d.family,
            },
            LabelledItem,
        )
        for d in data
    ]


def guard_input(item: LabelledItem, categories: Sequence[str] = ()) -> GuardInput:
    """The item as a guard sees it: a prompt as one untrusted user span of an input, an output as the
    generated text of an output."""
    if item.shape == "output":
        return GuardInput(
            direction="output", spans=(Span(text=item.text, source="output"),), categories=tuple(categories)
        )
    return GuardInput(
        direction="input",
        spans=(Span(text=item.text, source="user", trusted=False),),
        categories=tuple(categories),
    )


def _flagged(result: CascadeResult) -> bool:
    """Block and escalate flag an item unsafe; allow clears it. (Errors are counted apart, never here.)"""
    return result.verdict in ("block", "escalate")


def _ratio(num: int, den: int) -> float | None:
    return num / den if den else None


def metrics(pairs: Iterable[tuple[Label, CascadeResult | None]]) -> Metrics:
    """Confusion counts and rates of (label, final result) pairs; None results count as needs-rerun."""
    n = tp = fp = tn = fn = errors = needs_rerun = 0
    for label, result in pairs:
        n += 1
        if result is None:
            needs_rerun += 1
        elif result.verdict == "error":
            errors += 1
        elif _flagged(result):
            tp, fp = (tp + 1, fp) if label == "unsafe" else (tp, fp + 1)
        else:
            fn, tn = (fn + 1, tn) if label == "unsafe" else (fn, tn + 1)
    precision, recall = _ratio(tp, tp + fp), _ratio(tp, tp + fn)
    f1 = _ratio(2 * tp, 2 * tp + fp + fn)  # = 2PR/(P+R), defined whenever either is
    return Metrics(
        n=n,
        tp=tp,
        fp=fp,
        tn=tn,
        fn=fn,
        errors=errors,
        needs_rerun=needs_rerun,
        precision=precision,
        recall=recall,
        f1=f1,
        fpr=_ratio(fp, fp + tn),
        fnr=_ratio(fn, fn + tp),
    )

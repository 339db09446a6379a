"""Would one score from several stages beat the stages deciding one after another? A measurement.

Given every stage's stored score of every item (`python -m ops.eval score`, which runs every stage on every
item) of a fitting split and of a measuring split, `compare` fits a logistic regression over the chosen
stages' logits on the fitting split's prompts (each kind of item weighing alike: look-alikes, everyday
prompts and harmful requests count the same however many of each there are), then puts each stage alone and
the combination to one rule: block above the score that keeps look-alike prompts and everyday prompts of the
fitting split within the budget (`Budget.lookalike_fpr`, `Budget.everyday_prompts`), no band. It reports, on
the measuring split's prompts, the harmful requests blocked (in all and per language) and the look-alikes and
everyday prompts blocked. Nothing of the measuring split is fitted on. An item with a failed stage is left
out (a failure settles nothing, and a combination cannot read it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from guard.combination import logit, sigmoid
from guard.labelled import LabelledItem
from ops.eval.calibrate import Budget
from ops.eval.evaluation import ItemScores
from registry.models import CascadeStage, StageCombination

Floats = npt.NDArray[np.float64]


class Combination(msgspec.Struct, frozen=True, kw_only=True):
    """A logistic regression over some stages' logits, standardised by the fitting split's mean and scale."""

    stages: tuple[int, ...]
    mean: tuple[float, ...]
    scale: tuple[float, ...]
    coef: tuple[float, ...]  # per standardised logit
    bias: float

    def as_stage(self) -> StageCombination:
        """The combination as a policy's combine stage computes it: weights on the stages' raw logits, the
        standardisation folded into them and the bias."""
        weights = [c / s for c, s in zip(self.coef, self.scale, strict=True)]
        bias = self.bias - sum(w * m for w, m in zip(weights, self.mean, strict=True))
        return StageCombination(reads=self.stages, weights=tuple(weights), bias=bias)

    def score(self, logits: Floats) -> Floats:
        """The combined log-odds of rows of the stages' logits (in `stages` order)."""
        z = (logits - np.array(self.mean)) / np.array(self.scale)
        result: Floats = z @ np.array(self.coef) + self.bias
        return result


class Candidate(msgspec.Struct, frozen=True, kw_only=True):
    """One scorer put to the rule: its threshold (from the fitting split) and what it blocks when measured."""

    name: str
    threshold: float
    harmful_blocked: float
    lookalikes_blocked: float
    everyday_blocked: float
    by_language: dict[str, float]  # harmful requests blocked per language


class Comparison(msgspec.Struct, frozen=True, kw_only=True):
    combination: Combination
    fitted_on: int  # prompts of the fitting split
    measured_on: int  # prompts of the measuring split
    candidates: tuple[Candidate, ...]  # each stage alone, then the combination


def stage_logits(
    items: Sequence[LabelledItem], scores: Sequence[ItemScores], stages: Sequence[int]
) -> tuple[list[LabelledItem], Floats]:
    """The prompts with a score from every one of `stages`, and their logits (items x stages)."""
    by_id = {s.id: s for s in scores}
    kept: list[LabelledItem] = []
    rows: list[list[float]] = []
    for item in items:
        stored = by_id.get(item.id)
        if item.shape != "prompt" or stored is None:
            continue
        runs = {run.index: run.p_unsafe for run in stored.runs}
        chosen = [runs.get(stage) for stage in stages]
        if any(p is None for p in chosen):
            continue
        kept.append(item)
        rows.append([logit(p) for p in chosen if p is not None])
    return kept, np.array(rows, dtype=np.float64).reshape(len(rows), len(stages))


def kind_weights(items: Sequence[LabelledItem]) -> Floats:
    """Weights under which each kind of item (kind and label) weighs the same in all, mean 1."""
    keys = [(item.kind, item.label) for item in items]
    counts = Counter(keys)
    weights = np.array([1.0 / counts[key] for key in keys])
    result: Floats = weights * len(weights) / weights.sum()
    return result


def fit(
    logits: Floats, unsafe: npt.NDArray[np.bool_], weights: Floats, stages: Sequence[int], *, l2: float = 1.0
) -> Combination:
    """Weighted, L2-regularised logistic regression on standardised logits, by gradient descent."""
    mean = logits.mean(axis=0)
    scale = logits.std(axis=0) + 1e-9
    z = (logits - mean) / scale
    y = unsafe.astype(np.float64)
    coef = np.zeros(z.shape[1])
    bias = 0.0
    total = weights.sum()
    for _ in range(4000):
        p = 1.0 / (1.0 + np.exp(-(z @ coef + bias)))
        gradient = (p - y) * weights
        coef -= 0.2 * (z.T @ gradient / total + l2 * coef / len(y))
        bias -= 0.2 * float(gradient.sum() / total)
    return Combination(
        stages=tuple(stages),
        mean=tuple(float(v) for v in mean),
        scale=tuple(float(v) for v in scale),
        coef=tuple(float(v) for v in coef),
        bias=bias,
    )


def _masks(items: Sequence[LabelledItem]) -> tuple[npt.NDArray[np.bool_], ...]:
    harmful = np.array([i.label == "unsafe" for i in items], dtype=bool)
    lookalike = np.array([i.label == "safe" and i.kind == "lookalike" for i in items], dtype=bool)
    everyday = np.array([i.label == "safe" and i.kind == "everyday" for i in items], dtype=bool)
    return harmful, lookalike, everyday


def rule_threshold(score: Floats, items: Sequence[LabelledItem], budget: Budget) -> float:
    """The lowest score above which at most the budget's share of look-alike and of everyday prompts lie."""
    _, lookalike, everyday = _masks(items)
    bounds = [
        float(np.quantile(score[mask], 1.0 - share))
        for mask, share in ((lookalike, budget.lookalike_fpr), (everyday, budget.everyday_prompts))
        if mask.any()
    ]
    return max(bounds, default=float(score.max()))


def _share(blocked: npt.NDArray[np.bool_], mask: npt.NDArray[np.bool_]) -> float:
    return float(blocked[mask].mean()) if mask.any() else 0.0


def _candidate(
    name: str,
    fitting: tuple[Floats, Sequence[LabelledItem]],
    measured: tuple[Floats, Sequence[LabelledItem]],
    budget: Budget,
) -> Candidate:
    threshold = rule_threshold(*fitting, budget)
    score, items = measured
    blocked = score > threshold
    harmful, lookalike, everyday = _masks(items)
    languages = sorted({i.language for i in items})
    language = np.array([i.language for i in items])
    return Candidate(
        name=name,
        threshold=threshold,
        harmful_blocked=_share(blocked, harmful),
        lookalikes_blocked=_share(blocked, lookalike),
        everyday_blocked=_share(blocked, everyday),
        by_language={lang: _share(blocked, harmful & (language == lang)) for lang in languages},
    )


def compare(
    fit_items: Sequence[LabelledItem],
    fit_scores: Sequence[ItemScores],
    measure_items: Sequence[LabelledItem],
    measure_scores: Sequence[ItemScores],
    stages: Sequence[int],
    budget: Budget,
) -> Comparison:
    """Each of `stages` alone and their fitted combination, put to the rule on the fitting split and
    measured on the other (module docstring)."""
    if not stages:
        raise ValueError("name at least one stage")
    fitted, fit_logits = stage_logits(fit_items, fit_scores, stages)
    measured, measure_logits = stage_logits(measure_items, measure_scores, stages)
    if not fitted or not measured:
        raise ValueError("no prompt has a score from every named stage in one of the two sets")
    unsafe = np.array([i.label == "unsafe" for i in fitted], dtype=bool)
    combination = fit(fit_logits, unsafe, kind_weights(fitted), stages)
    candidates = [
        _candidate(f"stage {stage}", (fit_logits[:, k], fitted), (measure_logits[:, k], measured), budget)
        for k, stage in enumerate(stages)
    ]
    candidates.append(
        _candidate(
            "combined",
            (combination.score(fit_logits), fitted),
            (combination.score(measure_logits), measured),
            budget,
        )
    )
    return Comparison(
        combination=combination,
        fitted_on=len(fitted),
        measured_on=len(measured),
        candidates=tuple(candidates),
    )


def render(comparison: Comparison) -> str:
    """The comparison as a markdown table."""
    languages = sorted({lang for c in comparison.candidates for lang in c.by_language})
    lines = [
        f"Fitted on {comparison.fitted_on} prompts, measured on {comparison.measured_on}; combination of "
        f"stages {list(comparison.combination.stages)}: weights "
        f"{[round(c, 3) for c in comparison.combination.coef]} (standardised logits)",
        "",
        "| scorer | threshold (log-odds) | harmful blocked | look-alikes | everyday | "
        + " | ".join(languages)
        + " |",
        "|---" * (5 + len(languages)) + "|",
    ]
    for c in comparison.candidates:
        per = " | ".join(f"{c.by_language.get(lang, 0.0):.0%}" for lang in languages)
        lines.append(
            f"| {c.name} | {c.threshold:.3f} | {c.harmful_blocked:.1%} | {c.lookalikes_blocked:.1%} | "
            f"{c.everyday_blocked:.1%} | {per} |"
        )
    stage = combine_stage(comparison)
    lines += ["", "As a policy's stage (no band: it decides every item it reads):", "", _json(stage)]
    return "\n".join(lines) + "\n"


def combine_stage(comparison: Comparison) -> CascadeStage:
    """The combination as a policy's combine stage at the rule's threshold (the fitting split's), no band."""
    threshold = sigmoid(comparison.candidates[-1].threshold)
    return CascadeStage(
        kind="combine",
        allow_below=threshold,
        block_above=threshold,
        combine=comparison.combination.as_stage(),
    )


def _json(stage: CascadeStage) -> str:
    return msgspec.json.encode(stage).decode()

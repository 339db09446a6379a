"""The trained policy's combine stage, fitted when its guards are trained: one score from the n-gram and the
embedding guards.

Both guards, loaded from the directories just trained and run as the gateway runs them (their classifiers,
on the item as the gate builds it), score every prompt of the calibration split of the multilingual set.
`ops.eval.combine.compare` fits a logistic regression over their log-odds on those prompts (each kind of
prompt weighing alike: look-alikes, everyday prompts and harmful requests) and sets the stage's threshold
by its rule: the lowest score above which at most 5% of the look-alike prompts and 3% of the everyday
prompts lie (`ops.eval.calibrate.Budget`'s defaults), no band. Nothing of the test split is read. The
figures of each guard alone and of the combination at that rule, on the calibration prompts, go in the
manifest; README "Safety guard" has those on the test split.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec

from guard.base import Classifier
from guard.cascade import StageRun
from guard.combination import sigmoid
from guard.embedding import load_embedding_guard
from guard.labelled import LabelledItem, guard_input, load_items
from guard.ngram import load_ngram_guard
from ops.eval.calibrate import Budget
from ops.eval.combine import Candidate, compare
from ops.eval.evaluation import ItemScores
from registry.models import GuardModelSpec

# The stages the combination reads, as the trained policy orders them: rules (0), n-gram (1), embedding (2).
NGRAM_STAGE = 1
EMBEDDING_STAGE = 2


class PreparedCombination(msgspec.Struct, frozen=True, kw_only=True):
    """The combine stage's weights on the n-gram and embedding guards' log-odds, its bias, its threshold (a
    probability: block above, allow below), and the figures on the calibration prompts it was fitted on."""

    ngram_weight: float
    embedding_weight: float
    bias: float
    threshold: float
    fitted_on: int  # calibration prompts
    calibration: tuple[Candidate, ...]  # the n-gram guard alone, the embedding guard alone, the combination


def fit_combination(
    data_dir: Path, ngram: GuardModelSpec, embedding: GuardModelSpec, *, budget: Budget | None = None
) -> PreparedCombination:
    """Fit the combine stage on the calibration prompts of `data_dir`, scored by the guards `ngram` and
    `embedding` (their artifacts absolute paths)."""
    items = [i for i in load_items(data_dir) if i.split == "calibration" and i.shape == "prompt"]
    if not items:
        raise ValueError(f"{data_dir} has no calibration prompts to fit the combine stage on")
    scores = asyncio.run(_score(items, ngram, embedding))
    comparison = compare(items, scores, items, scores, (NGRAM_STAGE, EMBEDDING_STAGE), budget or Budget())
    stage = comparison.combination.as_stage()
    return PreparedCombination(
        ngram_weight=stage.weights[0],
        embedding_weight=stage.weights[1],
        bias=stage.bias,
        threshold=sigmoid(comparison.candidates[-1].threshold),
        fitted_on=comparison.fitted_on,
        calibration=comparison.candidates,
    )


async def _score(
    items: list[LabelledItem], ngram: GuardModelSpec, embedding: GuardModelSpec
) -> list[ItemScores]:
    with ThreadPoolExecutor(max_workers=1) as executor:
        guards: dict[int, Classifier] = {
            NGRAM_STAGE: await load_ngram_guard("ngram", ngram, Path("/"), executor),
            EMBEDDING_STAGE: await load_embedding_guard("embedding", embedding, Path("/"), executor),
        }
        out = []
        for item in items:
            guarded = guard_input(item)
            runs = []
            for index, guard in guards.items():
                score = await guard.classify(guarded)
                runs.append(_run(index, score.p_unsafe))
            out.append(ItemScores(id=item.id, runs=tuple(runs), stages=EMBEDDING_STAGE + 1, cost_s=0.0))
        return out


def _run(index: int, p_unsafe: float) -> StageRun:
    return StageRun(
        index=index,
        guard="",
        allow_below=0.0,
        block_above=1.0,
        p_unsafe=p_unsafe,
        verdict="next",
        latency_s=0.0,
    )

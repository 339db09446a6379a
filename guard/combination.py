"""A combine stage: one score from the scores earlier stages of the cascade gave the same item.

Two guards that err on different items can together tell apart what neither does alone: the n-gram guard
reads the words, the embedding guard the meaning. A combine stage scores

    p = sigmoid(bias + sum(weights[i] * logit(p of stage reads[i])))

(a logistic regression over the earlier stages' log-odds, each score clipped to [CLIP, 1 - CLIP] first, since
a score of 0 or 1 has no logit) and judges it at its own thresholds like any stage. It calls no model and
costs nothing but the arithmetic. The stages it reads must have run on the item: a stage they follow must
not settle it (give them a pair that passes everything on, allow_below 0 and block_above 1, for the
direction the combination is for). When one of them failed, the combine stage fails too
(`GuardError`): its categories are then unjudged, and the policy's fail mode decides, as for any stage.
`guard.cascade.CombineStage` runs it; `python -m ops.eval combine` fits the weights on stored scores and
prints them as a stage's `combine`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from registry.models import StageCombination

CLIP = 1e-4


def logit(p: float) -> float:
    """log(p / (1 - p)) of `p` clipped to [CLIP, 1 - CLIP]."""
    p = min(max(p, CLIP), 1.0 - CLIP)
    return math.log(p / (1.0 - p))


def sigmoid(x: float) -> float:
    """1 / (1 + exp(-x)), without overflow."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def combined(combination: StageCombination, scores: Sequence[float]) -> float:
    """The combination's score of the read stages' scores (in `combination.reads` order)."""
    total = combination.bias + sum(w * logit(p) for w, p in zip(combination.weights, scores, strict=True))
    return sigmoid(total)

"""Train the n-gram guard on the multilingual labelled set, and choose its thresholds on held-out families.

The set is a directory of JSONL files (`guard.dataset`, ops/eval/data/guard/); its families are split
train / calibration / test (`family_splits`). The head (`guard.ngram.NgramHead`) is fit on the train split
only: torch's EmbeddingBag, zero-initialised, full-batch Adam, L2 on the weights. The stage's thresholds are
chosen on the calibration split only (`choose_thresholds`), one pair for inputs from the prompts and one for
outputs from the outputs, and the test split is scored for the report, per direction.

The artifact directory holds the head (`ngram.npz`, `ngram.json`) and `guard.json`, the NgramReport: the
data's sha256, the ids trained on, the thresholds, the calibration and test figures, the test scores.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
from numpy.typing import NDArray

from guard.dataset import LANGUAGES, DataItem, dataset_dir_sha256, family_splits, load_data_dir
from guard.ngram import DIM, HEAD_WEIGHTS, METHOD, NgramHead, features, normalize
from ops.eval.evaluation import auroc
from ops.guard_training.data import TrainError

GUARD_JSON = "guard.json"
DEFAULT_GUARD_DATA = Path(__file__).resolve().parent.parent / "eval" / "data" / "guard"
PROGRESS_EPOCHS = 10  # epochs between progress lines

Say = Callable[[str], None]


class NgramSettings(msgspec.Struct, frozen=True, kw_only=True):
    """How the head is fit and how its thresholds are chosen (see `choose_thresholds`)."""

    epochs: int = 120
    lr: float = 0.05
    l2: float = 1e-6  # times the sum of squared weights (1e-5 blocked fewer test items: 23% against 27%)
    lookalike_quantile: float = 0.95  # block_above keeps this share of benign look-alikes under it
    # Input block_above keeps this share of everyday prompts under it too: look-alikes alone would let the
    # threshold fall where everyday prompts score (~12% of them above the look-alikes' 95% quantile).
    everyday_quantile: float = 0.99
    band_share: float = 0.10  # at most this share of a direction's calibration items scores in the band
    harmful_quantile: float = 0.20  # allow_below never above this quantile of the direction's harmful scores
    # Output block_above is never under this: the calibration split's safe outputs are a few dozen
    # hand-written replies, too few to bound the tail of generated text (a bench's everyday answers from the
    # embedded default scored up to 0.973; at 0.860, the highest safe output's score, 32 of 198 were cut).
    output_block_floor: float = 0.97


class Thresholds(msgspec.Struct, frozen=True, kw_only=True):
    """The stage's band: allow below `allow_below`, block above `block_above`, next stage in between."""

    allow_below: float
    block_above: float


class DirectedThresholds(msgspec.Struct, frozen=True, kw_only=True):
    """The stage's pair for inputs (chosen on prompts) and its pair for outputs (chosen on outputs)."""

    input: Thresholds
    output: Thresholds


class Figures(msgspec.Struct, frozen=True, kw_only=True):
    """What the stage does to one split under its thresholds: shares of each group (None: group empty)."""

    items: int
    harmful_blocked: float | None
    harmful_allowed: float | None  # scored under allow_below: let through without a further stage
    lookalikes_blocked: float | None
    safe_outputs_blocked: float | None  # everyday replies and refusals
    everyday_prompts_blocked: float | None
    band: float  # share of all items passed on to the next stage
    harmful_blocked_by_language: dict[str, float | None]
    auroc: float | None


class DirectedFigures(msgspec.Struct, frozen=True, kw_only=True):
    """Figures of a split's prompts at the input pair and of its outputs at the output pair."""

    input: Figures
    output: Figures


class NgramReport(msgspec.Struct, frozen=True, kw_only=True):
    """What was fit, its thresholds and how it does: `guard.json` of the artifact directory."""

    method: str
    training_data_sha256: str
    data_dir: str
    train_ids: tuple[str, ...]
    settings: NgramSettings
    thresholds: DirectedThresholds
    calibration: DirectedFigures
    test: DirectedFigures
    losses: tuple[float, ...]  # training loss at each progress line
    test_scores: dict[str, float]  # P(unsafe) of each test item by id, for threshold and cascade studies
    weights_file: str
    weights_sha256: str
    elapsed_s: float


def choose_thresholds(
    scores: Sequence[float], items: Sequence[DataItem], settings: NgramSettings
) -> DirectedThresholds:
    """The stage's thresholds from calibration scores (never training ones), each direction's pair from
    its own items: a guard scores prompts and answers differently, and one pair for both would be bound by
    whichever direction needs the higher block threshold. The rule:

    - input block_above = max(the `lookalike_quantile` quantile of the benign look-alike prompts' scores,
      the `everyday_quantile` quantile of the everyday prompts' scores): at most ~5% of look-alikes and ~1%
      of everyday prompts are blocked (a stage blocks a score strictly above block_above);
    - output block_above = max(the highest score of a safe output, the `lookalike_quantile` quantile of
      any look-alike outputs, `output_block_floor`): no everyday reply or refusal of the calibration split is
      cut, and this stage cuts an answer only when it is near certain (later stages judge the rest);
    - allow_below, per direction = the lowest threshold whose band [allow_below, block_above] holds at
      most `band_share` of the direction's items (the widest band the later, slower stages are given), but
      never above the `harmful_quantile` quantile of the direction's harmful items' scores (so at most ~20%
      of them are allowed by this stage without a second opinion), and never above block_above. (Items
      scoring exactly block_above are always in the band: a stage neither allows nor blocks them.)

    TrainError when the calibration split lacks look-alike prompts, safe outputs, or harmful items of
    either direction.
    """
    values = np.asarray(scores, dtype=np.float64)
    if values.shape != (len(items),):
        raise ValueError(f"{values.size} scores for {len(items)} items")

    def where(test: Callable[[DataItem], bool]) -> NDArray[np.float64]:
        chosen: NDArray[np.float64] = values[np.array([test(i) for i in items], dtype=bool)]
        return chosen

    prompts, outputs = where(lambda i: i.shape == "prompt"), where(lambda i: i.shape == "output")
    lookalikes = where(lambda i: i.shape == "prompt" and i.kind == "lookalike")
    everyday = where(lambda i: i.shape == "prompt" and i.kind == "everyday")
    safe_outputs = where(lambda i: i.shape == "output" and i.label == "safe")
    output_lookalikes = where(lambda i: i.shape == "output" and i.kind == "lookalike")
    harmful_prompts = where(lambda i: i.shape == "prompt" and i.label == "unsafe")
    harmful_outputs = where(lambda i: i.shape == "output" and i.label == "unsafe")
    if not (lookalikes.size and safe_outputs.size and harmful_prompts.size and harmful_outputs.size):
        raise TrainError(
            "the calibration split needs look-alikes, safe outputs and harmful items of both shapes "
            "(prompts and outputs)"
        )
    input_block = _quantile(lookalikes, settings.lookalike_quantile)
    if everyday.size:
        input_block = max(input_block, _quantile(everyday, settings.everyday_quantile))
    output_block = max(float(safe_outputs.max()), settings.output_block_floor)
    if output_lookalikes.size:
        output_block = max(output_block, _quantile(output_lookalikes, settings.lookalike_quantile))
    return DirectedThresholds(
        input=_band(prompts, harmful_prompts, input_block, settings),
        output=_band(outputs, harmful_outputs, output_block, settings),
    )


def _quantile(values: NDArray[np.float64], q: float) -> float:
    return float(np.quantile(values, q))


def _band(
    values: NDArray[np.float64], harmful: NDArray[np.float64], block_above: float, settings: NgramSettings
) -> Thresholds:
    """The pair of one direction: `block_above`, and allow_below by the band and harmful-quantile rule."""
    in_reach = np.sort(values[values <= block_above])[::-1]  # highest first
    room = int(settings.band_share * values.size)  # items the band may hold
    # Just above the first score that would not fit: ties with it stay out, so the band never holds more.
    widest = 0.0 if in_reach.size <= room else float(np.nextafter(in_reach[room], np.inf))
    cap = _quantile(harmful, settings.harmful_quantile)
    allow_below = min(widest, cap, block_above)
    return Thresholds(allow_below=_unit(allow_below), block_above=_unit(block_above))


def _unit(value: float) -> float:
    return min(1.0, max(0.0, value))


def _share(flags: NDArray[np.bool_]) -> float | None:
    return round(float(flags.mean()), 4) if flags.size else None


def figures(scores: Sequence[float], items: Sequence[DataItem], thresholds: Thresholds) -> Figures:
    """What `thresholds` do to `items` scored `scores`."""
    values = np.asarray(scores, dtype=np.float64)
    blocked = values > thresholds.block_above
    allowed = values < thresholds.allow_below

    def where(test: Callable[[DataItem], bool]) -> NDArray[np.bool_]:
        return np.array([test(i) for i in items], dtype=bool)

    harmful = where(lambda i: i.label == "unsafe")
    language = np.array([i.language for i in items])
    return Figures(
        items=len(items),
        harmful_blocked=_share(blocked[harmful]),
        harmful_allowed=_share(allowed[harmful]),
        lookalikes_blocked=_share(blocked[where(lambda i: i.kind == "lookalike")]),
        safe_outputs_blocked=_share(blocked[where(lambda i: i.shape == "output" and i.label == "safe")]),
        everyday_prompts_blocked=_share(blocked[where(lambda i: i.kind == "everyday")]),
        band=_share(~blocked & ~allowed) or 0.0,
        harmful_blocked_by_language={
            lang: _share(blocked[harmful & (language == lang)]) for lang in LANGUAGES
        },
        auroc=auroc(zip(values.tolist(), harmful.tolist(), strict=True)),
    )


def directed_figures(
    scores: Sequence[float], items: Sequence[DataItem], thresholds: DirectedThresholds
) -> DirectedFigures:
    """The prompts of `items` at the input pair and their outputs at the output pair."""
    pairs = list(zip(scores, items, strict=True))

    def of(shape: str, pair: Thresholds) -> Figures:
        chosen = [(s, i) for s, i in pairs if i.shape == shape]
        return figures([s for s, _ in chosen], [i for _, i in chosen], pair)

    return DirectedFigures(input=of("prompt", thresholds.input), output=of("output", thresholds.output))


def describe(figures: Figures) -> str:
    """One line of the figures that matter most."""

    def pct(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.0%}"

    langs = " ".join(f"{k} {pct(v)}" for k, v in figures.harmful_blocked_by_language.items())
    return (
        f"{figures.items} items: blocks {pct(figures.harmful_blocked)} of harmful, "
        f"{pct(figures.lookalikes_blocked)} of look-alikes, {pct(figures.safe_outputs_blocked)} of safe "
        f"outputs, {pct(figures.everyday_prompts_blocked)} of everyday prompts; allows "
        f"{pct(figures.harmful_allowed)} of harmful; passes on {pct(figures.band)}; by language: {langs}"
    )


def fit(
    rows: Sequence[NDArray[np.int64]], labels: Sequence[int], settings: NgramSettings, say: Say
) -> tuple[NDArray[np.float32], float, tuple[float, ...]]:
    """Weights, bias and the losses at each progress line of a logistic model over feature-id rows."""
    torch.manual_seed(0)
    flat = torch.from_numpy(np.concatenate(rows))
    offsets = torch.from_numpy(np.cumsum([0] + [len(r) for r in rows[:-1]]).astype(np.int64))
    per_feature = torch.from_numpy(
        np.concatenate([np.full(len(r), 1.0 / np.sqrt(len(r)), dtype=np.float32) for r in rows])
    )
    target = torch.tensor(labels, dtype=torch.float32)
    bag = torch.nn.EmbeddingBag(DIM, 1, mode="sum")
    torch.nn.init.zeros_(bag.weight)
    bias = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.Adam([bag.weight, bias], lr=settings.lr)
    losses: list[float] = []
    for epoch in range(1, settings.epochs + 1):
        optimizer.zero_grad()
        logits = bag(flat, offsets, per_sample_weights=per_feature).squeeze(1) + bias
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, target)
        objective: Any = loss + settings.l2 * bag.weight.pow(2).sum()
        objective.backward()
        optimizer.step()
        if epoch % PROGRESS_EPOCHS == 0 or epoch == settings.epochs:
            value = float(loss.detach())
            losses.append(round(value, 5))
            say(f"ngram guard: epoch {epoch}/{settings.epochs}, loss {value:.4f}")
    weights = bag.weight.detach().numpy()[:, 0].astype(np.float32)
    return weights, float(bias.detach()[0]), tuple(losses)


def train_ngram(
    data_dir: Path, out_dir: Path, settings: NgramSettings | None = None, say: Say = print
) -> NgramReport:
    """Fit the head on the train split of `data_dir`, choose its thresholds on the calibration split, score
    the test split; write it all to `out_dir` (which must not exist). Blocking and synchronous."""
    settings = settings or NgramSettings()
    started = time.perf_counter()
    if out_dir.exists():
        raise TrainError(f"{out_dir} already exists")
    items = load_data_dir(data_dir)
    split = family_splits(items)
    train = [i for i in items if split[i.family] == "train"]
    calibration = [i for i in items if split[i.family] == "calibration"]
    test = [i for i in items if split[i.family] == "test"]
    if {i.label for i in train} != {"safe", "unsafe"}:
        raise TrainError(f"{data_dir}: the train split needs both safe and unsafe items")
    sha256 = dataset_dir_sha256(data_dir)
    say(
        f"ngram guard: featurising {len(train)} train items of {data_dir} (sha256 {sha256[:16]}...); "
        f"{len(calibration)} calibration and {len(test)} test items held out"
    )
    rows = [features(normalize(i.text)) for i in train]
    weights, bias, losses = fit(rows, [1 if i.label == "unsafe" else 0 for i in train], settings, say)
    head = NgramHead(weights, bias, training_data_sha256=sha256, created=time.time())
    # Scored as in service (window by window, the worst deciding).
    calibration_scores = [max(head.score_text(i.text)) for i in calibration]
    test_scores = [max(head.score_text(i.text)) for i in test]
    thresholds = choose_thresholds(calibration_scores, calibration, settings)
    on_calibration = directed_figures(calibration_scores, calibration, thresholds)
    on_test = directed_figures(test_scores, test, thresholds)
    for direction, pair, on_cal, on_tst in (
        ("input", thresholds.input, on_calibration.input, on_test.input),
        ("output", thresholds.output, on_calibration.output, on_test.output),
    ):
        shown = f"allow_below {pair.allow_below:.4f}, block_above {pair.block_above:.4f}"
        say(f"ngram guard, {direction}s: {shown}")
        say(f"ngram guard, {direction}s: calibration, {describe(on_cal)}")
        say(f"ngram guard, {direction}s: test, {describe(on_tst)}")
    weights_sha256 = head.save(out_dir)
    report = NgramReport(
        method=METHOD,
        training_data_sha256=sha256,
        data_dir=data_dir.name,
        train_ids=tuple(i.id for i in train),
        settings=settings,
        thresholds=thresholds,
        calibration=on_calibration,
        test=on_test,
        losses=losses,
        test_scores={i.id: round(p, 6) for i, p in zip(test, test_scores, strict=True)},
        weights_file=HEAD_WEIGHTS,
        weights_sha256=weights_sha256,
        elapsed_s=round(time.perf_counter() - started, 1),
    )
    (out_dir / GUARD_JSON).write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    return report

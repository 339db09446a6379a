"""Train a one-token guard on CPU: the default model fine-tuned to answer the guard prompt "safe" or "uns".

The prompt is the zero-shot judge's (guard/default_guard.py) and it is tokenized by the serving classifier's
own code (`OneTokenClassifier`), so the trained prompt is the served prompt token for token: the fixed part
of the prompt before the text, the text's own tokens, then the fixed part after it.

Method ("last-layers"), chosen to fit in minutes on two cores (ARCHITECTURE.md section 7):

1. The frozen model runs once over every item, forward only, and keeps the hidden states that enter the
   first trained layer. The part of the prompt before the text is the same for every item, so it runs once
   and its KV cache is shared: each item costs only its own text and the prompt's tail.
2. The last `layers` decoder layers and the final norm are trained (AdamW, float32, right-padded batches)
   with cross-entropy over the whole vocabulary at the answer position, the last real token; the target is
   the first token of the lowercase answer: "safe" (18437 in SmolLM2) or "uns" (10082, "unsafe" is "uns" +
   "afe"). The embeddings and the tied `lm_head` stay as they are.
3. The trained weights are rounded to the base model's dtype (the dtype they are saved in), and the held-out
   items are scored from the cached states through those rounded layers: P(unsafe) = p(uns) / (p(uns) +
   p(safe)), the serving formula. The zero-shot judge is scored the same way through the untrained layers.
4. The model is saved as an ordinary model directory (safetensors; config, tokenizer and chat template
   copied byte for byte from the base, so `eos_token_id` and the tokenizer hashes stay the base's), loaded
   back with transformers, and a few held-out prompts are scored by a whole forward pass of the saved files:
   they must agree with step 3, so the figures describe the files vLLM will serve.

`guard.json` in the model directory records the data's sha256, the split, the ids trained on, the method
and its settings, the losses, the held-out figures and the elapsed time.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from guard.default_guard import DEFAULT_MIN_LABEL_MASS, JUDGE_PROMPT, SAFE_VARIANTS, UNSAFE_VARIANTS
from guard.one_token import SYSTEM_PROMPT
from ops.guard_training.data import Metrics, TrainError, TrainingSet, describe, label_of, score_metrics
from ops.guard_training.layers import (
    SAFE_TOKENS,
    UNSAFE_TOKENS,
    SplitModel,
    build_renderer,
    p_unsafe,
    render_prompts,
    score_states,
)
from ops.models.prepare import MANIFEST, PreparedModel, verify
from registry.hashing import sha256_file

METHOD = "last-layers"
GUARD_JSON = "guard.json"
WEIGHTS_FILE = "model.safetensors"
# The harm categories of the labelled sets (guard.labelled.Category without "benign"), in that order:
# the prompt lists them, so a policy whose stages name these categories asks the trained question.
DEFAULT_CATEGORIES = ("violence", "self_harm", "weapons", "malware", "prompt_injection", "hate")
# Largest difference allowed between a held-out score from the cached states and from a whole forward pass
# of the saved model (float32 sums in another order).
VERIFY_TOLERANCE = 2e-3
# Base files copied unchanged into the guard model directory (whichever of them exist).
_COPIED = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)

Say = Callable[[str], None]


class OneTokenSettings(msgspec.Struct, frozen=True, kw_only=True):
    """How the one-token guard is trained."""

    epochs: int = 8
    layers: int = 1  # decoder layers trained, counted from the last
    lr: float = 1e-4
    batch_size: int = 8
    seed: int = 0
    categories: tuple[str, ...] = DEFAULT_CATEGORIES
    policy: str = ""
    verify_items: int = 4  # held-out prompts scored again by a whole forward pass of the saved model


class OneTokenReport(msgspec.Struct, frozen=True, kw_only=True):
    """What was trained and how well it does on held-out items: `guard.json` of the model directory."""

    method: str
    base_model: str
    base_weights_sha256: str
    training_data_sha256: str
    data_file: str
    split: str
    train_ids: tuple[str, ...]
    test_items: int
    settings: OneTokenSettings
    system_prompt: str
    prompt_template: str
    safe_tokens: tuple[str, ...]
    unsafe_tokens: tuple[str, ...]
    safe_token_ids: tuple[int, ...]
    unsafe_token_ids: tuple[int, ...]
    losses: tuple[float, ...]  # mean training loss of each epoch
    metrics: Metrics  # the trained guard on the held-out items
    zero_shot: Metrics  # the zero-shot judge (guard/default_guard.py) on the same items
    label_mass_min: float  # least P(safe) + P(uns) of the trained guard over the held-out items
    zero_shot_low_mass: int  # held-out items where the judge's label mass is too small: guard errors
    test_scores: dict[str, float]  # P(unsafe) of each held-out item by id, for threshold and cascade studies
    zero_shot_test_scores: dict[str, float]  # the zero-shot judge's, likewise
    verified_items: int
    verify_max_diff: float
    weights_file: str
    weights_sha256: str
    elapsed_s: float


def train_one_token(
    data: TrainingSet,
    base_model_dir: Path,
    out_dir: Path,
    settings: OneTokenSettings | None = None,
    say: Say = print,
) -> OneTokenReport:
    """Train a one-token guard on `data.train` from the model in `base_model_dir`; write it to `out_dir`.

    `out_dir` must not exist yet. The held-out items (`data.test`) are only ever scored, never trained on.
    """
    settings = settings or OneTokenSettings()
    started = time.perf_counter()
    base = verify(base_model_dir)
    if out_dir.exists():
        raise TrainError(f"{out_dir} already exists")
    torch.manual_seed(settings.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(base_model_dir), local_files_only=True)
    renderer = build_renderer(tokenizer)
    judge = build_renderer(tokenizer, safe_tokens=SAFE_VARIANTS, unsafe_tokens=UNSAFE_VARIANTS)
    judge_ids = (judge.safe_ids, judge.unsafe_ids)
    label_ids = (renderer.safe_ids, renderer.unsafe_ids)
    model: Any = AutoModelForCausalLM.from_pretrained(
        str(base_model_dir), local_files_only=True, dtype=torch.float32
    )
    model.eval()
    saved_dtype = _config_dtype(base_model_dir)
    net = SplitModel(model, settings.layers, int(tokenizer.pad_token_id))
    items = [*data.train, *data.test]
    prompts = render_prompts(renderer, [i.text for i in items], settings.categories, settings.policy)
    say(
        f"one-token guard: {len(data.train)} training and {len(data.test)} held-out items, "
        f"prompt prefix of {len(prompts.prefix)} tokens shared"
    )

    def progress(done: int) -> None:
        if done == len(items) or done % (4 * settings.batch_size) == 0:
            elapsed = time.perf_counter() - started
            say(f"one-token guard: frozen forward {done}/{len(items)} items ({elapsed:.0f} s)")

    prefix_h, states = net.frozen_states(prompts, settings.batch_size, progress)
    train_states, test_states = states[: len(data.train)], states[len(data.train) :]
    zero_shot_scores, zero_shot_mass = score_states(
        net, prefix_h, test_states, judge_ids, settings.batch_size
    )
    zero_shot = score_metrics(zero_shot_scores, data.test)
    say(f"zero-shot judge: {describe(zero_shot)}")

    losses = _train(
        net, prefix_h, train_states, [label_of(i) for i in data.train], label_ids, settings, say, started
    )
    with torch.no_grad():
        for param in net.parameters():
            param.copy_(param.to(saved_dtype).to(torch.float32))
    scores, masses = score_states(net, prefix_h, test_states, label_ids, settings.batch_size)
    metrics = score_metrics(scores, data.test)
    say(f"one-token guard: {describe(metrics)}")

    say(f"writing {out_dir}")
    weights_sha256 = _save(model, saved_dtype, base_model_dir, out_dir, base)
    checked = min(settings.verify_items, len(data.test))
    max_diff = _verify_saved(
        out_dir,
        [prompts.prefix + t for t in prompts.tails[len(data.train) : len(data.train) + checked]],
        scores[:checked],
        label_ids,
    )
    report = OneTokenReport(
        method=METHOD,
        base_model=base.name,
        base_weights_sha256=base.weights_sha256,
        training_data_sha256=data.sha256,
        data_file=Path(data.path).name,
        split=data.split,
        train_ids=tuple(i.id for i in data.train),
        test_items=len(data.test),
        settings=settings,
        system_prompt=SYSTEM_PROMPT,
        prompt_template=JUDGE_PROMPT,
        safe_tokens=SAFE_TOKENS,
        unsafe_tokens=UNSAFE_TOKENS,
        safe_token_ids=tuple(renderer.safe_ids),
        unsafe_token_ids=tuple(renderer.unsafe_ids),
        losses=tuple(losses),
        metrics=metrics,
        zero_shot=zero_shot,
        label_mass_min=round(min(masses), 6),
        zero_shot_low_mass=sum(1 for m in zero_shot_mass if m < DEFAULT_MIN_LABEL_MASS),
        test_scores={i.id: round(p, 6) for i, p in zip(data.test, scores, strict=True)},
        zero_shot_test_scores={i.id: round(p, 6) for i, p in zip(data.test, zero_shot_scores, strict=True)},
        verified_items=checked,
        verify_max_diff=max_diff,
        weights_file=WEIGHTS_FILE,
        weights_sha256=weights_sha256,
        elapsed_s=round(time.perf_counter() - started, 1),
    )
    (out_dir / GUARD_JSON).write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    return report


def _train(
    net: SplitModel,
    prefix_h: Any,
    states: Sequence[Any],
    labels: Sequence[int],
    label_ids: tuple[Sequence[int], Sequence[int]],
    settings: OneTokenSettings,
    say: Say,
    started: float,
) -> list[float]:
    """AdamW over the trained layers; the mean loss of each epoch."""
    for param in net.model.parameters():
        param.requires_grad_(False)
    params = net.parameters()
    for param in params:
        param.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    # The answer's first token: "uns" for unsafe, "safe" for safe (the first id of each label's variants).
    targets = torch.tensor([label_ids[1][0] if y else label_ids[0][0] for y in labels], dtype=torch.long)
    order_rng = torch.Generator().manual_seed(settings.seed)
    losses: list[float] = []
    for epoch in range(1, settings.epochs + 1):
        order = torch.randperm(len(states), generator=order_rng).tolist()
        total = 0.0
        for lo in range(0, len(order), settings.batch_size):
            batch = order[lo : lo + settings.batch_size]
            logits = net.answer_logits(prefix_h, [states[i] for i in batch])
            loss: Any = torch.nn.functional.cross_entropy(logits, targets[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += float(loss.detach()) * len(batch)
        losses.append(total / len(order))
        say(
            f"one-token guard: epoch {epoch}/{settings.epochs} loss {losses[-1]:.3f} "
            f"({time.perf_counter() - started:.0f} s)"
        )
    for param in params:
        param.requires_grad_(False)
    return losses


def _config_dtype(model_dir: Path) -> Any:
    """The torch dtype a model directory's config.json names (float32 when it names none)."""
    config: Any = msgspec.json.decode((model_dir / "config.json").read_bytes())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise TrainError(f"{model_dir}/config.json names unknown dtype {name!r}")
    return dtype


def _save(model: Any, dtype: Any, base_dir: Path, out_dir: Path, base: PreparedModel) -> str:
    """Write the model in `dtype` with the base's config, tokenizer and template; the weights' sha256."""
    model.to(dtype)
    model.save_pretrained(str(out_dir))
    for name in _COPIED:
        if (base_dir / name).is_file():
            shutil.copyfile(base_dir / name, out_dir / name)
    with (
        safe_open(str(out_dir / WEIGHTS_FILE), "pt") as saved,
        safe_open(str(base_dir / base.weights_file), "pt") as original,
    ):
        # Same tensors as the base (lm_head still tied): only their values may differ.
        if set(saved.keys()) != set(original.keys()):
            raise TrainError(f"the saved guard's tensors differ from {base_dir}'s")
    weights_sha256 = sha256_file(out_dir / WEIGHTS_FILE)
    manifest = PreparedModel(
        name=out_dir.name,
        source=f"{base.name}@{base.weights_sha256[:12]} ({METHOD})",
        weights_file=WEIGHTS_FILE,
        weights_sha256=weights_sha256,
        eos_token_id=base.eos_token_id,
    )
    (out_dir / MANIFEST).write_bytes(msgspec.json.format(msgspec.json.encode(manifest)))
    return weights_sha256


def _verify_saved(
    out_dir: Path,
    prompts: Sequence[list[int]],
    expected: Sequence[float],
    label_ids: tuple[Sequence[int], Sequence[int]],
) -> float:
    """Score `prompts` with a whole forward pass of the saved model; TrainError unless they match."""
    if not prompts:
        return 0.0
    model: Any = AutoModelForCausalLM.from_pretrained(
        str(out_dir), local_files_only=True, dtype=torch.float32
    )
    model.eval()
    worst = 0.0
    with torch.inference_mode():
        for prompt, want in zip(prompts, expected, strict=True):
            logits = model(input_ids=torch.tensor([prompt], dtype=torch.long)).logits[:, -1]
            got = float(p_unsafe(logits, *label_ids)[0][0])
            worst = max(worst, abs(got - want))
    if worst > VERIFY_TOLERANCE:
        raise TrainError(
            f"the saved guard in {out_dir} scores held-out prompts up to {worst:.4f} away from training's "
            "own scores: the saved files are not the trained model"
        )
    return worst

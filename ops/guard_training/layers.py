"""The default model split at the first trained layer, and the guard prompts it reads.

Training a one-token guard runs the frozen layers once per item and the trained layers many times, so the
model is cut in two: `SplitModel.frozen_states` runs the prompts up to the first trained layer and keeps the
hidden states entering it; `SplitModel.answer_logits` runs those states through the trained layers, the
final norm and `lm_head` to the logits of the first answer token.

The part of the prompt before the text is the same for every item (it depends on the template's variables
only), so it runs once and its KV cache is shared: each item costs only its own text and the prompt's tail.
The prompts are tokenized by the serving classifier's own code (`OneTokenClassifier`), so a trained prompt
is the served prompt token for token.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any, cast

import msgspec
import torch
from transformers import DynamicCache

from engines.base import Engine
from guard.default_guard import JUDGE_PROMPT
from guard.one_token import OneTokenClassifier
from ops.guard_training.data import TrainError
from registry.models import GuardModelSpec

SAFE_TOKENS = ("safe",)
UNSAFE_TOKENS = ("uns",)


class _Stop(Exception):
    """Raised by a hook to end a forward pass at the first trained layer."""


class GuardPrompts(msgspec.Struct, frozen=True):
    """Token ids of the guard prompts of a list of texts: the shared part, then each text's own."""

    prefix: list[int]  # shared by every item
    tails: list[list[int]]  # each item's text and the prompt's end, in item order


def build_renderer(
    tokenizer: Any,
    template: str = JUDGE_PROMPT,
    safe_tokens: tuple[str, ...] = SAFE_TOKENS,
    unsafe_tokens: tuple[str, ...] = UNSAFE_TOKENS,
) -> OneTokenClassifier:
    """The serving classifier over `tokenizer` with `template`, used here to tokenize prompts and labels.

    Tokenizing needs no engine or executor, so none is given: training and serving render with one code
    path, and a trained prompt is the served prompt token for token.
    """
    spec = GuardModelSpec(
        kind="one_token",
        model="training@0",
        prompt_template=template,
        safe_tokens=safe_tokens,
        unsafe_tokens=unsafe_tokens,
    )
    return OneTokenClassifier(
        "training", spec, cast(Engine, None), tokenizer, cast(Executor, None), min_label_mass=0.0
    )


def render_prompts(
    renderer: OneTokenClassifier, texts: Sequence[str], categories: Sequence[str], policy: str
) -> GuardPrompts:
    """The guard prompt of each text, as `renderer` renders it in service with `categories` and `policy`."""
    listed = ", ".join(categories)
    prefix: list[int] | None = None
    tails: list[list[int]] = []
    for text in texts:
        before, after, content = renderer._tokenize(text, listed, policy)
        if prefix is None:
            prefix = before
        elif before != prefix:  # the part before the text depends on the template's variables only
            raise TrainError("the guard prompt's part before the text differs between items")
        tails.append(content + after)
    if prefix is None:
        raise TrainError("no items to render")
    return GuardPrompts(prefix=prefix, tails=tails)


class SplitModel:
    """The base model split at the first trained layer: a frozen part run once, a trained part run often."""

    def __init__(self, model: Any, layers: int, pad_id: int) -> None:
        self.model = model
        self.pad_id = pad_id
        total = len(model.model.layers)
        if not 1 <= layers < total:
            raise TrainError(f"layers must be between 1 and {total - 1}, got {layers}")
        self.first = total - layers
        self.trained = list(model.model.layers[self.first :])

    def parameters(self) -> list[Any]:
        """The trained parameters: the last layers and the final norm."""
        params = [p for layer in self.trained for p in layer.parameters()]
        return params + list(self.model.model.norm.parameters())

    def frozen_states(
        self, prompts: GuardPrompts, batch_size: int, progress: Callable[[int], None]
    ) -> tuple[Any, list[Any]]:
        """Hidden states entering the first trained layer: the prefix's, and each tail's after the prefix."""
        captured: dict[str, Any] = {}

        def stop(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            captured["h"] = args[0] if args else kwargs["hidden_states"]
            raise _Stop

        handle = self.model.model.layers[self.first].register_forward_pre_hook(stop, with_kwargs=True)
        try:
            with torch.inference_mode():
                cache = DynamicCache()
                prefix = torch.tensor([prompts.prefix], dtype=torch.long)
                with contextlib.suppress(_Stop):
                    self.model.model(input_ids=prefix, past_key_values=cache, use_cache=True)
                prefix_h = captured["h"][0].clone()
                width = len(prompts.prefix)
                states: list[Any] = [None] * len(prompts.tails)
                # Tails of similar length batched together: less padding to run through the model.
                by_length = sorted(range(len(prompts.tails)), key=lambda i: len(prompts.tails[i]))
                for lo in range(0, len(by_length), batch_size):
                    chosen = by_length[lo : lo + batch_size]
                    batch = [prompts.tails[i] for i in chosen]
                    longest = max(len(t) for t in batch)
                    ids = torch.full((len(batch), longest), self.pad_id, dtype=torch.long)
                    mask = torch.zeros((len(batch), width + longest), dtype=torch.long)
                    mask[:, :width] = 1
                    for row, tail in enumerate(batch):
                        ids[row, : len(tail)] = torch.tensor(tail, dtype=torch.long)
                        mask[row, width : width + len(tail)] = 1
                    positions = (width + torch.arange(longest)).unsqueeze(0).expand(len(batch), -1)
                    shared = copy.deepcopy(cache)
                    shared.batch_repeat_interleave(len(batch))
                    with contextlib.suppress(_Stop):
                        self.model.model(
                            input_ids=ids,
                            attention_mask=mask,
                            position_ids=positions,
                            past_key_values=shared,
                            use_cache=True,
                        )
                    for row, (index, tail) in enumerate(zip(chosen, batch, strict=True)):
                        states[index] = captured["h"][row, : len(tail)].clone()
                    progress(lo + len(batch))
        finally:
            handle.remove()
        return prefix_h, states

    def answer_logits(self, prefix_h: Any, tails: Sequence[Any]) -> Any:
        """Logits of the first answer token of each item, through the trained layers, norm and lm_head.

        Right-padded: a padded position comes after every real one, so causal attention keeps it out of the
        real positions, and the answer is read at each item's last real position.
        """
        width = prefix_h.shape[0]
        longest = max(t.shape[0] for t in tails)
        hidden = prefix_h.new_zeros((len(tails), width + longest, prefix_h.shape[1]))
        hidden[:, :width] = prefix_h
        for row, tail in enumerate(tails):
            hidden[row, width : width + tail.shape[0]] = tail
        positions = torch.arange(width + longest).unsqueeze(0).expand(len(tails), -1)
        rotary = self.model.model.rotary_emb(hidden, positions)
        for layer in self.trained:
            hidden = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=rotary)
        last = torch.stack([hidden[row, width + tail.shape[0] - 1] for row, tail in enumerate(tails)])
        return self.model.lm_head(self.model.model.norm(last))


def p_unsafe(logits: Any, safe_ids: Sequence[int], unsafe_ids: Sequence[int]) -> tuple[Any, Any]:
    """P(unsafe) = mass(unsafe ids) / (mass(unsafe) + mass(safe)) per row, and the label mass per row."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    safe = torch.logsumexp(log_probs[:, list(safe_ids)], dim=-1)
    unsafe = torch.logsumexp(log_probs[:, list(unsafe_ids)], dim=-1)
    return torch.sigmoid(unsafe - safe), torch.exp(torch.logaddexp(safe, unsafe))


def score_states(
    net: SplitModel,
    prefix_h: Any,
    states: Sequence[Any],
    ids: tuple[Sequence[int], Sequence[int]],
    batch: int,
) -> tuple[list[float], list[float]]:
    """P(unsafe) and label mass of each item from its cached states, through the trained layers."""
    scores: list[float] = []
    masses: list[float] = []
    with torch.inference_mode():
        for lo in range(0, len(states), batch):
            p, mass = p_unsafe(net.answer_logits(prefix_h, states[lo : lo + batch]), *ids)
            scores.extend(float(x) for x in p)
            masses.extend(float(x) for x in mass)
    return scores, masses

"""`OneTokenClassifier`: a guard model answers a prompt with one word, and the label tokens' masses decide.

The guard renders its version's prompt template (Jinja, sandboxed; variables `content`, `categories` and
`policy`) as the user message after an explicit system message, through the guard model's own chat template
with the generation prompt, and asks the engine for the log-probability of exactly each label token as the
first answer token (`Engine.score_next_token`, greedy, one token, at a priority that puts it ahead of batch
generation, with the item's `cache_salt`: the tenant's, so prefixes are cached per tenant as in generation).
Then

    P(unsafe) = mass(unsafe variants) / (mass(unsafe variants) + mass(safe variants)),

each mass the sum of exp(logprob) over that label's variants (e.g. "safe", " safe", "Safe"). Every variant
must be exactly one token of the guard's tokenizer; one that is not is refused when the guard is built,
naming how it tokenizes (the first token decides: "unsafe" is "uns" + "afe" in SmolLM2, so register "uns").

What it judges: of an input item, the untrusted spans only (the tenant's trusted system spans are its own
and are left out; an item with no untrusted text scores 0 without a model call); of an output item, the
generated text. The text is spliced into the prompt as tokens
that cannot be special tokens, so a text holding "<|im_end|>" cannot close the guard's user turn and answer
for the model.

A text longer than the guard model's context leaves room for beside the template is never cut silently: it
is checked in overlapping windows of its tokens, each window scored on its own, and the highest P(unsafe)
of them is the score (one unsafe passage makes the whole text unsafe). Past `max_windows` windows the guard
raises GuardInputError rather than score part of the text.

Whatever stops a score from being one, the guard raises GuardError and never returns a score that reads as
safe. The item's own failures are GuardInputError, which the guard's shared circuit breaker never counts (any
caller can produce them): a label mass too small to mean the model answered the question (below
`min_label_mass`: a text can talk the model out of answering with a label), a text too long to check, a
template that leaves this policy's item no room. The guard's are plain GuardError: an engine error (of any
kind), a label token missing from the engine's answer, a NaN or a positive log-probability.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

import jinja2
import msgspec
from jinja2.sandbox import SandboxedEnvironment

from engines.base import Scorer
from guard.backlog import Backlog
from guard.base import GuardError, GuardInput, GuardInputError, GuardScore
from guard.windows import window_starts
from registry.models import GuardModelSpec

# Without an explicit system message SmolLM2's chat template injects its own ("You are a helpful AI
# assistant named SmolLM..."), which pulls the answer away from the one-word label.
SYSTEM_PROMPT = "You are a content safety classifier. You answer with exactly one word."
# Stands for the text under check while the template is rendered; the text's own tokens replace it.
_SLOT = "\u2063LOCKGATE-CONTENT-SLOT\u2063"
# A window must leave the model some text to judge; a template that leaves less is a configuration error.
_MIN_WINDOW_TOKENS = 32
# Log-probabilities above 0 (beyond float noise) are not log-probabilities.
_LOGPROB_EPS = 1e-4


class WindowScore(msgspec.Struct, frozen=True, kw_only=True):
    """The label masses of one window of the text and the P(unsafe) they give."""

    p_unsafe: float
    safe_mass: float
    unsafe_mass: float
    prompt_tokens: int


class OneTokenClassifier:
    """A `Classifier` that reads P(unsafe) off a guard model's first answer token."""

    def __init__(
        self,
        name: str,
        spec: GuardModelSpec,
        engine: Scorer,
        tokenizer: Any,
        executor: Executor,
        *,
        min_label_mass: float,
        model_ref: str | None = None,
        priority: int = -10,
        system_prompt: str = SYSTEM_PROMPT,
        window_overlap: int = 64,
        max_windows: int = 16,
        clock: Callable[[], float] = time.perf_counter,
        backlog: Backlog | None = None,
    ) -> None:
        """Build the guard `name` (name@version) of `spec` on `engine`.

        `tokenizer` is the guard model's transformers tokenizer (with its chat template); its work runs in
        `executor`. `model_ref` (default `spec.model`) names the model version in every score. `backlog`
        counts the engine calls of every guard on the same engine pool (`expected_wait`). Raises
        ValueError for a spec that cannot work: not one-token, a template without exactly one `content`, a
        label variant that is not one token, or a token that is both safe and unsafe.
        """
        if spec.kind != "one_token":
            raise ValueError(f"guard {name}: a {spec.kind!r} spec is not a one-token guard")
        if not spec.safe_tokens or not spec.unsafe_tokens:
            raise ValueError(f"guard {name}: both safe_tokens and unsafe_tokens must name variants")
        if not 0.0 <= min_label_mass <= 1.0:
            raise ValueError(f"guard {name}: min_label_mass {min_label_mass} is not in [0, 1]")
        self.name = name
        self.model = spec.model if model_ref is None else model_ref
        self.priority = priority
        self.min_label_mass = min_label_mass
        self.template_sha256 = hashlib.sha256(spec.prompt_template.encode()).hexdigest()
        self._engine = engine
        self._tokenizer = tokenizer
        self._executor = executor
        self._system_prompt = system_prompt
        self._overlap = window_overlap
        self._max_windows = max_windows
        self._clock = clock
        self._backlog = backlog
        env = SandboxedEnvironment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
        try:
            self._template = env.from_string(spec.prompt_template)
            probe = self._template.render(content=_SLOT, categories="", policy="")
        except jinja2.TemplateError as exc:
            raise ValueError(f"guard {name}: prompt template does not render: {exc}") from exc
        if probe.count(_SLOT) != 1:
            raise ValueError(f"guard {name}: the prompt template must use {{{{ content }}}} exactly once")
        self.safe_ids = self._label_ids(spec.safe_tokens)
        self.unsafe_ids = self._label_ids(spec.unsafe_tokens)
        if both := set(self.safe_ids) & set(self.unsafe_ids):
            raise ValueError(f"guard {name}: token ids {sorted(both)} are both safe and unsafe variants")
        self._label_token_ids = (*self.safe_ids, *self.unsafe_ids)

    def _label_ids(self, variants: Sequence[str]) -> tuple[int, ...]:
        """The one token id of each variant (each id once); ValueError naming a variant that is not one."""
        ids: dict[int, None] = {}
        for variant in variants:
            tokens = list(self._tokenizer.encode(variant, add_special_tokens=False))
            if len(tokens) != 1:
                pieces = [self._tokenizer.decode([t]) for t in tokens]
                hint = f": the first token decides, so register {pieces[0]!r}" if pieces else ""
                raise ValueError(
                    f"guard {self.name}: label variant {variant!r} is not one token in this tokenizer, it is "
                    f"{pieces}{hint}"
                )
            ids[tokens[0]] = None
        return tuple(ids)

    def expected_wait(self) -> float:
        """Seconds until a call made now would be scored, behind the calls in flight on the engine pool (0
        without a backlog, or before the pool's speed is measured)."""
        return 0.0 if self._backlog is None else self._backlog.expected_wait()

    def oversized(self, item: GuardInput) -> bool:
        """Whether the judged text may be more than one prompt's work: more UTF-8 bytes than the engine's
        context has tokens (a byte-level BPE token is at least one byte). An estimate, for the breaker."""
        text = item.text(untrusted_only=item.direction == "input")
        return len(text.encode()) > self._engine.max_model_len

    async def classify(self, item: GuardInput) -> GuardScore:
        """P(unsafe) of the item's readings (`GuardInput.readings`: the untrusted spans of an input, the
        text of an output); the highest of their windows (one per reading unless it is longer than one
        prompt holds). GuardError when the guard cannot say."""
        began = self._clock()
        readings = item.readings()
        if not readings[0].strip():
            # Nothing the tenant did not write itself: there is nothing for the model to judge.
            return self._score(0.0, began, {"skipped": "no untrusted text", "windows": 0.0})
        categories = ", ".join(item.categories)
        windows = [w for text in readings for w in await self._windows(text, categories, item.policy)]
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._score_window(w, item.cache_salt)) for w in windows]
        except* GuardError as failed:
            # The guard's own failure on any window outweighs the item's on another: that one must count.
            errors = failed.exceptions
            first = next((e for e in errors if not isinstance(e, GuardInputError)), errors[0])
            kind = GuardInputError if isinstance(first, GuardInputError) else GuardError
            raise kind(f"guard {self.name}: {first}") from first
        scores = [t.result() for t in tasks]
        worst = max(range(len(scores)), key=lambda i: scores[i].p_unsafe)
        top = scores[worst]
        raw: dict[str, float | str] = {
            "safe_mass": top.safe_mass,
            "unsafe_mass": top.unsafe_mass,
            "prompt_tokens": float(top.prompt_tokens),
            "windows": float(len(scores)),
            "window": float(worst),
        }
        return self._score(top.p_unsafe, began, raw)

    def _score(self, p_unsafe: float, began: float, raw: dict[str, float | str]) -> GuardScore:
        return GuardScore(
            p_unsafe=p_unsafe,
            guard=self.name,
            model=self.model,
            template_sha256=self.template_sha256,
            latency_s=self._clock() - began,
            raw=raw,
        )

    async def _windows(self, text: str, categories: str, policy: str) -> list[list[int]]:
        """Prompt token ids for `text`: one prompt if it fits the guard model's context, else one per
        overlapping window of the text's tokens."""
        loop = asyncio.get_running_loop()
        prefix, suffix, content = await loop.run_in_executor(
            self._executor, self._tokenize, text, categories, policy
        )
        # One token is generated, so the prompt may take the rest of the context.
        room = self._engine.max_model_len - 1 - len(prefix) - len(suffix)
        if len(content) <= room:
            return [prefix + content + suffix]
        if room < _MIN_WINDOW_TOKENS:
            # The template as rendered with this item's categories and policy name: the item's failure.
            raise GuardInputError(f"guard {self.name}: the prompt template leaves {room} tokens for the text")
        starts = window_starts(len(content), room, min(self._overlap, room // 4))
        if len(starts) > self._max_windows:
            raise GuardInputError(
                f"guard {self.name}: a text of {len(content)} tokens needs {len(starts)} windows of {room}, "
                f"more than the {self._max_windows} allowed; it is not checked in part"
            )
        return [prefix + content[s : s + room] + suffix for s in starts]

    def _tokenize(self, text: str, categories: str, policy: str) -> tuple[list[int], list[int], list[int]]:
        """The prompt's token ids before and after the text, and the text's own (executor work)."""
        user = self._template.render(content=_SLOT, categories=categories, policy=policy)
        messages = [{"role": "system", "content": self._system_prompt}, {"role": "user", "content": user}]
        rendered = self._tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        before, slot, after = str(rendered).partition(_SLOT)
        if not slot:
            raise GuardError(f"guard {self.name}: the chat template dropped the text under check")
        tok = self._tokenizer
        # The template's special tokens are parsed; the text's never are (it may spell "<|im_end|>").
        content = tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return (
            list(tok(before, add_special_tokens=False)["input_ids"]),
            list(tok(after, add_special_tokens=False)["input_ids"]),
            list(content),
        )

    async def _score_window(self, prompt_ids: list[int], cache_salt: str) -> WindowScore:
        """Label masses of one prompt from the engine; GuardError for any failure or a non-answer."""
        backlog, completed = self._backlog, False
        if backlog is not None:
            backlog.begin(len(prompt_ids))
        try:
            logprobs = await self._engine.score_next_token(
                prompt_ids, self._label_token_ids, priority=self.priority, cache_salt=cache_salt or None
            )
            completed = True
        # Whatever the engine raises, the item was not scored: a guard error, which the policy's fail mode
        # handles, never an answer. (Cancellation is not an Exception and passes through.)
        except Exception as exc:
            raise GuardError(f"engine failed: {type(exc).__name__}: {exc}") from exc
        finally:
            if backlog is not None:
                backlog.end(len(prompt_ids), completed=completed)
        return self._masses(logprobs, len(prompt_ids))

    def _masses(self, logprobs: dict[int, float], prompt_tokens: int) -> WindowScore:
        missing = [t for t in self._label_token_ids if t not in logprobs]
        if missing:
            raise GuardError(f"the engine returned no logprob for label token ids {missing}")
        bad = {t: logprobs[t] for t in self._label_token_ids if not logprobs[t] <= _LOGPROB_EPS}
        if bad:  # NaN fails `<=` too
            raise GuardError(f"malformed label logprobs {bad}")
        safe = math.fsum(math.exp(logprobs[t]) for t in self.safe_ids)
        unsafe = math.fsum(math.exp(logprobs[t]) for t in self.unsafe_ids)
        total = safe + unsafe
        if not total >= self.min_label_mass or total <= 0.0:
            # The engine answered, off the labels: the text steered the model away (the item's failure).
            raise GuardInputError(
                f"label mass {total:.3g} (safe {safe:.3g}, unsafe {unsafe:.3g}) is below "
                f"{self.min_label_mass:.3g}: the model is not answering the question"
            )
        return WindowScore(
            p_unsafe=min(1.0, unsafe / total), safe_mass=safe, unsafe_mass=unsafe, prompt_tokens=prompt_tokens
        )

"""The built-in safety policies, and which one the `default` alias gets at start-up.

Every tenant is bound to the `default` policy alias until an administrator binds another. Versions:

- `default@1`: no guard stages (what tenants had before the guard cascade; kept so old records resolve).
- `default@rules-1`: the deterministic rules stage alone (`guard.rules.default_rules`).
- `default@trained-<hash>`: rules, then the n-gram guard, the embedding guard, one score from those two,
  and the trained one-token guard, all of which `lockgate models prepare` builds offline; `<hash>` follows
  the guard versions and the policy's thresholds and weights, so retraining or new thresholds publish a new
  policy version instead of changing one.
- `default@embedding-<hash>`: rules, then the embedding guard alone (`embedding_policy`), versioned alike.

At start-up the alias is created when missing, and moved to the configured choice only while it was last set
by start-up itself: a policy an administrator chose is never overridden by a restart.

Fail modes: the categories where a missed block is worst fail closed; the others fail open (allowed,
recorded as `fail_open`, counted).
"""

from __future__ import annotations

import hashlib
from typing import Literal

import msgspec

from guard.rules import default_rules
from registry.models import (
    CascadeStage,
    FailMode,
    PolicyCategory,
    PolicySpec,
    Severity,
    StageCombination,
)
from registry.service import Registry

DEFAULT_POLICY = "default"
STARTUP_ACTOR = "startup"
Choice = Literal["trained", "embedding", "rules", "none"]

# In the order the trained one-token guard saw them in its prompt (ops/eval/data/dev.jsonl's categories).
_CATEGORIES: tuple[tuple[str, Severity, FailMode], ...] = (
    ("violence", "high", "closed"),
    ("self_harm", "critical", "closed"),
    ("weapons", "critical", "closed"),
    ("malware", "high", "closed"),
    ("prompt_injection", "high", "open"),
    ("hate", "medium", "open"),
)
# The rules stage scores 1 on a block rule, 0 on an allow rule, 0.5 when unsure: 0.5 passes on.
RULES_STAGE = CascadeStage(kind="rules", allow_below=0.25, block_above=0.75, timeout_s=1.0)

NO_GUARDS = PolicySpec(
    categories=(),
    stages=(),
    past_last_stage="escalate",
    fail_modes={},
    hold_back_tokens=0,
    retention="none",
)


class TrainedGuards(msgspec.Struct, frozen=True, kw_only=True):
    """The guard versions `lockgate models prepare` trained and registered (name@version)."""

    embedding: str
    one_token: str
    ngram: str
    # The n-gram stage's output thresholds, chosen on the outputs of the calibration split of its training
    # data (its input pair, chosen on the prompts, is not used: the combine stage judges inputs).
    ngram_output_allow_below: float
    ngram_output_block_above: float
    # The combine stage over the n-gram and embedding stages, fitted on the same calibration split: its
    # weights on their log-odds (n-gram, embedding), its bias and its threshold (`trained_policy`).
    combine_weights: tuple[float, float]
    combine_bias: float
    combine_threshold: float
    # The categories the one-token guard's prompt listed in training, in order ("" = not recorded).
    categories: tuple[str, ...] = ()


def _policy(stages: tuple[CascadeStage, ...]) -> PolicySpec:
    return PolicySpec(
        categories=tuple(PolicyCategory(name=n, severity=s) for n, s, _ in _CATEGORIES),
        stages=stages,
        past_last_stage="escalate",
        fail_modes={n: mode for n, _, mode in _CATEGORIES},
        hold_back_tokens=8,
        check_every_tokens=16,
        retention="hash",
        rules=default_rules(),
    )


def rules_policy() -> PolicySpec:
    """The rules stage alone: clear cases blocked, everything else allowed and flagged for review."""
    return _policy((RULES_STAGE,))


# A stage's pair that settles nothing: it passes every item on (to the combine stage that reads its score).
PASS_ON = (0.0, 1.0)


def _embedding_stage(guards: TrainedGuards, inputs: tuple[float, float]) -> CascadeStage:
    """The embedding guard's stage at the input pair `inputs`, and the output pair chosen for it in the
    trained policy by `ops.eval calibrate`."""
    return CascadeStage(
        guard=guards.embedding,
        allow_below=inputs[0],
        block_above=inputs[1],
        output_allow_below=0.65,
        output_block_above=0.95,
        timeout_s=2.0,
    )


def embedding_policy(guards: TrainedGuards) -> PolicySpec:
    """Rules, then the embedding guard alone (inputs: allowed below 0.55, blocked above 0.65, as `ops.eval
    calibrate` chose for it when it followed the n-gram stage; outputs at its pair of the trained policy):
    the cheapest gate with a model in it (MiniLM on the CPU, no guard engine), and weaker than
    `trained_policy`. For a deployment without a guard engine, and for measuring what a model stage costs
    the hot path (`ops.bench.overhead --guard embedding`)."""
    return _policy((RULES_STAGE, _embedding_stage(guards, (0.55, 0.65))))


def trained_policy(guards: TrainedGuards) -> PolicySpec:
    """Rules, then the n-gram guard, the embedding guard, one score from those two, and the trained one-token
    guard.

    Inputs: what the rules do not settle, the combine stage decides (`guard.combination`): a logistic
    regression over the n-gram and embedding guards' log-odds and its threshold, both fitted when the guards
    were trained, on the calibration split of the multilingual set (`ops.guard_training.combination`: at
    most 5% of look-alike and 3% of everyday prompts blocked there), no band. The n-gram and embedding
    stages pass inputs on to it, so the one-token guard sees none unless the combine stage fails.
    Outputs: the n-gram stage at its own output pair (chosen on the set's outputs when it was trained), the
    embedding stage at the pair `ops.eval calibrate --keep 1` chose, no safe output blocked; the combine stage
    (fitted on prompts) passes them on, and the one-token guard decides what reaches it (no band).
    Figures on the test split are in README.md ("Safety guard").
    """
    threshold = guards.combine_threshold
    return _policy(
        (
            RULES_STAGE,
            CascadeStage(
                guard=guards.ngram,
                allow_below=PASS_ON[0],
                block_above=PASS_ON[1],
                output_allow_below=guards.ngram_output_allow_below,
                output_block_above=guards.ngram_output_block_above,
                timeout_s=2.0,
            ),
            _embedding_stage(guards, PASS_ON),
            CascadeStage(
                kind="combine",
                allow_below=threshold,
                block_above=threshold,
                output_allow_below=PASS_ON[0],
                output_block_above=PASS_ON[1],
                combine=StageCombination(
                    reads=(1, 2), weights=guards.combine_weights, bias=guards.combine_bias
                ),
            ),
            CascadeStage(
                guard=guards.one_token,
                allow_below=0.4,
                block_above=0.4,
                output_allow_below=0.65,
                output_block_above=0.65,
                timeout_s=5.0,
            ),
        )
    )


def _version(prefix: str, spec: PolicySpec, guards: tuple[str, ...]) -> str:
    # The guards and the policy's own content (thresholds): a change of either is a new version.
    content = msgspec.json.encode(spec).decode()
    digest = hashlib.sha256(f"{'|'.join(guards)}|{content}".encode()).hexdigest()
    return f"{prefix}-{digest[:12]}"


def _trained_version(guards: TrainedGuards) -> str:
    return _version("trained", trained_policy(guards), (guards.ngram, guards.embedding, guards.one_token))


def _embedding_version(guards: TrainedGuards) -> str:
    return _version("embedding", embedding_policy(guards), (guards.embedding,))


async def register_default_policy(
    registry: Registry, choice: Choice, guards: TrainedGuards | None, *, actor: str = STARTUP_ACTOR
) -> str:
    """Publish the built-in policy versions (idempotent) and point `default` at `choice`; its name@version.

    `trained` and `embedding` need `guards`; without them it is a start-up error, not a silent downgrade.
    """
    if choice in ("trained", "embedding") and guards is None:
        raise ValueError(
            f"the {choice} default policy needs the prepared guards; run `lockgate models prepare`"
        )
    await registry.publish("policy", DEFAULT_POLICY, "1", NO_GUARDS, actor=actor)
    await registry.publish("policy", DEFAULT_POLICY, "rules-1", rules_policy(), actor=actor)
    version = {"none": "1", "rules": "rules-1"}.get(choice, "")
    if choice == "embedding" and guards is not None:
        version = _embedding_version(guards)
        await registry.publish("policy", DEFAULT_POLICY, version, embedding_policy(guards), actor=actor)
    if choice == "trained" and guards is not None:
        names = tuple(n for n, _, _ in _CATEGORIES)
        if guards.categories and guards.categories != names:
            # The guard would be asked another question than the one it learnt to answer.
            raise ValueError(
                f"the one-token guard was trained with categories {list(guards.categories)}; the default "
                f"policy has {list(names)}: retrain it (`lockgate models prepare`)"
            )
        version = _trained_version(guards)
        await registry.publish("policy", DEFAULT_POLICY, version, trained_policy(guards), actor=actor)
    view = registry.view
    if not view.has_alias("policy", DEFAULT_POLICY) or view.alias("policy", DEFAULT_POLICY).actor == actor:
        current = view.alias("policy", DEFAULT_POLICY) if view.has_alias("policy", DEFAULT_POLICY) else None
        if current is None or [t.version for t in current.targets] != [version]:
            await registry.set_alias("policy", DEFAULT_POLICY, version, actor=actor)
    return f"{DEFAULT_POLICY}@{version}"

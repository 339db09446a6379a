"""The built-in safety policies, and which one the `default` alias gets at start-up.

Every tenant is bound to the `default` policy alias until an administrator binds another. Versions:

- `default@1`: no guard stages (what tenants had before the guard cascade; kept so old records resolve).
- `default@rules-1`: the deterministic rules stage alone (`guard.rules.default_rules`).
- `default@trained-<hash>`: rules, then the n-gram guard, then the embedding guard, then the trained
  one-token guard, all of which `lockgate models prepare` builds offline; `<hash>` follows the guard versions
  and the policy's thresholds, so retraining or new thresholds publish a new policy version instead of
  changing one.
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
from registry.models import CascadeStage, FailMode, PolicyCategory, PolicySpec, Severity
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
    # The n-gram stage's thresholds, chosen on the calibration split of its training data: for inputs (on
    # its prompts) and for outputs (on its outputs).
    ngram_allow_below: float
    ngram_block_above: float
    ngram_output_allow_below: float
    ngram_output_block_above: float
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


def _embedding_stage(guards: TrainedGuards) -> CascadeStage:
    """The embedding guard's stage, at the pairs chosen for it in the trained policy (`trained_policy`)."""
    return CascadeStage(
        guard=guards.embedding,
        allow_below=0.55,
        block_above=0.65,
        output_allow_below=0.65,
        output_block_above=0.95,
        timeout_s=2.0,
    )


def embedding_policy(guards: TrainedGuards) -> PolicySpec:
    """Rules, then the embedding guard alone, at its pairs of the trained policy: the cheapest gate with a
    model in it (MiniLM on the CPU, no guard engine), and weaker than `trained_policy`, whose other stages
    it lacks (its band, 0.55-0.65 there, is escalated here). For a deployment without a guard engine, and
    for measuring what a model stage costs the hot path (`ops.bench.overhead --guard embedding`)."""
    return _policy((RULES_STAGE, _embedding_stage(guards)))


def trained_policy(guards: TrainedGuards) -> PolicySpec:
    """Rules, then the n-gram guard, then the embedding guard, then the trained one-token guard.

    The n-gram stage's thresholds are its own, chosen when it was trained, on the calibration split of the
    multilingual set (ops/guard_training/ngram.py `choose_thresholds`), a pair for inputs chosen on its
    prompts and a pair for outputs chosen on its outputs: it blocks what it is sure of in any language,
    allows what it is sure is benign, and passes the rest on. The later stages' pairs were chosen on the
    same calibration split by `python -m ops.eval calibrate --keep 1` (the n-gram stage kept at its own)
    under its default budget: look-alikes blocked at most 5%, everyday prompts at most 3%, escalations at
    most 10%, no safe output blocked; the most harmful items blocked within it. The one-token guard decides
    what reaches it (no band).
    Figures on the test split are in README.md ("Safety guard").
    """
    return _policy(
        (
            RULES_STAGE,
            CascadeStage(
                guard=guards.ngram,
                allow_below=guards.ngram_allow_below,
                block_above=guards.ngram_block_above,
                output_allow_below=guards.ngram_output_allow_below,
                output_block_above=guards.ngram_output_block_above,
                timeout_s=2.0,
            ),
            _embedding_stage(guards),
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

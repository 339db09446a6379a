"""The cascades `python -m ops.eval score` builds from a policy file: rules stages only.

A model stage needs engines and guard versions from the registry: score a registry policy with `--policy`
instead, which builds the cascade the service itself runs (ops/eval/served_guards.py).
"""

from __future__ import annotations

from pathlib import Path

from guard.cascade import Cascade, Stage
from guard.rules import RulesClassifier, default_rules
from registry.models import PolicySpec, decode_spec

# The harm categories of the development set (ops/eval/data/dev.jsonl).
DEV_CATEGORIES = ("violence", "self_harm", "weapons", "malware", "prompt_injection", "hate")
# The rules stage scores 0 (an allow term), 0.5 (unsure) or 1 (a block rule): any thresholds between these
# three values mean the same.
RULES_ALLOW_BELOW = 0.25
RULES_BLOCK_ABOVE = 0.75


class UnsupportedStageError(Exception):
    """The policy has a stage this command cannot build yet (a model stage)."""


def default_rules_cascade() -> Cascade:
    """One rules stage with the starter rules (`guard.rules.default_rules`); past it, escalate."""
    stage = Stage(
        RulesClassifier(default_rules(), DEV_CATEGORIES),
        allow_below=RULES_ALLOW_BELOW,
        block_above=RULES_BLOCK_ABOVE,
        categories=DEV_CATEGORIES,
        timeout_s=5.0,
    )
    return Cascade([stage], "escalate", DEV_CATEGORIES)


def policy_cascade(spec: PolicySpec) -> Cascade:
    """The policy's cascade, when all its stages are rules stages; UnsupportedStageError otherwise."""
    categories = tuple(c.name for c in spec.categories)
    stages: list[Stage] = []
    for index, stage in enumerate(spec.stages):
        if stage.kind != "rules":
            raise UnsupportedStageError(
                f"stage {index} is a model stage ({stage.guard}): a policy file can hold rules stages only; "
                "publish the policy and score it with `--policy NAME`, which runs the service's own guards"
            )
        stages.append(
            Stage(
                RulesClassifier(spec.rules, stage.categories),
                allow_below=stage.allow_below,
                block_above=stage.block_above,
                categories=stage.categories,
                timeout_s=stage.timeout_s,
                output_thresholds=stage.thresholds("output"),
            )
        )
    return Cascade(stages, spec.past_last_stage, categories)


def load_policy(path: Path) -> PolicySpec:
    """A policy version's spec from a JSON file (registry.models.InvalidError when it is not one)."""
    spec = decode_spec("policy", path.read_bytes())
    if not isinstance(spec, PolicySpec):  # decode_spec returns the union; "policy" always gives a PolicySpec
        raise TypeError(f"{path} is not a policy spec")
    return spec

"""The cascades `python -m ops.eval score` can build without the gateway: rules stages only, for now.

A model stage needs the gateway's classifier factory (engines, guard model versions from the registry); until
`score` can call it, a policy with a model stage is refused with a message that says so.
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
            # TODO(eval): build model stages through the gateway's classifier factory once it exists.
            raise UnsupportedStageError(
                f"stage {index} is a model stage ({stage.guard}): scoring it needs the gateway's classifier "
                "factory, which ops.eval cannot call yet; score rules stages only, or store scores from the "
                "service and use `replay`/`report`"
            )
        stages.append(
            Stage(
                RulesClassifier(spec.rules, stage.categories),
                allow_below=stage.allow_below,
                block_above=stage.block_above,
                categories=stage.categories,
                timeout_s=stage.timeout_s,
            )
        )
    return Cascade(stages, spec.past_last_stage, categories)


def load_policy(path: Path) -> PolicySpec:
    """A policy version's spec from a JSON file (registry.models.InvalidError when it is not one)."""
    spec = decode_spec("policy", path.read_bytes())
    if not isinstance(spec, PolicySpec):  # decode_spec returns the union; "policy" always gives a PolicySpec
        raise TypeError(f"{path} is not a policy spec")
    return spec

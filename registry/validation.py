"""The registry's rules about content, as pure functions over a spec and what is already published.

Each failure raises an error whose message names the alias, version or field at fault: `InvalidError` for
a broken rule, `NotFoundError` for a reference to a version that is not published. Numeric bounds declared
on the Structs (0 <= threshold <= 1, positive layer counts) are enforced by decoding, in `decode_spec`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import msgspec

from registry.errors import InvalidError, NotFoundError
from registry.hashing import sha256_file
from registry.models import (
    AliasTarget,
    CascadeStage,
    EmbeddingModelSpec,
    GuardModelSpec,
    Kind,
    ModelSpec,
    PolicySpec,
    RouteSpec,
    Spec,
    StageCombination,
    TokenizerSpec,
    check_name,
    parse_ref,
)

# Weights are floats written by people ("0.9" and "0.1"): their sum is 1 only within rounding.
WEIGHT_TOLERANCE = 1e-9
MAX_TARGETS = 2
_SHA256 = re.compile("[0-9a-f]{64}")


class Known(Protocol):
    """What validation needs to know about published versions (a `RegistryView` is one)."""

    def has(self, kind: Kind, name: str, version: str) -> bool:
        """Whether `name@version` of `kind` is published."""
        ...


def check_targets(
    kind: Kind, name: str, targets: Sequence[AliasTarget], known: Known
) -> tuple[AliasTarget, ...]:
    """The targets of alias `kind:name`, checked: one version, or two with weights summing to 1."""
    where = f"alias {kind}:{name}"
    if not 1 <= len(targets) <= MAX_TARGETS:
        raise InvalidError(f"{where}: {len(targets)} targets; an alias has 1 target, or 2 for a canary")
    versions = [t.version for t in targets]
    if len(set(versions)) != len(versions):
        raise InvalidError(f"{where}: target version {versions[0]!r} is listed twice")
    for target in targets:
        # Written so that NaN fails too.
        if not (0.0 < target.weight <= 1.0):
            raise InvalidError(f"{where}: weight {target.weight} of {name}@{target.version} is not in (0, 1]")
    total = math.fsum(t.weight for t in targets)
    if abs(total - 1.0) > WEIGHT_TOLERANCE:
        weights = " + ".join(str(t.weight) for t in targets)
        raise InvalidError(f"{where}: canary weights {weights} sum to {total}, not 1")
    for target in targets:
        if not known.has(kind, name, target.version):
            raise NotFoundError(f"{where} -> {name}@{target.version}: no such {kind} version")
    return tuple(targets)


def check_spec(kind: Kind, ref: str, spec: Spec, known: Known) -> None:
    """The rules of `spec` (published as `ref` of `kind`) that involve more than one field or version."""
    if isinstance(spec, ModelSpec):
        check_model(ref, spec, known)
    elif isinstance(spec, GuardModelSpec):
        check_guard(ref, spec, known)
    elif isinstance(spec, PolicySpec):
        check_policy(ref, spec, known)
    elif isinstance(spec, EmbeddingModelSpec):
        check_embedding_model(ref, spec)
    elif isinstance(spec, RouteSpec):
        check_route(ref, spec, known)


def check_route(ref: str, spec: RouteSpec, known: Known) -> None:
    """A route's rules have distinct names and sound token bounds, and each pinned target is published (a
    target named by alias is resolved per request: an alias not set then is a 404 for that request)."""
    owner = f"route {ref}"
    names = [rule.name for rule in spec.rules]
    if len(set(names)) != len(names):
        raise InvalidError(f"{owner}: rule names repeat ({', '.join(names)})")
    for rule in spec.rules:
        low, high = rule.min_prompt_tokens, rule.max_prompt_tokens
        if low is not None and high is not None and low > high:
            raise InvalidError(
                f"{owner}: rule {rule.name}: min_prompt_tokens {low} > max_prompt_tokens {high}"
            )
    for target in spec.targets:
        if "@" in target:
            check_reference(owner, "model", target, known)
        else:
            check_name(f"{owner} target", target)


def check_embedding_model(ref: str, spec: EmbeddingModelSpec) -> None:
    """An embedding model's shortest vectors are no longer than its whole ones."""
    if spec.min_dimensions is not msgspec.UNSET and spec.min_dimensions > spec.dimensions:
        raise InvalidError(
            f"embedding_model {ref}: min_dimensions {spec.min_dimensions} "
            f"is over dimensions {spec.dimensions}"
        )


def check_reference(owner: str, kind: Kind, ref: str, known: Known) -> None:
    """`ref` is a published `name@version` of `kind`; `owner` (e.g. "model chat@1") is named on failure."""
    try:
        name, version = parse_ref(ref)
    except InvalidError as exc:
        raise InvalidError(f"{owner}: {kind} reference {exc}") from exc
    if not known.has(kind, name, version):
        raise NotFoundError(f"{owner} requires {kind} {ref}, which is not published")


def check_model(ref: str, spec: ModelSpec, known: Known) -> None:
    """A model's tokenizer and chat template versions exist."""
    owner = f"model {ref}"
    if not spec.artifact:
        raise InvalidError(f"{owner}: artifact is empty")
    check_reference(owner, "tokenizer", spec.tokenizer, known)
    check_reference(owner, "chat_template", spec.chat_template, known)


def check_guard(ref: str, spec: GuardModelSpec, known: Known) -> None:
    """A one-token guard names an existing model version, a prompt, and non-empty, disjoint label token lists;
    an embedding or n-gram guard names its artifact and the sha256 of its head's weights."""
    owner = f"guard_model {ref}"
    if spec.kind in ("embedding", "ngram"):
        if not spec.artifact:
            raise InvalidError(f"{owner}: an {spec.kind} guard needs its artifact directory")
        if not _SHA256.fullmatch(spec.weights_sha256):
            raise InvalidError(f"{owner}: weights_sha256 must be the sha256 (64 hex digits) of its head")
        return
    check_reference(owner, "model", spec.model, known)
    if not spec.prompt_template:
        raise InvalidError(f"{owner}: prompt_template is empty")
    for field, tokens in (("safe_tokens", spec.safe_tokens), ("unsafe_tokens", spec.unsafe_tokens)):
        if not tokens:
            raise InvalidError(f"{owner}: {field} is empty; list every variant of the label token")
        if "" in tokens:
            raise InvalidError(f"{owner}: {field} holds an empty token")
    both = sorted(set(spec.safe_tokens) & set(spec.unsafe_tokens))
    if both:
        raise InvalidError(f"{owner}: tokens {both} are both safe and unsafe")


def check_policy(ref: str, spec: PolicySpec, known: Known) -> None:
    """Categories are unique, each has exactly one fail mode, stage thresholds are ordered, guards exist,
    rules and stages name only the policy's categories, and rule patterns compile."""
    owner = f"policy {ref}"
    names = [c.name for c in spec.categories]
    if len(set(names)) != len(names) or "" in names:
        raise InvalidError(f"{owner}: category names must be non-empty and unique, got {names}")
    missing = [n for n in names if n not in spec.fail_modes]
    if missing:
        raise InvalidError(f"{owner}: no fail mode for categories {missing}")
    unknown = sorted(set(spec.fail_modes) - set(names))
    if unknown:
        raise InvalidError(f"{owner}: fail modes for unknown categories {unknown}")
    for i, stage in enumerate(spec.stages):
        where = f"{owner} stages[{i}]"
        if not (0.0 <= stage.allow_below <= stage.block_above <= 1.0):
            raise InvalidError(
                f"{where} needs 0 <= allow_below <= block_above <= 1, "
                f"got allow_below={stage.allow_below}, block_above={stage.block_above}"
            )
        _check_output_pair(where, stage)
        strange = sorted(set(stage.categories) - set(names))
        if strange:
            raise InvalidError(f"{where} names unknown categories {strange}")
        combine = stage.combine if not isinstance(stage.combine, msgspec.UnsetType) else None
        if stage.kind != "combine" and combine is not None:
            raise InvalidError(f"{where}: only a combine stage has `combine`")
        if stage.kind == "model":
            check_reference(where, "guard_model", stage.guard, known)
        elif stage.guard:
            raise InvalidError(f"{where}: a {stage.kind} stage names no guard")
        if stage.kind == "combine":
            _check_combination(where, i, combine)
    for i, rule in enumerate(spec.rules.block):
        where = f"{owner} rules.block[{i}]"
        if rule.category not in names:
            raise InvalidError(f"{where} names unknown category {rule.category!r}")
        if not rule.pattern:
            raise InvalidError(f"{where} has an empty pattern")
        if rule.regex:
            try:
                re.compile(rule.pattern)
            except re.error as exc:
                raise InvalidError(f"{where}: pattern {rule.pattern!r} does not compile: {exc}") from exc


def _check_combination(where: str, index: int, combine: StageCombination | None) -> None:
    """A combine stage reads earlier stages, each once, with one weight each (finite: the spec's JSON has
    no infinity or NaN, and msgspec refuses the null they become)."""
    if combine is None:
        raise InvalidError(
            f"{where}: a combine stage needs `combine` (the stages it reads and their weights)"
        )
    reads = combine.reads
    if not reads or len(set(reads)) != len(reads) or any(r >= index for r in reads):
        raise InvalidError(f"{where}: combine.reads must name earlier stages, each once; got {list(reads)}")
    if len(combine.weights) != len(reads):
        raise InvalidError(
            f"{where}: combine.weights needs one weight per stage read ({len(reads)}), "
            f"got {len(combine.weights)}"
        )


def _check_output_pair(where: str, stage: CascadeStage) -> None:
    """A stage's output thresholds: both or neither, each within [0, 1], allow not above block."""
    allow, block = stage.output_allow_below, stage.output_block_above
    if isinstance(allow, msgspec.UnsetType) and isinstance(block, msgspec.UnsetType):
        return
    if isinstance(allow, msgspec.UnsetType) or isinstance(block, msgspec.UnsetType):
        field = "output_allow_below" if isinstance(allow, msgspec.UnsetType) else "output_block_above"
        raise InvalidError(
            f"{where}.{field} is missing: set output_allow_below and output_block_above together"
        )
    for field, value in (("output_allow_below", allow), ("output_block_above", block)):
        if not 0.0 <= value <= 1.0:
            raise InvalidError(f"{where}.{field} must be within [0, 1], got {value}")
    if allow > block:
        raise InvalidError(
            f"{where}.output_allow_below must not exceed output_block_above, "
            f"got output_allow_below={allow}, output_block_above={block}"
        )


def check_tokenizer(
    model_ref: str,
    model: ModelSpec,
    *,
    supplied: str | None = None,
    tokenizer: TokenizerSpec | None = None,
    file_sha256: str | None = None,
) -> None:
    """InvalidError if a tokenizer does not match model `model_ref`.

    It does not match when `supplied` (a tokenizer ref a caller brings) is not the one the model declares,
    or when `file_sha256` (of a model directory's tokenizer.json) differs from `tokenizer`'s content hash.
    """
    if supplied is not None and supplied != model.tokenizer:
        raise InvalidError(
            f"tokenizer {supplied} does not match model {model_ref}, "
            f"which requires tokenizer {model.tokenizer}"
        )
    if file_sha256 is not None:
        if tokenizer is None:
            raise ValueError("file_sha256 needs the tokenizer version to compare with")
        if file_sha256 != tokenizer.content_hash:
            raise InvalidError(
                f"tokenizer.json (sha256 {file_sha256}) does not match tokenizer {model.tokenizer} of model "
                f"{model_ref} (content hash {tokenizer.content_hash})"
            )


def model_dir_of(data_dir: Path, artifact: str) -> Path:
    """The directory of a model version's files: its artifact is `<dir>/<weights file>` under the data
    directory (absolute artifacts are used as they are)."""
    path = Path(artifact)
    root = path if path.is_absolute() else data_dir / path
    return root.parent


def check_model_files(model_ref: str, model: ModelSpec, directory: Path, tokenizer: TokenizerSpec) -> None:
    """InvalidError unless `directory` holds model `model_ref`'s files and its tokenizer.json is the
    tokenizer version the model requires. Blocking (it hashes the file): run it in a worker thread."""
    if not directory.is_dir():
        raise InvalidError(f"model {model_ref}: artifact directory {directory} does not exist")
    tokenizer_json = directory / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise InvalidError(f"model {model_ref}: {directory} has no tokenizer.json")
    check_tokenizer(model_ref, model, tokenizer=tokenizer, file_sha256=sha256_file(tokenizer_json))

"""The guard's labelled data set: a directory of JSONL files, one scenario ("family") per ten languages.

Format of a line (`ops/eval/data/guard/README.md` says how the set was written and what it holds):

    {"id": "s9-p03-ja", "family": "s9-p03", "text": "...", "label": "unsafe", "hazard": "S9",
     "language": "ja", "severity": "critical", "shape": "prompt", "kind": "request", "context": "none"}

`hazard` is the MLCommons / Llama Guard 3 code (S1-S14), `injection`, `jailbreak`, or `none`: the topic the
text touches (a benign look-alike carries the hazard it resembles with label `safe`). `shape` says whether
the text goes into a model (`prompt`: a user message, a pasted document, a tool result) or comes out of one
(`output`); `kind` what it is (`request`, `lookalike`, `everyday` prompts; `reply`, `refusal`, `harmful`
outputs).

Splits are by family, never by item: a family's renderings (the same scenario in ten languages) are all in
`train`, all in `calibration` or all in `test`, so no near-duplicate of a test item is trained on or
calibrated on. Within each group of families of one hazard, shape and kind, in the order of their ids, the
splits go round `train, train, train, calibration, test` from an offset the group's name fixes (60/20/20).
The files hold no split: it is computed here, and a family numbered after its group's others moves no other.
Families of the generated series (`<hazard>-rNN`: the default model's own replies) form a group of their own
and go round `calibration, test` only: never trained on (`GENERATED_SERIES`).
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from pathlib import Path
from typing import Literal

import msgspec

__all__ = [
    "HAZARD_CATEGORY",
    "LANGUAGES",
    "SPLIT_RULE",
    "DataItem",
    "dataset_dir_sha256",
    "family_splits",
    "generated",
    "load_data_dir",
]

Hazard = Literal[
    "S1", "S2", "S3", "S4", "S5", "S6", "S7", "S8", "S9", "S10", "S11", "S12", "S13", "S14",
    "injection", "jailbreak", "none",
]  # fmt: skip
Shape = Literal["prompt", "output"]
Kind = Literal["request", "lookalike", "everyday", "reply", "refusal", "harmful"]
Context = Literal[
    "education", "fiction", "news", "security", "medicine", "history", "everyday", "law", "other", "none"
]
DataLanguage = Literal["en", "de", "fr", "es", "pt", "ar", "hi", "ja", "ru", "zh"]
LANGUAGES: tuple[str, ...] = ("en", "de", "fr", "es", "pt", "ar", "hi", "ja", "ru", "zh")

# The policy category each hazard is reported (and judged) under.
HAZARD_CATEGORY: dict[str, str] = {
    "S1": "violent_crimes",
    "S2": "nonviolent_crimes",
    "S3": "sex_crimes",
    "S4": "child_exploitation",
    "S5": "defamation",
    "S6": "specialized_advice",
    "S7": "privacy",
    "S8": "intellectual_property",
    "S9": "indiscriminate_weapons",
    "S10": "hate",
    "S11": "self_harm",
    "S12": "sexual_content",
    "S13": "elections",
    "S14": "code_interpreter_abuse",
    "injection": "prompt_injection",
    "jailbreak": "jailbreak",
    "none": "benign",
}
_ROUND = ("train", "train", "train", "calibration", "test")
# The default model's own answers (`ops.guard_training.generated_replies`) are never trained on: trained with
# them, the n-gram guard (one model for prompts and outputs) let a plain burglary request through at its input
# thresholds. They calibrate and measure the output checks, half each.
GENERATED_SERIES = "r"
# The version of the rule above, raised whenever it changes: guards trained under another are trained again.
SPLIT_RULE = 2
_HELD_OUT_ROUND = ("calibration", "test")
_UNSAFE_KINDS = ("request", "harmful")


class DataItem(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One line of a data file."""

    id: str
    family: str
    text: str
    label: Literal["safe", "unsafe"]
    hazard: Hazard
    language: DataLanguage
    severity: Literal["none", "low", "medium", "high", "critical"]
    shape: Shape
    kind: Kind
    context: Context


def _check(item: DataItem, where: str) -> None:
    """ValueError naming `where` when the item's fields contradict each other."""
    problems = []
    if item.id != f"{item.family}-{item.language}":
        problems.append(f"id must be <family>-<language>, {item.family}-{item.language}")
    if (item.label == "unsafe") != (item.kind in _UNSAFE_KINDS):
        problems.append(f"label {item.label} does not fit kind {item.kind}")
    if (item.severity == "none") != (item.label == "safe"):
        problems.append(f"severity {item.severity} does not fit label {item.label}")
    if (item.hazard == "none") != (item.kind in ("everyday", "reply")):
        problems.append(f"hazard {item.hazard} does not fit kind {item.kind}")
    if (item.shape == "output") != (item.kind in ("reply", "refusal", "harmful")):
        problems.append(f"shape {item.shape} does not fit kind {item.kind}")
    if problems:
        raise ValueError(f"{where}: {'; '.join(problems)}")


def load_data_dir(directory: str | Path) -> list[DataItem]:
    """Every item of the directory's `*.jsonl` files (in name order); ValueError naming the line of an invalid
    item, a repeated id, or a family that is not one scenario in each of the ten languages."""
    decoder = msgspec.json.Decoder(DataItem)
    items: list[DataItem] = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        for lineno, line in enumerate(path.read_bytes().splitlines(), start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                item = decoder.decode(line)
            except msgspec.DecodeError as exc:
                raise ValueError(f"{where}: {exc}") from exc
            _check(item, where)
            items.append(item)
    if not items:
        raise ValueError(f"{directory}: no items in *.jsonl")
    seen: set[str] = set()
    families: dict[str, list[DataItem]] = defaultdict(list)
    for item in items:
        if item.id in seen:
            raise ValueError(f"{directory}: item id {item.id!r} appears twice")
        seen.add(item.id)
        families[item.family].append(item)
    for family, members in families.items():
        languages = sorted(m.language for m in members)
        if languages != sorted(LANGUAGES):
            raise ValueError(f"{directory}: family {family} has languages {languages}, not one of each")
        shared = {(m.label, m.hazard, m.severity, m.shape, m.kind, m.context) for m in members}
        if len(shared) != 1:
            raise ValueError(f"{directory}: family {family}'s items differ in label, hazard or kind")
    return items


def generated(family: str) -> bool:
    """Whether `family` is of the series the default model generated (`<hazard>-rNN`: its own replies)."""
    return family.partition("-")[2].startswith(GENERATED_SERIES)


def family_splits(items: list[DataItem]) -> dict[str, str]:
    """The split of each family (see the module docstring)."""
    groups: dict[tuple[str, ...], set[str]] = defaultdict(set)
    for item in items:
        series = ("generated",) if generated(item.family) else ()
        groups[(item.hazard, item.shape, item.kind, *series)].add(item.family)
    splits: dict[str, str] = {}
    for key, families in groups.items():
        rounds = _HELD_OUT_ROUND if "generated" in key else _ROUND
        offset = hashlib.sha256("/".join(key).encode()).digest()[0] % len(rounds)
        for i, family in enumerate(sorted(families)):
            splits[family] = rounds[(i + offset) % len(rounds)]
    return splits


def dataset_dir_sha256(directory: str | Path) -> str:
    """sha256 over the directory's `*.jsonl` files, each name and its bytes' sha256, in name order: which
    version of the set a figure or a trained guard came from."""
    digest = hashlib.sha256()
    for path in sorted(Path(directory).glob("*.jsonl")):
        digest.update(f"{path.name}\0{hashlib.sha256(path.read_bytes()).hexdigest()}\n".encode())
    return digest.hexdigest()

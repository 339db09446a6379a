"""The guard's labelled data set (`ops/eval/data/guard/`): well-formed, at the scale and breadth the guard
needs, and split by scenario so that no rendering of a test scenario is trained or calibrated on."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import msgspec
import pytest

from guard.dataset import HAZARD_CATEGORY, LANGUAGES, family_splits, load_data_dir
from guard.labelled import LabelledItem, guard_input, load_items
from ops.eval.evaluation import dataset_sha256
from ops.guard_training.data import load_training_set, sample

DATA = Path(__file__).resolve().parents[2] / "ops" / "eval" / "data" / "guard"
HAZARDS = [h for h in HAZARD_CATEGORY if h != "none"]


@pytest.fixture(scope="module")
def items() -> list[LabelledItem]:
    return load_items(DATA)


def test_the_set_has_the_scale_and_languages_it_promises(items: list[LabelledItem]) -> None:
    assert len(items) >= 3000
    by_language = Counter(i.language for i in items)
    assert set(by_language) == set(LANGUAGES)
    # Every scenario in every language: the languages are equally represented.
    assert len(set(by_language.values())) == 1


@pytest.mark.parametrize("hazard", HAZARDS)
def test_every_hazard_has_requests_and_look_alikes_in_every_split(
    items: list[LabelledItem], hazard: str
) -> None:
    category = HAZARD_CATEGORY[hazard]
    mine = [i for i in items if i.category == category and i.shape == "prompt"]
    for split in ("train", "calibration", "test"):
        kinds = {i.kind for i in mine if i.split == split}
        assert "request" in kinds, (hazard, split)
        if split != "calibration":
            assert "lookalike" in kinds, (hazard, split)
    # Look-alikes are safe, requests unsafe, whatever the topic.
    assert {i.label for i in mine if i.kind == "lookalike"} == {"safe"}
    assert {i.label for i in mine if i.kind == "request"} == {"unsafe"}


def test_outputs_hold_everyday_replies_refusals_and_harmful_replies(items: list[LabelledItem]) -> None:
    outputs = Counter((i.kind, i.label) for i in items if i.shape == "output")
    assert outputs[("reply", "safe")] >= 100
    assert outputs[("refusal", "safe")] >= 100
    assert outputs[("harmful", "unsafe")] >= 100
    # An output is judged as generated text, not as a user's prompt.
    output = next(i for i in items if i.shape == "output")
    assert guard_input(output).direction == "output"


def test_a_scenario_never_straddles_splits(items: list[LabelledItem]) -> None:
    splits: dict[str, set[str]] = {}
    for item in items:
        splits.setdefault(item.family, set()).add(item.split)
    assert all(len(s) == 1 for s in splits.values())
    # About 60/20/20 by scenario.
    counts = Counter(next(iter(s)) for s in splits.values())
    total = sum(counts.values())
    assert 0.5 <= counts["train"] / total <= 0.7
    assert 0.12 <= counts["calibration"] / total <= 0.28
    assert 0.12 <= counts["test"] / total <= 0.28


def test_no_text_appears_twice(items: list[LabelledItem]) -> None:
    texts = Counter(" ".join(i.text.lower().split()) for i in items)
    assert [t for t, n in texts.items() if n > 1] == []


def test_the_version_names_every_file(tmp_path: Path) -> None:
    for path in DATA.glob("*.jsonl"):
        (tmp_path / path.name).write_bytes(path.read_bytes())
    assert dataset_sha256(tmp_path) == dataset_sha256(DATA)
    first = sorted(tmp_path.glob("*.jsonl"))[0]
    first.write_bytes(first.read_bytes() + b"\n")
    assert dataset_sha256(tmp_path) != dataset_sha256(DATA)


def _line(family: str, language: str, **fields: str) -> str:
    item = {
        "id": f"{family}-{language}",
        "family": family,
        "text": f"text of {family} in {language}",
        "label": "unsafe",
        "hazard": "S1",
        "language": language,
        "severity": "high",
        "shape": "prompt",
        "kind": "request",
        "context": "none",
        **fields,
    }
    return json.dumps(item, ensure_ascii=False)


def test_a_family_missing_a_language_or_contradicting_itself_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s1.jsonl"
    path.write_text("\n".join(_line("s1-p01", lang) for lang in LANGUAGES[:-1]))
    with pytest.raises(ValueError, match="s1-p01 has languages"):
        load_data_dir(tmp_path)
    lines = [_line("s1-p01", lang) for lang in LANGUAGES[:-1]] + [_line("s1-p01", "zh", severity="low")]
    path.write_text("\n".join(lines))
    with pytest.raises(ValueError, match="differ"):
        load_data_dir(tmp_path)
    path.write_text(_line("s1-p01", "en", label="safe"))
    with pytest.raises(ValueError, match=r"s1.jsonl:1: label safe does not fit kind request"):
        load_data_dir(tmp_path)


def test_splits_are_by_family_and_a_later_family_moves_none(tmp_path: Path) -> None:
    path = tmp_path / "s1.jsonl"
    path.write_text("\n".join(_line(f"s1-p{n:02}", lang) for n in range(1, 11) for lang in LANGUAGES))
    before = family_splits(load_data_dir(tmp_path))
    assert Counter(before.values()) == {"train": 6, "calibration": 2, "test": 2}
    with path.open("a") as out:
        out.write("\n" + "\n".join(_line("s1-p11", lang) for lang in LANGUAGES))
    after = family_splits(load_data_dir(tmp_path))
    assert {f: after[f] for f in before} == before


def test_a_sample_is_the_same_whatever_the_order_and_holds_out_only_the_test_split() -> None:
    data = load_training_set(DATA, "train")
    small = sample(data, 300, 100)
    assert (len(small.train), len(small.test)) == (300, 100)
    assert {i.split for i in small.train} == {"train"}
    assert {i.split for i in small.test} == {"test"}  # calibration items are never its held-out figures
    shuffled = msgspec.structs.replace(data, train=data.train[::-1], test=data.test[::-1])
    again = sample(shuffled, 300, 100)
    assert [i.id for i in again.train] == [i.id for i in small.train]
    assert [i.id for i in again.test] == [i.id for i in small.test]
    # Spread like the whole: every language, both labels.
    assert {i.language for i in small.train} == set(LANGUAGES)
    assert {i.label for i in small.train} == {"safe", "unsafe"}
    # 0: all of them.
    whole = sample(data, 0, 0)
    assert len(whole.train) == len(data.train)
    assert len(whole.test) == sum(i.split == "test" for i in data.test)


def test_generated_replies_are_never_trained_on_and_move_no_written_family(tmp_path: Path) -> None:
    reply = {"label": "safe", "hazard": "none", "severity": "none", "shape": "output", "kind": "reply"}
    path = tmp_path / "replies.jsonl"
    path.write_text(
        "\n".join(_line(f"none-o{n:02}", lang, **reply) for n in range(1, 11) for lang in LANGUAGES)
    )
    before = family_splits(load_data_dir(tmp_path))
    generated = [_line(f"none-r{n:02}", lang, **reply) for n in range(1, 11) for lang in LANGUAGES]
    with path.open("a") as out:
        out.write("\n" + "\n".join(generated))
    after = family_splits(load_data_dir(tmp_path))
    assert {f: after[f] for f in before} == before
    held_out = {f: split for f, split in after.items() if f.startswith("none-r")}
    assert Counter(held_out.values()) == {"calibration": 5, "test": 5}

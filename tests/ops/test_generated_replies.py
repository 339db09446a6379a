"""The generated replies' data lines: which prompts are answered, and how the answers become families."""

from __future__ import annotations

from guard.dataset import LANGUAGES, DataItem, family_splits, load_data_dir
from ops.guard_training.generated_replies import as_items, chosen_prompts

DATA = "ops/eval/data/guard"


def everyday(family: str, language: str) -> DataItem:
    return DataItem(
        id=f"{family}-{language}",
        family=family,
        text=f"{family} in {language}",
        label="safe",
        hazard="none",
        language=language,  # type: ignore[arg-type]
        severity="none",
        shape="prompt",
        kind="everyday",
        context="none",
    )


def test_every_nth_scenario_is_answered_in_all_its_languages() -> None:
    items = [everyday(f"none-l{n:02d}", language) for n in range(1, 8) for language in LANGUAGES]
    prompts = chosen_prompts(items, 3)
    assert sorted({p.family for p in prompts}) == ["none-l01", "none-l04", "none-l07"]
    assert len(prompts) == 30
    lines = as_items(prompts, [f"answer {i}" for i in range(30)])
    assert [line["family"] for line in lines[::10]] == ["none-r01", "none-r02", "none-r03"]
    assert lines[10] == {
        "id": "none-r02-ar",
        "family": "none-r02",
        "text": "answer 10",
        "label": "safe",
        "hazard": "none",
        "language": "ar",  # languages in id order
        "severity": "none",
        "shape": "output",
        "kind": "reply",
        "context": "none",
    }


def test_the_generated_replies_moved_no_hand_written_familys_split() -> None:
    items = load_data_dir(DATA)
    generated = [i for i in items if i.family.startswith("none-r")]
    assert len(generated) >= 500
    assert {(i.shape, i.kind, i.label) for i in generated} == {("output", "reply", "safe")}
    before = family_splits([i for i in items if not i.family.startswith("none-r")])
    after = family_splits(items)
    assert {f: after[f] for f in before} == before
    # The generated families are spread over the three splits as every group is.
    assert {after[i.family] for i in generated} == {"train", "calibration", "test"}

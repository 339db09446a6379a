"""The generated replies' data lines: which prompts are answered, and how the answers become families."""

from __future__ import annotations

from guard.dataset import LANGUAGES, DataItem
from ops.guard_training.generated_replies import as_items, chosen_prompts


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

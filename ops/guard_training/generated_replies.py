"""The default model's own answers to the guard set's everyday prompts, as labelled safe outputs.

    python -m ops.guard_training.generated_replies [--data ops/eval/data/guard] [--every 3]
                                                   [--out ops/eval/data/guard/replies.jsonl]

The output guard judges what the served model writes, and hand-written replies are tidier than a 135M
model's (which drifts, repeats itself, and answers an Arabic greeting with a paragraph on religion): a guard
calibrated on hand-written replies alone cut everyday answers live. So every `every`-th everyday prompt
scenario (in id order) is answered by the default model (SmolLM2-135M-Instruct as `lockgate models prepare`
builds it, offline, with vLLM: its own chat template and default system prompt, temperature 0.7, top-p 0.95,
128 tokens at most, seed 0 per request), in each of its ten languages, and each answer becomes one item of
a family `none-rNN` (shape `output`, kind `reply`, label `safe`), numbered in the order of the prompt
scenarios. The families sort after the hand-written replies (`none-oNN`), so adding them moves no other
family's split.

The answers are not edited: they are what users of the embedded default get (read them for harm before
committing them: a first run's 600 held nothing harmful; everyday prompts get everyday, if often confused,
answers); an answer that repeats another item's text word for word is regenerated with the next seed. The
set holds them as calibration and test data only (`guard.dataset.GENERATED_SERIES`: never trained on).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway.config import ModelConfig
from guard.dataset import DataItem, load_data_dir

DATA = Path(__file__).resolve().parent.parent / "eval" / "data" / "guard"
MAX_TOKENS = 128


def chosen_prompts(items: Sequence[DataItem], every: int) -> list[DataItem]:
    """The everyday prompts of every `every`-th everyday scenario, in family then language order."""
    families = sorted({i.family for i in items if i.shape == "prompt" and i.kind == "everyday"})
    keep = set(families[::every])
    return sorted((i for i in items if i.family in keep), key=lambda i: (i.family, i.id))


def as_items(prompts: Sequence[DataItem], texts: Sequence[str]) -> list[dict[str, str]]:
    """The answers as data lines: one `none-rNN` family per prompt scenario, its languages in order."""
    number = {family: n for n, family in enumerate(sorted({p.family for p in prompts}), start=1)}
    lines = []
    for prompt, text in zip(prompts, texts, strict=True):
        family = f"none-r{number[prompt.family]:02d}"
        lines.append(
            {
                "id": f"{family}-{prompt.language}",
                "family": family,
                "text": text,
                "label": "safe",
                "hazard": "none",
                "language": prompt.language,
                "severity": "none",
                "shape": "output",
                "kind": "reply",
                "context": "none",
            }
        )
    return lines


def generate(prompts: Sequence[DataItem], model_dir: Path, known: set[str]) -> list[str]:  # pragma: no cover
    """The model's answer to each prompt; an answer that is empty or already `known` is asked again with the
    next seed (at most five times)."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        max_model_len=2048,
        seed=0,
        enforce_eager=True,
        kv_cache_memory_bytes=2 << 30,
        max_num_seqs=128,
    )
    answers: dict[int, str] = {}
    pending = list(range(len(prompts)))
    for seed in range(5):
        params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=MAX_TOKENS, seed=seed)
        conversations: list[Any] = [[{"role": "user", "content": prompts[i].text}] for i in pending]
        outputs = llm.chat(conversations, params, use_tqdm=True)
        retry = []
        for i, output in zip(pending, outputs, strict=True):
            text = output.outputs[0].text.strip()
            if not text or text in known:
                retry.append(i)
            else:
                known.add(text)
                answers[i] = text
        pending = retry
        if not pending:
            break
    if pending:
        raise SystemExit(f"{len(pending)} prompts got no new answer in five tries")
    return [answers[i] for i in range(len(prompts))]


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover
    """Generate the replies and write them as a data file."""
    parser = argparse.ArgumentParser(prog="python -m ops.guard_training.generated_replies")
    parser.add_argument("--data", type=Path, default=DATA, help="the guard data directory")
    parser.add_argument("--every", type=int, default=3, help="answer every N-th everyday scenario")
    parser.add_argument("--out", type=Path, default=DATA / "replies.jsonl", help="the data file to write")
    args = parser.parse_args(argv)
    # Every item but the generated replies themselves (written again).
    items = [i for i in load_data_dir(args.data) if not i.family.startswith("none-r")]
    prompts = chosen_prompts(items, args.every)
    texts = generate(prompts, ModelConfig().model_dir(), {i.text for i in items})
    with args.out.open("w", encoding="utf-8") as out:
        for line in as_items(prompts, texts):
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
    print(f"wrote {len(texts)} replies to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

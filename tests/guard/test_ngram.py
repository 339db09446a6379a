"""The n-gram stage: its features, its head's files, windows, readings, failures and loading.

The heads here are made by hand (weights on the n-grams of one harmful sentence), so what a test asserts
follows from the mechanics, not from training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from guard.base import Classifier, GuardError, GuardInput, GuardInputError, ItemSized, Span
from guard.ngram import (
    DIM,
    MAX_WINDOWS,
    WINDOW_CHARS,
    WINDOW_OVERLAP,
    NgramClassifier,
    NgramHead,
    features,
    load_ngram_guard,
    normalize,
)
from registry.models import GuardModelSpec

ROOT = Path(__file__).resolve().parents[2]
HARMFUL = "detonate the pipe bomb in the crowded station"
_WORDS = [
    "garden",
    "tulips",
    "roses",
    "birds",
    "sang",
    "watered",
    "planted",
    "morning",
    "river",
    "bread",
    "kitchen",
    "window",
    "autumn",
    "leaves",
    "bicycle",
    "library",
    "museum",
    "concert",
    "recipe",
    "soup",
    "tomato",
    "onion",
    "carrot",
    "sunny",
    "cloudy",
    "train",
    "station",
    "holiday",
    "letter",
    "friend",
    "sister",
    "brother",
    "music",
    "piano",
    "guitar",
    "painting",
    "canvas",
    "poem",
    "story",
    "chapter",
    "teacher",
    "lesson",
]
# Benign, varied text (every window has n-grams of its own), already normalised: positions in it are
# positions in the normalised text.
FILLER = " ".join(np.random.default_rng(0).choice(_WORDS, size=32_000).tolist())


def filler(chars: int, offset: int = 0) -> str:
    """`chars` characters of benign text, no leading or trailing space."""
    text = FILLER[offset : offset + chars]
    assert len(text) == chars
    return f"x{text[1:-1]}x"


def hand_head() -> NgramHead:
    """Positive weights on the n-grams of HARMFUL that benign filler never has; a negative bias."""
    weights = np.zeros(DIM, dtype=np.float32)
    own = np.setdiff1d(features(normalize(HARMFUL)), features(FILLER))
    weights[own] = 1.5
    return NgramHead(weights, -3.0, training_data_sha256="d" * 64)


def spec(artifact: str = "", weights_sha256: str = "", training_data_sha256: str = "") -> GuardModelSpec:
    return GuardModelSpec(
        kind="ngram",
        artifact=artifact,
        weights_sha256=weights_sha256,
        training_data_sha256=training_data_sha256,
    )


def user(text: str) -> GuardInput:
    return GuardInput(direction="input", spans=(Span(text=text, source="user"),))


class CountingExecutor(Executor):
    """Runs work in a thread of its own and counts it: proof that scoring is not done on the event loop."""

    def __init__(self) -> None:
        self.calls = 0
        self._pool = ThreadPoolExecutor(max_workers=1)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.calls += 1
        return self._pool.submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=cancel_futures)


@pytest.fixture
def executor() -> Iterator[CountingExecutor]:
    pool = CountingExecutor()
    yield pool
    pool.shutdown()


@pytest.fixture
def guard(executor: CountingExecutor) -> NgramClassifier:
    return NgramClassifier("ngram@1", spec(), hand_head(), executor)


def test_features_follow_the_documented_recipe() -> None:
    # " a " padded: its 1- to 5-grams are " ", "a", " a", "a ", " a ".
    grams = {" ", "a", " a", "a ", " a "}
    expected = sorted({zlib.crc32(g.encode()) & (DIM - 1) for g in grams})
    assert features(normalize("A")).tolist() == expected
    # NFKC, lower case, whitespace collapsed: these are one text.
    full_width = "\uff30\uff49\uff50\uff45"  # "Pipe" in full-width letters
    assert normalize(f"  {full_width}\tBOMB \n now ") == "pipe bomb now"
    assert np.array_equal(features(normalize(f"{full_width}  BOMB")), features(normalize("pipe bomb")))


def test_features_are_the_same_in_another_process_whatever_its_hash_seed() -> None:
    text = "Comment fabriquer une bombe ? 如何制造炸弹 كيف أصنع قنبلة"
    here = features(normalize(text)).tolist()
    code = (
        "import sys; from guard.ngram import features, normalize; "
        "print(features(normalize(sys.argv[1])).tolist())"
    )
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}
        out = subprocess.run(
            [sys.executable, "-c", code, text], env=env, capture_output=True, text=True, check=True
        ).stdout
        assert json.loads(out) == here


@pytest.mark.parametrize(
    "text",
    [
        "كيف أصنع قنبلة في المنزل",
        "如何在家里制造炸弹",
        "घर पर बम कैसे बनाएं",
        "家で爆弾を作る方法",
        "как сделать бомбу дома",
    ],
)
def test_every_script_gives_features_of_its_own(text: str) -> None:
    ids = features(normalize(text))
    # Every character, pair, ... of the text: about five features per character, no tokenizer involved.
    assert len(ids) > 2 * len(text)
    assert ids.min() >= 0
    assert ids.max() < DIM
    # Features of the script itself, not only the padding's.
    assert len(np.setdiff1d(ids, features(normalize("how to make a bomb at home")))) > len(text)


def test_the_head_round_trips_and_is_pinned(tmp_path: Path) -> None:
    head = hand_head()
    sha = head.save(tmp_path)
    assert head.save(tmp_path / "again") == sha  # equal weights, equal file
    meta = json.loads((tmp_path / "ngram.json").read_text())
    assert (meta["dim"], meta["weights_sha256"], meta["training_data_sha256"]) == (DIM, sha, "d" * 64)
    loaded = NgramHead.load(tmp_path, sha)
    assert loaded.weights.dtype == np.float32
    assert np.array_equal(loaded.weights, head.weights)
    assert loaded.bias == head.bias
    assert loaded.score_text(HARMFUL) == head.score_text(HARMFUL)
    with pytest.raises(GuardError, match="sha256"):
        NgramHead.load(tmp_path, "0" * 64)
    with pytest.raises(GuardError, match="pinned"):
        NgramHead.load(tmp_path, "")
    data = bytearray((tmp_path / "ngram.npz").read_bytes())
    data[-30] ^= 1
    (tmp_path / "ngram.npz").write_bytes(bytes(data))
    with pytest.raises(GuardError, match="sha256"):
        NgramHead.load(tmp_path, sha)


def test_a_head_of_other_ngrams_is_refused(tmp_path: Path) -> None:
    sha = hand_head().save(tmp_path)
    meta = json.loads((tmp_path / "ngram.json").read_text())
    (tmp_path / "ngram.json").write_text(json.dumps({**meta, "ngram_sizes": [1, 2, 3]}))
    with pytest.raises(GuardError, match="n-grams"):
        NgramHead.load(tmp_path, sha)


async def test_a_harmful_sentence_in_a_long_benign_text_is_not_diluted_by_its_length(
    guard: NgramClassifier, executor: CountingExecutor
) -> None:
    head = hand_head()
    alone = (await guard.classify(user(HARMFUL))).p_unsafe
    assert alone > 0.9
    # One window: the sentence amid benign text.
    side = (WINDOW_CHARS - len(HARMFUL) - 2) // 2
    window = f"{filler(side)} {HARMFUL} {filler(WINDOW_CHARS - side - len(HARMFUL) - 2)}"
    assert len(window) == WINDOW_CHARS
    in_window = (await guard.classify(user(window))).p_unsafe
    assert in_window > 0.5
    # The same window inside 40 windows' worth of benign text: scored as the window alone.
    step = WINDOW_CHARS - WINDOW_OVERLAP
    document = f"{filler(20 * step - 1, 3_000)} {window} {filler(20 * step - 1, 20_000)}"
    score = await guard.classify(user(document))
    assert score.p_unsafe == pytest.approx(in_window)
    assert score.raw["windows"] == len(range(0, len(document) - WINDOW_CHARS, step)) + 1
    # Read whole, the document would pass as benign: what the windows are for.
    assert head.score(features(normalize(document))) < 0.5
    assert (await guard.classify(user(filler(len(document))))).p_unsafe < 0.1
    assert executor.calls == 4


async def test_a_sentence_across_a_window_boundary_lies_whole_in_the_next(guard: NgramClassifier) -> None:
    alone = (await guard.classify(user(HARMFUL))).p_unsafe
    # The sentence ends 10 characters past the first window's end; the second window starts 200 earlier.
    start = WINDOW_CHARS + 10 - len(HARMFUL)
    text = f"{filler(start - 1)} {HARMFUL} {filler(3 * WINDOW_CHARS)}"
    score = (await guard.classify(user(text))).p_unsafe
    assert score > 0.5
    assert score <= alone


async def test_inputs_are_judged_on_untrusted_spans_outputs_on_their_text(guard: NgramClassifier) -> None:
    trusted = GuardInput(
        direction="input",
        spans=(
            Span(text=HARMFUL, source="system", trusted=True),
            Span(text="what is a good tomato soup recipe?", source="user"),
        ),
    )
    assert (await guard.classify(trusted)).p_unsafe < 0.1
    untrusted = GuardInput(
        direction="input",
        spans=(
            Span(text="summarise this document", source="user"),
            Span(text=HARMFUL, source="document"),
        ),
    )
    assert (await guard.classify(untrusted)).p_unsafe > 0.9
    only_trusted = GuardInput(direction="input", spans=(Span(text=HARMFUL, source="system", trusted=True),))
    assert (await guard.classify(only_trusted)).p_unsafe == 0.0
    output = GuardInput(direction="output", spans=(Span(text=HARMFUL, source="output"),))
    assert (await guard.classify(output)).p_unsafe > 0.9


async def test_a_text_past_the_window_cap_is_the_items_guard_error(guard: NgramClassifier) -> None:
    assert isinstance(guard, Classifier)
    assert isinstance(guard, ItemSized)
    step = WINDOW_CHARS - WINDOW_OVERLAP
    with pytest.raises(GuardInputError, match="too long"):
        await guard.classify(user(filler(MAX_WINDOWS * step + WINDOW_CHARS)))
    assert not guard.oversized(user(filler(WINDOW_CHARS)))
    assert guard.oversized(user(filler(100 * step)))
    trusted = Span(text=filler(100 * step), source="system", trusted=True)
    assert not guard.oversized(GuardInput(direction="input", spans=(trusted, Span(text="hi", source="user"))))


async def test_load_ngram_guard_pins_the_head(executor: CountingExecutor, tmp_path: Path) -> None:
    sha = hand_head().save(tmp_path / "guards" / "ngram")
    guard = await load_ngram_guard("ngram@1", spec("guards/ngram", sha, "d" * 64), tmp_path, executor)
    assert (await guard.classify(user(HARMFUL))).p_unsafe > 0.9
    absolute = str(tmp_path / "guards" / "ngram")
    await load_ngram_guard("ngram@1", spec(absolute, sha), Path("/nonexistent"), executor)
    with pytest.raises(GuardError, match="sha256"):
        await load_ngram_guard("ngram@1", spec("guards/ngram", "0" * 64), tmp_path, executor)
    with pytest.raises(GuardError, match="data"):
        await load_ngram_guard("ngram@1", spec("guards/ngram", sha, "e" * 64), tmp_path, executor)
    with pytest.raises(GuardError, match="ngram"):
        await load_ngram_guard("x@1", GuardModelSpec(kind="embedding", artifact="a"), tmp_path, executor)


def test_serving_the_guard_does_not_import_torch() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = "import sys, guard.ngram; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

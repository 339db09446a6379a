"""Prepare a guards directory: train the three guards once, and reuse them while nothing changed.

Layout of a guards directory (`<data_dir>/guards/` for the default guards):

    lockgate-guards.json        PreparedGuards: written last, so its presence means the directory is complete
    SmolLM2-135M-guard/         the one-token guard model, an ordinary model directory vLLM serves
        config.json, generation_config.json, tokenizer.json, tokenizer_config.json, chat_template.jinja
                                (the base model's, byte for byte), model.safetensors,
        lockgate-model.json     (weights sha256, as `lockgate models prepare` writes for the served model)
        guard.json              OneTokenReport: data sha256, split, ids trained on, method, figures
    minilm-guard/               the embedding guard's artifact
        head.npz, head.json     the logistic head (guard/embedding.py)
        guard.json              EmbeddingReport
    ngram-guard/                the n-gram guard's artifact, trained on the multilingual set
        ngram.npz, ngram.json   the head (guard/ngram.py)
        guard.json              NgramReport: its thresholds, chosen on the set's calibration split

The manifest also holds the combine stage over the n-gram and embedding guards, fitted on the calibration
split's prompts once both are trained (`ops.guard_training.combination`).

The one-token guard is trained on a labelled file (ops/eval/data/dev.jsonl by default: training it on the
multilingual set does not fit the budget, see README "Safety guard"); the n-gram guard on the train split
of a labelled directory (ops/eval/data/guard/ by default), its thresholds chosen on that directory's
calibration split (ops/guard_training/ngram.py states the rule); the embedding guard on a sample of the same
train split (`EmbeddingSettings.train_items`).

A directory is reused when its manifest names the same training data (sha256 of the file's bytes, and of
the directory's), the same split, the same base model weights, the same settings and the same guard prompt
(template and system message), and its files are there; otherwise it is trained
again beside the old one and swapped in whole, so an interrupted run never leaves half a directory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from guard.dataset import SPLIT_RULE, dataset_dir_sha256
from guard.default_guard import JUDGE_PROMPT
from guard.embedding import HEAD_WEIGHTS as EMBEDDING_HEAD
from guard.ngram import HEAD_WEIGHTS as NGRAM_HEAD
from guard.one_token import SYSTEM_PROMPT
from ops.guard_training.combination import PreparedCombination, fit_combination
from ops.guard_training.data import Metrics, TrainError, load_training_set
from ops.guard_training.embedding import EmbeddingSettings, train_embedding
from ops.guard_training.ngram import DEFAULT_GUARD_DATA, DirectedFigures, NgramSettings, train_ngram
from ops.guard_training.one_token import OneTokenSettings, train_one_token
from ops.models.prepare import PrepareError, verify
from registry.hashing import sha256_file
from registry.models import GuardModelSpec

GUARDS_DIR = "guards"
MANIFEST = "lockgate-guards.json"  # registry/default_guards.py reads it under the same name
ONE_TOKEN_NAME = "SmolLM2-135M-guard"
EMBEDDING_NAME = "minilm-guard"
NGRAM_NAME = "ngram-guard"
DEFAULT_DATA = Path(__file__).resolve().parent.parent / "eval" / "data" / "dev.jsonl"

Say = Callable[[str], None]


class PreparedOneToken(msgspec.Struct, frozen=True, kw_only=True):
    """The one-token guard of a guards directory: its model directory and the prompt it was trained on."""

    name: str  # directory, model name and guard name
    weights_sha256: str
    system_prompt: str
    prompt_template: str
    categories: tuple[str, ...]  # what the prompt listed in training: the stage's categories to serve it with
    safe_tokens: tuple[str, ...]
    unsafe_tokens: tuple[str, ...]
    metrics: Metrics
    zero_shot: Metrics  # the zero-shot judge on the same held-out items


class PreparedEmbedding(msgspec.Struct, frozen=True, kw_only=True):
    """The embedding guard of a guards directory: its artifact directory, the head's sha256 and its data's."""

    name: str  # directory and guard name
    weights_sha256: str
    training_data_sha256: str  # of the multilingual directory it is trained on (as the n-gram guard)
    metrics: Metrics


class PreparedNgram(msgspec.Struct, frozen=True, kw_only=True):
    """The n-gram guard of a guards directory: its artifact directory, the head's sha256, the data it was
    trained on, and the stage thresholds chosen on that data's calibration split: a pair for inputs (chosen on
    its prompts) and a pair for outputs (chosen on its outputs). A manifest of an older layout, with one pair,
    fails to decode, so its guards are trained again."""

    name: str  # directory and guard name
    weights_sha256: str
    training_data_sha256: str  # guard.dataset.dataset_dir_sha256 of the labelled directory
    data_dir: str
    allow_below: float
    block_above: float
    output_allow_below: float
    output_block_above: float
    calibration: DirectedFigures
    test: DirectedFigures


class PreparedGuards(msgspec.Struct, frozen=True, kw_only=True):
    """`lockgate-guards.json`: what a guards directory holds and what it was trained from."""

    training_data_sha256: str
    data_file: str
    split: str
    base_model: str
    base_weights_sha256: str
    one_token_settings: OneTokenSettings
    embedding_settings: EmbeddingSettings
    ngram_settings: NgramSettings
    one_token: PreparedOneToken
    embedding: PreparedEmbedding
    ngram: PreparedNgram
    # The combine stage over the n-gram and embedding guards (`ops.guard_training.combination`). A manifest
    # without it (an older layout) fails to decode, so its guards are trained again.
    combination: PreparedCombination
    elapsed_s: float
    # The rule that split the multilingual set (`guard.dataset.SPLIT_RULE`; directories prepared before it
    # was recorded followed rule 1): a new rule moves items between splits, so the guards are trained again.
    split_rule: int = 1


class GuardsResult(msgspec.Struct, frozen=True, kw_only=True):
    """A prepared guards directory, and whether this call trained it (False: reused as it was)."""

    path: Path
    manifest: PreparedGuards
    trained: bool


def read_manifest(guards_dir: Path) -> PreparedGuards | None:
    """The manifest of `guards_dir`, or None when there is none (or it cannot be read, or is an older
    layout without a guard this one has)."""
    try:
        return msgspec.json.decode((guards_dir / MANIFEST).read_bytes(), type=PreparedGuards)
    except (OSError, msgspec.DecodeError):
        return None


def _reusable(
    guards_dir: Path,
    data_sha256: str,
    split: str,
    base_weights_sha256: str,
    one_token: OneTokenSettings,
    embedding: EmbeddingSettings,
    ngram_data_sha256: str,
    ngram: NgramSettings,
) -> PreparedGuards | None:
    manifest = read_manifest(guards_dir)
    if manifest is None:
        return None
    # Settings as written, not as decoded: a setting added since (decoded at its default) was not in force.
    written = msgspec.json.decode((guards_dir / MANIFEST).read_bytes())
    settings = {"one_token_settings": one_token, "embedding_settings": embedding, "ngram_settings": ngram}
    as_written = {key: msgspec.json.decode(msgspec.json.encode(value)) for key, value in settings.items()}
    same = (
        manifest.training_data_sha256 == data_sha256
        and manifest.split == split
        and manifest.base_weights_sha256 == base_weights_sha256
        and all(written.get(key) == value for key, value in as_written.items())
        and manifest.ngram.training_data_sha256 == ngram_data_sha256
        and manifest.split_rule == SPLIT_RULE
        # The served prompt must be the trained one, token for token.
        and manifest.one_token.prompt_template == JUDGE_PROMPT
        and manifest.one_token.system_prompt == SYSTEM_PROMPT
    )
    if not same:
        return None
    try:
        verify(guards_dir / manifest.one_token.name)
    except PrepareError:
        return None
    heads = (
        (guards_dir / manifest.embedding.name / EMBEDDING_HEAD, manifest.embedding.weights_sha256),
        (guards_dir / manifest.ngram.name / NGRAM_HEAD, manifest.ngram.weights_sha256),
    )
    if any(not head.is_file() or sha256_file(head) != sha for head, sha in heads):
        return None
    return manifest


def prepare_guards(
    guards_dir: Path,
    base_model_dir: Path,
    data_file: Path = DEFAULT_DATA,
    *,
    split: str = "train",
    one_token: OneTokenSettings | None = None,
    embedding: EmbeddingSettings | None = None,
    ngram_data_dir: Path = DEFAULT_GUARD_DATA,
    ngram: NgramSettings | None = None,
    say: Say = print,
) -> GuardsResult:
    """Train the one-token guard on `split` of `data_file`, and the n-gram and embedding guards on the train
    split of `ngram_data_dir`, into `guards_dir`, unless it already holds guards trained on the same
    data, split, base model and settings (then nothing is done).

    Raises TrainError (or ValueError for a malformed data file) when the guards cannot be trained.
    """
    started = time.perf_counter()
    one_token = one_token or OneTokenSettings()
    embedding = embedding or EmbeddingSettings()
    ngram = ngram or NgramSettings()
    data = load_training_set(data_file, split)
    ngram_sha256 = dataset_dir_sha256(ngram_data_dir)
    try:
        base = verify(base_model_dir)
    except PrepareError as exc:
        raise TrainError(f"no base model to train on: {exc}") from exc
    reused = _reusable(
        guards_dir, data.sha256, split, base.weights_sha256, one_token, embedding, ngram_sha256, ngram
    )
    if reused is not None:
        say(
            f"{guards_dir} is already prepared from {data_file.name} (sha256 {data.sha256[:16]}...) and "
            f"{ngram_data_dir.name}/ (sha256 {ngram_sha256[:16]}...)"
        )
        return GuardsResult(path=guards_dir, manifest=reused, trained=False)
    say(
        f"training guards on {len(data.train)} items of split {split!r} of {data_file} "
        f"(sha256 {data.sha256[:16]}...); {len(data.test)} items held out"
    )
    guards_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{guards_dir.name}-", dir=guards_dir.parent))
    try:
        ngram_report = train_ngram(ngram_data_dir, work / NGRAM_NAME, ngram, say=say)
        say(f"ngram guard trained ({time.perf_counter() - started:.0f} s)")
        emb_data = load_training_set(ngram_data_dir, "train")
        emb = train_embedding(emb_data, work / EMBEDDING_NAME, embedding, say=say)
        say(f"embedding guard trained ({time.perf_counter() - started:.0f} s)")
        combination = fit_combination(
            ngram_data_dir,
            GuardModelSpec(
                kind="ngram",
                artifact=str(work / NGRAM_NAME),
                weights_sha256=ngram_report.weights_sha256,
                training_data_sha256=ngram_report.training_data_sha256,
            ),
            GuardModelSpec(
                kind="embedding",
                artifact=str(work / EMBEDDING_NAME),
                weights_sha256=emb.weights_sha256,
                training_data_sha256=emb.training_data_sha256,
            ),
        )
        say(
            f"combine stage fitted on {combination.fitted_on} calibration prompts "
            f"({time.perf_counter() - started:.0f} s): "
            + "; ".join(
                f"{c.name} blocks {c.harmful_blocked:.0%} of harmful, {c.lookalikes_blocked:.0%} of "
                f"look-alike, {c.everyday_blocked:.0%} of everyday prompts"
                for c in combination.calibration
            )
        )
        one = train_one_token(data, base_model_dir, work / ONE_TOKEN_NAME, one_token, say=say)
        manifest = PreparedGuards(
            split_rule=SPLIT_RULE,
            training_data_sha256=data.sha256,
            data_file=data_file.name,
            split=split,
            base_model=base.name,
            base_weights_sha256=base.weights_sha256,
            one_token_settings=one_token,
            embedding_settings=embedding,
            ngram_settings=ngram,
            one_token=PreparedOneToken(
                name=ONE_TOKEN_NAME,
                weights_sha256=one.weights_sha256,
                system_prompt=one.system_prompt,
                prompt_template=one.prompt_template,
                categories=one_token.categories,
                safe_tokens=one.safe_tokens,
                unsafe_tokens=one.unsafe_tokens,
                metrics=one.metrics,
                zero_shot=one.zero_shot,
            ),
            embedding=PreparedEmbedding(
                name=EMBEDDING_NAME,
                weights_sha256=emb.weights_sha256,
                training_data_sha256=emb.training_data_sha256,
                metrics=emb.metrics,
            ),
            ngram=PreparedNgram(
                name=NGRAM_NAME,
                weights_sha256=ngram_report.weights_sha256,
                training_data_sha256=ngram_report.training_data_sha256,
                data_dir=ngram_data_dir.name,
                allow_below=ngram_report.thresholds.input.allow_below,
                block_above=ngram_report.thresholds.input.block_above,
                output_allow_below=ngram_report.thresholds.output.allow_below,
                output_block_above=ngram_report.thresholds.output.block_above,
                calibration=ngram_report.calibration,
                test=ngram_report.test,
            ),
            combination=combination,
            elapsed_s=round(time.perf_counter() - started, 1),
        )
        (work / MANIFEST).write_bytes(msgspec.json.format(msgspec.json.encode(manifest)))
        work.chmod(0o755)
        if guards_dir.exists():
            shutil.rmtree(guards_dir)
        os.replace(work, guards_dir)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    say(f"prepared {guards_dir} in {time.perf_counter() - started:.0f} s")
    return GuardsResult(path=guards_dir, manifest=manifest, trained=True)


def prepare_default_guards(data_dir: Path, base_model_dir: Path, say: Say = print) -> GuardsResult:
    """The default guards in `<data_dir>/guards/`: the one-token guard trained on the train split of
    ops/eval/data/dev.jsonl, the n-gram and embedding guards on that of ops/eval/data/guard/."""
    return prepare_guards(data_dir.expanduser() / GUARDS_DIR, base_model_dir, DEFAULT_DATA, say=say)

"""Register a prepared guards directory: the trained guard model and the three guard versions it holds.

`lockgate models prepare` (ops/guard_training/prepare.py) writes `<data_dir>/guards/` with a manifest,
`lockgate-guards.json`, read here with local Structs of the fields needed (the service must not import
ops/). Four versions are published, all content-derived, so registering the same directory again is a
no-op and a retrained guard becomes new versions instead of a conflict:

- model `<one_token.name>@<first 12 hex digits of its weights' sha256>`: the one-token guard's model
  directory, on engine pool "guard". It names the base model's tokenizer and chat template versions when
  its files are the same (they are copied byte for byte); otherwise it publishes its own under its name.
- guard_model `<one_token.name>@<12 hex digits of the spec's hash>`: kind one_token on that model, with the
  prompt it was trained on, its label tokens and the sha256 of its training data.
- guard_model `<embedding.name>@<12 hex digits of the spec's hash>`: kind embedding, the head's directory
  and its weights' sha256, and the training data's sha256.
- guard_model `<ngram.name>@<12 hex digits of the spec's hash>`: kind ngram, likewise, naming the sha256 of
  the labelled directory it was trained on; the thresholds chosen for it come back with the references, as
  do the weights and threshold of the combine stage fitted over it and the embedding guard.

Artifacts are recorded relative to the guards directory's parent (the model data directory), as
registry/default_model.py records the served model's, so replicas with their data elsewhere publish
identical content. No policy is published here.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec

from registry.default_model import VERSION_DIGITS, read_model_dir
from registry.hashing import spec_hash
from registry.models import ChatTemplateSpec, GuardModelSpec, ModelSpec, TokenizerSpec
from registry.service import Registry

GUARDS_MANIFEST = "lockgate-guards.json"
GUARD_ENGINE_POOL = "guard"


class _OneToken(msgspec.Struct, frozen=True):
    name: str
    categories: tuple[str, ...]
    prompt_template: str
    safe_tokens: tuple[str, ...]
    unsafe_tokens: tuple[str, ...]


class _Embedding(msgspec.Struct, frozen=True):
    name: str
    weights_sha256: str
    training_data_sha256: str


class _Ngram(msgspec.Struct, frozen=True):
    name: str
    weights_sha256: str
    training_data_sha256: str
    allow_below: float
    block_above: float
    output_allow_below: float
    output_block_above: float


class _Combination(msgspec.Struct, frozen=True):
    ngram_weight: float
    embedding_weight: float
    bias: float
    threshold: float


class _Manifest(msgspec.Struct, frozen=True):
    training_data_sha256: str
    one_token: _OneToken
    embedding: _Embedding
    ngram: _Ngram
    combination: _Combination


class GuardRefs(msgspec.Struct, frozen=True, kw_only=True):
    """What `register_guards` published, each as `name@version`."""

    model: str  # the one-token guard's model version (engine pool "guard")
    one_token: str  # guard_model version of kind one_token on `model`
    embedding: str  # guard_model version of kind embedding
    ngram: str  # guard_model version of kind ngram
    # The n-gram stage's thresholds, chosen on the calibration split of the data it was trained on: for
    # inputs (on its prompts) and for outputs (on its outputs).
    ngram_allow_below: float
    ngram_block_above: float
    ngram_output_allow_below: float
    ngram_output_block_above: float
    # The combine stage over the n-gram and embedding guards, fitted on the same calibration split: its
    # weights on their log-odds (n-gram, embedding), its bias and its threshold.
    combine_weights: tuple[float, float]
    combine_bias: float
    combine_threshold: float
    # The categories the one-token guard's prompt listed in training, in that order: a stage that passes
    # these (the policy's categories) asks the guard exactly the question it was trained on.
    categories: tuple[str, ...] = ()


def _read_manifest(guards_dir: Path) -> _Manifest | None:
    path = guards_dir / GUARDS_MANIFEST
    if not path.is_file():
        return None
    try:
        return msgspec.json.decode(path.read_bytes(), type=_Manifest)
    except msgspec.ValidationError:
        # Prepared by an older release, without a guard this one serves: as good as not prepared.
        return None


async def register_guards(
    registry: Registry, guards_dir: Path, *, base_model_ref: str, actor: str
) -> GuardRefs | None:
    """Publish the guards of a prepared `guards_dir` (idempotent); None when it holds no prepared guards (or
    guards prepared by an older release, without the n-gram guard or the combine stage).

    `base_model_ref` (name@version, published) is the model the one-token guard was trained from: its
    tokenizer and chat template versions are reused when the guard model's files match them.
    """
    manifest = await asyncio.to_thread(_read_manifest, guards_dir)
    if manifest is None:
        return None
    model_dir = guards_dir / manifest.one_token.name
    files = await asyncio.to_thread(read_model_dir, model_dir)
    base = registry.view.resolve_model(base_model_ref, key="")
    name = manifest.one_token.name

    tokenizer_ref = base.spec.tokenizer
    if base.tokenizer.spec_as(TokenizerSpec).content_hash != files.tokenizer_sha256:
        version = files.tokenizer_sha256[:VERSION_DIGITS]
        tokenizer = TokenizerSpec(content_hash=files.tokenizer_sha256)
        tokenizer_ref = (await registry.publish("tokenizer", name, version, tokenizer, actor=actor)).ref
    template_ref = base.spec.chat_template
    if base.template.text != files.template_text:
        template = ChatTemplateSpec(text=files.template_text)
        version = template.text_sha256()[:VERSION_DIGITS]
        template_ref = (await registry.publish("chat_template", name, version, template, actor=actor)).ref

    model_spec = ModelSpec(
        artifact=f"{guards_dir.name}/{model_dir.name}/{files.weights_file}",
        weights_sha256=files.weights_sha256,
        arch=files.arch,
        tokenizer=tokenizer_ref,
        chat_template=template_ref,
        engine_pool=GUARD_ENGINE_POOL,
    )
    model = await registry.publish(
        "model", name, files.weights_sha256[:VERSION_DIGITS], model_spec, actor=actor
    )
    one_token_spec = GuardModelSpec(
        kind="one_token",
        model=model.ref,
        prompt_template=manifest.one_token.prompt_template,
        safe_tokens=manifest.one_token.safe_tokens,
        unsafe_tokens=manifest.one_token.unsafe_tokens,
        training_data_sha256=manifest.training_data_sha256,
    )
    one_token = await registry.publish(
        "guard_model", name, spec_hash(one_token_spec)[:VERSION_DIGITS], one_token_spec, actor=actor
    )
    embedding_spec = GuardModelSpec(
        kind="embedding",
        artifact=f"{guards_dir.name}/{manifest.embedding.name}",
        weights_sha256=manifest.embedding.weights_sha256,
        training_data_sha256=manifest.embedding.training_data_sha256,
    )
    embedding = await registry.publish(
        "guard_model",
        manifest.embedding.name,
        spec_hash(embedding_spec)[:VERSION_DIGITS],
        embedding_spec,
        actor=actor,
    )
    ngram_spec = GuardModelSpec(
        kind="ngram",
        artifact=f"{guards_dir.name}/{manifest.ngram.name}",
        weights_sha256=manifest.ngram.weights_sha256,
        training_data_sha256=manifest.ngram.training_data_sha256,
    )
    ngram = await registry.publish(
        "guard_model", manifest.ngram.name, spec_hash(ngram_spec)[:VERSION_DIGITS], ngram_spec, actor=actor
    )
    return GuardRefs(
        model=model.ref,
        one_token=one_token.ref,
        embedding=embedding.ref,
        ngram=ngram.ref,
        ngram_allow_below=manifest.ngram.allow_below,
        ngram_block_above=manifest.ngram.block_above,
        ngram_output_allow_below=manifest.ngram.output_allow_below,
        ngram_output_block_above=manifest.ngram.output_block_above,
        combine_weights=(manifest.combination.ngram_weight, manifest.combination.embedding_weight),
        combine_bias=manifest.combination.bias,
        combine_threshold=manifest.combination.threshold,
        categories=manifest.one_token.categories,
    )

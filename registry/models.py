"""What the registry stores: the spec of each kind of version, published versions, aliases, snapshots.

Specs are input (from the admin API and manifests), so they forbid unknown fields; their numeric bounds are
checked when the registry decodes them (msgspec validates on decode, not on construction). A published
version is identified by `name@version` within its kind and never changes; its `content_hash` is the
canonical hash of its spec (see `registry.hashing`).
"""

from __future__ import annotations

import hashlib
import re
from typing import Annotated, Literal, TypeVar

import msgspec
from msgspec import Meta

from registry.errors import InvalidError

# What a guard failure does in a category: allow (audited as fail_open) or refuse.
FailMode = Literal["open", "closed"]
Kind = Literal[
    "model", "tokenizer", "chat_template", "guard_model", "policy", "prompt", "embedding_model", "route"
]
KINDS: tuple[Kind, ...] = (
    "model",
    "tokenizer",
    "chat_template",
    "guard_model",
    "policy",
    "prompt",
    "embedding_model",
    "route",
)
Severity = Literal["low", "medium", "high", "critical"]

Sha256 = Annotated[str, Meta(pattern="^[0-9a-f]{64}$")]
Positive = Annotated[int, Meta(ge=1)]
Fraction = Annotated[float, Meta(ge=0.0, le=1.0)]
# Names may hold "/" (e.g. "meta-llama/Llama-3-8B"); never "@", which separates name and version.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:+-]{0,127}")


class _Input(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of specs: immutable, keyword-only, and strict about the fields it accepts.

    msgspec passes these options on to subclasses; subclasses repeat `frozen` and `kw_only` only because
    mypy's dataclass_transform does not inherit them.
    """


class ModelArch(_Input, frozen=True, kw_only=True):
    """The shape of a model that fixes its KV cache size."""

    layers: Positive
    # KV heads (num_key_value_heads), not query heads: grouped-query attention shares KV between heads.
    kv_heads: Positive
    head_dim: Positive
    kv_dtype_bytes: Positive
    max_context: Positive

    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache one token takes: a key and a value per layer, KV head and head dimension."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_dtype_bytes


class ModelSpec(_Input, frozen=True, kw_only=True):
    """A model version: its weights, architecture, and the tokenizer and template versions it needs."""

    artifact: str
    weights_sha256: Sha256
    arch: ModelArch
    tokenizer: str  # "name@version" of a tokenizer version
    chat_template: str  # "name@version" of a chat template version
    engine_pool: str = "default"


class TokenizerSpec(_Input, frozen=True, kw_only=True):
    """A tokenizer version: the sha256 of its tokenizer.json."""

    content_hash: Sha256


class ChatTemplateSpec(_Input, frozen=True, kw_only=True):
    """A chat template version (Jinja text)."""

    text: str

    def text_sha256(self) -> str:
        """sha256 of the template text itself, to compare with a file on disk."""
        return hashlib.sha256(self.text.encode()).hexdigest()


GuardKind = Literal["one_token", "embedding", "ngram"]


class GuardModelSpec(_Input, frozen=True, kw_only=True):
    """A guard model version.

    `one_token`: a model version answers the guard prompt with one token; P(unsafe) is the probability mass of
    the unsafe label variants over that of both label sets. `embedding`: a sentence encoder and a logistic
    head, both in `artifact` (a directory), score the text directly. `ngram`: a logistic head over hashed
    character n-grams (`guard.ngram`), in `artifact`. A trained guard names the sha256 of the data it was
    trained on, so a score can be traced to its training set.
    """

    kind: GuardKind = "one_token"
    model: str = ""  # one_token: "name@version" of the model version that runs the prompt
    prompt_template: str = ""  # one_token: Jinja text with `content`, `categories` and `policy`
    safe_tokens: tuple[str, ...] = ()
    unsafe_tokens: tuple[str, ...] = ()
    artifact: str = ""  # embedding, ngram: directory of the head (and the embedding guard's encoder)
    weights_sha256: str = ""  # embedding, ngram: sha256 of the head's weights file
    training_data_sha256: str = ""  # trained guards: sha256 of the training set


class PolicyCategory(_Input, frozen=True, kw_only=True):
    """A harm category of a policy."""

    name: str
    severity: Severity


StageKind = Literal["rules", "model", "combine"]


class StageCombination(_Input, frozen=True, kw_only=True):
    """A combine stage's score: sigmoid(bias + sum(weights[i] * logit(score of stage reads[i]))), over
    earlier stages of the policy (`guard.combination`)."""

    reads: tuple[Annotated[int, Meta(ge=0)], ...]
    weights: tuple[float, ...]
    bias: float = 0.0


class CascadeStage(_Input, frozen=True, kw_only=True):
    """One guard stage: allow below one score, block above another, pass on to the next stage between.

    A `rules` stage runs the policy's own rules (no guard model); a `model` stage runs guard model `guard`;
    a `combine` stage scores what earlier stages scored the item (`combine`, `guard.combination`).
    `allow_below`/`block_above` judge inputs, and outputs too unless the stage has its own output pair
    (`output_allow_below`/`output_block_above`, both or neither): a guard scores a harmful prompt and a
    harmful answer differently, and everyday answers must never be cut.
    """

    kind: StageKind = "model"
    # Model stages: "name@version" of a guard model version, pinned so that the policy hash fixes it.
    guard: str = ""
    allow_below: Fraction
    block_above: Fraction
    # Unset: outputs are judged at the input pair. Unset fields stay out of the canonical JSON, so every
    # policy published before these fields keeps its hash.
    output_allow_below: Fraction | msgspec.UnsetType = msgspec.UNSET
    output_block_above: Fraction | msgspec.UnsetType = msgspec.UNSET
    # Categories this stage judges (empty: all of the policy's); their fail modes decide when it fails.
    categories: tuple[str, ...] = ()
    # Seconds one call may take before it counts as a guard failure.
    timeout_s: Annotated[float, Meta(gt=0.0, le=60.0)] = 5.0
    # Combine stages: which earlier stages' scores, and how they combine.
    combine: StageCombination | msgspec.UnsetType = msgspec.UNSET

    def thresholds(self, direction: Literal["input", "output"]) -> tuple[float, float]:
        """(allow_below, block_above) for items of `direction`."""
        allow, block = self.output_allow_below, self.output_block_above
        unset = isinstance(allow, msgspec.UnsetType) or isinstance(block, msgspec.UnsetType)
        if direction == "output" and not unset:
            return float(allow), float(block)  # type: ignore[arg-type]  # both set: narrowed above
        return self.allow_below, self.block_above


class RulePattern(_Input, frozen=True, kw_only=True):
    """A deterministic rule: a regular expression (case-insensitive) or a plain term, in one category."""

    category: str
    pattern: str
    regex: bool = False
    # Where it applies: untrusted input spans only (injection attempts), all input, or generated output too.
    applies_to: Literal["untrusted", "input", "all"] = "all"


class RulesSpec(_Input, frozen=True, kw_only=True):
    """The rules stage: patterns that block, patterns that clear, and size limits."""

    block: tuple[RulePattern, ...] = ()
    # Text that matches none of `block` and one of these is clear (score 0); otherwise the rules are unsure.
    allow: tuple[str, ...] = ()
    max_input_chars: Annotated[int, Meta(ge=0)] = 0  # 0: no limit


class PolicySpec(_Input, frozen=True, kw_only=True):
    """A safety policy version."""

    categories: tuple[PolicyCategory, ...]
    stages: tuple[CascadeStage, ...]
    past_last_stage: Literal["escalate", "block"]
    fail_modes: dict[str, FailMode]  # by category name
    hold_back_tokens: Annotated[int, Meta(ge=0)]
    retention: Literal["none", "hash", "full"]
    rules: RulesSpec = msgspec.field(default_factory=RulesSpec)
    # The output moderator checks the held-back text at least every this many tokens (and at the end).
    check_every_tokens: Annotated[int, Meta(ge=1)] = 16
    # Which directions the cascade guards.
    guard_input: bool = True
    guard_output: bool = True
    # Under an output guard: whether a request may ask for the alternatives to each chosen token (chat
    # `top_logprobs`, completions `logprobs: N`), tokens the guard never reads. Unset means "refuse", and
    # stays out of the canonical JSON so that every policy published before the field keeps its hash.
    top_logprobs: Literal["refuse", "allow"] | msgspec.UnsetType = msgspec.UNSET
    # Whether a session bound to this policy version whose model version is no longer served may move to the
    # version its model name resolves to now, where the session declared `on_retire: migrate`
    # (`gateway.sessions`). Unset means "refuse" (410 `model_version_retired`), kept out of the canonical JSON
    # as `top_logprobs` is.
    session_migration: Literal["refuse", "allow"] | msgspec.UnsetType = msgspec.UNSET
    # How long a response the Responses API stores (`store`) is kept, in seconds; 0: responses under this
    # policy are never stored (they answer `store: false`). Unset means the gateway's `[sessions] ttl`, and
    # stays out of the canonical JSON as `top_logprobs` does.
    stored_response_ttl: Annotated[int, Meta(ge=0)] | msgspec.UnsetType = msgspec.UNSET

    @property
    def allows_top_logprobs(self) -> bool:
        """Whether requests under this policy may ask for alternatives to the chosen tokens."""
        return self.top_logprobs == "allow"

    @property
    def allows_session_migration(self) -> bool:
        """Whether sessions under this policy may move off a retired model version (when they declared it)."""
        return self.session_migration == "allow"

    def stored_response_ttl_or(self, default: float) -> float:
        """Seconds a stored response under this policy is kept (0: not stored), `default` where unset."""
        return default if self.stored_response_ttl is msgspec.UNSET else float(self.stored_response_ttl)


class PromptSpec(_Input, frozen=True, kw_only=True):
    """A system prompt the operator publishes for a tenant or a key: the gateway prepends it to their chat
    requests as the first system message, and it is the only instruction text the guard trusts by default
    (what a client sends, whatever its role, is scored like user text)."""

    text: Annotated[str, Meta(min_length=1, max_length=32_768)]


class EmbeddingModelSpec(_Input, frozen=True, kw_only=True):
    """A sentence encoder served by `POST /v1/embeddings`: mean-pooled, L2-normalised vectors of
    `dimensions` floats for texts of at most `max_input_tokens` tokens (its own tokenizer's, special tokens
    included)."""

    artifact: str = ""  # "": the packaged MiniLM encoder; else a directory relative to the model data dir
    weights_sha256: Sha256  # of the encoder's model.safetensors
    dimensions: Positive
    max_input_tokens: Positive
    # A Matryoshka-trained encoder: a request's `dimensions` may cut its vectors to any length from this one
    # up to `dimensions` (re-normalised). Unset: its own length only (MiniLM), kept out of the canonical JSON.
    min_dimensions: Positive | msgspec.UnsetType = msgspec.UNSET

    def allows_dimensions(self, wanted: int) -> bool:
        """Whether vectors of `wanted` dimensions can be made."""
        low = self.dimensions if self.min_dimensions is msgspec.UNSET else self.min_dimensions
        return low <= wanted <= self.dimensions


Capability = Literal["tools", "structured", "logprobs"]
PriorityName = Literal["interactive", "batch"]


class RouteRule(_Input, frozen=True, kw_only=True):
    """One rule of a route: it holds when every condition it gives holds (none given: always), and then
    names the model that serves the request."""

    name: Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]
    target: str  # a model name (alias) or a pinned name@version
    # The prompt's tokens (the context needed), counted by the route's default model.
    min_prompt_tokens: Annotated[int, Meta(ge=0)] | None = None
    max_prompt_tokens: Annotated[int, Meta(ge=0)] | None = None
    # Holds when the request asks for any of these.
    capabilities: tuple[Capability, ...] = ()
    # Holds for these tenants, tenant tiers (`Tenant.tier`), API keys (key ids), priority classes only
    # (empty: any).
    tenants: tuple[str, ...] = ()
    tiers: tuple[str, ...] = ()
    keys: tuple[str, ...] = ()
    priority: tuple[PriorityName, ...] = ()
    # Holds when the request may wait at most this many seconds in the queue (its deadline).
    max_deadline_s: Annotated[float, Meta(gt=0)] | None = None
    # Holds when the tenant's token quota has at most this many tokens left (a tenant without a token
    # quota never matches).
    max_budget_tokens: Annotated[float, Meta(ge=0)] | None = None


class CascadeSpec(_Input, frozen=True, kw_only=True):
    """A route's confidence cascade: the model a rule (or the default) chose answers first, and when its
    answer's mean token log-probability is under `min_mean_logprob` the request runs again on `strong`. A
    stream is decided on its first `within_tokens` tokens, before any is released."""

    strong: str  # a model name (alias) or a pinned name@version
    min_mean_logprob: Annotated[float, Meta(le=0.0)]
    within_tokens: Positive = 16


class RouteSpec(_Input, frozen=True, kw_only=True):
    """A public model name that chooses a model per request: the first rule that holds names it, else
    `default`; when the chosen model's pool is saturated or unhealthy, `fallbacks` are tried in order; with a
    `cascade`, an answer of low confidence is answered again by the cascade's strong model
    (`gateway.generation.orchestration`)."""

    rules: tuple[RouteRule, ...] = ()
    default: str  # a model name (alias) or a pinned name@version
    fallbacks: tuple[str, ...] = ()
    cascade: CascadeSpec | None = None

    @property
    def targets(self) -> tuple[str, ...]:
        """Every model the route may name."""
        strong = (self.cascade.strong,) if self.cascade else ()
        return (*(r.target for r in self.rules), self.default, *self.fallbacks, *strong)


Spec = (
    ModelSpec
    | TokenizerSpec
    | ChatTemplateSpec
    | GuardModelSpec
    | PolicySpec
    | PromptSpec
    | EmbeddingModelSpec
    | RouteSpec
)
S = TypeVar(
    "S",
    ModelSpec,
    TokenizerSpec,
    ChatTemplateSpec,
    GuardModelSpec,
    PolicySpec,
    PromptSpec,
    EmbeddingModelSpec,
    RouteSpec,
)
SPEC_TYPES: dict[Kind, type[Spec]] = {
    "model": ModelSpec,
    "tokenizer": TokenizerSpec,
    "chat_template": ChatTemplateSpec,
    "guard_model": GuardModelSpec,
    "policy": PolicySpec,
    "prompt": PromptSpec,
    "embedding_model": EmbeddingModelSpec,
    "route": RouteSpec,
}
# Built once: decoders validate every bound declared above.
_DECODERS = {kind: msgspec.json.Decoder(spec_type) for kind, spec_type in SPEC_TYPES.items()}


def decode_spec(kind: Kind, spec_json: str | bytes) -> Spec:
    """The spec of a `kind` version from its JSON; InvalidError (with msgspec's location) if it is not one."""
    try:
        spec: Spec = _DECODERS[kind].decode(spec_json)
    except msgspec.ValidationError as exc:
        raise InvalidError(f"invalid {kind} spec: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise InvalidError(f"invalid {kind} spec JSON: {exc}") from exc
    return spec


class Published(msgspec.Struct, frozen=True, kw_only=True):
    """A published, immutable version. `spec_json` is the canonical JSON its `content_hash` covers."""

    kind: Kind
    name: str
    version: str
    content_hash: str
    spec_json: str
    published_at: float
    actor: str

    @property
    def ref(self) -> str:
        """`name@version`."""
        return f"{self.name}@{self.version}"

    def spec(self) -> Spec:
        """The spec, decoded into the Struct of this version's kind."""
        return decode_spec(self.kind, self.spec_json)

    def spec_as(self, spec_type: type[S]) -> S:
        """The spec as `spec_type`; InvalidError if this version is of another kind."""
        spec = self.spec()
        if not isinstance(spec, spec_type):
            raise InvalidError(f"{self.kind} {self.ref} is not a {spec_type.__name__}")
        return spec


class AliasTarget(_Input, frozen=True, kw_only=True):
    """One version an alias points at, with the share of requests it gets."""

    version: str
    weight: float = 1.0


class Alias(msgspec.Struct, frozen=True, kw_only=True):
    """A public name of a kind mapped to one version, or to two with canary weights."""

    kind: Kind
    name: str
    targets: tuple[AliasTarget, ...]
    updated_at: float
    actor: str
    revision: int  # id of the alias history entry that set these targets


class AliasChange(msgspec.Struct, frozen=True, kw_only=True):
    """An entry of an alias's append-only history."""

    change_id: int
    kind: Kind
    name: str
    action: Literal["set", "rollback"]
    targets: tuple[AliasTarget, ...]
    previous: tuple[AliasTarget, ...] | None
    # The entry a rollback returns to: the one that was current before this one was set. Rollbacks follow
    # these links, so repeated rollbacks walk further back instead of toggling between two states.
    parent_id: int | None
    at: float
    actor: str


class FiguresRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A version's figures on one evaluation suite, as the publish check recorded them.

    `context` is "" for a policy version's own cascade, or the policy `name@version` a guard model version
    was measured in (its stages swapped in). `figures` is the JSON object of the figures ("" when they could
    not be computed: `error` says why, and such a record exists only for a forced publish). `baseline` is
    the version compared against ("" for none), `forced` whether an operator published past a refusal.
    """

    kind: Kind
    name: str
    version: str
    suite_sha256: str
    context: str = ""
    figures: str
    error: str = ""
    baseline: str = ""
    forced: bool = False
    at: float
    actor: str


class RegistrySnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """Everything needed to resolve names, read in one consistent transaction."""

    generation: int
    versions: tuple[Published, ...]
    aliases: tuple[Alias, ...]


def check_name(what: str, value: str) -> str:
    """`value` if it is a valid name or version string, else InvalidError naming `what`."""
    if not NAME_PATTERN.fullmatch(value):
        raise InvalidError(f"{what} {value!r} must match {NAME_PATTERN.pattern} (and never contain '@')")
    return value


def parse_ref(ref: str) -> tuple[str, str]:
    """Split `name@version`; InvalidError if it is not exactly that."""
    name, at, version = ref.partition("@")
    if not at:
        raise InvalidError(f"{ref!r} is not a reference: expected name@version")
    return check_name("name", name), check_name("version", version)

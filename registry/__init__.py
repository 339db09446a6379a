"""The versioned registry: models, tokenizers, chat templates, guard models and safety policies.

Published versions are immutable and content-hashed (`name@version`); aliases map a public name to one
version or to two with canary weights, keep a history, and roll back in one call. `Registry` validates
changes and serves an immutable `RegistryView`, reloaded when the store's generation changes; stores are
SQLite (embedded) and PostgreSQL (shared by replicas).
"""

from registry.base import RegistryStore
from registry.default_model import arch_from_config, check_model_dir, register_default_model
from registry.errors import ConflictError, InvalidError, NotFoundError, RegistryError, UnavailableError
from registry.hashing import canary_pick, canonical_json, content_hash, spec_hash
from registry.manifest import (
    Manifest,
    ManifestResult,
    apply_manifest,
    apply_manifest_file,
    load_manifest,
    parse_manifest,
)
from registry.models import (
    KINDS,
    SPEC_TYPES,
    Alias,
    AliasChange,
    AliasTarget,
    CascadeStage,
    ChatTemplateSpec,
    FiguresRecord,
    GuardModelSpec,
    Kind,
    ModelArch,
    ModelSpec,
    PolicyCategory,
    PolicySpec,
    PromptSpec,
    Published,
    RegistrySnapshot,
    RulePattern,
    RulesSpec,
    Severity,
    Spec,
    StageCombination,
    TokenizerSpec,
    decode_spec,
    parse_ref,
)
from registry.service import Registry, RegistryHealth
from registry.store import MIGRATIONS, REGISTRY_STORE, PostgresRegistryStore, SqliteRegistryStore
from registry.validation import check_tokenizer
from registry.view import RegistryView, ResolvedGuard, ResolvedModel, ResolvedPolicy

__all__ = [
    "KINDS",
    "MIGRATIONS",
    "REGISTRY_STORE",
    "SPEC_TYPES",
    "Alias",
    "AliasChange",
    "AliasTarget",
    "CascadeStage",
    "ChatTemplateSpec",
    "ConflictError",
    "FiguresRecord",
    "GuardModelSpec",
    "InvalidError",
    "Kind",
    "Manifest",
    "ManifestResult",
    "ModelArch",
    "ModelSpec",
    "NotFoundError",
    "PolicyCategory",
    "PolicySpec",
    "PostgresRegistryStore",
    "PromptSpec",
    "Published",
    "Registry",
    "RegistryError",
    "RegistryHealth",
    "RegistrySnapshot",
    "RegistryStore",
    "RegistryView",
    "ResolvedGuard",
    "ResolvedModel",
    "ResolvedPolicy",
    "RulePattern",
    "RulesSpec",
    "Severity",
    "Spec",
    "SqliteRegistryStore",
    "StageCombination",
    "TokenizerSpec",
    "UnavailableError",
    "apply_manifest",
    "apply_manifest_file",
    "arch_from_config",
    "canary_pick",
    "canonical_json",
    "check_model_dir",
    "check_tokenizer",
    "content_hash",
    "decode_spec",
    "load_manifest",
    "parse_manifest",
    "parse_ref",
    "register_default_model",
    "spec_hash",
]

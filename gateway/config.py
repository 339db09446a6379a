"""Typed configuration: one TOML file, `LOCKGATE_*` environment overrides, defaults for everything.

With no file at all the result is the embedded default: one in-process vLLM engine serving the default model.
Environment overrides name a section and a field joined by a double underscore, for example
`LOCKGATE_SERVER__PORT=9000` or `LOCKGATE_ENGINE__KIND=simulated`; values are strings converted to the field's
type (`9000`, `0.5`, `true`, `null`), so `LOCKGATE_MODEL__NAME=2024` stays the string "2024".
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from engines.breaker import BreakerPolicy
from engines.simulated import SimulatorConfig
from engines.supervisor import RestartPolicy
from engines.vllm_remote_wire import RemoteEngineConfig
from gateway.overload import OverloadConfig
from policy.appeals.reasons import DEFAULT_REASONS, ReasonCode, check_reasons
from policy.audit.keys import MIN_MAC_KEY_CHARS
from policy.quota.lease import LeasePolicy
from policy.tenants.models import Limits
from routing.admission_types import AdmissionConfig
from routing.config import RoutingConfig

ENV_PREFIX = "LOCKGATE_"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# A configured `registry.secret` shorter than this is guessable offline from the salts it keys.
MIN_SECRET_CHARS = 16


class ConfigError(Exception):
    """A configuration value is wrong; the message names the field."""


class ServerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The HTTP listener and per-request limits."""

    # Address to listen on. Keep it on loopback unless a proxy in front terminates TLS.
    host: str = "127.0.0.1"
    # TCP port to listen on.
    port: int = 8080
    # Largest request body accepted, in bytes; larger bodies get 413.
    max_body_bytes: int = 1_048_576
    # Seconds that in-flight requests may keep running after SIGTERM before they are aborted.
    drain_timeout: float = 30.0
    # Engine deltas read ahead per stream, by a task of its own, while the client reads what came before.
    # 0: none; the task sending the stream pulls the engine as the client reads (no task, no queue).
    stream_buffer: int = 0
    # Seconds one write to a client may stay blocked (it stopped reading) before it is cut off and its
    # request aborted.
    stream_stall_timeout: float = 30.0
    # Most choices (`n`) one request may ask for; quota reserves n x max_tokens.
    max_choices: int = 4
    # Most calls one answer may hold when tool_choice is "required" (a small model may otherwise repeat
    # calls until max_tokens); 1 when the request sets parallel_tool_calls false.
    max_tool_calls: int = 4
    # Most inputs one `POST /v1/moderations` may hold (each is one check of the tenant's policy); their total
    # size is bounded by `max_body_bytes`.
    max_moderation_inputs: int = 32
    # Gateway processes serving the port (`lockgate serve --workers N` overrides it). More than 1 needs shared
    # state: the Redis quota store and console sessions, PostgreSQL storage, and no in-process vLLM engine.
    workers: int = 1
    # Seconds one round of `/readyz` health checks (every engine's, the registry's) answers for: a flood of
    # probes checks each engine at most once per this. 0: every probe checks.
    readiness_cache: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    # Uvicorn log level.
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The served model."""

    # Public model name clients put in `model`.
    name: str = DEFAULT_MODEL_NAME
    # Directory holding prepared models (`lockgate models prepare` writes there).
    data_dir: str = "~/.cache/lockgate/models"
    # Explicit model directory; empty means `<data_dir>/<name>`.
    path: str = ""
    # Context length in tokens (prompt + completion).
    max_model_len: int = 2048
    # `max_tokens` used when a request gives none: the rest of the context, capped at this.
    default_max_tokens: int = 512
    # Threads that tokenize prompts off the event loop.
    tokenizer_threads: int = 2
    # Prompt renderers (one per tokenizer and chat template version pair) kept loaded, least recently used
    # first out.
    renderer_cache_size: int = 8

    def data_path(self) -> Path:
        """The data directory (prepared models and the guards trained for them)."""
        return Path(self.data_dir).expanduser()

    def model_dir(self) -> Path:
        """Directory of the served model's weights, tokenizer and chat template."""
        if self.path:
            return Path(self.path).expanduser()
        return Path(self.data_dir).expanduser() / self.name


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The engine behind the gateway."""

    # `vllm_local`: vLLM's AsyncLLM in this process (its engine core in a child process).
    # `simulated`: a timing-model simulator for load and fault tests; never for real traffic.
    kind: Literal["vllm_local", "simulated"] = "vllm_local"
    # Weight dtype for vLLM. `auto`: bfloat16 where the CPU or GPU computes it natively, else float32 on CPUs
    # (which emulate bf16, about three times slower) and float16 on GPUs.
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    # Bytes of KV cache vLLM may allocate.
    kv_cache_bytes: int = 268_435_456
    # Largest `top_logprobs` / `logprobs` a request may ask for.
    max_logprobs: int = 20
    # Skip CUDA graphs / compilation (faster start, the only choice on CPU).
    enforce_eager: bool = True
    # Most sequences in one engine step (vLLM's `max_num_seqs`).
    max_num_seqs: int = 16
    # Most tokens in one engine step (vLLM's `max_num_batched_tokens`; long prompts are prefilled in chunks
    # of this size). 0: measured on this host so that one step takes at most `step_target` seconds (the
    # first start on a host measures it and caches the result under `model.data_dir`).
    max_num_batched_tokens: int = 0
    # Seconds one engine step may take: the bound on how long an abort, or the next token of every running
    # stream, waits behind a long prompt's prefill.
    step_target: float = 0.5
    # How a dead engine is noticed and restarted without restarting the gateway.
    supervisor: RestartPolicy = msgspec.field(default_factory=RestartPolicy)
    # Simulator settings, used only with kind = "simulated".
    simulator: SimulatorConfig = msgspec.field(default_factory=SimulatorConfig)


class StorageConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where tenants, keys and admin changes live."""

    # `sqlite`: one file, for the embedded single-process default. `postgres`: shared by gateway replicas.
    backend: Literal["sqlite", "postgres"] = "sqlite"
    # SQLite database file.
    sqlite_path: str = "~/.local/share/lockgate/lockgate.sqlite3"
    # PostgreSQL connection string, e.g. "postgresql://lockgate@127.0.0.1:5432/lockgate".
    postgres_dsn: str = ""
    # PostgreSQL schema holding Lockgate's tables.
    postgres_schema: str = "public"
    # Seconds one attempt to open a PostgreSQL connection may take (a server that is down or paused).
    postgres_connect_timeout: float = 5.0
    # Seconds one PostgreSQL statement may take before it is cancelled and reported as unreachable.
    postgres_command_timeout: float = 10.0


class QuotaConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where token buckets live."""

    # `memory`: in this process (embedded default). `redis`: shared by every gateway replica.
    backend: Literal["memory", "redis"] = "memory"
    # Redis URL for the `redis` backend.
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Seconds one Redis operation may take before the tenant's quota fail mode decides.
    op_timeout: float = 0.25
    # `redis_url` names one node of a Redis Cluster (keys of one tenant share the hash tag `{tenant}`).
    redis_cluster: bool = False
    # Most Redis operations in flight per gateway process (on one server they share one pipelined
    # connection); with a cluster, also the most connections per node.
    pool_size: int = 50
    # Seconds an operation may wait for a free slot; past it the request gets 503 `quota_busy`. A busy
    # pool is our own load, counted as `pool_exhausted`, never taken for Redis being unreachable.
    pool_timeout: float = 1.0
    # Tries (the first included) to settle a reservation while the store fails, before it is given up.
    settle_attempts: int = 10
    # Seconds before the first retry of a failed settlement; each further retry waits twice as long.
    settle_backoff: float = 0.05
    # Longest wait between two settlement retries, in seconds.
    settle_backoff_max: float = 5.0
    # Seconds shutdown waits for settlements still in flight (after requests are aborted, before the
    # store is closed).
    settle_drain_timeout: float = 10.0
    # What one generated token the output guard scores costs in the token buckets, against one token
    # generated (the guard's work is charged as a usage line of its own: `usage.guard_tokens`); 0: free.
    guard_token_price: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    # The tenant-wide buckets of a tenant `lockgate admin create-key` creates (None: unmetered, which must
    # be asked for). Change a tenant's with `PUT /admin/tenants/{id}/quotas`.
    default_tenant_limits: Limits | None = Limits(
        requests_per_second=5.0, request_burst=20.0, tokens_per_second=2_000.0, token_burst=32_768.0
    )
    # Leases (`[quota.lease]`, `redis` backend): each process reserves a small block of a key's buckets
    # ahead of need and grants that key's requests from it without a round trip to Redis, for a bounded
    # loss of exactness (README "Quota leases"). Off (every request reserves on Redis) unless set.
    lease: LeasePolicy | None = None


class AuthConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """API key authentication."""

    # Seconds a verified key stays cached: a revocation made on another replica takes effect within this bound
    # (on the replica that revokes, at once).
    cache_ttl: float = 5.0
    # Seconds a key lookup in the tenant store may take on a cache miss; past it, or when the store is
    # unreachable, a key that is not cached gets 503 `store_unavailable` with Retry-After.
    store_timeout: float = 1.0
    # Seconds past `cache_ttl` that a cached key keeps working while the tenant store is unreachable (0: not
    # at all). During an outage, and only then, a revocation made elsewhere takes up to
    # cache_ttl + stale_grace to show here.
    stale_grace: float = 60.0
    # Seconds an unknown key id is refused without asking the store again (0: not remembered).
    negative_ttl: float = 2.0
    # Failed authentications one client address (an IPv6 /64) may make at once, then `failed_per_second`;
    # past them it is served only keys this process has cached, anything else gets 429 with Retry-After (no
    # store lookup). 0: no limit. Behind a proxy, uvicorn must trust its X-Forwarded-For
    # (FORWARDED_ALLOW_IPS), or every client counts as the proxy.
    failed_burst: Annotated[float, msgspec.Meta(ge=0)] = 50.0
    # Failed authentications per second a throttled address earns back.
    failed_per_second: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    # Client addresses whose failures are remembered (the least recently failed dropped first).
    failed_max_sources: Annotated[int, msgspec.Meta(ge=1)] = 100_000


class RegistryConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The versioned registry (kept in the same database as tenants, see [storage])."""

    # TOML manifest of versions and aliases applied at start-up (idempotent); empty for none.
    manifest: str = ""
    # Seconds between checks for changes made by other replicas: the bound on how long they take to show here.
    refresh_interval: float = 1.0
    # Seconds one refresh may take before it counts as failed (the last view stays in use).
    refresh_timeout: float = 5.0
    # Seconds since the last successful refresh after which `/readyz` reports the registry stale (503).
    max_staleness: float = 30.0
    # The server secret that keys canary picks and tenants' prefix-cache salts (HMAC-SHA256,
    # `gateway.secret`); at least 16 characters. Empty: a random one, generated by the first gateway that
    # starts on the registry database and stored there, so every replica sharing it uses the same one.
    secret: str = ""


class GuardConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The safety guards every request passes."""

    # Which built-in policy the `default` alias gets when the registry has none yet. `trained`: rules, then
    # the n-gram and embedding guards, one score from those two (deciding inputs) and the one-token guard
    # (outputs), all of which `lockgate models prepare` trains offline (the embedded default); `embedding`:
    # rules, then the embedding guard alone (no guard engine); `rules`: the deterministic rules stage alone;
    # `none`: no guard stages (testing only).
    default_policy: Literal["trained", "embedding", "rules", "none"] = "trained"
    # Engine priority of guard calls (lower runs earlier): guards are not queued behind batch generation.
    priority: int = -10
    # Smallest probability mass a one-token guard must put on its label tokens; below it, the answer is
    # malformed (a guard error, never "safe").
    min_label_mass: float = 0.02
    # When a failing guard stops being called for a while.
    breaker: BreakerPolicy = msgspec.field(default_factory=BreakerPolicy)
    # Most generated tokens one output check scores at once when it has more to check than a streaming check
    # holds (a whole answer, checked at the end): it is scored in overlapping windows of this many tokens.
    output_window_tokens: Annotated[int, msgspec.Meta(ge=16)] = 512
    # Publishing a policy or guard model version through the admin API first measures it on the test split
    # and the red-team suite (`gateway.publish_check`), records the figures, and refuses (409) a version
    # whose recall falls, or whose look-alike false-positive rate rises, past these tolerances against the
    # version it replaces; an `operator` key may force it. Off: versions are published unmeasured.
    publish_check: bool = True
    publish_tolerance_recall: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.02
    publish_tolerance_fpr: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.02
    # The labelled directory whose test split is measured ("" = the project's ops/eval/data/guard), and the
    # red-team jailbreak templates ("" = ops/eval/data/redteam/templates.jsonl).
    publish_eval_data: str = ""
    publish_eval_templates: str = ""
    # At most this many test items of each kind (request, look-alike, ...) and red-team sources, spread over
    # the set (0 = all): every guard stage scores each item, so on 2 CPU cores the full set takes minutes.
    publish_eval_limit: Annotated[int, msgspec.Meta(ge=0)] = 0


class AuditConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The audit trail of gate decisions (kept in the [storage] database)."""

    # Directory of the durable spool that holds decisions while the audit store cannot be reached; replayed in
    # order when it returns. One gateway process per directory. "" = `audit-spool` beside the SQLite file.
    spool_dir: str = ""
    # Bytes the spool may hold; past it a decision cannot be recorded, and the policy's fail mode decides:
    # an allow under a policy with a fail-closed category is refused (503), otherwise served unaudited.
    spool_max_bytes: int = 1_073_741_824
    # Decisions written to the store in one batch, and seconds between two flushes of the buffer.
    batch_size: int = 256
    flush_interval: float = 0.2
    # Decisions waiting in memory for the next flush.
    buffer_size: int = 10_000
    # Seconds shutdown waits to flush what is buffered to the store before it goes to the spool.
    close_timeout: float = 10.0
    # Days the checked text of a decision is kept (stored only for tenants with retain_prompts, and only where
    # the policy's retention is `full`); past them the reviewer API and console show none of it, and the next
    # purge pass deletes it, while its hash and the decision remain. A tenant may set its own period.
    content_retention_days: float = 30.0
    # Seconds over which repeated no-cost refusals (quota denials, quota_exceeds_capacity, admission
    # refusals) of one key for one reason are recorded as one counted record (the first is recorded at once).
    refusal_interval: Annotated[float, msgspec.Meta(gt=0)] = 60.0
    # Keys whose refusals are tallied at once; past it they are counted per tenant (memory stays bounded).
    refusal_max_keys: Annotated[int, msgspec.Meta(ge=1)] = 10_000
    # Seconds between two purge passes over the audit database (one also runs at start).
    purge_interval: Annotated[float, msgspec.Meta(gt=0)] = 3600.0
    # The key that MACs every record's chain hash and every spooled line, never stored in the database (a
    # database writer without it cannot forge a chain), inline (at least 32 characters); "" = `mac_key_file`.
    mac_key: str = ""
    # File of the MAC key, a random one created there (0600) by the first start if it is absent.
    # "" = `audit-mac.key` beside the SQLite file. Replicas sharing a PostgreSQL database need the same key.
    mac_key_file: str = ""
    # Seconds between two signed checkpoints of each tenant's chain head that moved (0: none).
    checkpoint_interval: Annotated[float, msgspec.Meta(ge=0)] = 60.0
    # JSONL file (outside the database, 0600, fsync'd) the signed checkpoints are appended to; `lockgate
    # audit verify` checks chains against it. "" = `audit-checkpoints.jsonl` beside the SQLite file.
    checkpoint_file: str = ""
    # Ed25519 key that signs checkpoints (PKCS#8 PEM, created 0600 if absent); its public key is written to
    # `<file>.pub` for verifiers. "" = `audit-signing.key` beside the SQLite file.
    signing_key_file: str = ""

    def spool_path(self, storage: StorageConfig) -> Path:
        """The spool directory."""
        if self.spool_dir:
            return Path(self.spool_dir).expanduser()
        return Path(storage.sqlite_path).expanduser().parent / "audit-spool"

    def file_path(self, configured: str, default: str, storage: StorageConfig) -> Path:
        """A key or checkpoint file: `configured`, else `default` beside the SQLite file."""
        if configured:
            return Path(configured).expanduser()
        return Path(storage.sqlite_path).expanduser().parent / default

    def mac_key_path(self, storage: StorageConfig) -> Path:
        """The MAC key file (used unless `mac_key` is set inline)."""
        return self.file_path(self.mac_key_file, "audit-mac.key", storage)

    def checkpoint_path(self, storage: StorageConfig) -> Path:
        """The signed checkpoint file."""
        return self.file_path(self.checkpoint_file, "audit-checkpoints.jsonl", storage)

    def signing_key_path(self, storage: StorageConfig) -> Path:
        """The checkpoint signing key file."""
        return self.file_path(self.signing_key_file, "audit-signing.key", storage)


class AppealsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Who decides appeals (API and console)."""

    # Only reviewers of the operating organisation may uphold or overturn an appeal (403 `operator_only` for
    # a tenant's reviewers, who still read the queue, take flagged decisions up and move appeals into
    # review). Off: a tenant's reviewers decide their own tenant's appeals.
    operator_reviewers_only: bool = False
    # Days the content a consumer shares with an appeal (`POST /v1/appeals` `share_content` or `content`) is
    # kept, whatever the tenant's audit retention: the review's evidence, deleted by the retention pass.
    evidence_retention_days: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    # The reasons a reviewer may give for upholding or overturning (`policy.appeals.reasons`): unique codes,
    # at least one per outcome; each with its DSA ground and category and the text the consumer reads.
    reasons: tuple[ReasonCode, ...] = DEFAULT_REASONS
    # Seconds a reviewer's claim on an appeal lasts (`POST /audit/appeals/{id}/claim`, renewed by claiming
    # again): meanwhile no other reviewer may step or decide it.
    claim_lease: Annotated[float, msgspec.Meta(gt=0)] = 900.0

    def __post_init__(self) -> None:
        check_reasons(self.reasons)


class ConsoleConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Sessions of the reviewer console (`/console`)."""

    # `memory`: in this process (one gateway process). `redis`: shared by every gateway process, required for
    # `lockgate serve --workers N` with N > 1 (Redis holds only ciphertext keyed by a hash of the cookie).
    session_store: Literal["memory", "redis"] = "memory"
    # Redis URL for the `redis` session store; "" = the quota store's `quota.redis_url`.
    redis_url: str = ""
    # Seconds a console session lasts after sign-in.
    session_ttl: Annotated[float, msgspec.Meta(gt=0)] = 8 * 3600.0
    # Most sessions one reviewer key holds (in either store): its next sign-in ends its own oldest session,
    # never another key's.
    sessions_per_key: Annotated[int, msgspec.Meta(gt=0)] = 5
    # Most sessions kept by the `memory` store; when it is full a sign-in is refused (503), nobody is evicted.
    max_sessions: Annotated[int, msgspec.Meta(gt=0)] = 1000
    # Sign-in attempts (failed or not) a client address, and a key id, may make at once. Past them the sign-in
    # page answers 429 with Retry-After. Counted in the quota store (`[quota] backend`), so every gateway
    # process on one Redis shares them.
    login_burst: Annotated[int, msgspec.Meta(gt=0)] = 10
    # Sign-in attempts a client address, and a key id, get back per minute after the burst.
    login_per_minute: Annotated[float, msgspec.Meta(gt=0)] = 6.0
    # Plain-HTTP development only (`make serve` sets it): the cookies lose `Secure` and the `__Host-` prefix,
    # which a browser refuses over http://. Off: they are `Secure`, whatever scheme the gateway sees (a TLS
    # proxy in front talks plain HTTP to it).
    insecure_cookie: bool = False
    # Seconds one Redis operation of the `redis` store may take; past it the console answers 503.
    op_timeout: Annotated[float, msgspec.Meta(gt=0)] = 0.5
    # Undecided appeals on one page of the review queue (oldest filed first, a link to the next page), and
    # the most flagged decisions it shows.
    queue_page_size: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 200


# Seconds; 0 = no target.
_Target = Annotated[float, msgspec.Meta(ge=0)]


class SloTargets(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The service-level objective of one priority class: a completed request meets it when each target
    that is set (> 0) holds."""

    # Seconds from the request's arrival to the engine's first token (auth, quota, guard, queue included).
    ttft: _Target
    # Mean seconds between output tokens (decode time over the gaps between engine deltas).
    itl: _Target
    # Seconds from arrival to the end of the response.
    e2e: _Target = 0.0


class SloConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """SLO targets per priority class: `lockgate:slo_attained_requests_total{class}` counts the requests that
    met them (goodput), `lockgate:requests_finished_total{class}` all that count toward attainment."""

    interactive: SloTargets = msgspec.field(default_factory=lambda: SloTargets(ttft=2.0, itl=0.2))
    batch: SloTargets = msgspec.field(default_factory=lambda: SloTargets(ttft=30.0, itl=1.0))


class MetricsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Prometheus metrics at `GET /metrics` and the per-request log."""

    # One JSON line per request end on the `lockgate.requests` logger (at INFO).
    request_log: bool = True
    # GET /metrics needs a key with the `metrics` (scrape only) or `operator` role of the operating
    # organisation (tenant "lockgate"), sent as `Authorization: Bearer` (Prometheus: `authorization:
    # {credentials: ...}`), since its series count every tenant's traffic. Off: no key (then only the scraper
    # should reach the port).
    require_key: bool = True
    # The `tenant` label of the per-tenant series (requests, tokens): "id" the tenant id; "hash" a keyed
    # digest of it (12 hex digits of HMAC-SHA256 under the server secret: one series per tenant, the same on
    # every replica and across restarts, and no tenant id in Prometheus or the OTLP backend); "drop" "" (the
    # tenants' series summed into one).
    tenant_label: Literal["id", "hash", "drop"] = "id"
    # OTLP/HTTP metrics endpoint to push the same series to, e.g. "http://127.0.0.1:4318/v1/metrics";
    # "" = no OTLP export (Prometheus scrapes GET /metrics either way).
    otlp_endpoint: str = ""
    # Seconds between two OTLP pushes.
    otlp_interval: float = 15.0
    # Seconds between two copies of the scrape-time series (engine, queue, quota, guard, overload) into the
    # shared metric files, in each worker of `lockgate serve --workers N`.
    multiprocess_interval: Annotated[float, msgspec.Meta(gt=0)] = 1.0


class TracingConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """OpenTelemetry traces of requests (gateway/observe/tracing.py)."""

    # Off: no span is built or exported (requests keep only the timestamps their metrics need).
    enabled: bool = False
    # OTLP/HTTP traces endpoint, e.g. "http://127.0.0.1:4318/v1/traces"; "" = the exporter's default
    # (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else http://localhost:4318/v1/traces).
    otlp_endpoint: str = ""
    # `service.name` of the spans (and of the OTLP metrics push, [metrics] otlp_endpoint).
    service_name: str = "lockgate"
    # Seconds one export may take before it is given up.
    export_timeout: float = 10.0


class ReplicaSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One engine replica of `[[engines]]`."""

    # `vllm_local`: vLLM in this process, with the [engine] settings. `vllm_remote`: a `vllm serve` replica
    # reached over HTTP ([engines.remote]). `simulated`: the timing-model simulator ([engine.simulator]).
    kind: Literal["vllm_local", "vllm_remote", "simulated"]
    # The pool it serves (a model version names its pool; guard models may have pools of their own).
    pool: str = "default"
    # name@version of the model version whose weights it serves; "" = the version `model.name` names at
    # start-up. A local replica's weights are checked against the version's sha256; a remote one must list
    # its `served_model` name, and is trusted to serve that version's weights.
    model: str = ""
    # Only for `vllm_remote`.
    remote: RemoteEngineConfig | None = None
    # Only for `simulated`: this replica's simulator settings (None: `[engine.simulator]`), e.g. a cheap and a
    # strong simulated model that differ in speed and declared answer quality.
    simulator: SimulatorConfig | None = None
    # The replica's KV cache memory in bytes (a remote server's `--kv-cache-memory-bytes`); 0 = for
    # `vllm_local` the [engine] kv_cache_bytes, otherwise none. Divided by the registry's KV bytes per token
    # of the version it serves, it bounds the replica's KV capacity, and gives it when the engine reports
    # none (routing.replicas).
    kv_cache_bytes: int = 0


class IdempotencyConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`Idempotency-Key` on chat and legacy completions: a retried request gets the answer stored the first
    time, with no second engine call and no second charge (`gateway.idempotency`)."""

    # Off: the header is ignored (every request runs).
    enabled: bool = True
    # `memory`: in this process. `redis`: shared by every gateway process, required for `lockgate serve
    # --workers N` with N > 1 (a retry may reach another worker).
    backend: Literal["memory", "redis"] = "memory"
    # Redis URL for the `redis` backend; "" = the quota store's `quota.redis_url`.
    redis_url: str = ""
    # Seconds an answer is kept for retries of its key.
    window: Annotated[float, msgspec.Meta(gt=0)] = 24 * 3600.0
    # Seconds a key stays claimed by a request still running; past it (a gateway process that died
    # mid-request) a retry runs afresh. Longer than any request may take.
    pending_timeout: Annotated[float, msgspec.Meta(gt=0)] = 3600.0
    # Most keys the `memory` backend keeps; past it the oldest answers are forgotten first.
    max_entries: Annotated[int, msgspec.Meta(gt=0)] = 10_000
    # Most bytes of answers the `memory` backend keeps in all; past it the oldest answers are forgotten first.
    max_bytes: Annotated[int, msgspec.Meta(gt=0)] = 268_435_456
    # Largest answer (body bytes) kept; a larger one is served but not kept, so its retry runs again.
    max_answer_bytes: Annotated[int, msgspec.Meta(gt=0)] = 1_048_576
    # Seconds one Redis operation may take; past it the request gets 503 `idempotency_unavailable`.
    op_timeout: Annotated[float, msgspec.Meta(gt=0)] = 0.5


class ResultCacheConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Answers to deterministic requests kept and served again (`gateway.result_cache`): off unless asked."""

    # Off: every request is generated.
    enabled: bool = False
    # `memory`: in this process. `redis`: shared by every gateway process.
    backend: Literal["memory", "redis"] = "memory"
    # Redis URL for the `redis` backend; "" = the quota store's `quota.redis_url`.
    redis_url: str = ""
    # Seconds an answer is kept.
    ttl: Annotated[float, msgspec.Meta(gt=0)] = 3600.0
    # Most bytes of answers the `memory` backend keeps in all; past it the least recently used go first.
    max_bytes: Annotated[int, msgspec.Meta(gt=0)] = 268_435_456
    # Largest answer (stored bytes) kept; a larger one is served but not kept.
    max_entry_bytes: Annotated[int, msgspec.Meta(gt=0)] = 1_048_576
    # What a hit charges to the token buckets, as a share of its prompt tokens (its completion tokens are
    # free: nothing was generated); the output guard's checks of the replayed answer are charged as usual.
    hit_prompt_price: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.1
    # Seconds one Redis operation may take; past it the lookup counts as a miss (the request is generated).
    op_timeout: Annotated[float, msgspec.Meta(gt=0)] = 0.1


class SessionsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Server-side sessions bound to the versions they started on (`gateway.sessions`, `/v1/sessions`)."""

    # Off: `/v1/sessions` answers 404 and `x-lockgate-session` is refused.
    enabled: bool = True
    # `memory`: in this process. `redis` or `postgres`: shared by every gateway process and replica (a
    # restarted or second gateway continues a session); one of them is required for `lockgate serve --workers
    # N`. `postgres` keeps them in `[storage]`'s `postgres_dsn` and `postgres_schema` (whatever
    # `storage.backend` is), in a table of their own.
    backend: Literal["memory", "redis", "postgres"] = "memory"
    # Redis URL for the `redis` backend; "" = the quota store's `quota.redis_url`.
    redis_url: str = ""
    # Seconds a session lives from its creation (absolute expiry) unless it asks for less; and the most it
    # may ask for.
    ttl: Annotated[float, msgspec.Meta(gt=0)] = 24 * 3600.0
    max_ttl: Annotated[float, msgspec.Meta(gt=0)] = 7 * 24 * 3600.0
    # Seconds without a step after which a session expires (idle expiry); a session may ask for less.
    idle_timeout: Annotated[float, msgspec.Meta(gt=0)] = 3600.0
    # Seconds an ended session (expired, evicted, deleted, retired) still answers 410 with its reason.
    tombstone: Annotated[float, msgspec.Meta(gt=0)] = 7 * 24 * 3600.0
    # Per tenant: most live sessions, and most history tokens over its live sessions. Past either, the
    # tenant's least recently used other sessions end (410 `evicted_capacity`).
    max_sessions_per_tenant: Annotated[int, msgspec.Meta(gt=0)] = 1000
    max_history_tokens_per_tenant: Annotated[int, msgspec.Meta(gt=0)] = 10_000_000
    # Most sessions the `memory` backend keeps (live and ended).
    max_entries: Annotated[int, msgspec.Meta(gt=0)] = 100_000
    # Seconds a step stays claimed by a request still running; past it (a gateway that died mid-step) the
    # step may be sent again. Longer than any request may take.
    pending_timeout: Annotated[float, msgspec.Meta(gt=0)] = 3600.0
    # Largest answer (body bytes) a step keeps for its retries. A larger answer is sent but the step is not
    # recorded (as a failed step is not): the session stays where it was and the step may be sent again.
    max_answer_bytes: Annotated[int, msgspec.Meta(gt=0)] = 4_194_304
    # Seconds one operation of the `redis` or `postgres` store may take; past it the request gets 503
    # `session_store_unavailable`.
    op_timeout: Annotated[float, msgspec.Meta(gt=0)] = 0.5


class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The whole gateway configuration."""

    # Engine replicas; empty = one replica from [engine] serving the configured model in pool "default".
    engines: list[ReplicaSpec] = msgspec.field(default_factory=list)
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    storage: StorageConfig = msgspec.field(default_factory=StorageConfig)
    quota: QuotaConfig = msgspec.field(default_factory=QuotaConfig)
    auth: AuthConfig = msgspec.field(default_factory=AuthConfig)
    registry: RegistryConfig = msgspec.field(default_factory=RegistryConfig)
    guard: GuardConfig = msgspec.field(default_factory=GuardConfig)
    admission: AdmissionConfig = msgspec.field(default_factory=AdmissionConfig)
    audit: AuditConfig = msgspec.field(default_factory=AuditConfig)
    appeals: AppealsConfig = msgspec.field(default_factory=AppealsConfig)
    console: ConsoleConfig = msgspec.field(default_factory=ConsoleConfig)
    idempotency: IdempotencyConfig = msgspec.field(default_factory=IdempotencyConfig)
    result_cache: ResultCacheConfig = msgspec.field(default_factory=ResultCacheConfig)
    sessions: SessionsConfig = msgspec.field(default_factory=SessionsConfig)
    routing: RoutingConfig = msgspec.field(default_factory=RoutingConfig)
    overload: OverloadConfig = msgspec.field(default_factory=OverloadConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    slo: SloConfig = msgspec.field(default_factory=SloConfig)
    tracing: TracingConfig = msgspec.field(default_factory=TracingConfig)


_AT = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<field>[^`]*)`")


def _describe(exc: msgspec.ValidationError, sources: Mapping[str, str]) -> str:
    """A message naming the dotted field path (and the environment variable that set it, if one did)."""
    message = str(exc)
    match = _AT.search(message)
    where = match.group("path") if match else ""
    unknown = _UNKNOWN.match(message)
    if unknown:
        field = f"{where}.{unknown.group('field')}" if where else unknown.group("field")
        text = f"unknown configuration field `{field}`"
    else:
        field = where
        text = f"bad configuration value at `{where}`: {message}" if where else message
    source = sources.get(field)
    return f"{text} (set by {source})" if source else text


def _apply_env(raw: dict[str, Any], env: Mapping[str, str]) -> dict[str, str]:
    """Write `LOCKGATE_*` overrides into `raw`; return which variable set each dotted field."""
    sources: dict[str, str] = {}
    for key, value in env.items():
        if not key.startswith(ENV_PREFIX):
            continue
        parts = [p.lower() for p in key[len(ENV_PREFIX) :].split("__")]
        if len(parts) < 2 or not all(parts):
            continue
        node = raw
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{key}: `{'.'.join(parts)}` is not a section")
            node = child
        # Kept as a string: msgspec's lax conversion turns it into the field's own type.
        node[parts[-1]] = value
        sources[".".join(parts)] = key
    return sources


def with_workers(config: Config, workers: int) -> Config:
    """`config` served by `workers` processes (`lockgate serve --workers`), checked."""
    if workers < 1:
        raise ConfigError(f"`--workers` must be >= 1, got {workers}")
    served = msgspec.structs.replace(config, server=msgspec.structs.replace(config.server, workers=workers))
    check_workers(served)
    return served


def check_workers(config: Config) -> None:
    """More than one gateway process (`server.workers`) needs every piece of state they share outside them:
    ConfigError naming each one that is not."""
    if config.server.workers <= 1:
        return
    problems = []
    if config.quota.backend != "redis":
        problems.append(
            "`quota.backend` must be redis (a memory store would give each worker its own quotas)"
        )
    if config.storage.backend != "postgres":
        problems.append("`storage.backend` must be postgres (SQLite takes one writer process)")
    if config.console.session_store != "redis":
        problems.append("`console.session_store` must be redis (a reviewer signs in on one worker)")
    if config.idempotency.enabled and config.idempotency.backend != "redis":
        problems.append("`idempotency.backend` must be redis (a retry may reach another worker)")
    if config.result_cache.enabled and config.result_cache.backend != "redis":
        problems.append("`result_cache.backend` must be redis (each worker would keep a cache of its own)")
    if config.sessions.enabled and config.sessions.backend == "memory":
        problems.append(
            "`sessions.backend` must be redis or postgres (a session's next step may reach another worker)"
        )
    local = [f"[[engines]] #{i + 1}" for i, spec in enumerate(config.engines) if spec.kind == "vllm_local"]
    if not config.engines and config.engine.kind == "vllm_local":
        local.append("the embedded engine (`engine.kind` vllm_local)")
    if local:
        problems.append(
            f"{', '.join(local)} would start a vLLM engine in every worker: serve it with `vllm serve` and "
            "list it as a vllm_remote replica"
        )
    if problems:
        raise ConfigError(f"`server.workers` = {config.server.workers}: " + "; ".join(problems))


def _check(config: Config) -> None:
    positive = {
        "server.max_body_bytes": config.server.max_body_bytes,
        "server.drain_timeout": config.server.drain_timeout,
        "server.stream_stall_timeout": config.server.stream_stall_timeout,
        "server.workers": config.server.workers,
        "server.max_moderation_inputs": config.server.max_moderation_inputs,
        "model.max_model_len": config.model.max_model_len,
        "model.default_max_tokens": config.model.default_max_tokens,
        "model.tokenizer_threads": config.model.tokenizer_threads,
        "model.renderer_cache_size": config.model.renderer_cache_size,
        "engine.kv_cache_bytes": config.engine.kv_cache_bytes,
        "engine.max_num_seqs": config.engine.max_num_seqs,
        "engine.step_target": config.engine.step_target,
        "engine.supervisor.health_interval": config.engine.supervisor.health_interval,
        "engine.supervisor.max_restarts": config.engine.supervisor.max_restarts,
        "engine.supervisor.backoff": config.engine.supervisor.backoff,
        "engine.supervisor.backoff_max": config.engine.supervisor.backoff_max,
        "engine.supervisor.shutdown_timeout": config.engine.supervisor.shutdown_timeout,
        "engine.supervisor.stall_timeout": config.engine.supervisor.stall_timeout,
        "quota.op_timeout": config.quota.op_timeout,
        "quota.pool_size": config.quota.pool_size,
        "quota.pool_timeout": config.quota.pool_timeout,
        "quota.settle_attempts": config.quota.settle_attempts,
        "quota.settle_backoff": config.quota.settle_backoff,
        "quota.settle_backoff_max": config.quota.settle_backoff_max,
        "quota.settle_drain_timeout": config.quota.settle_drain_timeout,
        "auth.cache_ttl": config.auth.cache_ttl,
        "registry.refresh_interval": config.registry.refresh_interval,
        "auth.store_timeout": config.auth.store_timeout,
        "registry.refresh_timeout": config.registry.refresh_timeout,
        "registry.max_staleness": config.registry.max_staleness,
        "storage.postgres_connect_timeout": config.storage.postgres_connect_timeout,
        "storage.postgres_command_timeout": config.storage.postgres_command_timeout,
    }
    lease = config.quota.lease
    if lease is not None:
        positive |= {
            "quota.lease.requests": lease.requests,
            "quota.lease.fraction": lease.fraction,
            "quota.lease.seconds": lease.seconds,
        }
        if lease.fraction > 1 or not 0 <= lease.floor <= 1:
            raise ConfigError("`quota.lease.fraction` must be in (0, 1] and `quota.lease.floor` in [0, 1]")
    for name, value in positive.items():
        if value <= 0:
            raise ConfigError(f"`{name}` must be > 0, got {value}")
    if config.server.stream_buffer < 0:
        raise ConfigError(f"`server.stream_buffer` must be >= 0, got {config.server.stream_buffer}")
    if not 0 < config.server.port < 65536:
        raise ConfigError(f"`server.port` must be in 1..65535, got {config.server.port}")
    if config.storage.backend == "postgres" and not config.storage.postgres_dsn:
        raise ConfigError("`storage.postgres_dsn` must be set when `storage.backend` is postgres")
    if config.sessions.enabled and config.sessions.backend == "postgres" and not config.storage.postgres_dsn:
        raise ConfigError("`storage.postgres_dsn` must be set when `sessions.backend` is postgres")
    for name, value in {
        "auth.stale_grace": config.auth.stale_grace,
        "auth.negative_ttl": config.auth.negative_ttl,
    }.items():
        if value < 0:
            raise ConfigError(f"`{name}` must be >= 0, got {value}")
    if config.engine.max_num_batched_tokens < 0:
        raise ConfigError(
            "`engine.max_num_batched_tokens` must be >= 0 (0 = measured), "
            f"got {config.engine.max_num_batched_tokens}"
        )
    if 0 < config.engine.max_num_batched_tokens < config.engine.max_num_seqs:
        raise ConfigError("`engine.max_num_batched_tokens` must be at least `engine.max_num_seqs`")
    if (
        config.console.session_store == "redis"
        and not config.console.redis_url
        and config.quota.redis_cluster
    ):
        raise ConfigError(
            "`console.redis_url` must be set when `console.session_store` is redis and the quota store is a "
            "Redis Cluster (console sessions use one Redis server)"
        )
    ledger = config.routing.replicas
    if ledger.capacity_ledger == "redis" and not ledger.capacity_ledger_url and config.quota.redis_cluster:
        raise ConfigError(
            "`routing.replicas.capacity_ledger_url` must be set when `routing.replicas.capacity_ledger` is "
            "redis and the quota store is a Redis Cluster (the ledger's script uses one Redis server)"
        )
    idempotency = config.idempotency
    if idempotency.backend == "redis" and not idempotency.redis_url and config.quota.redis_cluster:
        raise ConfigError(
            "`idempotency.redis_url` must be set when `idempotency.backend` is redis and the quota store is "
            "a Redis Cluster (the idempotency store's scripts use one Redis server)"
        )
    if 0 < len(config.audit.mac_key) < MIN_MAC_KEY_CHARS:
        raise ConfigError(f"`audit.mac_key` must be at least {MIN_MAC_KEY_CHARS} characters (or empty)")
    if 0 < len(config.registry.secret) < MIN_SECRET_CHARS:
        raise ConfigError(f"`registry.secret` must be at least {MIN_SECRET_CHARS} characters (or empty)")
    check_workers(config)
    if config.engine.max_logprobs < 0:
        raise ConfigError(f"`engine.max_logprobs` must be >= 0, got {config.engine.max_logprobs}")


def load_config(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Read the TOML file (if any), apply `LOCKGATE_*` overrides from `env` (or os.environ), validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path} is not valid TOML: {exc}") from exc
    sources = _apply_env(raw, os.environ if env is None else env)
    try:
        config = msgspec.convert(raw, Config, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(_describe(exc, sources)) from exc
    _check(config)
    return config

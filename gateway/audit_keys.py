"""The audit trail's keys and checkpoints as the configuration places them (`[audit]`), for the gateway's
lifespan, and `lockgate audit verify`.

`lockgate audit verify` reads the chains through a store of its own (SQLite: read-only connections, so it
never takes the gateway's write lock), checks hashes, links, MACs and the signed checkpoints, and with
`--from-checkpoint` starts each chain from the last checkpoint it verified (kept in
`<checkpoint file stem>.verified.json`, beside the checkpoint file)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable

import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gateway.config import Config
from policy.audit.base import AuditStore
from policy.audit.checkpoints import Checkpointer, CheckpointError, read_checkpoints
from policy.audit.keys import AuditKeyError, MacKey, load_mac_key, load_public_key, load_signing_key
from policy.audit.records import ChainReport, Checkpoint
from policy.audit.verify import read_state, verify_tenants, write_state


async def mac_key(config: Config) -> MacKey:
    """The configured MAC key (its file created on first use), read off the event loop."""
    audit = config.audit
    return await asyncio.to_thread(load_mac_key, audit.mac_key, audit.mac_key_path(config.storage))


async def signing_key(config: Config) -> Ed25519PrivateKey:
    """The checkpoint signing key (created on first use, its public key beside it), off the event loop."""
    return await asyncio.to_thread(load_signing_key, config.audit.signing_key_path(config.storage))


async def checkpointer(
    config: Config, store: AuditStore, key: MacKey, clock: Callable[[], float]
) -> Checkpointer:
    """The checkpointer of `store`'s heads, writing to the configured checkpoint file."""
    path = config.audit.checkpoint_path(config.storage)
    await asyncio.to_thread(path.parent.mkdir, parents=True, exist_ok=True)
    return Checkpointer(store, key, await signing_key(config), path, clock)


class TenantVerified(msgspec.Struct, frozen=True, kw_only=True):
    """One line of `lockgate audit verify`'s output."""

    tenant: str
    report: ChainReport


async def verify_command(config: Config, tenant: str | None, from_checkpoint: bool) -> int:
    """`lockgate audit verify`: verify chains (every tenant's, or `tenant`'s) against the MAC key and the
    signed checkpoints, print one JSON line per tenant; 0 when every chain verifies, 1 otherwise."""
    from policy.audit import AUDIT_STORE
    from registry.db.stores import open_store

    audit = config.audit
    try:
        key = await asyncio.to_thread(
            load_mac_key, audit.mac_key, audit.mac_key_path(config.storage), create=False
        )
        checkpoints = await asyncio.to_thread(_checkpoints, config)
    except (OSError, AuditKeyError, CheckpointError) as exc:
        print(f"lockgate audit verify: {exc}", file=sys.stderr)
        return 1
    state_path = audit.checkpoint_path(config.storage).with_suffix(".verified.json")
    state = await asyncio.to_thread(read_state, state_path)
    store = await open_store(AUDIT_STORE, config.storage, mac_key=key)
    try:
        tenants = [tenant] if tenant is not None else sorted(await store.heads())
        reports = await verify_tenants(
            store,
            tenants,
            key=key,
            checkpoints=checkpoints,
            state=state,
            from_checkpoint=from_checkpoint,
        )
    finally:
        await store.close()
    await asyncio.to_thread(write_state, state_path, state)
    for name, report in reports.items():
        print(msgspec.json.encode(TenantVerified(tenant=name, report=report)).decode())
    return 0 if all(report.ok for report in reports.values()) else 1


def _checkpoints(config: Config) -> dict[str, list[Checkpoint]]:
    """The signed checkpoints, checked with the public key beside the signing key (none before the first
    checkpoint was written)."""
    path = config.audit.checkpoint_path(config.storage)
    if not path.exists():
        return {}
    public = config.audit.signing_key_path(config.storage)
    return read_checkpoints(path, load_public_key(public.with_name(public.name + ".pub")))

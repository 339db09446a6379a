"""Verifying a tenant's chain in bounded pages, against the MAC key and the signed checkpoints.

The head is read first, then the records up to it, `PAGE` at a time by seq: records are append-only and an
append writes its records and the head in one transaction, so the records up to a head read are all there
and no snapshot has to be held open while a long chain is read. Pages come through the store's own read
path (`AuditStore.chain_page`), never the connection appends use, so verifying never holds appends up.

Checkpoints (`policy.audit.checkpoints`) pin (seq, hash) pairs signed outside the database: the chain must
still hold each of them, and its head must not be behind the latest (records cut off the end, the head set
back). Started from a checkpoint (`start`), only the records after it are read: the record at the
checkpoint must still have its hash, and each later record chains to it, so a rewrite that recomputes the
hashes from an earlier record on is found too (the checkpoint's hash changes with them). What an
incremental run does not see is a record before the checkpoint changed without recomputing the hashes after
it: a full run (the default of `lockgate audit verify`) finds that.

`verify_tenants` keeps, in a state file of the verifier's own, the last checkpoint each tenant's chain was
verified through, and starts the next incremental run from it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import msgspec

from policy.audit.base import AuditStore, BadRow
from policy.audit.keys import MacKey
from policy.audit.records import GENESIS_HASH, ChainReport, ChainVerifier, Checkpoint

# Records read per query while verifying.
PAGE = 1000


async def verify_tenant(
    store: AuditStore,
    tenant: str,
    *,
    key: MacKey | None,
    checkpoints: Sequence[Checkpoint] = (),
    start: Checkpoint | None = None,
    page: int = PAGE,
) -> ChainReport:
    """Verify `tenant`'s chain up to its head, from seq 1 or from after the checkpoint `start` (its report
    counts only the records read)."""
    head_seq, head_hash = (await store.heads(tenant)).get(tenant, (0, GENESIS_HASH))
    pins = {cp.seq: cp.hash for cp in checkpoints if cp.tenant == tenant}
    verifier = ChainVerifier(tenant, key, pins=pins)
    after = 0
    if start is not None:
        found = await store.chain_page(tenant, start.seq - 1, start.seq, 1)
        if not found or isinstance(found[0], BadRow) or found[0].hash != start.hash:
            verifier.fail(start.seq, "checkpoint", "the record at the last verified checkpoint changed")
            return verifier.report()
        verifier = ChainVerifier(
            tenant, key, after=(start.seq, start.hash), keyed=start.mac is not None, pins=pins
        )
        after = start.seq
    while verifier.ok and after < head_seq:
        rows = await store.chain_page(tenant, after, head_seq, page)
        for row in rows:
            if isinstance(row, BadRow):
                verifier.fail(row.seq, "hash", f"the stored record does not decode: {row.detail}")
            if isinstance(row, BadRow) or not verifier.feed(row):
                break
        if not rows:
            break  # the rest is missing: check_head says where it ends
        after = rows[-1].seq
    verifier.check_head(head_seq, head_hash)
    latest = max(pins, default=0)
    if latest > head_seq:
        verifier.fail(
            head_seq + 1,
            "checkpoint",
            f"the chain ends at seq {head_seq}, before the signed checkpoint at seq {latest}",
            read=False,
        )
    return verifier.report()


_state_decoder = msgspec.json.Decoder(dict[str, Checkpoint])


def read_state(path: Path) -> dict[str, Checkpoint]:
    """The last verified checkpoint of each tenant (none if `path` is absent). Blocking file I/O."""
    return _state_decoder.decode(path.read_bytes()) if path.exists() else {}


def write_state(path: Path, state: Mapping[str, Checkpoint]) -> None:
    """Save `state` (0600, written whole then renamed into place). Blocking file I/O."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, msgspec.json.encode(dict(state)))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


async def verify_tenants(
    store: AuditStore,
    tenants: Sequence[str],
    *,
    key: MacKey | None,
    checkpoints: Mapping[str, Sequence[Checkpoint]],
    state: dict[str, Checkpoint],
    from_checkpoint: bool,
) -> dict[str, ChainReport]:
    """Verify each tenant's chain (from its last verified checkpoint in `state` if `from_checkpoint`), and
    move `state` on to the latest checkpoint each chain that verified holds."""
    reports: dict[str, ChainReport] = {}
    for tenant in tenants:
        own = checkpoints.get(tenant, ())
        start = state.get(tenant) if from_checkpoint else None
        report = await verify_tenant(store, tenant, key=key, checkpoints=own, start=start)
        reports[tenant] = report
        covered = [cp for cp in own if cp.seq <= report.last_seq]
        if report.ok and covered:
            state[tenant] = max(covered, key=lambda cp: cp.seq)
    return reports

"""Signed checkpoints of each tenant's chain head, written outside the database.

Every `[audit] checkpoint_interval` seconds the `Checkpointer` appends, for each tenant whose head moved,
one line `{tenant, seq, hash, mac, at, sig}` to the checkpoint file (JSONL, 0600, fsync'd): `sig` is an
Ed25519 signature (`policy.audit.keys.load_signing_key`) of the other fields. A head is checkpointed only
when the record at it carries a valid MAC, so a chain rewritten by a database writer without the MAC key is
never signed. `policy.audit.verify` then checks that the chain still holds each checkpoint and has not
fallen behind the latest: a database writer can neither rewrite what a checkpoint covers nor cut records
off the end unnoticed. Posting checkpoints to an external endpoint as well is not implemented.

Each gateway process writes its own file (replicas on one PostgreSQL database each keep one); lines of a
tenant only ever move forward within a file.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from policy.audit.base import AuditStore, AuditUnavailableError, BadRow
from policy.audit.keys import MacKey
from policy.audit.records import Checkpoint

log = logging.getLogger("lockgate.audit")

_DOMAIN = b"lockgate-audit-checkpoint-v1\n"
_encode_sorted = msgspec.json.Encoder(order="sorted")


class SignedCheckpoint(Checkpoint, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A checkpoint line: the checkpoint and its Ed25519 signature (hex)."""

    sig: str


_line_decoder = msgspec.json.Decoder(SignedCheckpoint)


class CheckpointError(ValueError):
    """A checkpoint file line that does not decode or whose signature does not verify (forged)."""


def _signed_bytes(cp: Checkpoint) -> bytes:
    fields = {name: getattr(cp, name) for name in Checkpoint.__struct_fields__}
    return _DOMAIN + _encode_sorted.encode(fields)


def sign(cp: Checkpoint, key: Ed25519PrivateKey) -> SignedCheckpoint:
    """`cp` signed with `key`."""
    fields = {name: getattr(cp, name) for name in Checkpoint.__struct_fields__}
    return SignedCheckpoint(**fields, sig=key.sign(_signed_bytes(cp)).hex())


def read_checkpoints(path: Path, public: Ed25519PublicKey) -> dict[str, list[Checkpoint]]:
    """Every checkpoint in `path` (none if it is absent), by tenant in file order, each signature checked:
    CheckpointError names the first line that does not verify. A torn last line (a crash mid-write) is
    left out. Blocking file I/O."""
    found: dict[str, list[Checkpoint]] = {}
    if not path.exists():
        return found
    data = path.read_bytes()
    lines = data.split(b"\n")
    if lines[-1]:
        log.warning("audit checkpoints %s: leaving out a torn last line", path)
    for number, line in enumerate(lines[:-1], start=1):
        try:
            signed = _line_decoder.decode(line)
            plain = Checkpoint(**{n: getattr(signed, n) for n in Checkpoint.__struct_fields__})
            public.verify(bytes.fromhex(signed.sig), _signed_bytes(plain))
        except (msgspec.DecodeError, ValueError, InvalidSignature) as exc:
            raise CheckpointError(f"{path} line {number}: not a validly signed checkpoint ({exc!r})") from exc
        found.setdefault(plain.tenant, []).append(plain)
    return found


def _append(path: Path, lines: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, lines)
        os.fsync(fd)
    finally:
        os.close(fd)


class Checkpointer:
    """Appends signed checkpoints of the heads that moved (`once`), every interval (`run`)."""

    def __init__(
        self,
        store: AuditStore,
        mac_key: MacKey,
        signing_key: Ed25519PrivateKey,
        path: Path,
        clock: Callable[[], float],
    ) -> None:
        self._store = store
        self._mac_key = mac_key
        self._signing_key = signing_key
        self._path = path
        self._clock = clock
        # (seq, hash) last checkpointed, by tenant (read from the file on first use).
        self._last: dict[str, tuple[int, str]] | None = None
        self.counters: dict[str, int] = {"written": 0, "refused": 0}

    async def read(self) -> dict[str, list[Checkpoint]]:
        """Every checkpoint in the file, signatures checked (CheckpointError: a forged line)."""
        public = self._signing_key.public_key()
        return await asyncio.to_thread(read_checkpoints, self._path, public)

    async def once(self) -> list[Checkpoint]:
        """Checkpoint every tenant whose head moved since its last checkpoint; the checkpoints written.
        A head whose record has no valid MAC, or that is behind or differs from the last checkpoint, is not
        signed: logged critically and counted (`refused`)."""
        if self._last is None:
            known = await self.read()
            self._last = {tenant: (cps[-1].seq, cps[-1].hash) for tenant, cps in known.items()}
        now = self._clock()
        fresh: list[Checkpoint] = []
        for tenant, (seq, head_hash) in sorted((await self._store.heads()).items()):
            last_seq, last_hash = self._last.get(tenant, (0, ""))
            if (seq, head_hash) == (last_seq, last_hash):
                continue
            if seq <= last_seq:
                self.counters["refused"] += 1
                log.critical(
                    "audit head of %s (seq %d) is not the one checkpointed at seq %d",
                    *(tenant, seq, last_seq),
                )
                continue
            found = await self._store.chain_page(tenant, seq - 1, seq, 1)
            record = found[0] if found else None
            if (
                record is None
                or isinstance(record, BadRow)
                or record.hash != head_hash
                or record.mac is None
                or not self._mac_key.chain_ok(record.hash, record.mac)
            ):
                self.counters["refused"] += 1
                log.critical("audit head of %s at seq %d has no valid MAC: not checkpointed", tenant, seq)
                continue
            fresh.append(Checkpoint(tenant=tenant, seq=seq, hash=head_hash, mac=record.mac, at=now))
        if fresh:
            lines = b"".join(msgspec.json.encode(sign(cp, self._signing_key)) + b"\n" for cp in fresh)
            await asyncio.to_thread(_append, self._path, lines)
            for cp in fresh:
                self._last[cp.tenant] = (cp.seq, cp.hash)
            self.counters["written"] += len(fresh)
        return fresh

    async def run(self, interval: float, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        """`once` every `interval` seconds, until cancelled; a store that cannot answer fails one pass."""
        while True:
            await sleep(interval)
            try:
                await self.once()
            except AuditUnavailableError as exc:
                log.warning("audit checkpoint pass skipped: %s", exc)
            except (OSError, CheckpointError) as exc:
                log.critical("audit checkpoints not written to %s: %s", self._path, exc)

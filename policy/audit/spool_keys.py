"""Crypto-shredding of spooled content: the text of a spooled draft is readable only while its tenant's
retention keeps it, without rewriting a spool file.

A draft's content is never written to a spool line in clear: it is encrypted (AES-256-GCM, a random 96-bit
nonce per line) under a data key of its own (tenant, hour of `draft.at`) "slot", and the line carries the
key's id, the nonce and the ciphertext (`Sealed`) instead of `content`. The associated data binds the
tenant, the slot's hour, the draft id, the content hash and the key id, so a line (or a key file entry)
moved to another tenant, hour or draft does not decrypt at all, never to another draft's content.

The keys live in `content-keys.json` in the spool directory (each worker's directory has its own), 0600,
replaced atomically (`policy.audit.files.replace_synced`: written whole, fsync'd, renamed), and written
before the spool lines that use them: a crash leaves the old key file or the new one, and at worst a key no
line uses. Deleting a key (`shred`) makes every line sealed under it unreadable at once: the retention pass
(`policy.audit.retention`) deletes the keys of every slot wholly past its tenant's retention (all of a
tenant's that keeps no prompts), and the spool deletes the keys no remaining spool file uses
(`forget_before`), so the file holds at most one key per tenant and hour still spooled.

A line whose key is gone is replayed without its content (content_hash and the decision stay, exactly as a
record whose content a purge removed from the database; the keys deleted are counted, `spool_keys_shredded`).
A line whose key does not open it (a key file tampered with or swapped) is replayed without its content
too, with `detail` saying so (`UNREADABLE_NOTE`), logged critically and counted (`spool_content_unreadable`).
A key file that does not parse is treated as empty (all content shredded), logged critically and counted
(`spool_keys_unreadable`).

Limits: deleting a key removes it from the file system, not from freed disk blocks or backups (as the
database's purge does not). Lines written before this existed carry content in clear and replay as they are.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import threading
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import msgspec
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from policy.audit.files import fsync_dir, replace_synced
from policy.audit.records import AuditDraft

log = logging.getLogger("lockgate.audit")

KEYS_FILE = "content-keys.json"
# Width of a key's slot, seconds: spooled content outlives its retention by at most this (plus the time to
# the next purge pass).
BUCKET_S = 3600.0
_AAD_DOMAIN = b"lockgate-spool-content-v1\n"
_DRAFT_FIELDS = AuditDraft.__struct_fields__
UNREADABLE_NOTE = "content not replayed: its spool encryption does not verify"


class Sealed(msgspec.Struct, frozen=True, kw_only=True):
    """A draft's content as spooled: AES-GCM `data` under key `kid`, with `nonce`."""

    kid: str
    nonce: bytes
    data: bytes


class SpoolLine(AuditDraft, frozen=True, kw_only=True):
    """What a spool line holds: the draft, its content (if any) `sealed` instead of in `content`."""

    sealed: Sealed | None = None


class ContentKey(msgspec.Struct, frozen=True, kw_only=True):
    """The data key of one (tenant, hour) slot; `last_file`: the newest spool file with a line under it."""

    kid: str
    tenant: str
    bucket: int
    key: bytes
    last_file: int


class _KeyFile(msgspec.Struct, frozen=True, kw_only=True):
    keys: tuple[ContentKey, ...] = ()


_key_file_decoder = msgspec.json.Decoder(_KeyFile)
_encoder = msgspec.json.Encoder()


def _aad(tenant: str, bucket: int, draft: AuditDraft, kid: str) -> bytes:
    return _AAD_DOMAIN + _encoder.encode([tenant, bucket, draft.draft_id, draft.content_hash, kid])


def _draft(line: AuditDraft, content: str | None, detail: str | None = None) -> AuditDraft:
    fields = {name: getattr(line, name) for name in _DRAFT_FIELDS}
    fields["content"] = content
    if detail is not None:
        fields["detail"] = detail
    return AuditDraft(**fields)


class SpoolKeys:
    """The content keys of one spool directory. Blocking file I/O: used from the spool's worker threads;
    a lock makes `shred` (the retention task's) safe beside the writer's reads and writes."""

    def __init__(self, directory: Path, *, counters: Counter[str], bucket_s: float = BUCKET_S) -> None:
        self.path = directory / KEYS_FILE
        self._bucket_s = bucket_s
        self._counters = counters
        self._lock = threading.Lock()
        # Invariant: _slots maps (tenant, bucket) to the kid of its one key in _keys, and back.
        self._keys: dict[str, ContentKey] = {}
        self._slots: dict[tuple[str, int], str] = {}
        # Each tenant's retention cutoff at the last `shred`: content older than it is not sealed at all.
        self._cutoffs: dict[str, float] = {}
        self._dirty = False

    def bucket(self, at: float) -> int:
        """The slot (hour) of a draft's `at`."""
        return math.floor(at / self._bucket_s)

    def load(self) -> None:
        """Read the key file (absent: no keys)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            raw = None
        keys: tuple[ContentKey, ...] = ()
        if raw is not None:
            try:
                keys = _key_file_decoder.decode(raw).keys
            except msgspec.DecodeError as exc:
                self._counters["spool_keys_unreadable"] += 1
                log.critical("audit spool keys %s unreadable, spooled content lost: %s", self.path, exc)
        with self._lock:
            self._keys = {k.kid: k for k in keys}
            self._slots = {(k.tenant, k.bucket): k.kid for k in keys}
            self._dirty = False

    def seal(self, draft: AuditDraft, file: int) -> AuditDraft:
        """`draft` as spooled in spool file number `file`: a `SpoolLine` with its content sealed (a new key
        made for its slot if needed: call `flush` before writing the line), or without content when its
        retention already ended."""
        if draft.content is None:
            return draft
        with self._lock:
            if draft.at < self._cutoffs.get(draft.tenant, -math.inf):
                return _draft(draft, None)
            slot = (draft.tenant, self.bucket(draft.at))
            kid = self._slots.get(slot)
            key = None if kid is None else self._keys[kid]
            if key is None:
                key = ContentKey(
                    kid=secrets.token_hex(12),
                    tenant=slot[0],
                    bucket=slot[1],
                    key=AESGCM.generate_key(256),
                    last_file=file,
                )
                self._slots[slot] = key.kid
            elif key.last_file < file:
                key = msgspec.structs.replace(key, last_file=file)
            if self._keys.get(key.kid) is not key:
                self._keys[key.kid] = key
                self._dirty = True
        nonce = os.urandom(12)
        plain = draft.content.encode("utf-8", "surrogatepass")
        data = AESGCM(key.key).encrypt(nonce, plain, _aad(key.tenant, key.bucket, draft, key.kid))
        fields = {name: getattr(draft, name) for name in _DRAFT_FIELDS}
        fields["content"] = None
        return SpoolLine(**fields, sealed=Sealed(kid=key.kid, nonce=nonce, data=data))

    def unseal(self, line: SpoolLine, *, count: bool = True) -> AuditDraft:
        """The draft a spool line stands for: its content opened, or None when its key is gone (or fails).
        Counted and logged when `count` (the line's first read: a batch is read again after a failed
        append)."""
        sealed = line.sealed
        if sealed is None:
            return _draft(line, line.content)  # no content, or a line from before content was sealed
        with self._lock:
            key = self._keys.get(sealed.kid)
        if key is None:
            return _draft(line, None)
        plain = None
        if (key.tenant, key.bucket) == (line.tenant, self.bucket(line.at)):
            aad = _aad(line.tenant, key.bucket, line, sealed.kid)
            try:
                plain = AESGCM(key.key).decrypt(sealed.nonce, sealed.data, aad)
            except (InvalidTag, ValueError):  # ValueError: a nonce of the wrong length
                plain = None
        if plain is not None:
            return _draft(line, plain.decode("utf-8", "surrogatepass"))
        if count:
            self._counters["spool_content_unreadable"] += 1
            log.critical(
                "audit spool: the content of request %s of %s does not open under its key %s: replayed "
                "without it",
                *(line.request_id, line.tenant, sealed.kid),
            )
        return _draft(line, None, f"{line.detail}; {UNREADABLE_NOTE}".lstrip("; "))

    def flush(self) -> None:
        """Write the key file if a key was added or changed since (fsync'd, atomic)."""
        with self._lock:
            if self._dirty:
                self._save()

    def shred(self, cutoffs: Mapping[str, float]) -> int:
        """Delete the keys of every slot of a tenant in `cutoffs` that ends at or before its cutoff (an `at`:
        content before it has expired; inf: all), durably; the number deleted. Tenants not in `cutoffs` keep
        their keys. Content sealed from now on is dropped when older than its tenant's cutoff."""
        with self._lock:
            self._cutoffs.update(cutoffs)
            gone = [
                k
                for k in self._keys.values()
                if k.tenant in cutoffs and (k.bucket + 1) * self._bucket_s <= cutoffs[k.tenant]
            ]
            self._drop(gone)
        if gone:
            self._counters["spool_keys_shredded"] += len(gone)
            log.info("audit spool %s: %d content keys past retention deleted", self.path.parent, len(gone))
        return len(gone)

    def forget_before(self, oldest: int | None) -> None:
        """Delete the keys no spool file uses any more: those whose last file is before `oldest`, the oldest
        spool file left (None: none is left, so all)."""
        with self._lock:
            self._drop([k for k in self._keys.values() if oldest is None or k.last_file < oldest])

    def _drop(self, keys: list[ContentKey]) -> None:
        for key in keys:
            del self._keys[key.kid]
            del self._slots[(key.tenant, key.bucket)]
        if keys or (not self._keys and self.path.exists()):
            self._save()

    def _save(self) -> None:
        # Under the lock. No keys: no file (an empty spool directory is left as it was).
        if self._keys:
            replace_synced(self.path, _encoder.encode(_KeyFile(keys=tuple(self._keys.values()))))
        elif self.path.exists():
            self.path.unlink()
            fsync_dir(self.path.parent)
        self._dirty = False

"""The keys that make the audit trail evidence against whoever can write to its database.

The hash chain alone has no secret: a database writer can rewrite records and recompute every hash and the
head. So each record also carries `mac = HMAC-SHA256(MAC key, hash)`, and the MAC key lives in the
configuration or a file, never in the database: without it a rewritten record cannot get a valid MAC. A
spooled line carries an HMAC under the same key (another domain prefix, so neither MAC stands for the
other). Checkpoints of each tenant's head are signed with an Ed25519 key (`policy.audit.checkpoints`), so
a verifier needs only the public key.

Key files are created by the first process that needs them (0600, written whole then linked into place, so
two processes starting at once agree on one key) and read as they are afterwards.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

# Fewest characters of an inline `[audit] mac_key` (and bytes of a key file): below it, guessable offline.
MIN_MAC_KEY_CHARS = 32
_CHAIN_DOMAIN = b"lockgate-audit-mac-v1\n"
_LINE_DOMAIN = b"lockgate-spool-line-v1\n"


class AuditKeyError(ValueError):
    """A key file that holds no usable key."""


class MacKey:
    """The secret that MACs chain hashes and spooled lines (never logged, never stored in the database)."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_MAC_KEY_CHARS:
            raise AuditKeyError(f"an audit MAC key needs at least {MIN_MAC_KEY_CHARS} bytes")
        self._secret = secret

    def _mac(self, domain: bytes, data: bytes) -> str:
        return hmac.new(self._secret, domain + data, hashlib.sha256).hexdigest()

    def chain_mac(self, record_hash: str) -> str:
        """The MAC of a record's chain hash (which covers every field and the previous hash)."""
        return self._mac(_CHAIN_DOMAIN, record_hash.encode())

    def chain_ok(self, record_hash: str, mac: str) -> bool:
        """Whether `mac` is the MAC of `record_hash` (compared in constant time)."""
        return hmac.compare_digest(self.chain_mac(record_hash), mac)

    def line_mac(self, line: bytes) -> str:
        """The MAC of one spooled line's JSON."""
        return self._mac(_LINE_DOMAIN, line)

    def line_ok(self, line: bytes, mac: bytes) -> bool:
        """Whether `mac` (hex, as spooled) is the MAC of `line`."""
        return hmac.compare_digest(self.line_mac(line).encode(), mac)


def _create_exclusive(path: Path, data: bytes) -> None:
    """Write `data` to `path` (0600) unless it exists: written whole to a temporary file and hard-linked
    into place, so a reader never sees half a key and of two racing creators one wins."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass  # another process created it first: its key is the one
    finally:
        tmp.unlink()


def load_mac_key(inline: str, path: Path, *, create: bool = True) -> MacKey:
    """The configured inline key, else the key in `path` (a random one created there if it is absent and
    `create`; else FileNotFoundError). Blocking file I/O: call it off the event loop."""
    if inline:
        return MacKey(inline.encode())
    if create and not path.exists():
        _create_exclusive(path, secrets.token_hex(32).encode() + b"\n")
    secret = path.read_bytes().strip()
    if len(secret) < MIN_MAC_KEY_CHARS:
        raise AuditKeyError(f"{path} holds no audit MAC key (at least {MIN_MAC_KEY_CHARS} bytes)")
    return MacKey(secret)


def load_signing_key(path: Path) -> Ed25519PrivateKey:
    """The Ed25519 checkpoint signing key in `path` (PKCS#8 PEM), created there if absent, with its public
    key beside it in `<path>.pub` for verifiers. Blocking file I/O."""
    if not path.exists():
        fresh = Ed25519PrivateKey.generate()
        pem = fresh.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        _create_exclusive(path, pem)
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise AuditKeyError(f"{path} holds no Ed25519 private key")
    public = public_pem(key.public_key())
    pub_path = path.with_name(path.name + ".pub")
    if not pub_path.exists() or pub_path.read_bytes() != public:
        pub_path.write_bytes(public)
    return key


def public_pem(key: Ed25519PublicKey) -> bytes:
    """`key` as a SubjectPublicKeyInfo PEM (what `<signing key>.pub` holds)."""
    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def load_public_key(path: Path) -> Ed25519PublicKey:
    """An Ed25519 public key from a PEM file (a verifier's copy of `<signing key>.pub`)."""
    key = serialization.load_pem_public_key(path.read_bytes())
    if not isinstance(key, Ed25519PublicKey):
        raise AuditKeyError(f"{path} holds no Ed25519 public key")
    return key

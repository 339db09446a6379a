"""API key material: minting, parsing and verifying `lg-<key_id>-<secret>` keys.

The plaintext key is shown to its owner once. The store keeps the key id (public, used to look the key up)
and a hash of the secret; the secret itself is never stored.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

PREFIX = "lg"
# `secrets.token_urlsafe(32)` is always 43 URL-safe base64 characters (32 bytes, no padding).
_KEY = re.compile(r"lg-([0-9a-f]{12})-([A-Za-z0-9_-]{43})")


def new_key() -> tuple[str, str, str]:
    """Mint a key: (plaintext shown once, key_id, secret_hash to store)."""
    # 48 random bits: ids only need to be unique per deployment, and a collision is refused by the store
    # (ConflictError), never silently merged.
    key_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    return f"{PREFIX}-{key_id}-{secret}", key_id, hash_secret(secret)


def hash_secret(secret: str) -> str:
    """Hex SHA-256 of a key secret."""
    # A fast hash is right here, unlike for passwords: secrets are 256 random bits, so there is no dictionary
    # to try and no brute force that a slow hash (bcrypt, scrypt) would make any harder. It also keeps
    # authentication on the request path cheap.
    return hashlib.sha256(secret.encode()).hexdigest()


def parse_key(plaintext: str) -> tuple[str, str] | None:
    """(key_id, secret) of a well-formed key, or None for anything else."""
    match = _KEY.fullmatch(plaintext)
    if match is None:
        return None
    return match.group(1), match.group(2)


def verify(secret: str, secret_hash: str) -> bool:
    """Whether `secret` hashes to `secret_hash`, compared in constant time."""
    # Bytes, because compare_digest refuses non-ASCII str (a corrupt stored hash must read as a mismatch).
    return hmac.compare_digest(hash_secret(secret).encode(), secret_hash.encode())

"""Content hashes of specs and files, and the deterministic canary choice.

The content hash of a spec is the sha256 of its canonical JSON: msgspec encodes Struct fields in their
declared order and, with `order="deterministic"`, dict keys sorted, so equal specs always give equal bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import msgspec

from registry.models import AliasTarget, Spec

_CHUNK = 1 << 20


def canonical_json(spec: Spec) -> str:
    """The canonical JSON text of a spec (what is stored and hashed)."""
    return msgspec.json.encode(spec, order="deterministic").decode()


def content_hash(spec_json: str) -> str:
    """sha256 hex of canonical spec JSON."""
    return hashlib.sha256(spec_json.encode()).hexdigest()


def spec_hash(spec: Spec) -> str:
    """The content hash of a spec."""
    return content_hash(canonical_json(spec))


def sha256_file(path: Path) -> str:
    """sha256 hex of a file, read in chunks. Blocking: call it through `asyncio.to_thread`."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def unit_interval(key: str) -> float:
    """A number in [0, 1) fixed by `key` and uniformly spread over keys."""
    # 53 bits: exactly representable in a float, so the result is strictly below 1.
    return (int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") >> 11) / float(1 << 53)


def canary_pick(key: str, targets: Sequence[AliasTarget], salt: str = "") -> str:
    """The version pick key `key` goes to: the same one on every call (so a retry lands on it again).

    `key` must be one the client cannot choose or predict (the gateway's are HMACs of the tenant and key id
    under its server secret, `gateway.secret`): whoever can compute the point below picks the version.
    `salt` (the registry passes "kind:name") makes different aliases split independently. With the stable
    version listed first, raising the canary's weight only moves keys to the canary, never back.
    """
    if not targets:
        raise ValueError("an alias needs at least one target")
    if len(targets) == 1:  # no split to make (and no hash to pay for on every request)
        return targets[0].version
    point = unit_interval(f"{salt}\x00{key}")
    cumulative = 0.0
    for target in targets:
        cumulative += target.weight
        if point < cumulative:
            return target.version
    # Weights sum to 1 within rounding; a point above their float sum belongs to the last target.
    return targets[-1].version

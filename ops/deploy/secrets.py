"""`python -m ops.deploy.secrets DIR`: the fleet's secrets, fresh and random, written into a kustomize
overlay's directory for its secretGenerator (README "Deploying"): `secrets.env` (the audit MAC key, the
registry secret, PostgreSQL's password and the gateway's DSN with it) and the audit checkpoint signing key
with its public key. Files are created 0600 and never overwritten: a new MAC key would leave every chain
recorded under the old one unverifiable (pass --force only for a fleet with no audit trail yet)."""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

ENV_FILE = "secrets.env"
SIGNING_KEY = "audit-signing.key"
SIGNING_KEY_PUB = "audit-signing.key.pub"
FILES = (ENV_FILE, SIGNING_KEY, SIGNING_KEY_PUB)


def fresh(postgres_host: str = "postgres") -> dict[str, bytes]:
    """The contents of each file of `FILES`, from fresh random values."""
    password = secrets.token_urlsafe(24)
    lines = {
        "audit-mac-key": secrets.token_urlsafe(48),
        "registry-secret": secrets.token_urlsafe(32),
        "postgres-password": password,
        "postgres-dsn": f"postgresql://lockgate:{password}@{postgres_host}:5432/lockgate",
    }
    key = Ed25519PrivateKey.generate()
    return {
        ENV_FILE: "".join(f"{name}={value}\n" for name, value in lines.items()).encode(),
        SIGNING_KEY: key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
        SIGNING_KEY_PUB: key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ),
    }


def write(directory: Path, *, postgres_host: str = "postgres", force: bool = False) -> list[Path]:
    """Write fresh secrets into `directory`; FileExistsError naming the first file already there (unless
    `force`). Returns the paths written."""
    paths = [directory / name for name in FILES]
    if not force:
        for path in paths:
            if path.exists():
                raise FileExistsError(f"{path} exists: its secrets are in use (--force replaces them)")
    written = []
    for name, content in fresh(postgres_host).items():
        path = directory / name
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(content)
        written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.deploy.secrets", description=__doc__)
    parser.add_argument(
        "directory", type=Path, help="the overlay's directory (beside its kustomization.yaml)"
    )
    parser.add_argument("--postgres-host", default="postgres", help="PostgreSQL's host in the DSN")
    parser.add_argument("--force", action="store_true", help="replace secrets already there")
    args = parser.parse_args(argv)
    try:
        paths = write(args.directory, postgres_host=args.postgres_host, force=args.force)
    except FileExistsError as exc:
        print(exc, file=sys.stderr)
        return 1
    for path in paths:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

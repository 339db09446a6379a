"""Private, durable files for the audit spool: created 0600 (directories 0700) whatever the umask, fsync'd,
replaced atomically. Blocking I/O: call these off the event loop."""

from __future__ import annotations

import os
from pathlib import Path


def private_opener(path: str, flags: int) -> int:
    """`open`'s opener for a file only this user may read or write (0600 when created): spooled drafts hold
    what the audit trail holds, prompts included where retained."""
    return os.open(path, flags, 0o600)


def private_dir(directory: Path) -> None:
    """`directory`, each missing part of it created 0700; what exists is left as it is."""
    missing = [d for d in (directory, *directory.parents) if not d.is_dir()]
    for part in reversed(missing):
        part.mkdir(exist_ok=True)
        part.chmod(0o700)


def append_synced(path: Path, line: bytes) -> None:
    """Append `line` to `path` (created 0600) and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: Path) -> None:
    """fsync `directory`, so the names created, renamed or deleted in it are durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_synced(path: Path, data: bytes, *, sync_dir: bool = True) -> None:
    """Make `path` hold `data` (0600), atomically: written whole and fsync'd to `<path>.tmp`, then renamed
    over `path`, so a crash leaves the old contents or the new, never a mix. With `sync_dir` the rename is
    fsync'd too (the caller may do that itself, after more changes to the directory)."""
    tmp = path.with_name(f"{path.name}.tmp")
    with open(tmp, "wb", opener=private_opener) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    if sync_dir:
        fsync_dir(path.parent)

"""A trained head's files: named arrays in an `.npz` whose sha256 the registry pins, and a JSON of metadata.

The embedding guard's logistic head (`guard.embedding`) and the n-gram guard's head (`guard.ngram`) are
saved and loaded here. The zip is written with fixed timestamps, so equal arrays give an equal file and an
equal hash; a load hashes the bytes it then parses, so no file can be swapped in between.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from guard.base import GuardError


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` so a reader sees the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def save_arrays(
    directory: Path,
    weights_file: str,
    meta_file: str,
    arrays: Mapping[str, NDArray[Any]],
    meta: dict[str, Any],
) -> str:
    """Write `arrays` (in their order and dtypes) to `directory/weights_file` and `meta`, with the arrays'
    sha256 added as `weights_sha256`, to `directory/meta_file`; that sha256."""
    directory.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for name, array in arrays.items():
            member = io.BytesIO()
            np.save(member, np.ascontiguousarray(array), allow_pickle=False)
            archive.writestr(
                zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0)), member.getvalue()
            )
    data = buffer.getvalue()
    sha = hashlib.sha256(data).hexdigest()
    write_atomic(directory / weights_file, data)
    encoded = json.dumps({**meta, "weights_sha256": sha}, indent=2, sort_keys=True).encode()
    write_atomic(directory / meta_file, encoded)
    return sha


def load_arrays(
    directory: Path, weights_file: str, meta_file: str, names: tuple[str, ...], expected_sha256: str
) -> tuple[dict[str, NDArray[Any]], dict[str, Any]]:
    """The arrays `names` and the metadata saved in `directory`; GuardError unless the weights file has
    sha256 `expected_sha256` (an empty one included: a head is never loaded unpinned) and holds them all."""
    if not expected_sha256:
        raise GuardError("a head is loaded only against a pinned weights sha256")
    try:
        data = (directory / weights_file).read_bytes()
        meta = json.loads((directory / meta_file).read_text())
    except (OSError, ValueError) as exc:
        raise GuardError(f"cannot read the head in {directory}: {exc}") from exc
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected_sha256:
        raise GuardError(f"{directory / weights_file} has sha256 {actual}, expected {expected_sha256}")
    if not isinstance(meta, dict):
        raise GuardError(f"{directory / meta_file} is not a JSON object")
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as archive:
            arrays = {name: np.asarray(archive[name]) for name in names}
    except (OSError, ValueError, KeyError) as exc:
        raise GuardError(f"malformed head weights in {directory}: {exc}") from exc
    return arrays, meta

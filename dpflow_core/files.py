"""Small file helpers shared by every stage: hashing and durable renames."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def default_workdir() -> Path:
    """The work folder (manifests, datasets, reports, checkpoints): ``$DPFLOW_WORKDIR``, else ``<cwd>/outputs``."""
    env = os.environ.get("DPFLOW_WORKDIR")
    return Path(env) if env else Path.cwd() / "outputs"


def sha256_file(path: str | Path, chunk_bytes: int = 1 << 20) -> str:
    """SHA-256 (64 lowercase hex digits) of a local file, read in ``chunk_bytes`` blocks (hashlib).

    Raises:
        OSError: when the file cannot be read.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(chunk_bytes), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_dir(folder: str | Path) -> None:
    """fsync a directory so a rename inside it survives a crash; silently a no-op where unsupported."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

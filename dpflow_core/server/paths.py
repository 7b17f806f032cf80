"""Where a dataset lives on the GPU server, and the free disk it needs there.

Takes a server, a task name and a dataset's SHA-256; gives the content-addressed path
``<data_root>/<task>/<sha256[:16]>/dataset.npz`` (``dataset.zarr.zip`` for a UMI export) and the disk margin (bytes) kept beyond a file.
Used by both :mod:`~dpflow_core.server.preflight` and :mod:`~dpflow_core.server.upload`.
"""

from __future__ import annotations

import posixpath

from dpflow_core.errors import DatasetError
from dpflow_core.names import validate_name
from dpflow_core.server.config import is_sha256
from dpflow_core.server.gpu_server import GpuServer

#: File name of a dataset on the server (inside its content-addressed folder).
REMOTE_DATASET_NAME = "dataset.npz"
#: File name of a UMI zarr replay buffer there (``dpflow export-umi``): UMI's loaders expect ``.zarr.zip``.
REMOTE_UMI_DATASET_NAME = "dataset.zarr.zip"


def remote_dataset_name(local_name: str) -> str:
    """The server-side file name for a local dataset file: :data:`REMOTE_UMI_DATASET_NAME` for a
    ``*.zarr.zip``, else :data:`REMOTE_DATASET_NAME`."""
    return REMOTE_UMI_DATASET_NAME if local_name.endswith(".zarr.zip") else REMOTE_DATASET_NAME
#: Free space kept beyond the dataset: max(DISK_MARGIN_MIN_BYTES, DISK_MARGIN_FRACTION x size).
DISK_MARGIN_FRACTION = 0.05
DISK_MARGIN_MIN_BYTES = 256 * 1024 * 1024


def disk_margin_bytes(size_bytes: int) -> int:
    """Free space required beyond a file of ``size_bytes`` (bytes)."""
    return max(DISK_MARGIN_MIN_BYTES, int(DISK_MARGIN_FRACTION * size_bytes))


def remote_dataset_path(server: GpuServer, task: str, sha256: str, name: str = REMOTE_DATASET_NAME) -> str:
    """``<data_root>/<task>/<sha256[:16]>/<name>`` on ``server`` (absolute; ``name``: ``dataset.npz``
    or, for a UMI export, ``dataset.zarr.zip``).

    Raises:
        InvalidNameError: for an unsafe task name.
        DatasetError: when ``sha256`` is not 64 lowercase hex digits.
    """
    validate_name(task, "task")
    if not is_sha256(sha256):
        raise DatasetError(f"invalid SHA-256 {sha256!r}", code="bad_sha256")
    if name not in (REMOTE_DATASET_NAME, REMOTE_UMI_DATASET_NAME):
        raise DatasetError(f"invalid remote dataset name {name!r}", code="bad_name")
    return posixpath.join(server.data_root, task, sha256[:16], name)

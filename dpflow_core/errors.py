"""Error types. Each carries the offending file or value and the reason, so the
CLI can print it in one line and Dagster can show it as failure metadata."""

from __future__ import annotations

import errno
import os
from pathlib import Path


class DpflowError(Exception):
    """Base class of every error dpflow raises on purpose.

    Attributes:
        path: the file or directory at fault, when there is one.
        reason: a human-readable sentence saying what is wrong.
        code: a stable machine-readable code (``snake_case``).
    """

    code = "error"

    def __init__(self, reason: str, path: str | Path | None = None, code: str | None = None):
        self.reason = reason
        self.path = None if path is None else str(path)
        if code is not None:
            self.code = code
        super().__init__(f"{self.path}: {reason}" if self.path else reason)


class RecordingError(DpflowError):
    """An MCAP recording cannot be read or is not a Matrix Studio recording."""

    code = "bad_recording"


class PairingError(DpflowError):
    """The recordings folder or manifest cannot be paired (e.g. no <STEM>.mcap files)."""

    code = "pairing_error"


class ConversionError(DpflowError):
    """Conversion to a replay buffer failed (no valid episodes, output exists, ...)."""

    code = "conversion_error"


class DatasetError(DpflowError):
    """A dataset.npz or its metadata is missing, inconsistent or invalid."""

    code = "dataset_error"


class RemoteError(DpflowError):
    """A command or transfer on the GPU server failed, or a check of it did."""

    code = "remote_error"


class InvalidNameError(DpflowError):
    """A run, task or stem name does not match the allowed pattern."""

    code = "invalid_name"


class RunError(DpflowError):
    """A smoke or training run failed, or one of its checks did."""

    code = "run_error"


class WeightsError(DpflowError):
    """Pretrained weights are missing, unreadable, or do not fit the model (names or shapes)."""

    code = "bad_weights"


class ResultError(DpflowError):
    """A stage result (an asset's value) is not what its type says: a field is missing or of the wrong kind."""

    code = "bad_result"


class StorageError(DpflowError):
    """A file or folder could not be written or read: the disk is full, permission is denied, the file system is
    read-only, ... ``path`` is the output (or the file the OS named), ``reason`` what was being done and the
    OS's words with its errno name; ``code`` ``no_space``, ``permission_denied``, ``read_only_file_system``
    or ``os_error``."""

    code = "os_error"


_ERRNO_CODES = {"ENOSPC": "no_space", "EDQUOT": "no_space", "EACCES": "permission_denied", "EPERM": "permission_denied",
                "EROFS": "read_only_file_system"}


def storage_error(exc: OSError, path: str | Path, doing: str) -> StorageError:
    """The :class:`StorageError` for an ``OSError`` met while ``doing`` (e.g. "writing the dataset") to ``path``.

    A write that fails for lack of space raises with no file name; then ``path`` is the one named. When the
    OS names another file (an input, a folder), it is named too; a temporary's name is not (the output is).
    """
    name = errno.errorcode.get(exc.errno or -1, "")
    words = exc.strerror or (os.strerror(exc.errno) if exc.errno else str(exc))
    where = ""
    if exc.filename is not None and Path(str(exc.filename)).name[:1] != "." and str(exc.filename) != str(path):
        where = f" (on {exc.filename})"
    return StorageError(f"{doing} failed: {words}{f' ({name})' if name else ''}{where}", path,
                        code=_ERRNO_CODES.get(name, "os_error"))


#: OS errors that say the disk being written is at fault (full, over quota, read-only), never the input being read:
#: a worker meeting one stops the whole run with a :class:`StorageError` instead of rejecting its episode.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})

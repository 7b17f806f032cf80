"""Error types. Each carries the offending file or value and the reason, so the
CLI can print it in one line and Dagster can show it as failure metadata."""

from __future__ import annotations

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

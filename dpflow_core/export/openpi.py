"""openpi norm stats: ``norm_stats.json`` (mean, std, q01, q99 per dimension) of a LeRobot dataset.

Takes a validated dataset folder; gives :class:`NormStats` for the state and the actions, computed from
the parquet columns only (never a video), and writes them in openpi's layout.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dpflow_core.errors import DatasetError
from dpflow_core.export.features import CODEBASE_VERSION
from dpflow_core.export.validation import LeRobotLayout, read_lowdim, validate_lerobot_dataset
from dpflow_core.files import write_text_atomic


@dataclass(frozen=True)
class NormStats:
    """openpi normalisation statistics of one vector, each (D,) float64.

    ``std`` is the population standard deviation; ``q01``/``q99`` are the exact
    1st and 99th percentiles (numpy's default linear interpolation), where
    openpi's own tool approximates them with 5000-bin histograms.
    """

    mean: np.ndarray
    std: np.ndarray
    q01: np.ndarray
    q99: np.ndarray

    def to_json(self) -> dict[str, list[float]]:
        """``{"mean": [...], "std": [...], "q01": [...], "q99": [...]}`` as Python floats."""
        return {k: [float(x) for x in getattr(self, k)] for k in ("mean", "std", "q01", "q99")}


def norm_stats_of(values: np.ndarray) -> NormStats:
    """openpi statistics of (T, D) values: mean, population std, exact q01 and q99, each (D,) float64.

    Raises:
        DatasetError: when there are fewer than 2 rows or a value is not finite.
    """
    v = np.asarray(values, dtype=np.float64)
    if len(v) < 2:
        raise DatasetError(f"need at least 2 frames for statistics, got {len(v)}", code="empty_dataset")
    if not np.all(np.isfinite(v)):
        raise DatasetError(f"{np.count_nonzero(~np.isfinite(v))} values are not finite", code="bad_data")
    q01, q99 = np.quantile(v, [0.01, 0.99], axis=0)
    return NormStats(mean=v.mean(axis=0), std=v.std(axis=0), q01=q01, q99=q99)


def compute_openpi_norm_stats(dataset_dir: str | Path, expected_version: str = CODEBASE_VERSION) -> dict[str, NormStats]:
    """openpi norm stats of a LeRobot dataset, from its parquet columns only.

    Args:
        dataset_dir: the dataset folder.
        expected_version: required ``codebase_version`` of ``meta/info.json``.

    Returns:
        ``{"state": NormStats, "actions": NormStats}``.

    Raises:
        DatasetError: see :func:`validate_lerobot_dataset` and :func:`read_lowdim`.
    """
    return _norm_stats_of_layout(validate_lerobot_dataset(dataset_dir, expected_version))


def _norm_stats_of_layout(layout: LeRobotLayout) -> dict[str, NormStats]:
    try:
        return {k: norm_stats_of(v) for k, v in read_lowdim(layout).items()}
    except DatasetError as exc:
        if exc.path is None:
            raise DatasetError(exc.reason, layout.root, code=exc.code) from exc
        raise


def write_openpi_norm_stats(
    dataset_dir: str | Path,
    output: str | Path | None = None,
    overwrite: bool = False,
    expected_version: str = CODEBASE_VERSION,
) -> Path:
    """Compute and write openpi's ``norm_stats.json`` (``{"norm_stats": {"state": ..., "actions": ...}}``).

    Args:
        dataset_dir: the LeRobot dataset folder.
        output: the ``.json`` file to write, or a folder (an existing one, or any
            path not ending in ``.json``) to write ``norm_stats.json`` into, as in
            openpi's ``assets/<config>/<repo_id>/``; default ``<dataset_dir>/norm_stats.json``.
        overwrite: replace an existing file (an existing file with exactly the
            computed content is kept either way).
        expected_version: required ``codebase_version``.

    Returns:
        The written path.

    Raises:
        DatasetError: invalid dataset (see :func:`compute_openpi_norm_stats`) or
            an existing, different output without ``overwrite`` (``output_exists``).
    """
    out = Path(dataset_dir) / "norm_stats.json" if output is None else Path(output)
    if out.is_dir() or out.suffix.lower() != ".json":
        out = out / "norm_stats.json"
    layout = validate_lerobot_dataset(dataset_dir, expected_version)
    text = json.dumps({"norm_stats": {k: s.to_json() for k, s in _norm_stats_of_layout(layout).items()}}, indent=2) + "\n"
    if out.exists() and not overwrite:
        if out.is_file() and out.read_text() == text:
            return out
        raise DatasetError(
            "a different norm stats file already exists (pass --overwrite (overwrite=True) to replace it)", out, code="output_exists"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, text)
    return out

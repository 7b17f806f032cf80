"""openpi norm stats: ``norm_stats.json`` (mean, std, q01, q99 per dimension) of a LeRobot dataset.

Takes a validated dataset folder (v3.0 or v2.1); gives :class:`NormStats` for the state and the
actions as openpi's ``scripts/compute_norm_stats.py`` computes them (its data loader's order and
batches, action chunks over the action horizon, the optional delta-action transform, and its
``RunningStats`` histogram quantiles), from the parquet columns only (never a video), and writes
them in openpi's layout.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dpflow_core.errors import DatasetError
from dpflow_core.export import OPENPI_ACTION_HORIZON, OPENPI_BATCH_SIZE  # noqa: F401  (defined there for the CLI)
from dpflow_core.export.validation import LeRobotLayout, read_lowdim, validate_lerobot_dataset
from dpflow_core.files import os_errors_named, remove_stale_temporaries, write_text_atomic
from dpflow_core.results import StageResult


#: Histogram bins of openpi's ``RunningStats`` quantiles.
OPENPI_QUANTILE_BINS = 5000


@dataclass(frozen=True)
class NormStats:
    """openpi normalisation statistics of one vector, each (D,).

    ``std`` is the population standard deviation; ``q01``/``q99`` are openpi's
    histogram quantiles (:class:`RunningStats`).
    """

    mean: np.ndarray
    std: np.ndarray
    q01: np.ndarray
    q99: np.ndarray

    def to_json(self) -> dict[str, list[float]]:
        """``{"mean": [...], "std": [...], "q01": [...], "q99": [...]}`` as Python floats."""
        return {k: [float(x) for x in getattr(self, k)] for k in ("mean", "std", "q01", "q99")}


class RunningStats:
    """Running mean, std and histogram quantiles of batches of vectors: openpi's method.

    Learnt from ``openpi/shared/normalize.py`` (``RunningStats``, Physical-Intelligence/openpi
    at commit 138701cd), written here. Per dimension a 5000-bin histogram spans
    ``[min - 1e-10, max + 1e-10]`` of the values seen so far; when a batch widens the range,
    the counts are moved to new edges by the left edge of their old bin. The mean and the mean
    of squares are running averages in the batches' dtype; ``std = sqrt(max(0, E[x^2] - E[x]^2))``;
    the q-quantile is the left edge of the bin where the cumulative count reaches ``q * count``
    (no interpolation). The result depends on the batch order and size, which is why
    :func:`openpi_norm_stats` reproduces openpi's data loader.
    """

    def __init__(self, bins: int = OPENPI_QUANTILE_BINS):
        self.bins = bins
        self.count = 0
        self._mean = self._mean_sq = self._min = self._max = None
        self._hist: list[np.ndarray] = []
        self._edges: list[np.ndarray] = []

    def update(self, batch: np.ndarray) -> None:
        """Add a batch: an array whose last axis is the vector (D), every other axis a batch axis.

        Raises:
            DatasetError: when D differs from the first batch's.
        """
        batch = batch.reshape(-1, batch.shape[-1])
        n, d = batch.shape
        if self.count == 0:
            self._mean, self._mean_sq = batch.mean(axis=0), (batch ** 2).mean(axis=0)
            self._min, self._max = batch.min(axis=0), batch.max(axis=0)
            self._hist = [np.zeros(self.bins) for _ in range(d)]
            self._edges = [np.linspace(self._min[i] - 1e-10, self._max[i] + 1e-10, self.bins + 1) for i in range(d)]
        else:
            if d != self._mean.size:
                raise DatasetError(f"vectors of length {d} after vectors of length {self._mean.size}", code="bad_data")
            new_min, new_max = batch.min(axis=0), batch.max(axis=0)
            widened = np.any(new_max > self._max) or np.any(new_min < self._min)
            self._max, self._min = np.maximum(self._max, new_max), np.minimum(self._min, new_min)
            if widened:
                for i in range(d):
                    edges = np.linspace(self._min[i] - 1e-10, self._max[i] + 1e-10, self.bins + 1)
                    self._hist[i] = np.histogram(self._edges[i][:-1], bins=edges, weights=self._hist[i])[0]
                    self._edges[i] = edges
        self.count += n
        self._mean += (batch.mean(axis=0) - self._mean) * (n / self.count)
        self._mean_sq += ((batch ** 2).mean(axis=0) - self._mean_sq) * (n / self.count)
        for i in range(d):
            self._hist[i] += np.histogram(batch[:, i], bins=self._edges[i])[0]

    def statistics(self) -> NormStats:
        """The statistics so far.

        Raises:
            DatasetError: with fewer than 2 vectors.
        """
        if self.count < 2:
            raise DatasetError(f"need at least 2 vectors for statistics, got {self.count}", code="empty_dataset")
        std = np.sqrt(np.maximum(0, self._mean_sq - self._mean ** 2))
        q01, q99 = ([e[np.searchsorted(np.cumsum(h), q * self.count)] for h, e in zip(self._hist, self._edges)]
                    for q in (0.01, 0.99))
        return NormStats(mean=self._mean.copy(), std=std, q01=np.array(q01), q99=np.array(q99))


def norm_stats_of(values: np.ndarray, batch_size: int = OPENPI_BATCH_SIZE) -> NormStats:
    """openpi statistics of (T, D) values fed to :class:`RunningStats` in batches of ``batch_size`` rows
    (the last partial batch kept).

    Raises:
        DatasetError: when there are fewer than 2 rows or a value is not finite.
    """
    v = np.asarray(values)
    if len(v) < 2:
        raise DatasetError(f"need at least 2 frames for statistics, got {len(v)}", code="empty_dataset")
    if not np.all(np.isfinite(v)):
        raise DatasetError(f"{np.count_nonzero(~np.isfinite(v))} values are not finite", code="bad_data")
    stats = RunningStats()
    for a in range(0, len(v), batch_size):
        stats.update(v[a:a + batch_size])
    return stats.statistics()


def action_chunks(actions: np.ndarray, lengths: list[int], horizon: int) -> np.ndarray:
    """The action chunk of every frame, as lerobot's ``delta_timestamps`` give it to openpi.

    Frame t of an episode gets the actions of frames t .. t + horizon - 1, the indices past
    the episode's last frame clamped to it (lerobot repeats the last action and marks it padded).

    Args:
        actions: (T, D) the episodes' actions, concatenated in order.
        lengths: frames per episode (sum = T).
        horizon: action steps per chunk (openpi's ``action_horizon``), >= 1.

    Returns:
        (T, horizon, D), same dtype.
    """
    index = []
    start = 0
    for n in lengths:
        t = np.arange(start, start + n)[:, None] + np.arange(horizon)[None, :]
        index.append(np.minimum(t, start + n - 1))
        start += n
    return actions[np.concatenate(index)] if index else actions[:0, None].repeat(horizon, axis=1)


def openpi_norm_stats(
    state: np.ndarray,
    actions: np.ndarray,
    lengths: list[int],
    action_horizon: int = OPENPI_ACTION_HORIZON,
    batch_size: int = OPENPI_BATCH_SIZE,
    delta_action_mask: list[bool] | None = None,
) -> dict[str, NormStats]:
    """What openpi's ``scripts/compute_norm_stats.py`` computes from a LeRobot dataset's state and actions.

    openpi iterates the dataset in order (no shuffle) in batches of ``batch_size`` frames,
    dropping the last partial batch (``num_batches = len(dataset) // batch_size``); each frame
    carries its state (D,) and its action chunk (:func:`action_chunks`); with a delta-action
    transform (openpi's ``DeltaActions(mask)``), ``actions[..., :len(mask)] -= state`` where the
    mask is true, per frame over its whole chunk (openpi's configs: ``make_bool_mask(6, -1)``,
    the pose relative, the gripper absolute). Each batch updates a :class:`RunningStats` per key.

    Args:
        state, actions: (T, D) float32 (parquet columns, episodes in index order).
        lengths: frames per episode.
        action_horizon: openpi's ``model.action_horizon`` (pi0: 50).
        batch_size: openpi's ``TrainConfig.batch_size`` (32).
        delta_action_mask: None (no transform), or one bool per leading action dimension.

    Returns:
        ``{"state": NormStats, "actions": NormStats}``.

    Raises:
        DatasetError: fewer frames than one batch, a value not finite, a mask longer than D,
            or lengths that do not add up to T.
    """
    state, actions = np.asarray(state), np.asarray(actions)
    if sum(lengths) != len(state) or len(state) != len(actions):
        raise DatasetError(f"episode lengths add up to {sum(lengths)}, state has {len(state)} rows, actions {len(actions)}",
                           code="inconsistent_data")
    if action_horizon < 1 or batch_size < 1:
        raise DatasetError(f"action_horizon {action_horizon} and batch_size {batch_size} must be >= 1", code="bad_option")
    n_batches = len(state) // batch_size
    if n_batches == 0 or n_batches * batch_size < 2:
        raise DatasetError(f"{len(state)} frames make no full batch of {batch_size} (openpi drops partial batches)",
                           code="empty_dataset")
    for key, v in (("state", state), ("actions", actions)):
        if not np.all(np.isfinite(v)):
            raise DatasetError(f"{key}: {np.count_nonzero(~np.isfinite(v))} values are not finite", code="bad_data")
    chunks = action_chunks(actions, list(lengths), action_horizon)
    if delta_action_mask is not None:
        mask = np.asarray(delta_action_mask, dtype=bool)
        if mask.ndim != 1 or len(mask) > actions.shape[1] or len(mask) > state.shape[1]:
            raise DatasetError(f"delta action mask of length {mask.size} for {actions.shape[1]}-D actions", code="bad_option")
        dims = len(mask)
        chunks = chunks.copy()
        chunks[..., :dims] -= np.where(mask, state[:, :dims], 0)[:, None, :].astype(chunks.dtype)
    out = {"state": RunningStats(), "actions": RunningStats()}
    for b in range(n_batches):
        sl = slice(b * batch_size, (b + 1) * batch_size)
        out["state"].update(state[sl])
        out["actions"].update(chunks[sl])
    return {k: s.statistics() for k, s in out.items()}


def compute_openpi_norm_stats(
    dataset_dir: str | Path,
    expected_version: str | None = None,
    action_horizon: int = OPENPI_ACTION_HORIZON,
    batch_size: int = OPENPI_BATCH_SIZE,
    delta_action_mask: list[bool] | None = None,
) -> dict[str, NormStats]:
    """openpi norm stats of a LeRobot dataset (v3.0 or v2.1), from its parquet columns only.

    Args:
        dataset_dir: the dataset folder.
        expected_version: required ``codebase_version``; None accepts either format.
        action_horizon, batch_size, delta_action_mask: see :func:`openpi_norm_stats`.

    Returns:
        ``{"state": NormStats, "actions": NormStats}``.

    Raises:
        DatasetError: see :func:`validate_lerobot_dataset`, :func:`read_lowdim` and :func:`openpi_norm_stats`.
    """
    layout = validate_lerobot_dataset(dataset_dir, expected_version)
    return _norm_stats_of_layout(layout, action_horizon, batch_size, delta_action_mask)


def _norm_stats_of_layout(layout: LeRobotLayout, action_horizon: int, batch_size: int,
                          delta_action_mask: list[bool] | None) -> dict[str, NormStats]:
    try:
        cols = read_lowdim(layout)
        return openpi_norm_stats(cols["state"], cols["actions"], list(layout.lengths.values()),
                                 action_horizon, batch_size, delta_action_mask)
    except DatasetError as exc:
        if exc.path is None:
            raise DatasetError(exc.reason, layout.root, code=exc.code) from exc
        raise


def write_openpi_norm_stats(
    dataset_dir: str | Path,
    output: str | Path | None = None,
    overwrite: bool = False,
    expected_version: str | None = None,
    action_horizon: int = OPENPI_ACTION_HORIZON,
    batch_size: int = OPENPI_BATCH_SIZE,
    delta_action_mask: list[bool] | None = None,
) -> Path:
    """Compute and write openpi's ``norm_stats.json`` (``{"norm_stats": {"state": ..., "actions": ...}}``).

    Args:
        dataset_dir: the LeRobot dataset folder.
        output: the ``.json`` file to write, or a folder (an existing one, or any
            path not ending in ``.json``) to write ``norm_stats.json`` into, as in
            openpi's ``assets/<config>/<repo_id>/``; default ``<dataset_dir>/norm_stats.json``.
        overwrite: replace an existing file (an existing file with exactly the
            computed content is kept either way).
        expected_version: required ``codebase_version``; None accepts either format.
        action_horizon, batch_size, delta_action_mask: see :func:`openpi_norm_stats`.

    Returns:
        The written path.

    Raises:
        DatasetError: invalid dataset (see :func:`compute_openpi_norm_stats`) or
            an existing, different output without ``overwrite`` (``output_exists``).
        StorageError: the disk is full, read-only or the folder not writable, naming the output.
    """
    out = Path(dataset_dir) / "norm_stats.json" if output is None else Path(output)
    if out.is_dir() or out.suffix.lower() != ".json":
        out = out / "norm_stats.json"
    layout = validate_lerobot_dataset(dataset_dir, expected_version)
    stats = _norm_stats_of_layout(layout, action_horizon, batch_size, delta_action_mask)
    text = json.dumps({"norm_stats": {k: s.to_json() for k, s in stats.items()}}, indent=2) + "\n"
    if out.exists() and not overwrite:
        if out.is_file() and out.read_text() == text:
            return out
        raise DatasetError(
            "a different norm stats file already exists (pass --overwrite (overwrite=True from Python) to replace it)", out, code="output_exists"
        )
    with os_errors_named(out, "writing the openpi norm stats"):
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(out.parent)
        write_text_atomic(out, text)
    return out


@dataclass(frozen=True)
class OpenpiNormStatsFile(StageResult):
    """A written openpi ``norm_stats.json``: the value of the ``norm_stats`` asset (``to_dict``/``from_dict``).

    Attributes:
        path: the ``norm_stats.json``; dataset_path: the LeRobot dataset folder it was computed from.
        state_dim, action_dim: dimensions of ``state`` and ``actions`` (7 for rotvec, 10 for rot6d).
    """

    path: str
    dataset_path: str
    state_dim: int
    action_dim: int

    @classmethod
    def read(cls, path: str | Path, dataset_path: str | Path) -> "OpenpiNormStatsFile":
        """The file at ``path`` (written by :func:`write_openpi_norm_stats` from ``dataset_path``).

        Raises:
            DatasetError: the file is not openpi's layout (``bad_metadata``).
        """
        stats = _read_norm_stats(path)
        return cls(str(path), str(dataset_path), len(stats["state"]["mean"]), len(stats["actions"]["mean"]))

    def markdown_table(self) -> str:
        """A Markdown table of the file: one row per key and dimension, mean, std, q01, q99 (4 digits)."""
        rows = ["| key | dim | mean | std | q01 | q99 |", "|---|---|---|---|---|---|"]
        for key, s in _read_norm_stats(self.path).items():
            for d in range(len(s["mean"])):
                rows.append(
                    f"| {key if d == 0 else ''} | {d} | {s['mean'][d]:.4g} | {s['std'][d]:.4g} "
                    f"| {s['q01'][d]:.4g} | {s['q99'][d]:.4g} |"
                )
        return "\n".join(rows)


def _read_norm_stats(path: str | Path) -> dict:
    try:
        stats = json.loads(Path(path).read_text())["norm_stats"]
        for key in ("state", "actions"):
            stats[key]["mean"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DatasetError(f"not an openpi norm_stats.json: {exc!r}", path, code="bad_metadata") from exc
    return stats

"""LeRobot v3.0 statistics: per-episode ``min, max, mean, std, count, q01, q10, q50, q90, q99`` and their aggregate.

Takes one episode's columns (vectors, index columns, camera frames); gives the per-episode statistics
stored in ``meta/episodes/`` and, aggregated over episodes, ``meta/stats.json``. The method is that of
lerobot 0.4.4's ``lerobot/datasets/compute_stats.py`` (read there, written here):

* quantiles of a vector column come from a 5000-bin histogram per dimension whose edges span
  ``[min - 1e-10, max + 1e-10]`` of the episode, with linear interpolation inside the bin where the
  cumulative count reaches ``q * count``;
* a camera's statistics are over the pixels of ``estimate_num_samples(N)`` frames taken evenly
  (``round(linspace(0, N - 1, k))``), each subsampled by ``int(max(H, W) / 150)`` in both directions
  when ``max(H, W) >= 300``, per channel and divided by 255; ``count`` is the number of frames sampled;
* the dataset's statistics aggregate the episodes': min of mins, max of maxes, the count-weighted
  mean, the pooled variance, and each quantile as the count-weighted mean of the episodes' quantiles.

Where dpflow differs, on purpose: means and variances are accumulated in float64 (lerobot keeps the
column's dtype, float32 for vectors, and squares camera pixels in uint8, which wraps around), so
``std`` is the exact population standard deviation.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

import numpy as np

from dpflow_core.errors import ConversionError
from dpflow_core.export.features import QUANTILES

#: Bins of lerobot's histogram quantiles (``RunningQuantileStats.num_quantile_bins``).
QUANTILE_BINS = 5000
QUANTILE_KEYS = tuple(f"q{int(q * 100):02d}" for q in QUANTILES)


def _histogram(column: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Counts and edges of lerobot's histogram of one column: ``bins`` equal bins over ``[min - 1e-10, max + 1e-10]``
    (the arithmetic in the column's dtype, as lerobot does it).

    Uniform edges take numpy's equal-bins path (it corrects for rounding at the edges, so the counts equal
    those of the explicit edges) unless rounding has made the range empty or too narrow for it.
    """
    lo, hi = column.min(), column.max()
    first, last = lo - 1e-10, hi + 1e-10
    edges = np.linspace(first, last, bins + 1)
    if first < last:
        try:
            counts, uniform = np.histogram(column, bins=bins, range=(first, last))
        except ValueError:  # a range too narrow for finite equal bins in this dtype
            uniform = None
        if uniform is not None and np.array_equal(uniform, edges):
            return counts, edges
    return np.histogram(column, bins=edges)[0], edges


def _quantile(cumsum: np.ndarray, edges: np.ndarray, target: float) -> float:
    """lerobot's ``_compute_single_quantile``: linear interpolation inside the bin where the cumulative count reaches ``target``."""
    idx = int(np.searchsorted(cumsum, target))
    if idx == 0:
        return float(edges[0])
    if idx >= len(cumsum):
        return float(edges[-1])
    before = cumsum[idx - 1]
    in_bin = cumsum[idx] - before
    if in_bin == 0:
        return float(edges[idx])
    return float(edges[idx] + (target - before) / in_bin * (edges[idx + 1] - edges[idx]))


def vector_stats(values: np.ndarray, bins: int = QUANTILE_BINS) -> dict[str, np.ndarray]:
    """Statistics of one episode's column, as lerobot 0.4 stores them.

    Args:
        values: (N,) or (N, D) numbers (N >= 1).
        bins: histogram bins of the quantiles.

    Returns:
        ``min, max, mean, std`` and ``q01 ... q99``, each (D,) float64 ((1,) for a 1-D column),
        and ``count`` = [N] int64. With a single row every quantile is the row itself.

    Raises:
        ConversionError: when ``values`` is empty or not 1-D / 2-D.
    """
    v = np.asarray(values)
    if v.ndim not in (1, 2) or len(v) == 0:
        raise ConversionError(f"statistics need (N>=1,) or (N>=1, D) values, got {v.shape}")
    v2 = v.reshape(len(v), -1)
    out = {
        "min": v2.min(axis=0).astype(np.float64),
        "max": v2.max(axis=0).astype(np.float64),
        "mean": v2.mean(axis=0, dtype=np.float64),
        "std": v2.std(axis=0, dtype=np.float64),
        "count": np.array([len(v2)], dtype=np.int64),
    }
    quantiles = np.empty((len(QUANTILES), v2.shape[1]))
    if len(v2) < 2:
        quantiles[:] = out["mean"]
    else:
        for d in range(v2.shape[1]):
            counts, edges = _histogram(np.ascontiguousarray(v2[:, d]), bins)
            cumsum = np.cumsum(counts)
            quantiles[:, d] = [_quantile(cumsum, edges, q * len(v2)) for q in QUANTILES]
    out.update({key: quantiles[i] for i, key in enumerate(QUANTILE_KEYS)})
    return out


def sample_frame_indices(n_frames: int) -> np.ndarray:
    """The frames lerobot samples for a camera's statistics: ``k`` evenly spaced indices, where
    ``k = max(min(100, n), min(int(n ** 0.75), 10000))``."""
    k = max(min(100, n_frames), min(int(n_frames ** 0.75), 10_000))
    return np.round(np.linspace(0, n_frames - 1, k)).astype(int)


def camera_stats(frames: np.ndarray, bins: int = QUANTILE_BINS) -> dict[str, np.ndarray]:
    """Statistics of one episode's camera, sampled as lerobot 0.4 samples them (see the module doc).

    Args:
        frames: (N, H, W, 3) uint8 RGB.

    Returns:
        ``min, max, mean, std, q01 ... q99`` each (3, 1, 1) float64 in [0, 1], and ``count`` =
        [number of frames sampled].

    Raises:
        ConversionError: when ``frames`` is not (N>=1, H, W, 3) uint8.
    """
    f = np.asarray(frames)
    if f.dtype != np.uint8 or f.ndim != 4 or f.shape[-1] != 3 or len(f) == 0:
        raise ConversionError(f"frames must be (N>=1, H, W, 3) uint8, got {f.shape} {f.dtype}")
    idx = sample_frame_indices(len(f))
    h, w = f.shape[1:3]
    step = 1 if max(h, w) < 300 else int((w if w > h else h) / 150)
    sampled = f[idx, ::step, ::step]
    out = {k: np.empty((3, 1, 1)) for k in ("min", "max", "mean", "std", *QUANTILE_KEYS)}
    levels = np.arange(256, dtype=np.float64)
    for c in range(3):
        # per-level counts give exactly what lerobot's pixel histogram gives, at a fraction of the cost
        counts = np.bincount(sampled[..., c].ravel(), minlength=256).astype(np.float64)
        n = counts.sum()
        present = np.flatnonzero(counts)
        mean = float(counts @ levels) / n
        stats = {"min": float(present[0]), "max": float(present[-1]), "mean": mean,
                 "std": float(np.sqrt(counts @ (levels - mean) ** 2 / n))}
        if n >= 2:
            edges = np.linspace(np.uint8(present[0]) - 1e-10, np.uint8(present[-1]) + 1e-10, bins + 1)
            cumsum = np.cumsum(np.histogram(present.astype(np.float64), bins=edges, weights=counts[present])[0])
            stats.update({key: _quantile(cumsum, edges, q * n) for key, q in zip(QUANTILE_KEYS, QUANTILES)})
        else:
            stats.update({key: mean for key in QUANTILE_KEYS})
        for key, value in stats.items():
            out[key][c, 0, 0] = value / 255.0
    out["count"] = np.array([len(idx)], dtype=np.int64)
    return out


def aggregate_stats(per_episode: Iterable[Mapping[str, Mapping[str, np.ndarray]]]) -> dict[str, dict[str, np.ndarray]]:
    """The dataset's statistics from the episodes' (lerobot's ``aggregate_stats`` rule, module doc).

    Args:
        per_episode: per episode, feature -> the dict of :func:`vector_stats` / :func:`camera_stats`.

    Returns:
        feature -> ``min, max, mean, std, count`` and the quantiles present in every episode.

    Raises:
        ConversionError: when there is no episode.
    """
    episodes = list(per_episode)
    if not episodes:
        raise ConversionError("no episode statistics to aggregate")
    out: dict[str, dict[str, np.ndarray]] = {}
    for key in {k for ep in episodes for k in ep}:
        parts = [ep[key] for ep in episodes if key in ep]
        counts = np.stack([np.asarray(p["count"], dtype=np.float64) for p in parts])
        means = np.stack([p["mean"] for p in parts])
        w = counts.reshape(counts.shape + (1,) * (means.ndim - counts.ndim))
        total = counts.sum(axis=0)  # (1,): broadcasts against (D,) and (3, 1, 1)
        mean = (means * w).sum(axis=0) / total
        var = ((np.stack([p["std"] for p in parts]) ** 2 + (means - mean) ** 2) * w).sum(axis=0) / total
        agg = {
            "min": np.min(np.stack([p["min"] for p in parts]), axis=0),
            "max": np.max(np.stack([p["max"] for p in parts]), axis=0),
            "mean": mean,
            "std": np.sqrt(var),
            "count": total.astype(np.int64),
        }
        for q in QUANTILE_KEYS:
            if all(q in p for p in parts):
                agg[q] = (np.stack([p[q] for p in parts]) * w).sum(axis=0) / total
        out[key] = agg
    return out


# --------------------------------------------------------------------------- v2.1 (lerobot 0.3)


def feature_stats(values: np.ndarray) -> dict[str, np.ndarray]:
    """LeRobot per-episode statistics of a low-dimensional feature.

    Args:
        values: (N,) or (N, D) numbers.

    Returns:
        ``min``, ``max``, ``mean``, ``std`` (population), each (D,) — (1,) for a
        1-D column — and ``count`` = [N].
    """
    v = np.asarray(values)
    v2 = v.reshape(len(v), -1)
    stats = {
        "min": v2.min(axis=0),
        "max": v2.max(axis=0),
        "mean": v2.mean(axis=0, dtype=np.float64),
        "std": v2.std(axis=0, dtype=np.float64),
    }
    stats["count"] = np.array([len(v)], dtype=np.int64)
    return stats


def image_stats(frames: np.ndarray) -> dict[str, np.ndarray]:
    """LeRobot per-episode statistics of a camera, over every pixel of every frame.

    Args:
        frames: (N, H, W, 3) uint8 RGB.

    Returns:
        ``min``, ``max``, ``mean``, ``std`` per channel, each (3, 1, 1) float64
        scaled to [0, 1] (value / 255), and ``count`` = [N]. Exact: computed
        from per-channel histograms of the uint8 values.
    """
    f = np.asarray(frames)
    if f.dtype != np.uint8 or f.ndim != 4 or f.shape[-1] != 3:
        raise ConversionError(f"frames must be (N, H, W, 3) uint8, got {f.shape} {f.dtype}")
    levels = np.arange(256, dtype=np.float64)
    out = {k: np.zeros((3, 1, 1)) for k in ("min", "max", "mean", "std")}
    for c in range(3):
        hist = np.bincount(f[..., c].ravel(), minlength=256).astype(np.float64)
        n = hist.sum()
        present = np.flatnonzero(hist)
        mean = float(hist @ levels) / n
        var = float(hist @ (levels - mean) ** 2) / n
        out["min"][c, 0, 0] = present[0] / 255.0
        out["max"][c, 0, 0] = present[-1] / 255.0
        out["mean"][c, 0, 0] = mean / 255.0
        out["std"][c, 0, 0] = math.sqrt(var) / 255.0
    out["count"] = np.array([len(f)], dtype=np.int64)
    return out

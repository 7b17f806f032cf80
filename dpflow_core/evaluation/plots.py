"""Evaluation plots (PNG, matplotlib's Agg backend): trajectories, errors per horizon step, training loss."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Sequence

import numpy as np

from dpflow_core.evaluation.baselines import absolute_actions
from dpflow_core.evaluation.metrics import DIMENSION_NAMES, PredictorMetrics
from dpflow_core.files import atomic_path


def read_loss_curve(log_path: str | Path) -> dict[str, list[float]]:
    """Training curve from ``logs.json.txt``: per-step and per-epoch losses.

    Returns:
        ``{"step": [...], "train_loss": [...], "epoch_step": [...], "epoch_train_loss": [...],
        "val_step": [...], "val_loss": [...]}`` (global steps and losses as floats).
    """
    from dpflow_core.logs import parse_log_text

    records = parse_log_text(Path(log_path).read_text(encoding="utf-8", errors="replace"))
    out: dict[str, list[float]] = {k: [] for k in ("step", "train_loss", "epoch_step", "epoch_train_loss", "val_step", "val_loss")}
    for r in records:
        if "global_step" not in r:
            continue
        step = float(r["global_step"])
        if r.get("epoch_summary"):
            if "train_loss" in r:
                out["epoch_step"].append(step)
                out["epoch_train_loss"].append(float(r["train_loss"]))
            if "val_loss" in r:
                out["val_step"].append(step)
                out["val_loss"].append(float(r["val_loss"]))
        elif "train_loss" in r:
            out["step"].append(step)
            out["train_loss"].append(float(r["train_loss"]))
    return out


def plot_loss_curve(curve: dict[str, list[float]], path: str | Path, title: str = "training loss") -> Path:
    """Write the loss curve of :func:`read_loss_curve` as a PNG (log-scale loss axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if curve["step"]:
        ax.plot(curve["step"], curve["train_loss"], lw=0.8, alpha=0.6, label="train_loss (per step)")
    if curve["epoch_step"]:
        ax.plot(curve["epoch_step"], curve["epoch_train_loss"], "o-", label="train_loss (epoch mean)")
    if curve["val_step"]:
        ax.plot(curve["val_step"], curve["val_loss"], "s--", label="val_loss")
    values = [v for k in ("train_loss", "epoch_train_loss", "val_loss") for v in curve[k] if v > 0 and math.isfinite(v)]
    if values:
        ax.set_yscale("log")
    ax.set_xlabel("global_step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    return _save_figure(fig, path)


def _save_figure(fig, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    path = Path(path)
    try:
        with atomic_path(path, suffix=".png") as tmp:
            fig.savefig(tmp, format="png")
    finally:
        plt.close(fig)
    return path


_COLOURS = {"policy": "tab:blue", "mean_relative": "tab:red", "hold": "tab:green", "constant_velocity": "tab:orange"}


def plot_trajectories(
    buffer,
    episodes: Sequence[int],
    episode_rows: dict[int, tuple[np.ndarray, dict[str, np.ndarray]]],
    step_s: float,
    path: str | Path,
    steps: Sequence[int] | None = None,
) -> Path:
    """Recorded vs predicted absolute actions, one column per episode, one row per dimension.

    ``episode_rows[e] = (anchors, {predictor: (N, H, 7)})`` with anchors ``(N,)`` buffer
    indices. Each predictor is drawn as thin lines over the horizon ``steps`` (the executed
    ones; None: all), the policy's first drawn action as a dot; hold as short flat segments.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    da = len(DIMENSION_NAMES)
    cols = max(1, len(episodes))
    fig, axes = plt.subplots(da, cols, figsize=(4.2 * cols, 1.6 * da + 0.6), dpi=90, squeeze=False, sharex="col")
    freq = float(buffer.frequency_hz)
    for c, ep in enumerate(episodes):
        sl = buffer.episode_slice(ep)
        recorded = absolute_actions(buffer, sl)
        t = np.arange(len(recorded)) / freq
        anchors, preds = episode_rows[ep]
        shown = np.arange(preds["policy"].shape[1]) if steps is None else np.asarray(steps, dtype=np.int64)
        horizon_t = shown * step_s
        for d in range(da):
            ax = axes[d, c]
            ax.plot(t, recorded[:, d], color="black", lw=1.2, label="recorded")
            for name in ("mean_relative", "constant_velocity", "hold", "policy"):
                # one line per predictor, its horizons separated by NaN (one artist, fast to draw)
                xs = np.full((len(anchors), len(horizon_t) + 1), np.nan)
                ys = np.full_like(xs, np.nan)
                xs[:, :-1] = (anchors[:, None] - sl.start) / freq + horizon_t[None, :]
                ys[:, :-1] = preds[name][:, shown, d]
                ax.plot(xs.ravel(), ys.ravel(), color=_COLOURS[name], lw=0.6, alpha=0.45)
            ax.plot((anchors - sl.start) / freq + horizon_t[0], preds["policy"][:, shown[0], d], ".",
                    color=_COLOURS["policy"], ms=3, label="policy")
            for name in ("hold", "constant_velocity", "mean_relative"):
                ax.plot([], [], color=_COLOURS[name], lw=0.8, label=name.replace("_", " "))
            if c == 0:
                ax.set_ylabel(DIMENSION_NAMES[d], fontsize=8)
            ax.tick_params(labelsize=7)
            if d == 0:
                ax.set_title(f"held-out episode {ep}", fontsize=9)
        axes[-1, c].set_xlabel("time (s)", fontsize=8)
    axes[0, 0].legend(loc="best", fontsize=6)
    fig.tight_layout()
    return _save_figure(fig, path)


def plot_errors_per_step(
    metrics: Mapping[str, PredictorMetrics], step_s: float, path: str | Path, steps: Sequence[int] | None = None
) -> Path:
    """MSE, TCP position error and geodesic rotation error per scored horizon step, one line per predictor.

    ``steps``: the horizon steps the metrics' per-step figures are for (None: 0, 1, ...).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), dpi=90)
    panels = (("mse_per_step", "MSE (dataset units$^2$)"), ("position_error_m_per_step", "TCP position error (m)"),
              ("rotation_error_rad_per_step", "rotation error (rad)"))
    for ax, (attr, label) in zip(axes, panels):
        for name, m in metrics.items():
            values = np.asarray(getattr(m, attr), dtype=np.float64)
            k = np.arange(len(values)) if steps is None else np.asarray(steps)
            ax.plot(k * step_s, values, "o-", ms=3, color=_COLOURS.get(name), label=name.replace("_", " "))
        if attr == "mse_per_step" and all(v > 0 for m in metrics.values() for v in getattr(m, attr) if math.isfinite(v)):
            ax.set_yscale("log")
        ax.set_xlabel("time ahead of the anchor (s)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return _save_figure(fig, path)

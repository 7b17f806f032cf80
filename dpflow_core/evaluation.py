"""Offline evaluation of a trained policy on held-out episodes.

The checkpoint's EMA policy (:func:`dpflow_core.train.checkpoint.load_policy`)
predicts the action horizon at anchors of the episodes the trainer held out
for validation (the split is recomputed from the checkpoint's own
``task.val_ratio`` and ``task.split_seed``, so it is the same set the trainer
never trained on). Samples are cut exactly as in training
(:class:`~dpflow_core.train.data.SequenceDataset` with the checkpoint's
:class:`~dpflow_core.train.data.ObsActionSpec`, observation latencies included).

Metrics are mean squared errors in dataset units against the recorded
actions over the whole horizon: overall, per action dimension and per action
key (position in m^2, rotation vector in rad^2, gripper width in m^2). Next to
them stands a constant baseline that always predicts the mean action of the
training episodes: a policy that does not beat it has learned nothing usable,
whatever its training loss says.

Plots (PNG, matplotlib's Agg backend): recorded vs predicted action
trajectories of a few held-out episodes, and the training loss curve from
``logs.json.txt``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from dpflow_core.errors import DatasetError, RunError

log = logging.getLogger(__name__)

#: Readable names of the action keys of the default action (others keep their key name).
ACTION_GROUP_NAMES = {
    "robot0_eef_pos": "position",
    "robot0_eef_rot_axis_angle": "rotation",
    "robot0_gripper_width": "gripper",
}
_AXIS_NAMES = {"position": ("x", "y", "z"), "rotation": ("rx", "ry", "rz"), "gripper": ("width",)}

RESULT_NAME = "evaluation.json"
TRAJECTORY_PLOT = "trajectories.png"
LOSS_PLOT = "loss_curve.png"


@dataclass(frozen=True)
class EvaluationResult:
    """What :func:`evaluate_checkpoint` measured.

    Attributes:
        checkpoint_path, dataset_path: the inputs.
        held_out_episodes: indices of the evaluated (validation) episodes.
        train_episodes: number of training episodes (the baseline's source).
        n_samples: anchors evaluated; each compares ``horizon`` actions of ``action_dim`` values.
        horizon: actions predicted per anchor.
        dimension_names: one name per action dimension (``position.x``, ..., ``gripper.width``).
        policy_mse, baseline_mse: overall MSE (dataset units squared) of the policy and of the
            constant training-mean baseline.
        policy_mse_per_dim, baseline_mse_per_dim: ``(action_dim,)`` MSE per dimension.
        policy_mse_per_group, baseline_mse_per_group: MSE per action key
            (``position`` m^2, ``rotation`` rad^2, ``gripper`` m^2).
        baseline_action: the constant prediction, ``(action_dim,)`` (m, rad).
        trajectory_plot, loss_plot: PNG files (loss_plot None without a log file).
        out_dir: where the PNGs and ``evaluation.json`` were written.
        seconds: wall-clock duration.
    """

    checkpoint_path: str
    dataset_path: str
    held_out_episodes: tuple[int, ...]
    train_episodes: int
    n_samples: int
    horizon: int
    dimension_names: tuple[str, ...]
    policy_mse: float
    baseline_mse: float
    policy_mse_per_dim: tuple[float, ...]
    baseline_mse_per_dim: tuple[float, ...]
    policy_mse_per_group: dict[str, float]
    baseline_mse_per_group: dict[str, float]
    baseline_action: tuple[float, ...]
    trajectory_plot: str
    loss_plot: str | None
    out_dir: str
    seconds: float
    notes: tuple[str, ...] = field(default=())

    @property
    def beats_baseline(self) -> bool:
        """True when the policy's held-out MSE is strictly below the constant baseline's."""
        return math.isfinite(self.policy_mse) and self.policy_mse < self.baseline_mse

    @property
    def improvement(self) -> float:
        """``1 - policy_mse / baseline_mse`` (1 = perfect, 0 = no better than the mean, < 0 worse)."""
        return 1.0 - self.policy_mse / self.baseline_mse if self.baseline_mse > 0 else float("nan")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable form (with ``beats_baseline`` and ``improvement``)."""
        data = asdict(self)
        data["beats_baseline"] = self.beats_baseline
        data["improvement"] = self.improvement
        return data

    def markdown_table(self) -> str:
        """A Markdown table: policy vs baseline, overall and per action key and dimension."""
        rows = ["| action | policy MSE | baseline MSE | ratio |", "|---|---|---|---|"]

        def row(name: str, p: float, b: float) -> str:
            ratio = p / b if b > 0 else float("nan")
            return f"| {name} | {p:.6g} | {b:.6g} | {ratio:.3f} |"

        rows.append(row("**overall**", self.policy_mse, self.baseline_mse))
        for name in self.policy_mse_per_group:
            rows.append(row(name, self.policy_mse_per_group[name], self.baseline_mse_per_group[name]))
        for name, p, b in zip(self.dimension_names, self.policy_mse_per_dim, self.baseline_mse_per_dim):
            rows.append(row(name, p, b))
        return "\n".join(rows)


def action_groups(spec, buffer) -> list[tuple[str, slice, tuple[str, ...]]]:
    """``(group name, slice of the action vector, per-dimension names)`` for each action key."""
    groups = []
    start = 0
    for key in spec.action_keys:
        width = int(buffer[key].shape[1])
        name = ACTION_GROUP_NAMES.get(key, key)
        axes = _AXIS_NAMES.get(name, tuple(str(i) for i in range(width)))
        if len(axes) != width:
            axes = tuple(str(i) for i in range(width))
        groups.append((name, slice(start, start + width), tuple(f"{name}.{a}" for a in axes)))
        start += width
    return groups


def held_out_split(cfg, n_episodes: int) -> tuple[np.ndarray, np.ndarray]:
    """(train_mask, held_out_mask) over the episodes, as the trainer split them.

    Raises:
        RunError: when the checkpoint's config held out no episode (``task.val_ratio`` 0):
            evaluating on training episodes would say nothing about generalisation.
    """
    from omegaconf import OmegaConf

    from dpflow_core.train.data import split_episodes

    ratio = float(OmegaConf.select(cfg, "task.val_ratio", default=0.0) or 0.0)
    seed = int(OmegaConf.select(cfg, "task.split_seed", default=0) or 0)
    if ratio <= 0:
        raise RunError(
            "the checkpoint's training held out no episode (task.val_ratio=0): there is nothing to evaluate "
            "offline; train with task.val_ratio > 0",
            code="no_held_out_episodes",
        )
    train_mask, val_mask = split_episodes(n_episodes, ratio, seed)
    return train_mask, val_mask


def _anchor_rows(index: np.ndarray, max_per_episode: int) -> np.ndarray:
    """Evenly spaced rows of a sequence index, at most ``max_per_episode`` per episode."""
    keep = []
    for start in np.unique(index[:, 1]):
        rows = np.flatnonzero(index[:, 1] == start)
        if len(rows) > max_per_episode:
            rows = rows[np.linspace(0, len(rows) - 1, max_per_episode).round().astype(int)]
        keep.append(rows)
    return np.concatenate(keep) if keep else np.zeros(0, dtype=np.int64)


def _predict(policy, dataset, rows: np.ndarray, batch_size: int, seed: int, device) -> tuple[np.ndarray, np.ndarray]:
    """Predicted and recorded action horizons at the given sample rows: two ``(N, H, Da)`` float32 arrays."""
    import torch

    generator = torch.Generator(device="cpu").manual_seed(seed)
    preds, targets = [], []
    for i in range(0, len(rows), batch_size):
        batch = dataset.collate([int(r) for r in rows[i : i + batch_size]])
        obs = {k: v.to(device) for k, v in batch["obs"].items()}
        noise_gen = generator if str(device) == "cpu" else None
        with torch.no_grad():
            out = policy.predict_action(obs, generator=noise_gen)["action_pred"]
        preds.append(out.float().cpu().numpy())
        targets.append(batch["action"].float().numpy())
    return np.concatenate(preds), np.concatenate(targets)


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
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return path


def plot_trajectories(
    buffer,
    spec,
    episodes: Sequence[int],
    episode_rows: dict[int, tuple[np.ndarray, np.ndarray]],
    baseline: np.ndarray,
    dimension_names: Sequence[str],
    path: str | Path,
) -> Path:
    """Recorded vs predicted actions, one column per episode, one row per action dimension.

    ``episode_rows[e] = (anchors, predictions)`` with anchors ``(N,)`` buffer indices and
    predictions ``(N, H, Da)``; each prediction is drawn as a thin line over its horizon
    and its first action as a dot; the constant baseline is a dashed line.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dpflow_core.train.data import action_array

    da = len(dimension_names)
    cols = max(1, len(episodes))
    fig, axes = plt.subplots(da, cols, figsize=(4.2 * cols, 1.6 * da + 0.6), dpi=90, squeeze=False, sharex="col")
    freq = float(buffer.frequency_hz)
    for c, ep in enumerate(episodes):
        sl = buffer.episode_slice(ep)
        recorded = action_array(buffer, spec, sl)
        t = np.arange(len(recorded)) / freq
        anchors, preds = episode_rows[ep]
        offsets = np.arange(preds.shape[1]) * spec.action_down_sample_steps
        for d in range(da):
            ax = axes[d, c]
            ax.plot(t, recorded[:, d], color="black", lw=1.2, label="recorded")
            for a, p in zip(anchors, preds):
                ts = (a - sl.start + offsets) / freq
                ax.plot(ts, p[:, d], color="tab:blue", lw=0.6, alpha=0.5)
            ax.plot((anchors - sl.start) / freq, preds[:, 0, d], ".", color="tab:blue", ms=3, label="predicted")
            ax.axhline(baseline[d], color="tab:red", ls="--", lw=0.8, label="baseline (train mean)")
            if c == 0:
                ax.set_ylabel(dimension_names[d], fontsize=8)
            ax.tick_params(labelsize=7)
            if d == 0:
                ax.set_title(f"held-out episode {ep}", fontsize=9)
        axes[-1, c].set_xlabel("time (s)", fontsize=8)
    axes[0, 0].legend(loc="best", fontsize=6)
    fig.tight_layout()
    return _save_figure(fig, path)


def evaluate_checkpoint(
    checkpoint_path: str | Path,
    dataset_path: str | Path,
    out_dir: str | Path,
    *,
    log_path: str | Path | None = None,
    max_samples_per_episode: int = 48,
    plot_episodes: int = 3,
    batch_size: int = 64,
    seed: int = 0,
    device: str = "cpu",
    overwrite: bool = False,
) -> EvaluationResult:
    """Evaluate the checkpoint's EMA policy on the held-out episodes of ``dataset_path``.

    Args:
        checkpoint_path: a trainer checkpoint (``latest.ckpt`` or a top-k file).
        dataset_path: the ``dataset.npz`` the checkpoint was trained on (checked by its
            episode and step counts, recorded in the checkpoint).
        out_dir: folder for ``evaluation.json`` and the PNGs (created; existing results
            are kept unless ``overwrite``).
        log_path: the run's ``logs.json.txt`` for the loss curve (optional).
        max_samples_per_episode: anchors per held-out episode, evenly spaced.
        plot_episodes: how many held-out episodes the trajectory plot shows.
        batch_size: samples per ``predict_action`` call.
        seed: seed of the diffusion noise (the result is reproducible for a seed).
        device: torch device of the policy.
        overwrite: replace an existing ``evaluation.json`` in ``out_dir``.

    Returns:
        EvaluationResult (``beats_baseline`` tells whether the policy learned anything).

    Raises:
        RunError: unreadable checkpoint, no held-out episode, existing results.
        DatasetError: the dataset differs from the one the checkpoint was trained on, or
            its held-out episodes give no sample.
    """
    import torch

    from dpflow_core.replay_buffer import ReplayBuffer
    from dpflow_core.train.checkpoint import load_checkpoint, load_policy
    from dpflow_core.train.data import SequenceDataset, action_array

    started = time.monotonic()
    out_dir = Path(out_dir)
    result_path = out_dir / RESULT_NAME
    if result_path.exists() and not overwrite:
        raise RunError("evaluation results exist already (pass --overwrite (overwrite=True) to replace them)", path=result_path, code="exists")
    out_dir.mkdir(parents=True, exist_ok=True)

    payload = load_checkpoint(checkpoint_path, require_complete=False)
    trained_on = dict(payload.get("dataset") or {})
    del payload
    policy, cfg, spec = load_policy(checkpoint_path, device=device, use_ema=True)
    buffer = ReplayBuffer(dataset_path)
    notes: list[str] = []
    for key, actual in (("n_episodes", buffer.n_episodes), ("n_steps", buffer.n_steps)):
        if key in trained_on and int(trained_on[key]) != int(actual):
            raise DatasetError(
                f"the checkpoint was trained on a dataset with {key}={trained_on[key]} "
                f"({trained_on.get('path')}), this one has {actual}: the held-out split would differ",
                path=buffer.path,
                code="dataset_mismatch",
            )
    train_mask, val_mask = held_out_split(cfg, buffer.n_episodes)
    held_out = tuple(int(e) for e in np.flatnonzero(val_mask))
    dataset = SequenceDataset(buffer, spec, val_mask)
    if len(dataset) == 0:
        raise DatasetError(
            f"the held-out episodes {list(held_out)} give no sample (each is shorter than "
            f"{spec.min_episode_length} frames)",
            path=buffer.path,
        )
    rows = _anchor_rows(dataset.index, max_samples_per_episode)

    torch.manual_seed(seed)
    preds, targets = _predict(policy, dataset, rows, batch_size, seed, device)

    train_steps = np.concatenate([np.arange(s.start, s.stop) for e in np.flatnonzero(train_mask) for s in [buffer.episode_slice(int(e))]])
    baseline = action_array(buffer, spec, train_steps).astype(np.float64).mean(axis=0)

    err_policy = (preds.astype(np.float64) - targets) ** 2
    err_base = (baseline[None, None, :] - targets.astype(np.float64)) ** 2
    groups = action_groups(spec, buffer)
    dim_names = tuple(n for _, _, names in groups for n in names)
    per_dim_p = err_policy.mean(axis=(0, 1))
    per_dim_b = err_base.mean(axis=(0, 1))
    per_group_p = {name: float(err_policy[..., sl].mean()) for name, sl, _ in groups}
    per_group_b = {name: float(err_base[..., sl].mean()) for name, sl, _ in groups}
    if not np.isfinite(err_policy).all():
        notes.append("the policy predicted non-finite actions")

    # Trajectory plot: the first few held-out episodes, at the evaluated anchors.
    shown = list(held_out[: max(1, plot_episodes)])
    anchors_all = dataset.index[rows, 0]
    starts_all = dataset.index[rows, 1]
    episode_rows = {}
    for ep in shown:
        mask = starts_all == buffer.episode_slice(ep).start
        episode_rows[ep] = (anchors_all[mask], preds[mask])
    shown = [ep for ep in shown if len(episode_rows[ep][0])]
    trajectory_plot = plot_trajectories(buffer, spec, shown, episode_rows, baseline, dim_names, out_dir / TRAJECTORY_PLOT)

    loss_plot = None
    if log_path is not None and Path(log_path).is_file():
        loss_plot = str(plot_loss_curve(read_loss_curve(log_path), out_dir / LOSS_PLOT, title=f"training loss ({Path(checkpoint_path).name})"))
    elif log_path is not None:
        notes.append(f"no training log at {log_path}: no loss curve")

    result = EvaluationResult(
        checkpoint_path=str(Path(checkpoint_path).resolve()),
        dataset_path=str(buffer.path),
        held_out_episodes=held_out,
        train_episodes=int(train_mask.sum()),
        n_samples=int(len(rows)),
        horizon=int(preds.shape[1]),
        dimension_names=dim_names,
        policy_mse=float(err_policy.mean()),
        baseline_mse=float(err_base.mean()),
        policy_mse_per_dim=tuple(float(v) for v in per_dim_p),
        baseline_mse_per_dim=tuple(float(v) for v in per_dim_b),
        policy_mse_per_group=per_group_p,
        baseline_mse_per_group=per_group_b,
        baseline_action=tuple(float(v) for v in baseline),
        trajectory_plot=str(trajectory_plot),
        loss_plot=loss_plot,
        out_dir=str(out_dir.resolve()),
        seconds=time.monotonic() - started,
        notes=tuple(notes),
    )
    tmp = result_path.with_name(f".{result_path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    os.replace(tmp, result_path)
    log.info("evaluation of %s: policy MSE %.6g vs baseline %.6g", checkpoint_path, result.policy_mse, result.baseline_mse)
    return result


__all__ = ["EvaluationResult", "evaluate_checkpoint", "held_out_split", "plot_loss_curve", "read_loss_curve"]

"""The evaluation of a checkpoint on its held-out episodes, the result and its gate (see the package docstring)."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from dpflow_core.errors import DatasetError, RunError
from dpflow_core.results import StageResult
from dpflow_core.evaluation.baselines import (
    absolute_actions, action_index_matrix, constant_velocity_baseline, hold_baseline, mean_baseline,
)
from dpflow_core.evaluation.metrics import ABS_ACTION_KEYS, ACTION_GROUPS, DIMENSION_NAMES, score_predictions
from dpflow_core.evaluation.plots import plot_errors_per_step, plot_loss_curve, plot_trajectories, read_loss_curve

log = logging.getLogger("dpflow_core.evaluation")

#: Predictors scored, in report order; the gate compares ``policy`` with ``mean`` and ``hold``.
PREDICTORS: tuple[str, ...] = ("policy", "mean", "hold", "constant_velocity")
GATE_BASELINES: tuple[str, ...] = ("mean", "hold")
DEFAULT_MARGIN = 0.2
#: Fewest held-out episodes an evaluation accepts.
MIN_HELD_OUT_EPISODES = 2

RESULT_NAME = "evaluation.json"
TRAJECTORY_PLOT = "trajectories.png"
ERROR_PLOT = "errors_per_step.png"
LOSS_PLOT = "loss_curve.png"

def held_out_split(cfg, n_episodes: int) -> tuple[np.ndarray, np.ndarray]:
    """(train_mask, held_out_mask) over the episodes, as the trainer split them.

    Uses the checkpoint config's ``task.val_ratio``, ``task.val_min_episodes`` (1 when
    absent, as older checkpoints trained) and ``task.split_seed`` with
    :func:`dpflow_core.train.data.split_episodes`.

    Raises:
        RunError: ``no_held_out_episodes`` when the dataset has fewer than 2 episodes or the
            training held out none (``task.val_ratio`` 0); ``too_few_held_out_episodes`` when
            fewer than :data:`MIN_HELD_OUT_EPISODES` were held out. Evaluating on training
            episodes, or on one episode, would say nothing about generalisation.
    """
    from omegaconf import OmegaConf

    from dpflow_core.train.data import split_episodes

    ratio = float(OmegaConf.select(cfg, "task.val_ratio", default=0.0) or 0.0)
    minimum = int(OmegaConf.select(cfg, "task.val_min_episodes", default=1) or 1)
    seed = int(OmegaConf.select(cfg, "task.split_seed", default=0) or 0)
    if n_episodes < 2:
        raise RunError(
            f"evaluation needs held-out episodes: the dataset has {n_episodes} episode(s), so every one was "
            f"used for training; record at least {MIN_HELD_OUT_EPISODES + 1} episodes",
            code="no_held_out_episodes",
        )
    if ratio <= 0:
        raise RunError(
            "evaluation needs held-out episodes: the checkpoint's training held out none (task.val_ratio=0); "
            "train with task.val_ratio > 0",
            code="no_held_out_episodes",
        )
    train_mask, val_mask = split_episodes(n_episodes, ratio, seed, min_val_episodes=minimum)
    if val_mask.sum() < MIN_HELD_OUT_EPISODES:
        raise RunError(
            f"evaluation needs at least {MIN_HELD_OUT_EPISODES} held-out episodes; the checkpoint's training held "
            f"out {int(val_mask.sum())} of {n_episodes} (task.val_ratio={ratio}, task.val_min_episodes={minimum}): "
            f"record more episodes or train with task.val_min_episodes={MIN_HELD_OUT_EPISODES}",
            code="too_few_held_out_episodes",
        )
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


def predict_absolute_actions(policy, dataset, rows: np.ndarray, *, batch_size: int, seed: int, device) -> np.ndarray:
    """The policy's ABSOLUTE action predictions at sample rows of ``dataset``: ``(N, H, 7)`` float64.

    This is the one function between the evaluation and the policy: everything else scores
    ``[pos m, rotvec rad, width m]`` per horizon step. Today's trainer predicts exactly those
    keys through :meth:`dpflow_core.inference.Policy.predict_samples`, which undoes the
    pose representation and normalisation (what a robot runs).

    Args:
        policy: a :class:`dpflow_core.inference.Policy` (:func:`dpflow_core.inference.load_policy`).
        dataset: the :class:`~dpflow_core.train.data.SequenceDataset` of the held-out episodes.
        rows: positions in ``dataset`` (its ``index`` rows) to predict at.
        batch_size: samples per ``predict_action`` call; seed: seed of the diffusion noise;
        device: the policy's torch device.

    Raises:
        RunError: when ``policy`` is not an inference policy.
    """
    if not hasattr(policy, "predict_samples"):
        raise RunError("evaluation needs a dpflow_core.inference.Policy (load_policy)", code="action_representation")
    return policy.predict_samples(dataset.buffer, dataset.index[rows], batch_size=batch_size, seed=seed)


def recorded_dataset_sha256(payload: Mapping[str, Any], checkpoint_path: str | Path) -> tuple[str | None, str | None]:
    """The training dataset's SHA-256 recorded with a checkpoint, and where it was found.

    Looks in the checkpoint's ``dataset.sha256`` entry (written by the trainer), then in
    the run record (``run_record.json``) that :func:`dpflow_core.checkpoints.download_checkpoint`
    puts beside a downloaded checkpoint.

    Returns:
        ``(sha256 hex or None, "checkpoint" | "<record path>" | None)``.
    """
    from dpflow_core.checkpoints import RECORD_FILE

    digest = (payload.get("dataset") or {}).get("sha256")
    if digest:
        return str(digest), "checkpoint"
    record = Path(checkpoint_path).parent / RECORD_FILE
    if record.is_file():
        try:
            digest = (json.loads(record.read_text()).get("dataset") or {}).get("sha256")
        except (OSError, ValueError):
            digest = None
        if digest:
            return str(digest), str(record)
    return None, None


# Result ---------------------------------------------------------------------------------------


def evaluation_dir_for(checkpoint_dir: str | Path) -> Path:
    """A new folder for one evaluation of the checkpoint in ``checkpoint_dir``:
    ``<checkpoint_dir>/evaluation/<UTC time, YYYYmmddTHHMMSSZ>`` (not created here)."""
    from datetime import datetime, timezone

    return Path(checkpoint_dir) / "evaluation" / datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")



@dataclass(frozen=True)
class EvaluationResult(StageResult):
    """What :func:`evaluate_checkpoint` measured; the value of the ``evaluation`` asset.

    Attributes:
        checkpoint_path, dataset_path: the inputs.
        dataset_sha256: SHA-256 of the evaluated dataset; recorded_dataset_sha256: the one recorded
            with the checkpoint (equal, or the evaluation was refused; None when none was recorded).
        held_out_episodes: indices of the held-out (validation) episodes.
        n_episodes: held-out episodes that gave samples; train_episodes: training episodes (the
            mean baseline's source).
        n_samples: anchors evaluated; each compares ``horizon`` absolute 7-D actions.
        horizon: actions per anchor; step_s: seconds between them.
        dimension_names: the 7 dimensions (``position.x``, ..., ``gripper.width``).
        metrics: per predictor (:data:`PREDICTORS`), its :class:`PredictorMetrics` as a dict.
        mean_action: the mean baseline's constant prediction, ``(7,)`` (m, rad, m).
        gripper_threshold_m: width threshold of the open/close events (m).
        margin: how much lower than the best gate baseline the policy's MSE must be (0.2 = 20 %).
        trajectory_plot, error_plot, loss_plot: PNG files (loss_plot None without a log file).
        out_dir: where the PNGs and ``evaluation.json`` were written.
        seconds: wall-clock duration.
        notes: how the evaluation went, where it matters (no dataset SHA-256 recorded, non-finite predictions, no log).
        checkpoint_sha256: SHA-256 of the evaluated checkpoint, when the caller knew it.

    ``to_dict`` adds the gate's figures; ``from_dict`` reads ``to_dict``'s form (and so what the
    ``evaluation`` asset stored before its value was typed), ignoring those derived figures.
    """

    checkpoint_path: str
    dataset_path: str
    dataset_sha256: str
    recorded_dataset_sha256: str | None
    held_out_episodes: tuple[int, ...]
    n_episodes: int
    train_episodes: int
    n_samples: int
    horizon: int
    step_s: float
    dimension_names: tuple[str, ...]
    metrics: dict[str, dict[str, Any]]
    mean_action: tuple[float, ...]
    gripper_threshold_m: float
    margin: float
    trajectory_plot: str
    error_plot: str
    loss_plot: str | None
    out_dir: str
    seconds: float
    notes: tuple[str, ...] = field(default=())
    checkpoint_sha256: str | None = None

    def mse(self, predictor: str) -> float:
        """Overall MSE of one predictor (``policy``, ``mean``, ``hold``, ``constant_velocity``)."""
        return float(self.metrics[predictor]["mse"])

    @property
    def policy_mse(self) -> float:
        return self.mse("policy")

    @property
    def best_baseline(self) -> str:
        """The better of the gate's baselines (``mean`` or ``hold``) by MSE."""
        return min(GATE_BASELINES, key=self.mse)

    @property
    def baseline_mse(self) -> float:
        """MSE of the best gate baseline (the smaller of the mean and hold baselines')."""
        return self.mse(self.best_baseline)

    @property
    def required_mse(self) -> float:
        """The MSE the policy must stay below: ``(1 - margin) x baseline_mse``."""
        return (1.0 - self.margin) * self.baseline_mse

    @property
    def beats_baseline(self) -> bool:
        """True when the policy's MSE is finite and below ``required_mse``."""
        return math.isfinite(self.policy_mse) and self.policy_mse < self.required_mse

    @property
    def improvement(self) -> float:
        """``1 - policy_mse / baseline_mse`` (1 = perfect, 0 = as good as the best baseline, < 0 worse)."""
        return 1.0 - self.policy_mse / self.baseline_mse if self.baseline_mse > 0 else float("nan")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable form, with the gate's figures (``beats_baseline``, ``*_mse``)."""
        data = super().to_dict()
        data.update(
            beats_baseline=self.beats_baseline,
            improvement=self.improvement,
            best_baseline=self.best_baseline,
            baseline_mse=self.baseline_mse,
            required_mse=self.required_mse,
            **{f"{name}_mse": self.mse(name) for name in PREDICTORS},
        )
        return data

    def markdown_table(self) -> str:
        """A Markdown table: one column per predictor, one row per metric."""
        head = "| metric | " + " | ".join(PREDICTORS) + " |"
        rows = [head, "|---" * (len(PREDICTORS) + 1) + "|"]

        def row(label: str, values: Sequence[float], fmt: str = "{:.6g}") -> None:
            rows.append(f"| {label} | " + " | ".join(fmt.format(v) for v in values) + " |")

        m = self.metrics
        row("**MSE**", [m[p]["mse"] for p in PREDICTORS])
        for name, _ in ACTION_GROUPS:
            row(f"MSE {name}", [m[p]["mse_per_key"][name] for p in PREDICTORS])
        row("position error (m)", [m[p]["position_error_m"] for p in PREDICTORS])
        row("rotation error (rad)", [m[p]["rotation_error_rad"] for p in PREDICTORS])
        row("gripper error (m)", [m[p]["gripper_error_m"] for p in PREDICTORS])
        rows.append(
            "| gripper events matched / recorded (false) | "
            + " | ".join(f"{m[p]['gripper_events_matched']}/{m[p]['gripper_events']} ({m[p]['gripper_events_false']})" for p in PREDICTORS)
            + " |"
        )
        row("gripper event timing error (s)", [m[p]["gripper_timing_error_s"] for p in PREDICTORS], "{:.3g}")
        for k in range(self.horizon):
            row(f"MSE step {k}", [m[p]["mse_per_step"][k] for p in PREDICTORS])
        return "\n".join(rows)

    def verdict(self) -> str:
        """One line: the four MSEs and what the gate required."""
        return (
            f"policy MSE {self.policy_mse:.6g} vs required < {self.required_mse:.6g} "
            f"({1 - self.margin:.0%} of the {self.best_baseline} baseline's {self.baseline_mse:.6g}); "
            f"mean {self.mse('mean'):.6g}, hold {self.mse('hold'):.6g}, constant velocity "
            f"{self.mse('constant_velocity'):.6g}; {self.n_samples} samples from {self.n_episodes} held-out episodes"
        )


# Evaluation --------------------------------------------------------------------------------------


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
    margin: float = DEFAULT_MARGIN,
    gripper_threshold_m: float | None = None,
    overwrite: bool = False,
) -> EvaluationResult:
    """Evaluate the checkpoint's EMA policy and the three baselines on the held-out episodes.

    Args:
        checkpoint_path: a trainer checkpoint (``latest.ckpt`` or a top-k file).
        dataset_path: the ``dataset.npz`` the checkpoint was trained on (checked by SHA-256
            when one is recorded, else by its episode and step counts).
        out_dir: folder for ``evaluation.json`` and the PNGs (created; existing results
            are kept unless ``overwrite``).
        log_path: the run's ``logs.json.txt`` for the loss curve (optional).
        max_samples_per_episode: anchors per held-out episode, evenly spaced.
        plot_episodes: how many held-out episodes the trajectory plot shows.
        batch_size: samples per ``predict_action`` call.
        seed: seed of the diffusion noise (the result is reproducible for a seed).
        device: torch device of the policy.
        margin: fraction in [0, 1) by which the policy's MSE must undercut the best of the mean
            and hold baselines (0.2: at least 20 % lower).
        gripper_threshold_m: width threshold (m) of gripper open/close events; None: the middle
            of the training episodes' width range.
        overwrite: replace an existing ``evaluation.json`` in ``out_dir``.

    Returns:
        EvaluationResult (``beats_baseline`` is the gate).

    Raises:
        RunError: unreadable checkpoint, fewer than 2 held-out episodes, a policy whose action
            is not absolute, existing results, a margin outside [0, 1).
        DatasetError: the dataset differs from the one the checkpoint was trained on (SHA-256,
            both named; or episode/step counts), lacks a pose key, or its held-out episodes give
            no sample.
    """
    import torch

    from dpflow_core.files import sha256_file, write_text_atomic
    from dpflow_core.replay_buffer import ReplayBuffer
    from dpflow_core.inference import load_policy
    from dpflow_core.train.checkpoint import load_checkpoint
    from dpflow_core.train.data import SequenceDataset

    started = time.monotonic()
    if not 0.0 <= float(margin) < 1.0:
        raise RunError(f"the evaluation margin must be in [0, 1), got {margin!r}", code="bad_margin")
    out_dir = Path(out_dir)
    result_path = out_dir / RESULT_NAME
    if result_path.exists() and not overwrite:
        raise RunError("evaluation results exist already (pass --overwrite (overwrite=True from Python) to replace them)", path=result_path, code="exists")

    payload = load_checkpoint(checkpoint_path, require_complete=False)
    trained_on = dict(payload.get("dataset") or {})
    recorded_sha, sha_source = recorded_dataset_sha256(payload, checkpoint_path)
    del payload
    buffer = ReplayBuffer(dataset_path)
    notes: list[str] = []
    actual_sha = sha256_file(buffer.path)
    if recorded_sha is not None and recorded_sha != actual_sha:
        raise DatasetError(
            f"SHA-256 is {actual_sha} but the checkpoint was trained on a dataset with SHA-256 {recorded_sha} "
            f"(recorded in {sha_source}; trained on {trained_on.get('path')}): evaluate on the training dataset",
            path=buffer.path,
            code="dataset_mismatch",
        )
    if recorded_sha is None:
        notes.append("no dataset SHA-256 recorded with the checkpoint: only episode and step counts were compared")
    for key, actual in (("n_episodes", buffer.n_episodes), ("n_steps", buffer.n_steps)):
        if key in trained_on and int(trained_on[key]) != int(actual):
            raise DatasetError(
                f"the checkpoint was trained on a dataset with {key}={trained_on[key]} "
                f"({trained_on.get('path')}), this one has {actual}: the held-out split would differ",
                path=buffer.path,
                code="dataset_mismatch",
            )
    policy = load_policy(checkpoint_path, device=device, use_ema=True)
    cfg, spec = policy.cfg, policy.spec
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
    index_rows = dataset.index[rows]
    step_s = float(spec.action_down_sample_steps) / float(buffer.frequency_hz)
    targets = absolute_actions(buffer, action_index_matrix(spec, index_rows))

    torch.manual_seed(seed)
    train_steps = np.concatenate([np.arange(s.start, s.stop) for e in np.flatnonzero(train_mask) for s in [buffer.episode_slice(int(e))]])
    mean_action = mean_baseline(buffer, train_steps)
    predictions = {
        "policy": predict_absolute_actions(policy, dataset, rows, batch_size=batch_size, seed=seed, device=device),
        "mean": np.broadcast_to(mean_action, targets.shape).copy(),
        "hold": hold_baseline(buffer, spec, index_rows),
        "constant_velocity": constant_velocity_baseline(buffer, spec, index_rows),
    }
    if gripper_threshold_m is None:
        widths = np.asarray(buffer["robot0_gripper_width"][train_steps], dtype=np.float64)
        gripper_threshold_m = float(widths.min() + widths.max()) / 2.0
    metrics = {
        name: score_predictions(pred, targets, gripper_threshold_m=gripper_threshold_m, step_s=step_s)
        for name, pred in predictions.items()
    }
    if not np.isfinite(predictions["policy"]).all():
        notes.append("the policy predicted non-finite actions")

    out_dir.mkdir(parents=True, exist_ok=True)
    shown = list(held_out[: max(1, plot_episodes)])
    episode_rows = {}
    for ep in shown:
        mask = index_rows[:, 1] == buffer.episode_slice(ep).start
        episode_rows[ep] = (index_rows[mask, 0], {name: p[mask] for name, p in predictions.items()})
    shown = [ep for ep in shown if len(episode_rows[ep][0])]
    trajectory_plot = plot_trajectories(buffer, shown, episode_rows, step_s, out_dir / TRAJECTORY_PLOT)
    error_plot = plot_errors_per_step(metrics, step_s, out_dir / ERROR_PLOT)

    loss_plot = None
    if log_path is not None and Path(log_path).is_file():
        loss_plot = str(plot_loss_curve(read_loss_curve(log_path), out_dir / LOSS_PLOT, title=f"training loss ({Path(checkpoint_path).name})"))
    elif log_path is not None:
        notes.append(f"no training log at {log_path}: no loss curve")

    result = EvaluationResult(
        checkpoint_path=str(Path(checkpoint_path).resolve()),
        dataset_path=str(buffer.path),
        dataset_sha256=actual_sha,
        recorded_dataset_sha256=recorded_sha,
        held_out_episodes=held_out,
        n_episodes=int(len(np.unique(index_rows[:, 1]))),
        train_episodes=int(train_mask.sum()),
        n_samples=int(len(rows)),
        horizon=int(spec.horizon),
        step_s=step_s,
        dimension_names=DIMENSION_NAMES,
        metrics={name: asdict(m) for name, m in metrics.items()},
        mean_action=tuple(float(v) for v in mean_action),
        gripper_threshold_m=float(gripper_threshold_m),
        margin=float(margin),
        trajectory_plot=str(trajectory_plot),
        error_plot=str(error_plot),
        loss_plot=loss_plot,
        out_dir=str(out_dir.resolve()),
        seconds=time.monotonic() - started,
        notes=tuple(notes),
    )
    write_text_atomic(result_path, json.dumps(result.to_dict(), indent=2) + "\n", overwrite=overwrite)
    log.info("evaluation of %s: %s", checkpoint_path, result.verdict())
    return result

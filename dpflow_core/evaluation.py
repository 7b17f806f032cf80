"""Offline evaluation of a trained policy on held-out episodes, against trivial predictors.

The checkpoint's EMA policy predicts the action horizon at anchors of the
episodes the trainer held out for validation (the split is recomputed from the
checkpoint's own ``task.val_ratio``, ``task.val_min_episodes`` and
``task.split_seed``, so it is the set the trainer never trained on). Samples
are cut exactly as in training (:class:`~dpflow_core.train.data.SequenceDataset`
with the checkpoint's :class:`~dpflow_core.train.data.ObsActionSpec`,
observation latencies included).

Everything is scored on ABSOLUTE actions, whatever representation the network
learned: per sample and horizon step, the 7-D vector ``[position (3) m,
rotation vector (3) rad, gripper width (1) m]`` read from the replay buffer's
``robot0_eef_pos``, ``robot0_eef_rot_axis_angle`` and ``robot0_gripper_width``
at the action indices. :func:`predict_absolute_actions` is the one place that
turns the policy's output into that vector.

Three baselines are scored on the same samples:

- ``mean``: the training episodes' mean action (positions and widths averaged,
  rotations by scipy's chordal mean, ``Rotation.mean``), the same for every step;
- ``hold``: the latest observed pose and gripper width, repeated over the horizon;
- ``constant_velocity``: the last two observed poses extrapolated; positions and
  widths linearly, rotations on SO(3): with ``D = R_0 R_1^-1`` the rotation from the
  previous to the latest observation, step ``s`` (in observation intervals) predicts
  ``exp(s log D) R_0``.

Metrics per predictor (:class:`PredictorMetrics`): MSE overall, per action key
and dimension and per horizon step (dataset units squared: m^2, rad^2 of the
rotation-vector components, m^2); position error (Euclidean, m), geodesic
rotation error (the angle of ``R_pred^-1 R_true``, rad) and gripper width error
(m); gripper open/close events (crossings of a width threshold inside the
horizon, crossing times interpolated linearly) with their timing error (s).

The gate (:attr:`EvaluationResult.beats_baseline`): the policy's MSE must be
below ``(1 - margin)`` times the best of the mean and hold baselines (margin 20 %
by default). Constant velocity is reported beside it and drawn in the plots.

Before any of this the dataset's SHA-256 is compared with the one recorded with
the checkpoint (its ``dataset.sha256`` entry, else the downloaded run record):
a different dataset is refused, naming both hashes.

Plots (PNG, matplotlib's Agg backend): recorded vs predicted trajectories of a
few held-out episodes (policy and constant velocity over their horizons, hold
and mean), errors per horizon step of the four predictors, and the training
loss curve from ``logs.json.txt``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from dpflow_core.errors import DatasetError, RunError

log = logging.getLogger(__name__)

#: The absolute action every metric is computed on: keys of the replay buffer, in order.
ABS_ACTION_KEYS: tuple[str, ...] = ("robot0_eef_pos", "robot0_eef_rot_axis_angle", "robot0_gripper_width")
POS, ROT, GRIP = slice(0, 3), slice(3, 6), slice(6, 7)
#: ``(name, slice of the 7-D absolute action)`` per action key.
ACTION_GROUPS: tuple[tuple[str, slice], ...] = (("position", POS), ("rotation", ROT), ("gripper", GRIP))
DIMENSION_NAMES: tuple[str, ...] = (
    "position.x", "position.y", "position.z", "rotation.rx", "rotation.ry", "rotation.rz", "gripper.width",
)
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


# Metrics --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PredictorMetrics:
    """Errors of one predictor against the recorded absolute actions of the evaluated samples.

    Attributes:
        mse: mean squared error over samples, horizon steps and the 7 dimensions.
        mse_per_key: ``{"position": m^2, "rotation": rad^2 (rotation-vector components), "gripper": m^2}``.
        mse_per_dim: ``(7,)`` per dimension (:data:`DIMENSION_NAMES`).
        mse_per_step: ``(H,)`` per horizon step (all 7 dimensions).
        position_error_m: mean Euclidean position error (m); ``position_error_m_per_step`` ``(H,)``.
        rotation_error_rad: mean geodesic angle between predicted and recorded rotations (rad);
            ``rotation_error_rad_per_step`` ``(H,)``.
        gripper_error_m: mean absolute gripper width error (m).
        gripper_events: recorded open/close events (threshold crossings inside the horizons).
        gripper_events_matched: recorded events the predictor also crosses, in the same direction
            and sample; ``gripper_events_missed`` the others; ``gripper_events_false`` predicted
            crossings with no recorded one.
        gripper_timing_error_s: mean absolute time difference of matched events (s; NaN when none).
    """

    mse: float
    mse_per_key: dict[str, float]
    mse_per_dim: tuple[float, ...]
    mse_per_step: tuple[float, ...]
    position_error_m: float
    position_error_m_per_step: tuple[float, ...]
    rotation_error_rad: float
    rotation_error_rad_per_step: tuple[float, ...]
    gripper_error_m: float
    gripper_events: int
    gripper_events_matched: int
    gripper_events_missed: int
    gripper_events_false: int
    gripper_timing_error_s: float


def geodesic_error(rotvec_a: np.ndarray, rotvec_b: np.ndarray) -> np.ndarray:
    """Angle (rad, in [0, pi]) of the rotation between two rotation vectors, elementwise.

    Args:
        rotvec_a, rotvec_b: ``(..., 3)`` rotation vectors (rad), same shape.

    Returns:
        ``(...)`` float64: ``|log(R_a^-1 R_b)|``, via scipy ``Rotation.magnitude``.
    """
    from scipy.spatial.transform import Rotation

    a = np.asarray(rotvec_a, dtype=np.float64)
    b = np.asarray(rotvec_b, dtype=np.float64)
    if a.shape != b.shape or a.shape[-1] != 3:
        raise ValueError(f"rotation vectors must both be (..., 3), got {a.shape} and {b.shape}")
    ra = Rotation.from_rotvec(a.reshape(-1, 3))
    rb = Rotation.from_rotvec(b.reshape(-1, 3))
    return (ra.inv() * rb).magnitude().reshape(a.shape[:-1])


def threshold_crossings(widths: np.ndarray, threshold: float, step_s: float) -> list[tuple[float, int]]:
    """Open (+1) and close (-1) events of one gripper width sequence.

    An event lies between steps ``k`` and ``k+1`` when the width goes from below
    ``threshold`` to at or above it (open) or from at or above to below (close); its
    time is interpolated linearly between the two steps.

    Args:
        widths: ``(H,)`` widths (m) at times ``k * step_s``.
        threshold: width (m) separating closed from open.
        step_s: seconds between consecutive widths.

    Returns:
        ``[(time s, direction)]`` in time order.
    """
    w = np.asarray(widths, dtype=np.float64).reshape(-1)
    above = w >= threshold
    events = []
    for k in np.flatnonzero(above[1:] != above[:-1]):
        frac = (threshold - w[k]) / (w[k + 1] - w[k])
        events.append(((k + float(frac)) * step_s, 1 if above[k + 1] else -1))
    return events


def gripper_event_errors(
    predicted: np.ndarray, recorded: np.ndarray, threshold: float, step_s: float
) -> dict[str, float | int]:
    """Compare gripper open/close events of predicted and recorded horizons.

    In each sample, each recorded event is matched to the nearest not yet matched
    predicted event of the same direction.

    Args:
        predicted, recorded: ``(N, H)`` gripper widths (m).
        threshold: event threshold (m); step_s: seconds between horizon steps.

    Returns:
        ``{"events", "matched", "missed", "false", "timing_error_s"}`` (counts; mean absolute
        timing error of the matched events in s, NaN when none matched).
    """
    events = matched = false = 0
    timing: list[float] = []
    for p, r in zip(np.asarray(predicted), np.asarray(recorded)):
        pred_ev = threshold_crossings(p, threshold, step_s)
        rec_ev = threshold_crossings(r, threshold, step_s)
        events += len(rec_ev)
        free = list(pred_ev)
        for t, d in rec_ev:
            same = [i for i, (_, dp) in enumerate(free) if dp == d]
            if not same:
                continue
            best = min(same, key=lambda i: abs(free[i][0] - t))
            timing.append(abs(free[best][0] - t))
            free.pop(best)
            matched += 1
        false += len(free)
    return {
        "events": events,
        "matched": matched,
        "missed": events - matched,
        "false": false,
        "timing_error_s": float(np.mean(timing)) if timing else float("nan"),
    }


def score_predictions(
    predicted: np.ndarray, recorded: np.ndarray, *, gripper_threshold_m: float, step_s: float
) -> PredictorMetrics:
    """All metrics of one predictor.

    Args:
        predicted, recorded: ``(N, H, 7)`` absolute actions ``[pos m, rotvec rad, width m]``.
        gripper_threshold_m: width threshold of open/close events (m).
        step_s: seconds between horizon steps (``action_down_sample_steps / frequency``).

    Raises:
        ValueError: when the shapes differ or are not ``(N, H, 7)`` with N >= 1.
    """
    p = np.asarray(predicted, dtype=np.float64)
    r = np.asarray(recorded, dtype=np.float64)
    if p.shape != r.shape or p.ndim != 3 or p.shape[-1] != 7 or len(p) == 0:
        raise ValueError(f"predictions and recorded actions must both be (N >= 1, H, 7), got {p.shape} and {r.shape}")
    sq = (p - r) ** 2
    pos_err = np.linalg.norm(p[..., POS] - r[..., POS], axis=-1)
    finite = np.isfinite(p[..., ROT]).all(axis=-1)
    rot_err = np.full(p.shape[:2], np.nan)
    if finite.any():
        rot_err[finite] = geodesic_error(p[..., ROT][finite], r[..., ROT][finite])
    ev = gripper_event_errors(p[..., 6], r[..., 6], gripper_threshold_m, step_s)
    return PredictorMetrics(
        mse=float(sq.mean()),
        mse_per_key={name: float(sq[..., sl].mean()) for name, sl in ACTION_GROUPS},
        mse_per_dim=tuple(float(v) for v in sq.mean(axis=(0, 1))),
        mse_per_step=tuple(float(v) for v in sq.mean(axis=(0, 2))),
        position_error_m=float(pos_err.mean()),
        position_error_m_per_step=tuple(float(v) for v in pos_err.mean(axis=0)),
        rotation_error_rad=float(rot_err.mean()),
        rotation_error_rad_per_step=tuple(float(v) for v in rot_err.mean(axis=0)),
        gripper_error_m=float(np.abs(p[..., 6] - r[..., 6]).mean()),
        gripper_events=int(ev["events"]),
        gripper_events_matched=int(ev["matched"]),
        gripper_events_missed=int(ev["missed"]),
        gripper_events_false=int(ev["false"]),
        gripper_timing_error_s=float(ev["timing_error_s"]),
    )


# Samples and baselines ------------------------------------------------------------------------


def absolute_actions(buffer: Mapping[str, np.ndarray], index: np.ndarray | slice) -> np.ndarray:
    """The recorded absolute action at buffer ``index``: ``(..., 7)`` float64 ``[pos m, rotvec rad, width m]``.

    Raises:
        DatasetError: when one of :data:`ABS_ACTION_KEYS` is missing or not of width 3, 3, 1.
    """
    for key, width in zip(ABS_ACTION_KEYS, (3, 3, 1)):
        if key not in buffer:
            raise DatasetError(f"evaluation needs the key {key!r}, absent from the dataset", path=getattr(buffer, "path", None))
        if buffer[key].shape[-1] != width:
            raise DatasetError(
                f"evaluation needs {key!r} of width {width}, got shape {buffer[key].shape}", path=getattr(buffer, "path", None)
            )
    return np.concatenate([np.asarray(buffer[k][index], dtype=np.float64) for k in ABS_ACTION_KEYS], axis=-1)


def action_index_matrix(spec, rows: np.ndarray) -> np.ndarray:
    """``(N, H)`` buffer indices of the actions of sample rows ``(anchor, start, end)``."""
    from dpflow_core.train.data import action_indices

    rows = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
    return np.stack([action_indices(spec, *(int(v) for v in row)) for row in rows]) if len(rows) else np.zeros((0, spec.horizon), np.int64)


def _observed_pair(spec, key: str, row: np.ndarray) -> tuple[int, int]:
    """Buffer indices of the latest and the previous observation of ``key`` for one sample row.

    The previous one is ``obs_down_sample_steps`` earlier (edge-padded at the episode start,
    where both may coincide), as the policy's observation history sees it.
    """
    from dpflow_core.train.data import obs_indices

    anchor, start, end = (int(v) for v in row)
    idx = obs_indices(spec, key, anchor, start, end)
    latest = int(idx[-1])
    previous = int(idx[-2]) if len(idx) >= 2 else max(start, latest - int(spec.obs_down_sample_steps))
    return latest, previous


def mean_baseline(buffer: Mapping[str, np.ndarray], steps: np.ndarray) -> np.ndarray:
    """The training-mean action: ``(7,)`` float64 over buffer ``steps`` (the training episodes' steps).

    Positions and widths are arithmetic means; the rotation is scipy's chordal mean
    (``Rotation.mean``), returned as a rotation vector (rad).
    """
    from scipy.spatial.transform import Rotation

    a = absolute_actions(buffer, np.asarray(steps, dtype=np.int64))
    rot = Rotation.from_rotvec(a[:, ROT]).mean().as_rotvec()
    return np.concatenate([a[:, POS].mean(axis=0), rot, a[:, GRIP].mean(axis=0)])


def hold_baseline(buffer: Mapping[str, np.ndarray], spec, rows: np.ndarray) -> np.ndarray:
    """The hold baseline, ``(N, H, 7)``: the latest observed pose and width repeated over the horizon.

    Each key's latest observation is the one the policy sees (the key's observation latency
    applied, :func:`dpflow_core.train.data.obs_indices`).
    """
    rows = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
    out = np.empty((len(rows), spec.horizon, 7))
    for key, (_, sl) in zip(ABS_ACTION_KEYS, ACTION_GROUPS):
        latest = np.array([_observed_pair(spec, key, row)[0] for row in rows], dtype=np.int64)
        out[..., sl] = np.asarray(buffer[key][latest], dtype=np.float64)[:, None, :]
    return out


def constant_velocity_baseline(buffer: Mapping[str, np.ndarray], spec, rows: np.ndarray) -> np.ndarray:
    """Constant velocity from the last two observations: ``(N, H, 7)``.

    With latest observation index ``i0`` and previous ``i1`` of a key, action index ``j``
    is ``s = (j - i0) / (i0 - i1)`` observation intervals ahead: positions and widths
    ``x0 + s (x0 - x1)``; rotations ``exp(s log(R0 R1^-1)) R0`` (scipy ``Rotation``, composed
    on SO(3), never added as vectors). Where ``i0 == i1`` (episode start) it holds.
    """
    from scipy.spatial.transform import Rotation

    rows = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
    actions = action_index_matrix(spec, rows).astype(np.float64)
    out = np.empty((len(rows), spec.horizon, 7))
    if not len(rows):
        return out
    for key, (name, sl) in zip(ABS_ACTION_KEYS, ACTION_GROUPS):
        pairs = np.array([_observed_pair(spec, key, row) for row in rows], dtype=np.int64)
        x0 = np.asarray(buffer[key][pairs[:, 0]], dtype=np.float64)
        x1 = np.asarray(buffer[key][pairs[:, 1]], dtype=np.float64)
        gap = (pairs[:, 0] - pairs[:, 1]).astype(np.float64)
        s = np.where(gap[:, None] > 0, (actions - pairs[:, :1]) / np.maximum(gap, 1.0)[:, None], 0.0)  # (N, H)
        if name != "rotation":
            out[..., sl] = x0[:, None, :] + s[..., None] * (x0 - x1)[:, None, :]
            continue
        r0 = Rotation.from_rotvec(x0)
        delta = (r0 * Rotation.from_rotvec(x1).inv()).as_rotvec()  # (N, 3), |.| <= pi
        steps = Rotation.from_rotvec((s[..., None] * delta[:, None, :]).reshape(-1, 3))
        out[..., sl] = (steps * Rotation.from_rotvec(np.repeat(x0, spec.horizon, axis=0))).as_rotvec().reshape(len(rows), spec.horizon, 3)
    return out


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
    keys in absolute dataset units (``spec.action_keys == ABS_ACTION_KEYS``), so its
    ``predict_action(obs)["action_pred"]`` is returned as is; a policy with another action
    representation plugs in here by returning absolute actions.

    Args:
        policy: the loaded policy (``predict_action(obs, generator=...)``).
        dataset: the :class:`~dpflow_core.train.data.SequenceDataset` of the held-out episodes.
        rows: positions in ``dataset`` (its ``index`` rows) to predict at.
        batch_size: samples per ``predict_action`` call; seed: seed of the diffusion noise;
        device: the policy's torch device.

    Raises:
        RunError: when the policy's action is not the absolute 7-D one.
    """
    import torch

    keys = tuple(dataset.spec.action_keys)
    if keys != ABS_ACTION_KEYS:
        raise RunError(
            f"the policy predicts {list(keys)}; evaluation needs absolute {list(ABS_ACTION_KEYS)} actions",
            code="action_representation",
        )
    generator = torch.Generator(device="cpu").manual_seed(seed)
    preds = []
    for i in range(0, len(rows), batch_size):
        batch = dataset.collate([int(r) for r in rows[i : i + batch_size]])
        obs = {k: v.to(device) for k, v in batch["obs"].items()}
        noise_gen = generator if str(device) == "cpu" else None
        with torch.no_grad():
            out = policy.predict_action(obs, generator=noise_gen)["action_pred"]
        preds.append(out.float().cpu().numpy().astype(np.float64))
    return np.concatenate(preds)


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


@dataclass(frozen=True)
class EvaluationResult:
    """What :func:`evaluate_checkpoint` measured.

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
        data = asdict(self)
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


# Plots ------------------------------------------------------------------------------------------


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


_COLOURS = {"policy": "tab:blue", "mean": "tab:red", "hold": "tab:green", "constant_velocity": "tab:orange"}


def plot_trajectories(
    buffer,
    episodes: Sequence[int],
    episode_rows: dict[int, tuple[np.ndarray, dict[str, np.ndarray]]],
    step_s: float,
    path: str | Path,
) -> Path:
    """Recorded vs predicted absolute actions, one column per episode, one row per dimension.

    ``episode_rows[e] = (anchors, {predictor: (N, H, 7)})`` with anchors ``(N,)`` buffer
    indices. Policy and constant-velocity predictions are drawn as thin lines over their
    horizons (the policy's first action as a dot); hold as short flat segments; the mean
    baseline as a dashed line.
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
        horizon_t = np.arange(preds["policy"].shape[1]) * step_s
        for d in range(da):
            ax = axes[d, c]
            ax.plot(t, recorded[:, d], color="black", lw=1.2, label="recorded")
            for name in ("constant_velocity", "hold", "policy"):
                # one line per predictor, its horizons separated by NaN (one artist, fast to draw)
                xs = np.full((len(anchors), len(horizon_t) + 1), np.nan)
                ys = np.full_like(xs, np.nan)
                xs[:, :-1] = (anchors[:, None] - sl.start) / freq + horizon_t[None, :]
                ys[:, :-1] = preds[name][:, :, d]
                ax.plot(xs.ravel(), ys.ravel(), color=_COLOURS[name], lw=0.6, alpha=0.45)
            ax.plot((anchors - sl.start) / freq, preds["policy"][:, 0, d], ".", color=_COLOURS["policy"], ms=3, label="policy")
            ax.plot([], [], color=_COLOURS["hold"], lw=0.8, label="hold")
            ax.plot([], [], color=_COLOURS["constant_velocity"], lw=0.8, label="constant velocity")
            ax.axhline(preds["mean"][0, 0, d], color=_COLOURS["mean"], ls="--", lw=0.8, label="mean")
            if c == 0:
                ax.set_ylabel(DIMENSION_NAMES[d], fontsize=8)
            ax.tick_params(labelsize=7)
            if d == 0:
                ax.set_title(f"held-out episode {ep}", fontsize=9)
        axes[-1, c].set_xlabel("time (s)", fontsize=8)
    axes[0, 0].legend(loc="best", fontsize=6)
    fig.tight_layout()
    return _save_figure(fig, path)


def plot_errors_per_step(metrics: Mapping[str, PredictorMetrics], step_s: float, path: str | Path) -> Path:
    """MSE, position error and geodesic rotation error per horizon step, one line per predictor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), dpi=90)
    panels = (("mse_per_step", "MSE (dataset units$^2$)"), ("position_error_m_per_step", "position error (m)"),
              ("rotation_error_rad_per_step", "rotation error (rad)"))
    for ax, (attr, label) in zip(axes, panels):
        for name, m in metrics.items():
            values = np.asarray(getattr(m, attr), dtype=np.float64)
            ax.plot(np.arange(len(values)) * step_s, values, "o-", ms=3, color=_COLOURS.get(name), label=name.replace("_", " "))
        if attr == "mse_per_step" and all(v > 0 for m in metrics.values() for v in getattr(m, attr) if math.isfinite(v)):
            ax.set_yscale("log")
        ax.set_xlabel("time ahead of the anchor (s)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return _save_figure(fig, path)


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

    from dpflow_core.files import sha256_file
    from dpflow_core.replay_buffer import ReplayBuffer
    from dpflow_core.train.checkpoint import load_checkpoint, load_policy
    from dpflow_core.train.data import SequenceDataset

    started = time.monotonic()
    if not 0.0 <= float(margin) < 1.0:
        raise RunError(f"the evaluation margin must be in [0, 1), got {margin!r}", code="bad_margin")
    out_dir = Path(out_dir)
    result_path = out_dir / RESULT_NAME
    if result_path.exists() and not overwrite:
        raise RunError("evaluation results exist already (pass --overwrite (overwrite=True) to replace them)", path=result_path, code="exists")

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
    policy, cfg, spec = load_policy(checkpoint_path, device=device, use_ema=True)
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
    tmp = result_path.with_name(f".{result_path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    os.replace(tmp, result_path)
    log.info("evaluation of %s: %s", checkpoint_path, result.verdict())
    return result


__all__ = [
    "ABS_ACTION_KEYS",
    "EvaluationResult",
    "PredictorMetrics",
    "constant_velocity_baseline",
    "evaluate_checkpoint",
    "geodesic_error",
    "gripper_event_errors",
    "held_out_split",
    "hold_baseline",
    "mean_baseline",
    "plot_loss_curve",
    "predict_absolute_actions",
    "read_loss_curve",
    "score_predictions",
    "threshold_crossings",
]

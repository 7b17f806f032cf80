"""Scoring on held-out episodes: the predictors, the samples a robot would execute, the gate's inputs.

Used by :func:`dpflow_core.evaluation.evaluate.evaluate_checkpoint`; callable on any predictor
(a function of sample rows), which is how the tests feed trivial predictors and mutated decoders in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpflow_core.errors import DatasetError
from dpflow_core.evaluation.baselines import (
    absolute_actions, action_index_matrix, constant_velocity_baseline, fit_mean_relative_action, hold_baseline,
    mean_relative_baseline,
)
from dpflow_core.evaluation.gate import BOOTSTRAP_RESAMPLES, gate_criteria
from dpflow_core.evaluation.metrics import sample_errors, score_predictions

#: Predictors scored, in report order; the gate compares ``policy`` with the best of the others.
PREDICTORS: tuple[str, ...] = ("policy", "hold", "constant_velocity", "mean_relative")
GATE_BASELINES: tuple[str, ...] = ("hold", "constant_velocity", "mean_relative")
from dpflow_core.evaluation.settings import DEFAULT_MARGIN, EvaluationSettings  # noqa: E402,F401 (re-exported)


def chunk_anchor_rows(index: np.ndarray, stride: int, max_per_episode: int | None = None) -> np.ndarray:
    """Rows of a sequence index at which a robot would predict: every ``stride`` steps of each episode.

    A robot executing chunks of ``K`` actions ``action_down_sample_steps`` apart predicts again
    ``stride = K x action_down_sample_steps`` steps later, so the executed steps of these anchors
    cover each episode once. ``max_per_episode`` (None: all) keeps that many, evenly spaced.
    """
    keep = []
    for start in np.unique(index[:, 1]):
        rows = np.flatnonzero(index[:, 1] == start)
        rows = rows[(index[rows, 0] - index[rows[0], 0]) % max(1, int(stride)) == 0]
        if max_per_episode is not None and len(rows) > max_per_episode:
            rows = rows[np.linspace(0, len(rows) - 1, max_per_episode).round().astype(int)]
        keep.append(rows)
    return np.concatenate(keep) if keep else np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class HeldOutScores:
    """What :func:`score_held_out` computed.

    Attributes:
        rows: ``(N, 3)`` sample rows ``(anchor, episode_start, episode_end)``; episodes: ``(N,)``
            the episode index of each.
        steps: ``(K,)`` the horizon steps scored (those a robot executes); step_s: seconds between
            horizon steps.
        targets: ``(N, H, 7)`` recorded absolute actions; predictions: per predictor ``(N, H, 7)``
            (dataset frame, the whole horizon, for plots).
        metrics: per predictor its :class:`~dpflow_core.evaluation.metrics.PredictorMetrics` on the
            scored steps; gate: :func:`~dpflow_core.evaluation.gate.gate_criteria`'s criteria.
        mean_relative: ``(H, 7)`` the mean relative action (:func:`fit_mean_relative_action`).
        gripper_threshold_m: width threshold of the gripper events (m).
    """

    rows: np.ndarray
    episodes: np.ndarray
    steps: np.ndarray
    step_s: float
    targets: np.ndarray
    predictions: dict[str, np.ndarray]
    metrics: dict[str, Any]
    gate: dict[str, dict[str, Any]]
    mean_relative: np.ndarray
    gripper_threshold_m: float


def score_held_out(
    predict: Callable[[np.ndarray], np.ndarray],
    buffer: Mapping[str, np.ndarray],
    spec,
    train_mask: np.ndarray,
    val_mask: np.ndarray,
    *,
    frequency_hz: float,
    n_action_steps: int,
    latency_s: float,
    settings: EvaluationSettings | None = None,
    resamples: int = BOOTSTRAP_RESAMPLES,
) -> HeldOutScores:
    """Score a predictor and the trivial baselines on the held-out episodes, and decide the gate.

    Anchors are those a robot executing chunks would predict at (:func:`chunk_anchor_rows`);
    of each prediction only the executed steps are scored
    (:func:`dpflow_core.inference.executed_action_steps`).

    Args:
        predict: rows ``(N, 3)`` -> absolute actions ``(N, H, 7)`` in the dataset frame (the
            policy: :meth:`dpflow_core.inference.Policy.predict_samples`).
        buffer: the replay buffer (a mapping of key to array with ``episode_ends``).
        spec: the policy's :class:`~dpflow_core.train.data.ObsActionSpec`.
        train_mask, val_mask: ``(E,)`` bool, training and held-out episodes.
        frequency_hz: the dataset's frequency (times the actions).
        n_action_steps: actions a robot executes per chunk; latency_s: from the anchor frame's
            capture to the moment the policy acts (s).
        settings: the evaluation's :class:`~dpflow_core.evaluation.settings.EvaluationSettings`: its ``margin``
            and ``seed`` (of :func:`~dpflow_core.evaluation.gate.gate_criteria`), ``max_samples_per_episode``
            (the cap on anchors per held-out episode; None: every chunk) and ``gripper_threshold_m`` (None: the
            middle of the training widths' range). Default: every chunk, the other defaults.
        resamples: bootstrap draws of :func:`~dpflow_core.evaluation.gate.gate_criteria`.

    Raises:
        DatasetError: the held-out episodes give no sample, the training ones none.
        ValueError: a latency that leaves no executed step; a bad margin.
    """
    from dpflow_core.inference import executed_action_steps
    from dpflow_core.train.data import sequence_index

    settings = settings or EvaluationSettings(max_samples_per_episode=None)
    margin, seed, max_samples_per_episode = settings.margin, settings.seed, settings.max_samples_per_episode
    gripper_threshold_m = settings.gripper_threshold_m

    ends = np.asarray(buffer.episode_ends, dtype=np.int64)
    index = sequence_index(ends, np.asarray(val_mask, bool), spec)
    if not len(index):
        raise DatasetError(
            f"the held-out episodes {np.flatnonzero(val_mask).tolist()} give no sample (each is shorter than "
            f"{spec.min_episode_length} frames)", path=getattr(buffer, "path", None),
        )
    step_s = float(spec.action_down_sample_steps) / float(frequency_hz)
    steps = executed_action_steps(spec.horizon, n_action_steps, step_s, latency_s)
    rows = index[chunk_anchor_rows(index, len(steps) * spec.action_down_sample_steps, max_samples_per_episode)]
    episodes = np.searchsorted(ends, rows[:, 0], side="right")
    targets = absolute_actions(buffer, action_index_matrix(spec, rows))
    train_rows = sequence_index(ends, np.asarray(train_mask, bool), spec)
    mean_relative = fit_mean_relative_action(buffer, spec, train_rows)
    predictions = {
        "policy": np.asarray(predict(rows), dtype=np.float64),
        "hold": hold_baseline(buffer, spec, rows),
        "constant_velocity": constant_velocity_baseline(buffer, spec, rows),
        "mean_relative": mean_relative_baseline(buffer, spec, rows, mean_relative),
    }
    if predictions["policy"].shape != targets.shape:
        raise ValueError(f"the policy predicted {predictions['policy'].shape}, the samples need {targets.shape}")
    if gripper_threshold_m is None:
        starts = np.concatenate([[0], ends[:-1]])
        train_steps = np.concatenate([np.arange(a, b) for a, b, m in zip(starts, ends, train_mask) if m])
        widths = np.asarray(buffer["robot0_gripper_width"][train_steps], dtype=np.float64)
        gripper_threshold_m = float(widths.min() + widths.max()) / 2.0
    kwargs = dict(gripper_threshold_m=gripper_threshold_m, step_s=step_s, tx_cam_tcp=spec.tx)
    metrics = {n: score_predictions(p[:, steps], targets[:, steps], **kwargs) for n, p in predictions.items()}
    errors = {n: sample_errors(p[:, steps], targets[:, steps], **kwargs) for n, p in predictions.items()}
    gate = gate_criteria(errors, episodes, GATE_BASELINES, margin, resamples=resamples, seed=seed)
    return HeldOutScores(rows, episodes, steps, step_s, targets, predictions, metrics, gate, mean_relative, float(gripper_threshold_m))

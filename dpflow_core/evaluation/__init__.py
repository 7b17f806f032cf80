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

Modules: :mod:`~dpflow_core.evaluation.metrics` (errors of one predictor),
:mod:`~dpflow_core.evaluation.baselines` (the trivial predictors), :mod:`~dpflow_core.evaluation.plots`
and :mod:`~dpflow_core.evaluation.evaluate` (the checkpoint's evaluation and its gate); the names other
code uses are re-exported here.
"""

from __future__ import annotations

from dpflow_core.evaluation.metrics import (
    ABS_ACTION_KEYS, ACTION_GROUPS, DIMENSION_NAMES, PredictorMetrics, geodesic_error, gripper_event_errors,
    score_predictions, threshold_crossings,
)
from dpflow_core.evaluation.baselines import (
    absolute_actions, action_index_matrix, constant_velocity_baseline, hold_baseline, mean_baseline,
)
from dpflow_core.evaluation.plots import plot_errors_per_step, plot_loss_curve, plot_trajectories, read_loss_curve
from dpflow_core.evaluation.evaluate import (
    DEFAULT_MARGIN, GATE_BASELINES, MIN_HELD_OUT_EPISODES, PREDICTORS, RESULT_NAME, EvaluationResult,
    evaluate_checkpoint, evaluation_dir_for, held_out_split, predict_absolute_actions, recorded_dataset_sha256,
)

__all__ = [
    "ABS_ACTION_KEYS", "ACTION_GROUPS", "DEFAULT_MARGIN", "DIMENSION_NAMES", "GATE_BASELINES", "MIN_HELD_OUT_EPISODES",
    "PREDICTORS", "RESULT_NAME", "EvaluationResult", "PredictorMetrics", "absolute_actions", "action_index_matrix",
    "constant_velocity_baseline", "evaluate_checkpoint", "evaluation_dir_for", "geodesic_error", "gripper_event_errors", "held_out_split",
    "hold_baseline", "mean_baseline", "plot_errors_per_step", "plot_loss_curve", "plot_trajectories",
    "predict_absolute_actions", "read_loss_curve", "recorded_dataset_sha256", "score_predictions", "threshold_crossings",
]

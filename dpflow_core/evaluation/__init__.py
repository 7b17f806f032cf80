"""Offline evaluation of a trained policy on held-out episodes: a gate that trivial predictors cannot pass.

The checkpoint's EMA policy predicts at anchors of the episodes the trainer held out
for validation (the split is recomputed from the checkpoint's own ``task.val_ratio``,
``task.val_min_episodes`` and ``task.split_seed``, so it is the set the trainer never
trained on). Observations are cut exactly as in training
(:meth:`dpflow_core.inference.Policy.predict_samples`, observation latencies included).

Which steps are scored: those a robot executes. It predicts every ``n_action_steps``
actions (the anchors are one chunk apart, so each recorded step is scored once), and of
each chunk it executes the first ``n_action_steps`` actions whose time lies after the
moment it acts, ``task.camera_obs_latency`` after the anchor frame
(:func:`dpflow_core.inference.executed_action_steps`, UMI's rule).

Everything is scored on ABSOLUTE actions, whatever representation the network
learned: ``[position (3) m, rotation vector (3) rad, gripper width (1) m]`` read from the
replay buffer's ``robot0_eef_pos``, ``robot0_eef_rot_axis_angle`` and ``robot0_gripper_width``.
:func:`predict_absolute_actions` is the one place that turns the policy's output into that vector.

Three trivial predictors are scored on the same samples (:mod:`~dpflow_core.evaluation.baselines`):

- ``hold``: the latest observed pose and gripper width, repeated;
- ``constant_velocity``: the last two observed poses extrapolated; positions and widths
  linearly, rotations on SO(3): with ``D = R_0 R_1^-1``, step ``s`` (in observation
  intervals) predicts ``exp(s log D) R_0``;
- ``mean_relative``: the training samples' mean action per horizon step, expressed relative to
  the current TCP pose (``inv(B) A_k``, averaged) and applied to each sample's current pose.

The gate (:attr:`EvaluationResult.beats_baseline`, :mod:`~dpflow_core.evaluation.gate`): for each of
TCP position error (m), geodesic TCP rotation error (rad) and gripper events (matched minus false),
the policy's error must undercut the best of the three baselines' by the margin (20 % by default).
Each criterion reports an episode-level bootstrap interval. Every gated number is invariant to the
dataset's world frame (the VIO origin is arbitrary). The 7-D MSE, which adds m^2 to rad^2 of
rotation-vector components, is reported beside them and never gated.

Before any of this the dataset's SHA-256 is compared with the one recorded with
the checkpoint (its ``dataset.sha256`` entry, else the downloaded run record):
a different dataset is refused, naming both hashes.

Plots (PNG, matplotlib's Agg backend): recorded vs predicted trajectories of a few held-out
episodes over the executed steps, errors per executed step of the four predictors, and the
training loss curve from ``logs.json.txt``.

Modules: :mod:`~dpflow_core.evaluation.metrics` (errors of one predictor),
:mod:`~dpflow_core.evaluation.baselines` (the trivial predictors), :mod:`~dpflow_core.evaluation.gate`
(criteria and intervals), :mod:`~dpflow_core.evaluation.scoring` (held-out samples of any predictor),
:mod:`~dpflow_core.evaluation.plots` and :mod:`~dpflow_core.evaluation.evaluate` (the checkpoint's
evaluation and its result); the names other code uses are re-exported here.
"""

from __future__ import annotations

from dpflow_core._lazy import lazy_exports

# each name is imported from its module on first use: the command line's options (settings) load no NumPy
__getattr__, __dir__ = lazy_exports(__name__, {
    "ABS_ACTION_KEYS": "metrics",
    "ACTION_GROUPS": "metrics",
    "BOOTSTRAP_RESAMPLES": "gate",
    "CRITERIA": "gate",
    "DEFAULT_MARGIN": "settings",
    "DIMENSION_NAMES": "metrics",
    "EvaluationResult": "evaluate",
    "EvaluationSettings": "settings",
    "GATE_BASELINES": "scoring",
    "HeldOutScores": "scoring",
    "MIN_HELD_OUT_EPISODES": "evaluate",
    "PREDICTORS": "scoring",
    "PredictorMetrics": "metrics",
    "RESULT_NAME": "evaluate",
    "SampleErrors": "metrics",
    "absolute_actions": "baselines",
    "action_index_matrix": "baselines",
    "chunk_anchor_rows": "scoring",
    "constant_velocity_baseline": "baselines",
    "evaluate_checkpoint": "evaluate",
    "evaluation_dir_for": "evaluate",
    "fit_mean_relative_action": "baselines",
    "gate_criteria": "gate",
    "geodesic_error": "metrics",
    "gripper_event_errors": "metrics",
    "held_out_split": "evaluate",
    "hold_baseline": "baselines",
    "mean_relative_baseline": "baselines",
    "plot_errors_per_step": "plots",
    "plot_loss_curve": "plots",
    "plot_trajectories": "plots",
    "predict_absolute_actions": "evaluate",
    "read_loss_curve": "plots",
    "recorded_dataset_sha256": "evaluate",
    "sample_errors": "metrics",
    "score_held_out": "scoring",
    "score_predictions": "metrics",
    "threshold_crossings": "metrics",
})

__all__ = [
    "EvaluationSettings",
    "ABS_ACTION_KEYS", "ACTION_GROUPS", "BOOTSTRAP_RESAMPLES", "CRITERIA", "DEFAULT_MARGIN", "DIMENSION_NAMES",
    "GATE_BASELINES", "MIN_HELD_OUT_EPISODES", "PREDICTORS", "RESULT_NAME", "EvaluationResult", "HeldOutScores",
    "PredictorMetrics", "SampleErrors", "absolute_actions", "action_index_matrix", "chunk_anchor_rows",
    "constant_velocity_baseline", "evaluate_checkpoint", "evaluation_dir_for", "fit_mean_relative_action",
    "gate_criteria", "geodesic_error", "gripper_event_errors", "held_out_split", "hold_baseline",
    "mean_relative_baseline", "plot_errors_per_step", "plot_loss_curve", "plot_trajectories",
    "predict_absolute_actions", "read_loss_curve", "recorded_dataset_sha256", "sample_errors", "score_held_out",
    "score_predictions", "threshold_crossings",
]

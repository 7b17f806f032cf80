"""Every offline metric of a checkpoint on held-out recordings, kept per episode so that it can be bootstrapped.

The study of :mod:`~dpflow_core.evaluation.ranking` asks which offline figure ranks checkpoints as
closed-loop success does. Each metric here is a ratio of sums over the held-out *episodes*,
``sum_e num[e] / sum_e den[e]`` (averaged over ``K`` columns where it has several), so an episode
bootstrap only reweights the rows (:func:`metric_value`). Samples are those the offline gate scores
(:mod:`~dpflow_core.evaluation.scoring`): one anchor per executed chunk, and of each predicted chunk
only the steps a robot executes (:func:`dpflow_core.inference.executed_action_steps`), all on
absolute actions ``[pos m, rotvec rad, width m]``. Lower is better for every metric.

The metrics (:data:`METRICS`):

- ``mse``: the raw 7-D MSE (m^2 and rad^2 of rotation-vector components added: what a training
  log's validation loss resembles);
- ``hold_normalised_mse``: per dimension, the policy's squared error divided by the ``hold``
  baseline's (the latest observation repeated) on the same steps, averaged over the 7 dimensions
  (unitless; 1 is no better than holding still). It weighs position, rotation and gripper equally
  where the raw MSE is dominated by whichever has the largest numbers; a dimension in which
  hold is exact is left out;
- ``position_error_m``, ``rotation_error_rad``: mean TCP position error (m) and geodesic TCP rotation
  error (rad), the offline gate's first two criteria;
- ``gripper_event_error``: missed plus false gripper open/close events per recorded event (the
  gate's third criterion, ``events - (matched - false)``, made a rate);
- ``critical_position_error_m`` and ``critical_mse``: the position error and the 7-D MSE on the
  *critical* steps only (:func:`critical_mask`): within :data:`CRITICAL_WINDOW_S` of a recorded
  gripper event, or with the TCP within :data:`CONTACT_HEIGHT_M` of the lowest it comes in the
  episode (at the table: grasping the block and setting it down). Most of an episode is free-space
  motion that any reasonable policy gets roughly right; a grasp is won or lost in these steps;
- ``best_of_n_position_error_m``: of :data:`BEST_OF_N` policy samples (different diffusion noise)
  per anchor, the position error of the closest one (:func:`best_of_n`). A multimodal policy that
  goes left or right round an obstacle is penalised by a single sample that picked the other mode,
  not by the best of several.

Sample 0 of the ``n_draws`` is the single sample every other metric scores.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from dpflow_core.errors import DatasetError
from dpflow_core.evaluation.metrics import sample_errors, tcp_poses, threshold_crossings

#: Seconds either side of a recorded gripper event that count as critical: a grasp's closing takes
#: about 0.3 s in the world's recordings and the last approach before it about as long.
CRITICAL_WINDOW_S = 0.5
#: A TCP this close (m) above the lowest it comes in its episode is at the table (grasp, placement).
CONTACT_HEIGHT_M = 0.01
#: Policy samples per anchor of the best-of-N error.
BEST_OF_N = 8

#: The metrics, in report order: (name, unit, what it is). Lower is better for each.
METRICS: tuple[tuple[str, str, str], ...] = (
    ("mse", "m^2, rad^2", "raw 7-D MSE on executed steps"),
    ("hold_normalised_mse", "x hold", "per-dimension MSE over hold's, averaged"),
    ("position_error_m", "m", "TCP position error on executed steps"),
    ("rotation_error_rad", "rad", "geodesic TCP rotation error on executed steps"),
    ("gripper_event_error", "per event", "(missed + false) gripper events per recorded event"),
    ("critical_position_error_m", "m", f"position error within {CRITICAL_WINDOW_S:g} s of gripper events or at contact"),
    ("critical_mse", "m^2, rad^2", "7-D MSE on the same critical steps"),
    ("best_of_n_position_error_m", "m", f"position error of the closest of {BEST_OF_N} policy samples"),
)


def metric_values(numerator: np.ndarray, denominator: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """:func:`metric_value` under each row of episode ``weights`` ``(B, E)``: ``(B,)`` float64."""
    num = np.asarray(numerator, dtype=np.float64).reshape(len(numerator), -1)
    den = np.asarray(denominator, dtype=np.float64).reshape(len(denominator), -1)
    top, bottom = np.asarray(weights, dtype=np.float64) @ num, np.asarray(weights, dtype=np.float64) @ den
    ok = bottom > 0
    ratio = np.where(ok, top / np.where(ok, bottom, 1.0), 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(ok.any(axis=1), ratio.sum(axis=1) / ok.sum(axis=1), np.nan)


def metric_value(numerator: np.ndarray, denominator: np.ndarray, weights: np.ndarray | None = None) -> float:
    """``mean_k (w @ numerator[:, k]) / (w @ denominator[:, k])`` over the columns whose denominator is > 0.

    Args:
        numerator, denominator: ``(E,)`` or ``(E, K)`` per-episode sums.
        weights: ``(E,)`` episode weights (a bootstrap resample's counts); None: all 1.

    Returns:
        The metric; NaN when no column has a positive denominator.
    """
    w = np.ones(len(numerator)) if weights is None else np.asarray(weights, dtype=np.float64)
    return float(metric_values(numerator, denominator, w[None])[0])


def critical_mask(
    width_m: np.ndarray, tcp_z_m: np.ndarray, episode_ends: np.ndarray, frequency_hz: float, threshold_m: float,
    window_s: float = CRITICAL_WINDOW_S, contact_height_m: float = CONTACT_HEIGHT_M,
) -> np.ndarray:
    """Which recorded steps are critical: ``(T,)`` bool.

    Step ``k`` of an episode (at ``k / frequency_hz`` s) is critical when it lies within ``window_s``
    of a gripper event of the episode's recorded widths (:func:`threshold_crossings` at
    ``threshold_m``, both ends included), or when its TCP height is within ``contact_height_m`` of the
    episode's lowest. The height must be along gravity (the VIO frame's ``Z`` is up).

    Args:
        width_m: ``(T,)`` recorded gripper widths (m); tcp_z_m: ``(T,)`` TCP heights (m).
        episode_ends: ``(E,)`` cumulative episode ends; frequency_hz: the recording rate.
        threshold_m: width separating closed from open (m).

    Raises:
        ValueError: lengths that do not match the episode ends, a rate or window that is not positive.
    """
    w = np.asarray(width_m, dtype=np.float64).reshape(-1)
    z = np.asarray(tcp_z_m, dtype=np.float64).reshape(-1)
    ends = np.asarray(episode_ends, dtype=np.int64)
    if len(w) != len(z) or not len(ends) or int(ends[-1]) != len(w):
        raise ValueError(f"widths ({len(w)}) and heights ({len(z)}) must cover the episodes (last end {ends[-1] if len(ends) else None})")
    if not frequency_hz > 0 or window_s < 0 or contact_height_m < 0:
        raise ValueError(f"frequency ({frequency_hz}) must be > 0, window ({window_s}) and height ({contact_height_m}) >= 0")
    out = np.zeros(len(w), dtype=bool)
    for start, end in zip(np.concatenate([[0], ends[:-1]]), ends):
        t = np.arange(end - start) / float(frequency_hz)
        near = np.zeros(len(t), dtype=bool)
        for t_event, _ in threshold_crossings(w[start:end], threshold_m, 1.0 / float(frequency_hz)):
            near |= np.abs(t - t_event) <= window_s + 1e-9
        ez = z[start:end]
        out[start:end] = near | (ez - ez.min() <= contact_height_m)
    return out


def best_of_n(position_errors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The closest of several samples per anchor: ``(best (N, S), index (N,))``.

    Args:
        position_errors: ``(n_draws, N, S)`` per-step position errors (m) of each draw at each anchor.

    The closest draw of an anchor is the one with the smallest mean error over its ``S`` steps; a
    draw with a non-finite error is never chosen unless every draw has one.
    """
    e = np.asarray(position_errors, dtype=np.float64)
    if e.ndim != 3 or not e.shape[0]:
        raise ValueError(f"position_errors must be (n_draws >= 1, N, S), got {e.shape}")
    mean = e.mean(axis=2)
    index = np.argmin(np.where(np.isfinite(mean), mean, np.inf), axis=0)
    return e[index, np.arange(e.shape[1])], index


@dataclass(frozen=True)
class EpisodeStats:
    """Per held-out episode, the sums each metric is a ratio of.

    Attributes:
        episodes: ``(E,)`` episode indices of the held-out dataset.
        numerator, denominator: ``{metric: (E, K)}``; the metric is :func:`metric_value` of the pair.
    """

    episodes: np.ndarray
    numerator: dict[str, np.ndarray]
    denominator: dict[str, np.ndarray]

    def value(self, metric: str, weights: np.ndarray | None = None) -> float:
        return metric_value(self.numerator[metric], self.denominator[metric], weights)

    def values(self) -> dict[str, float]:
        return {m: self.value(m) for m in self.numerator}

    def to_npz(self) -> dict[str, np.ndarray]:
        """Arrays for ``np.savez`` (:meth:`from_npz` reads them back)."""
        out = {"episodes": self.episodes}
        out |= {f"num__{k}": v for k, v in self.numerator.items()} | {f"den__{k}": v for k, v in self.denominator.items()}
        return out

    @classmethod
    def from_npz(cls, data: Mapping[str, np.ndarray]) -> "EpisodeStats":
        names = [k[5:] for k in data if k.startswith("num__")]
        return cls(np.asarray(data["episodes"]), {m: np.asarray(data[f"num__{m}"]) for m in names},
                   {m: np.asarray(data[f"den__{m}"]) for m in names})


def episode_statistics(
    draws: np.ndarray, targets: np.ndarray, hold: np.ndarray, sample_episode: np.ndarray, critical: np.ndarray, *,
    gripper_threshold_m: float, step_s: float, tx_cam_tcp: np.ndarray | None = None,
) -> EpisodeStats:
    """The per-episode sums of every metric of :data:`METRICS`, on the scored steps.

    Args:
        draws: ``(n_draws, N, S, 7)`` policy predictions on the scored steps (draw 0 is the single sample).
        targets, hold: ``(N, S, 7)`` recorded actions and the hold baseline's on the same steps.
        sample_episode: ``(N,)`` the episode of each anchor; critical: ``(N, S)`` bool, critical steps.
        gripper_threshold_m, step_s, tx_cam_tcp: of :func:`~dpflow_core.evaluation.metrics.sample_errors`.

    Raises:
        ValueError: shapes that do not agree.
    """
    d = np.asarray(draws, dtype=np.float64)
    r = np.asarray(targets, dtype=np.float64)
    crit = np.asarray(critical, dtype=bool)
    if d.ndim != 4 or d.shape[1:] != r.shape or np.shape(hold) != r.shape or crit.shape != r.shape[:2]:
        raise ValueError(f"draws {d.shape}, targets {r.shape}, hold {np.shape(hold)}, critical {crit.shape} do not agree")
    episodes, ep = np.unique(np.asarray(sample_episode), return_inverse=True)
    if len(ep) != len(r):
        raise ValueError(f"sample_episode has {len(ep)} entries for {len(r)} anchors")
    kw = dict(gripper_threshold_m=gripper_threshold_m, step_s=step_s, tx_cam_tcp=tx_cam_tcp)
    one = sample_errors(d[0], r, **kw)
    pos_all = np.stack([one.position_error_m] + [sample_errors(x, r, **kw).position_error_m for x in d[1:]])
    best, _ = best_of_n(pos_all)
    sq = (d[0] - r) ** 2
    sq_hold = (np.asarray(hold, dtype=np.float64) - r) ** 2
    per_step = np.ones(r.shape[:2])

    def per_episode(values: np.ndarray) -> np.ndarray:
        """``(N, ...)`` -> ``(E, K)`` sums over each episode's anchors."""
        v = values.reshape(len(values), -1)
        out = np.zeros((len(episodes), v.shape[1]))
        np.add.at(out, ep, v)
        return out

    nums = {
        "mse": per_episode(sq.sum(axis=(1, 2))),
        "hold_normalised_mse": per_episode(sq.sum(axis=1)),
        "position_error_m": per_episode(one.position_error_m.sum(axis=1)),
        "rotation_error_rad": per_episode(one.rotation_error_rad.sum(axis=1)),
        "gripper_event_error": per_episode((one.events - one.matched + one.false).astype(np.float64)),
        "critical_position_error_m": per_episode((one.position_error_m * crit).sum(axis=1)),
        "critical_mse": per_episode((sq.sum(axis=2) * crit).sum(axis=1)),
        "best_of_n_position_error_m": per_episode(best.sum(axis=1)),
    }
    dens = {
        "mse": per_episode(per_step.sum(axis=1) * 7),
        "hold_normalised_mse": per_episode(sq_hold.sum(axis=1)),
        "position_error_m": per_episode(per_step.sum(axis=1)),
        "rotation_error_rad": per_episode(per_step.sum(axis=1)),
        "gripper_event_error": per_episode(one.events.astype(np.float64)),
        "critical_position_error_m": per_episode(crit.sum(axis=1).astype(np.float64)),
        "critical_mse": per_episode(crit.sum(axis=1) * 7.0),
        "best_of_n_position_error_m": per_episode(per_step.sum(axis=1)),
    }
    return EpisodeStats(episodes, nums, dens)


@dataclass(frozen=True)
class HeldOutSamples:
    """The scored samples of a held-out dataset for one policy spec (:func:`held_out_samples`).

    Attributes:
        rows: ``(N, 3)`` anchors ``(anchor, episode_start, episode_end)``; episodes: ``(N,)`` their episode.
        steps: ``(S,)`` executed horizon steps; step_s: seconds between horizon steps.
        targets, hold: ``(N, S, 7)`` recorded actions and the hold baseline on those steps.
        critical: ``(N, S)`` bool; gripper_threshold_m: the event threshold (m).
    """

    rows: np.ndarray
    episodes: np.ndarray
    steps: np.ndarray
    step_s: float
    targets: np.ndarray
    hold: np.ndarray
    critical: np.ndarray
    gripper_threshold_m: float


def held_out_samples(buffer, spec, *, frequency_hz: float, n_action_steps: int, latency_s: float,
                     gripper_threshold_m: float | None = None) -> HeldOutSamples:
    """Anchors, executed steps, targets, hold baseline and critical steps of every episode of ``buffer``.

    Every episode of ``buffer`` is held out (it is a dataset of recordings no checkpoint trained on).
    ``gripper_threshold_m`` None: the middle of the dataset's width range (the same fingers as in training).

    Raises:
        DatasetError: no episode gives a sample (all shorter than the spec needs).
        ValueError: a latency that leaves no executed step.
    """
    from dpflow_core.evaluation.baselines import absolute_actions, action_index_matrix, hold_baseline
    from dpflow_core.evaluation.scoring import chunk_anchor_rows
    from dpflow_core.inference import executed_action_steps
    from dpflow_core.train.data import sequence_index

    ends = np.asarray(buffer.episode_ends, dtype=np.int64)
    index = sequence_index(ends, np.ones(len(ends), bool), spec)
    if not len(index):
        raise DatasetError(f"no held-out episode is {spec.min_episode_length} frames long", path=getattr(buffer, "path", None))
    step_s = float(spec.action_down_sample_steps) / float(frequency_hz)
    steps = executed_action_steps(spec.horizon, n_action_steps, step_s, latency_s)
    rows = index[chunk_anchor_rows(index, len(steps) * spec.action_down_sample_steps)]
    episodes = np.searchsorted(ends, rows[:, 0], side="right")
    actions_at = action_index_matrix(spec, rows)[:, steps]
    recorded = absolute_actions(buffer, slice(None))
    if gripper_threshold_m is None:
        gripper_threshold_m = float(recorded[:, 6].min() + recorded[:, 6].max()) / 2.0
    tcp_z = tcp_poses(recorded, spec.tx)[:, 2, 3]
    critical = critical_mask(recorded[:, 6], tcp_z, ends, frequency_hz, gripper_threshold_m)
    hold = hold_baseline(buffer, spec, rows)[:, steps]
    return HeldOutSamples(rows, episodes, steps, step_s, recorded[actions_at], hold, critical[actions_at],
                          float(gripper_threshold_m))


def policy_statistics(policy, buffer, samples: HeldOutSamples, *, n_draws: int = BEST_OF_N, seed: int = 0,
                      batch_size: int = 64) -> EpisodeStats:
    """:func:`episode_statistics` of a loaded policy (:func:`dpflow_core.inference.load_policy`) on ``samples``.

    Draw ``j`` is :meth:`~dpflow_core.inference.Policy.predict_samples` with noise seed ``seed + j``.
    """
    if n_draws < 1:
        raise ValueError(f"n_draws must be >= 1, got {n_draws}")
    draws = np.stack([policy.predict_samples(buffer, samples.rows, batch_size=batch_size, seed=seed + j)[:, samples.steps]
                      for j in range(int(n_draws))])
    return episode_statistics(draws, samples.targets, samples.hold, samples.episodes, samples.critical,
                              gripper_threshold_m=samples.gripper_threshold_m, step_s=samples.step_s,
                              tx_cam_tcp=policy.spec.tx)

"""Errors of a predictor on absolute actions: MSE, position, geodesic rotation, gripper width and events.

Every array here is an absolute action ``[position (3) m, rotation vector (3) rad, gripper width (1) m]``
per sample and horizon step, ``(N, H, 7)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: The absolute action every metric is computed on: keys of the replay buffer, in order.
ABS_ACTION_KEYS: tuple[str, ...] = ("robot0_eef_pos", "robot0_eef_rot_axis_angle", "robot0_gripper_width")
POS, ROT, GRIP = slice(0, 3), slice(3, 6), slice(6, 7)
#: ``(name, slice of the 7-D absolute action)`` per action key.
ACTION_GROUPS: tuple[tuple[str, slice], ...] = (("position", POS), ("rotation", ROT), ("gripper", GRIP))
DIMENSION_NAMES: tuple[str, ...] = (
    "position.x", "position.y", "position.z", "rotation.rx", "rotation.ry", "rotation.rz", "gripper.width",
)

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

"""Errors of a predictor on absolute actions: MSE, TCP position, geodesic rotation, gripper width and events.

Every array here is an absolute action ``[position (3) m, rotation vector (3) rad, gripper width (1) m]``
per sample and scored horizon step, ``(N, S, 7)``, in the dataset's world frame (the camera pose the
replay buffer records). Position and rotation errors are those of the TCP (``pose @ tx_cam_tcp``,
:mod:`dpflow_core.pose`), what a robot controller moves. Both are invariant to the world frame:
changing it to ``W @ pose`` rotates position differences without changing their length and leaves
``R_pred^-1 R_true`` unchanged. The mixed-unit MSE (m^2 beside rad^2 of rotation-vector components)
is not: it is reported, never gated.
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


@dataclass(frozen=True)
class SampleErrors:
    """Frame-invariant errors of one predictor, per sample: what the gate and its bootstrap add up.

    Attributes:
        position_error_m: ``(N, S)`` Euclidean TCP position error (m) per sample and scored step.
        rotation_error_rad: ``(N, S)`` geodesic angle of ``R_pred^-1 R_true`` of the TCP (rad; NaN
            where the prediction is not finite).
        events, matched, false: ``(N,)`` int64 gripper events per sample: recorded, recorded and
            predicted in the same direction, predicted without a recorded one.
    """

    position_error_m: np.ndarray
    rotation_error_rad: np.ndarray
    events: np.ndarray
    matched: np.ndarray
    false: np.ndarray


@dataclass(frozen=True)
class PredictorMetrics:
    """Errors of one predictor against the recorded absolute actions of the scored steps.

    Attributes:
        mse: mean squared error over samples, scored steps and the 7 dimensions (dataset frame,
            mixed units: reported, not gated).
        mse_per_key: ``{"position": m^2, "rotation": rad^2 (rotation-vector components), "gripper": m^2}``.
        mse_per_dim: ``(7,)`` per dimension (:data:`DIMENSION_NAMES`).
        mse_per_step: ``(S,)`` per scored step (all 7 dimensions).
        position_error_m: mean Euclidean TCP position error (m); ``position_error_m_per_step`` ``(S,)``.
        rotation_error_rad: mean geodesic angle between predicted and recorded TCP rotations (rad);
            ``rotation_error_rad_per_step`` ``(S,)``.
        gripper_error_m: mean absolute gripper width error (m).
        gripper_events: recorded open/close events (threshold crossings inside the scored steps).
        gripper_events_matched: recorded events the predictor also crosses, in the same direction
            and sample; ``gripper_events_missed`` the others; ``gripper_events_false`` predicted
            crossings with no recorded one; ``gripper_event_score`` matched minus false.
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
    gripper_event_score: int
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


def _match_events(predicted, recorded, threshold: float, step_s: float) -> tuple[int, int, int, list[float]]:
    """(recorded, matched, false, timing errors) of one sample's width sequences."""
    pred_ev = threshold_crossings(predicted, threshold, step_s)
    rec_ev = threshold_crossings(recorded, threshold, step_s)
    free = list(pred_ev)
    timing: list[float] = []
    for t, d in rec_ev:
        same = [i for i, (_, dp) in enumerate(free) if dp == d]
        if not same:
            continue
        best = min(same, key=lambda i: abs(free[i][0] - t))
        timing.append(abs(free[best][0] - t))
        free.pop(best)
    return len(rec_ev), len(timing), len(free), timing


def gripper_event_errors(
    predicted: np.ndarray, recorded: np.ndarray, threshold: float, step_s: float
) -> dict[str, float | int]:
    """Compare gripper open/close events of predicted and recorded horizons.

    In each sample, each recorded event is matched to the nearest not yet matched
    predicted event of the same direction.

    Args:
        predicted, recorded: ``(N, S)`` gripper widths (m).
        threshold: event threshold (m); step_s: seconds between steps.

    Returns:
        ``{"events", "matched", "missed", "false", "timing_error_s"}`` (counts; mean absolute
        timing error of the matched events in s, NaN when none matched).
    """
    events = matched = false = 0
    timing: list[float] = []
    for p, r in zip(np.asarray(predicted), np.asarray(recorded)):
        e, m, f, t = _match_events(p, r, threshold, step_s)
        events, matched, false = events + e, matched + m, false + f
        timing += t
    return {
        "events": events,
        "matched": matched,
        "missed": events - matched,
        "false": false,
        "timing_error_s": float(np.mean(timing)) if timing else float("nan"),
    }


def _check_shapes(p: np.ndarray, r: np.ndarray) -> None:
    if p.shape != r.shape or p.ndim != 3 or p.shape[-1] != 7 or len(p) == 0:
        raise ValueError(f"predictions and recorded actions must both be (N >= 1, S, 7), got {p.shape} and {r.shape}")


def tcp_poses(actions: np.ndarray, tx_cam_tcp: np.ndarray | None) -> np.ndarray:
    """``(..., 4, 4)`` TCP poses of absolute actions ``(..., 7)`` (camera poses, dataset frame).

    Non-finite poses stay NaN instead of raising, so that a policy predicting NaN is scored
    (and fails) rather than aborting the evaluation.
    """
    from dpflow_core import pose as P

    a = np.asarray(actions, dtype=np.float64)
    finite = np.isfinite(a[..., :6]).all(axis=-1)
    mats = np.full(a.shape[:-1] + (4, 4), np.nan)
    if finite.any():
        m = P.pos_rot_to_mat(a[..., POS][finite], a[..., ROT][finite])
        mats[finite] = m if tx_cam_tcp is None or P.is_identity(tx_cam_tcp) else P.apply_tx(m, np.asarray(tx_cam_tcp, np.float64))
    return mats


def sample_errors(
    predicted: np.ndarray, recorded: np.ndarray, *, gripper_threshold_m: float, step_s: float,
    tx_cam_tcp: np.ndarray | None = None,
) -> SampleErrors:
    """The frame-invariant errors of :class:`SampleErrors`, per sample.

    Args:
        predicted, recorded: ``(N, S, 7)`` absolute actions (dataset frame, camera poses).
        gripper_threshold_m: width threshold of open/close events (m).
        step_s: seconds between scored steps.
        tx_cam_tcp: ``(4, 4)`` pose of the TCP in the camera frame; None: identity.

    Raises:
        ValueError: when the shapes differ or are not ``(N, S, 7)`` with N >= 1.
    """
    p = np.asarray(predicted, dtype=np.float64)
    r = np.asarray(recorded, dtype=np.float64)
    _check_shapes(p, r)
    tp, tr = tcp_poses(p, tx_cam_tcp), tcp_poses(r, tx_cam_tcp)
    pos_err = np.linalg.norm(tp[..., :3, 3] - tr[..., :3, 3], axis=-1)
    rot_err = np.full(p.shape[:2], np.nan)
    finite = np.isfinite(tp).all(axis=(-2, -1))
    if finite.any():
        from scipy.spatial.transform import Rotation

        delta = np.swapaxes(tp[finite][:, :3, :3], -1, -2) @ tr[finite][:, :3, :3]
        rot_err[finite] = Rotation.from_matrix(delta).magnitude()
    counts = np.array([_match_events(a, b, gripper_threshold_m, step_s)[:3] for a, b in zip(p[..., 6], r[..., 6])], dtype=np.int64)
    return SampleErrors(pos_err, rot_err, counts[:, 0], counts[:, 1], counts[:, 2])


def score_predictions(
    predicted: np.ndarray, recorded: np.ndarray, *, gripper_threshold_m: float, step_s: float,
    tx_cam_tcp: np.ndarray | None = None,
) -> PredictorMetrics:
    """All metrics of one predictor on the scored steps.

    Args:
        predicted, recorded: ``(N, S, 7)`` absolute actions ``[pos m, rotvec rad, width m]`` (dataset frame).
        gripper_threshold_m: width threshold of open/close events (m).
        step_s: seconds between scored steps (``action_down_sample_steps / frequency``).
        tx_cam_tcp: ``(4, 4)`` pose of the TCP in the camera frame (position and rotation errors
            are the TCP's); None: identity.

    Raises:
        ValueError: when the shapes differ or are not ``(N, S, 7)`` with N >= 1.
    """
    p = np.asarray(predicted, dtype=np.float64)
    r = np.asarray(recorded, dtype=np.float64)
    errors = sample_errors(p, r, gripper_threshold_m=gripper_threshold_m, step_s=step_s, tx_cam_tcp=tx_cam_tcp)
    sq = (p - r) ** 2
    ev = gripper_event_errors(p[..., 6], r[..., 6], gripper_threshold_m, step_s)
    return PredictorMetrics(
        mse=float(sq.mean()),
        mse_per_key={name: float(sq[..., sl].mean()) for name, sl in ACTION_GROUPS},
        mse_per_dim=tuple(float(v) for v in sq.mean(axis=(0, 1))),
        mse_per_step=tuple(float(v) for v in sq.mean(axis=(0, 2))),
        position_error_m=float(errors.position_error_m.mean()),
        position_error_m_per_step=tuple(float(v) for v in errors.position_error_m.mean(axis=0)),
        rotation_error_rad=float(errors.rotation_error_rad.mean()),
        rotation_error_rad_per_step=tuple(float(v) for v in errors.rotation_error_rad.mean(axis=0)),
        gripper_error_m=float(np.abs(p[..., 6] - r[..., 6]).mean()),
        gripper_events=int(ev["events"]),
        gripper_events_matched=int(ev["matched"]),
        gripper_events_missed=int(ev["missed"]),
        gripper_events_false=int(ev["false"]),
        gripper_event_score=int(ev["matched"]) - int(ev["false"]),
        gripper_timing_error_s=float(ev["timing_error_s"]),
    )

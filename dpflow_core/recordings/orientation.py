"""Does the pose track's quaternion convention agree with the IMU? (a plausibility class)

A pose quaternion is read as (x, y, z, w), rotating camera axes into the world (camera-to-world,
docs/formats.md). A writer that stores the inverse (world-to-camera), or (w, x, y, z), gives a
track that parses, interpolates and trains, but every rotation is wrong. The IMU, rigidly on the
device, says which convention the track follows:

- **gyro**: over each window of about ``convention_window_s``, the camera-frame rotation of the
  track (``R_a^-1 R_b`` as a rotation vector) equals the gyro's integral over the window, up to one
  fixed IMU-to-camera rotation;
- **gravity**: the window's mean specific force (the accelerometer, dominated by gravity for a
  hand) equals the world's up axis seen from the camera (``R^-1 e_z``), up to the same kind of
  fixed rotation.

Method: for each candidate reading of the stored numbers (as declared; conjugated; (w, x, y, z))
the fixed rotation is fitted by orthogonal Procrustes (Kabsch, proper rotations only) and the
residual is the unexplained share, summed over the signals present, ``sum |g - M b|^2 / sum |g|^2`` (noise level for the right
reading: under 0.005 on the sample tracks with a 0.003 rad/s gyro). The track disagrees with the IMU
when the declared reading leaves more than ``convention_min_residual`` (0.02) unexplained and
``convention_ratio`` (10) times more than another reading: a finding ``quaternion_convention``
naming the reading that fits. An IMU that fits no reading (noise, a broken sensor), a still device,
or rotation about one axis only (a conjugate then fits as well, by a half turn) give no finding.

**The gyro turning against the track** (``imu_reversed``): a time-reversed episode (every stream's samples in
reverse order, stamps ascending) or a gyro whose sign is flipped matches the track only negated, an improper map
no proper rotation gives, so no reading fits. The negated gyro is fitted to the declared reading too; when it is
the best explanation (its residual, plus the declared reading's gravity, below every other reading's) and the
declared gyro leaves more than ``reversed_min_residual`` (5e-4) and ``reversed_ratio`` (3) times more, the episode
is ``imu_reversed``. The world turns mostly about the vertical, where a half turn nearly maps the rotations onto
their negatives, so its margins are the narrow ones. Measured on 64 world episodes (``record_task``, both tasks;
60 turn enough for the gyro to be fitted): an honest gyro leaves 1.2e-5 to 3.3e-4 as declared and 5.9e-4 to 0.54
negated, so a reversed or flipped one leaves 5.9e-4 to 0.54 as declared and 1.2e-5 to 3.3e-4 negated, 11.9 to
3,500 times less (honest: 0.0003 to 0.084 times). On 22 random-motion samples (their IMU made from the pose,
``fault_fixtures.imu_from_pose``): honest 0 to 2e-5, reversed or flipped 0.0018 to 0.65 as declared, 440 to 65,000
times the negated. ``reversed_ratio`` 3 is 4 times under the least reversed ratio and 36 times over the largest
honest one; ``reversed_min_residual`` lies 1.5 times over the honest gyro's largest residual and 1.2 times under
the least reversed one (the ratio decides; the minimum keeps two noise-level fits from being compared). A track
stored conjugated beside an honest gyro, turning about the vertical (the world's), fits the negated gyro nearly
as well (0.0007 to 0.005) but its conjugate reading better (1.1 to 11 times): ``quaternion_convention``'s case;
a reversed episode's negated gyro beats every other reading by 1.1 to 664 times, and the reason names a reading
within ``convention_ratio`` of it.
"""

from __future__ import annotations

import numpy as np

#: Candidate readings of stored (a, b, c, d) quaternion numbers, as (x, y, z, w) for scipy.
READINGS = {
    "declared (x, y, z, w), camera-to-world": lambda q: q,
    "conjugate (world-to-camera)": lambda q: q * np.array([-1.0, -1.0, -1.0, 1.0]),
    "(w, x, y, z) order": lambda q: q[:, [1, 2, 3, 0]],
}
DECLARED = next(iter(READINGS))
#: ``imu_disagrees``: the declared reading leaves this many times ``convention_min_residual`` of the gyro
#: unexplained and no other reading does ``convention_ratio`` times better (the right reading leaves under
#: 0.005; the sample writer's noise-only gyro carries no rotation to compare and is left out).
IMU_DISAGREES_FACTOR = 5.0


def procrustes_residual(b: np.ndarray, g: np.ndarray) -> float:
    """Unexplained share of ``g`` (N, 3) by the best proper rotation of ``b`` (N, 3):
    ``min_M sum |g - M b|^2 / sum |g|^2`` (Kabsch's solution, ``scipy``'s ``Rotation.align_vectors``)."""
    from scipy.spatial.transform import Rotation

    _, rssd = Rotation.align_vectors(g, b)
    return float(rssd**2 / max(np.sum(g**2), 1e-12))


def _window_integrals(t_s: np.ndarray, values: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(N, 3) trapezoid integrals of ``values`` (I, 3) at ``t_s`` (I,) over each ``[a, b]``."""
    cum = np.vstack([np.zeros((1, 3)), np.cumsum((values[1:] + values[:-1]) / 2 * np.diff(t_s)[:, None], axis=0)])
    at = lambda x: np.stack([np.interp(x, t_s, cum[:, k]) for k in range(3)], axis=1)  # noqa: E731
    return at(b) - at(a)


def orientation_residuals(pose_ts_ns: np.ndarray, quat_xyzw: np.ndarray, imu_ts_ns: np.ndarray,
                          gyro_rps: np.ndarray | None, accel_mps2: np.ndarray | None,
                          window_s: float = 0.25, min_rotation_rad: float = 0.02) -> dict[str, dict[str, float]]:
    """Residual of each reading (:data:`READINGS`) against the gyro and the gravity direction.

    Args:
        pose_ts_ns: (M,) int64 capture times, increasing; quat_xyzw: (M, 4) the stored numbers.
        imu_ts_ns: (I,) int64; gyro_rps: (I, 3) rad/s; accel_mps2: (I, 3) m/s^2 (either may be None).
        window_s: window length, s; min_rotation_rad: the RMS window rotation below which the gyro
            says nothing (a still device).

    Returns:
        ``{"gyro": {reading: residual}, "gravity": {...}}``, a signal left out when absent, unmeasurable
        or outside the pose track.
    """
    from scipy.spatial.transform import Rotation

    pose_s = (np.asarray(pose_ts_ns, np.int64) - int(pose_ts_ns[0])) / 1e9
    imu_s = (np.asarray(imu_ts_ns, np.int64) - int(pose_ts_ns[0])) / 1e9
    out: dict[str, dict[str, float]] = {}
    if len(pose_s) < 4 or len(imu_s) < 4:
        return out
    step = max(1, int(round(window_s / float(np.median(np.diff(pose_s))))))
    edges = np.arange(0, len(pose_s), step)
    ia, ib = edges[:-1], edges[1:]
    inside = (pose_s[ia] >= imu_s[0]) & (pose_s[ib] <= imu_s[-1])
    ia, ib = ia[inside], ib[inside]
    if len(ia) < 6:
        return out
    quat = np.asarray(quat_xyzw, np.float64)
    if gyro_rps is not None:
        g = _window_integrals(imu_s, np.asarray(gyro_rps, np.float64), pose_s[ia], pose_s[ib])
        if np.sqrt(np.mean(np.sum(g**2, axis=1))) >= min_rotation_rad:
            res = {}
            for name, read in READINGS.items():
                r = Rotation.from_quat(read(quat))
                res[name] = procrustes_residual((r[ia].inv() * r[ib]).as_rotvec(), g)
            out["gyro"] = res
    if accel_mps2 is not None:
        f = _window_integrals(imu_s, np.asarray(accel_mps2, np.float64), pose_s[ia], pose_s[ib])
        f /= np.maximum(np.linalg.norm(f, axis=1, keepdims=True), 1e-9)
        mid = (ia + ib) // 2
        res = {}
        for name, read in READINGS.items():
            up = Rotation.from_quat(read(quat))[mid].inv().apply([0.0, 0.0, 1.0])
            res[name] = procrustes_residual(up, f)
        out["gravity"] = res
    return out


def check_orientation(pose_ts_ns, quat_xyzw, imu_ts_ns, gyro_rps, accel_mps2, t0_ns: int, opts) -> list:
    """``imu_reversed``, ``quaternion_convention`` or ``imu_disagrees`` findings (:mod:`dpflow_core.recordings.plausibility`)
    of one episode (at most one).

    Args as :func:`orientation_residuals`; ``t0_ns`` the episode start; ``opts`` a
    :class:`~dpflow_core.recordings.plausibility.PlausibilityOptions` (``convention_window_s``,
    ``convention_min_residual``, ``convention_ratio``, the class's policy). No IMU: no finding.
    """
    from dpflow_core.recordings.plausibility import new_finding

    if imu_ts_ns is None or (gyro_rps is None and accel_mps2 is None):
        return []
    # NaN/inf IMU samples (named by check_imu as imu_not_finite) are left out; none left: no IMU
    finite = np.ones(len(imu_ts_ns), bool)
    for a in (gyro_rps, accel_mps2):
        finite &= np.isfinite(np.asarray(a, np.float64)).all(axis=1) if a is not None else True
    if finite.sum() < 3:
        return []
    imu_ts_ns, gyro_rps, accel_mps2 = (None if a is None else np.asarray(a)[finite] for a in (imu_ts_ns, gyro_rps, accel_mps2))
    res = orientation_residuals(pose_ts_ns, quat_xyzw, imu_ts_ns, gyro_rps, accel_mps2, opts.convention_window_s)
    if not res:
        return []
    # Summed over the signals: the gyro alone cannot tell readings that differ by a fixed rotation of
    # the world (the conjugate of a (w, x, y, z) reading is one), gravity can.
    total = {n: sum(f[n] for f in res.values()) for n in READINGS}
    declared = total[DECLARED]
    best = min((n for n in total if n != DECLARED), key=total.get)
    if "gyro" in res:
        reversed_ = _reversed(pose_ts_ns, quat_xyzw, imu_ts_ns, gyro_rps, res, total, best, t0_ns, opts)
        if reversed_:
            return reversed_
    if declared > opts.convention_min_residual and declared > opts.convention_ratio * total[best]:
        a, b = (int(pose_ts_ns[0]) - t0_ns) / 1e9, (int(pose_ts_ns[-1]) - t0_ns) / 1e9
        signals = " and ".join(res)
        return [new_finding(opts, "quaternion_convention", f"pose vs IMU {signals}", a, b, declared,
                            opts.convention_min_residual, "share unexplained", fits=best,
                            why=f"the {best} reading leaves {total[best]:.3g}" + (
                                "; an IMU with a flipped gyro sign or mirrored axes (two swapped) looks the same to "
                                "this check: verify the IMU's axes before re-reading the poses" if best.startswith("conjugate") else ""),
                            residuals={s: {n: round(v, 5) for n, v in f.items()} for s, f in res.items()})]
    gyro_left = res.get("gyro", {}).get(DECLARED, 0.0)  # the gyro: gravity alone also moves with the hand's accelerations
    if gyro_left > IMU_DISAGREES_FACTOR * opts.convention_min_residual:  # unexplained, and no reading explains it
        a, b = (int(pose_ts_ns[0]) - t0_ns) / 1e9, (int(pose_ts_ns[-1]) - t0_ns) / 1e9
        return [new_finding(opts, "imu_disagrees", "pose vs IMU gyro", a, b, gyro_left,
                            IMU_DISAGREES_FACTOR * opts.convention_min_residual, "share unexplained", fits=None,
                            why=f"no reading of the poses explains the IMU (the {best} one leaves {total[best]:.3g}): the "
                                "IMU's axes, signs or units may be wrong, or the poses",
                            residuals={s: {n: round(v, 5) for n, v in f.items()} for s, f in res.items()})]
    return []


def _reversed(pose_ts_ns, quat_xyzw, imu_ts_ns, gyro_rps, res: dict, total: dict, best: str, t0_ns: int, opts) -> list:
    """``[imu_reversed]`` when the negated gyro explains the declared reading (module docstring), else []."""
    from dpflow_core.recordings.plausibility import new_finding

    neg = orientation_residuals(pose_ts_ns, quat_xyzw, imu_ts_ns, -np.asarray(gyro_rps, np.float64), None,
                                opts.convention_window_s).get("gyro", {}).get(DECLARED)
    gyro = res["gyro"][DECLARED]
    if neg is None or gyro <= opts.reversed_min_residual or gyro <= opts.reversed_ratio * neg:
        return []
    flipped = neg + res.get("gravity", {}).get(DECLARED, 0.0)
    if flipped >= total[best]:
        return []
    alike = (f"; a track stored {best} looks alike while the device turns about one axis (it leaves {total[best]:.3g})"
             if total[best] < opts.convention_ratio * flipped else "")
    a, b = (int(pose_ts_ns[0]) - t0_ns) / 1e9, (int(pose_ts_ns[-1]) - t0_ns) / 1e9
    return [new_finding(opts, "imu_reversed", "pose vs IMU gyro", a, b, gyro, opts.reversed_min_residual,
                        "share unexplained", negated_gyro_residual=round(neg, 6),
                        why=f"the gyro turns against the pose track: the episode may be time-reversed, or the gyro's sign "
                            f"flipped (the negated gyro leaves {neg:.3g} unexplained, {gyro / max(neg, 1e-12):.0f} times "
                            f"less){alike}",
                        residuals={s: {n: round(v, 5) for n, v in f.items()} for s, f in res.items()})]


# --------------------------------------------------------------------------- positions against the accelerometer

#: Readings of the stored positions: as declared, or one world axis mirrored (a left-handed export).
POSITION_READINGS = {"declared": (1.0, 1.0, 1.0), "x mirrored": (-1.0, 1.0, 1.0), "y mirrored": (1.0, -1.0, 1.0),
                     "z mirrored": (1.0, 1.0, -1.0)}
GRAVITY_MPS2 = 9.81


def translation_residuals(pose_ts_ns: np.ndarray, position_m: np.ndarray, quat_xyzw: np.ndarray, imu_ts_ns: np.ndarray,
                          accel_mps2: np.ndarray, window_s: float = 0.25) -> dict[str, float]:
    """Residual of each position reading (:data:`POSITION_READINGS`) against the accelerometer.

    Over each window of about ``window_s`` the pose track's mean acceleration (its velocity, by central
    differences, at the window's ends), less gravity and turned into the camera frame by the window's middle
    rotation, is the specific force the device felt; the accelerometer's mean over the same window must equal
    it up to one fixed IMU-to-camera rotation (fitted as in :func:`procrustes_residual`). A track whose
    positions are mirrored in one world axis, while its rotations are right, gets that axis' accelerations
    backwards: gravity still fits, the hand's own accelerations do not.

    Args: as :func:`orientation_residuals` (``accel_mps2`` (I, 3) m/s^2, ``position_m`` (M, 3) m).

    Returns:
        ``{reading: residual}``, empty when fewer than 6 windows lie inside the IMU's span.
    """
    from scipy.spatial.transform import Rotation

    t = (np.asarray(pose_ts_ns, np.int64) - int(pose_ts_ns[0])) / 1e9
    ti = (np.asarray(imu_ts_ns, np.int64) - int(pose_ts_ns[0])) / 1e9
    if len(t) < 8 or len(ti) < 4:
        return {}
    step = max(1, int(round(window_s / float(np.median(np.diff(t))))))
    edges = np.arange(1, len(t) - 1, step)  # central differences need a sample either side
    ia, ib = edges[:-1], edges[1:]
    inside = (t[ia] >= ti[0]) & (t[ib] <= ti[-1])
    ia, ib = ia[inside], ib[inside]
    if len(ia) < 6:
        return {}
    felt = _window_integrals(ti, np.asarray(accel_mps2, np.float64), t[ia], t[ib]) / (t[ib] - t[ia])[:, None]
    turn = Rotation.from_quat(np.asarray(quat_xyzw, np.float64))[(ia + ib) // 2].inv()
    out = {}
    for name, signs in POSITION_READINGS.items():
        v = np.gradient(np.asarray(position_m, np.float64) * np.array(signs), t, axis=0)
        accel = (v[ib] - v[ia]) / (t[ib] - t[ia])[:, None]
        out[name] = procrustes_residual(turn.apply(accel + [0.0, 0.0, GRAVITY_MPS2]), felt)
    return out


def check_translation(pose_ts_ns, position_m, quat_xyzw, imu_ts_ns, accel_mps2, t0_ns: int, opts) -> list:
    """``pose_mirrored`` findings of one episode: the declared positions leave more than ``mirror_min_residual``
    of the accelerometer unexplained and a mirrored reading ``mirror_ratio`` times less. No accelerometer, or
    one no reading explains (noise, another device's IMU): no finding."""
    from dpflow_core.recordings.plausibility import new_finding

    if imu_ts_ns is None or accel_mps2 is None:
        return []
    finite = np.isfinite(np.asarray(accel_mps2, np.float64)).all(axis=1)
    if finite.sum() < 4:
        return []
    res = translation_residuals(pose_ts_ns, position_m, quat_xyzw, np.asarray(imu_ts_ns)[finite],
                                np.asarray(accel_mps2)[finite], opts.convention_window_s)
    if not res:
        return []
    declared = res["declared"]
    best = min((n for n in res if n != "declared"), key=res.get)
    if declared > opts.mirror_min_residual and declared > opts.mirror_ratio * res[best]:
        a, b = (int(pose_ts_ns[0]) - t0_ns) / 1e9, (int(pose_ts_ns[-1]) - t0_ns) / 1e9
        return [new_finding(opts, "pose_mirrored", "pose vs IMU accelerometer", a, b, declared,
                            opts.mirror_min_residual, "share unexplained", fits=best,
                            why=f"the positions read {best} leave {res[best]:.3g}: the track's world frame looks "
                                "left-handed (one axis of the positions flipped while the rotations are right)",
                            residuals={n: round(v, 6) for n, v in res.items()})]
    return []

"""Plausibility of what parses: a pose track, a gripper and a stream's clock checked against physics.

A recording can be well-formed and still wrong: a VIO relocalisation jump, a single pose 0.5 m
off its neighbours, a VIO that froze while the camera kept moving, a gripper encoder stuck or out
of its range, a clock that stepped. Each check here is a rule of what a handheld gripper and its
sensors can do, with a threshold in physical units (:class:`PlausibilityOptions`, documented in
docs/formats.md section "Plausibility"), and each finding is a :class:`Finding` naming the stream,
the time (s from the episode start), the figure measured and the limit, and what its class's policy
did with it:

========================  ==============================================  =================  ==============
class (``code``)          rule                                            default policy     policies
========================  ==============================================  =================  ==============
``pose_units``            the track's median speed or extent beyond a     reject             reject, warn
                          hand's (millimetres written as metres)
``pose_far_origin``       coordinates so far from the origin that float32 reject             reject, warn
                          (the dataset's) resolves them coarser than
                          0.1 mm (beyond about 1 km: a UTM-like frame)
``pose_rate_low``         the pose sampled under half as often as the     reject             reject, warn
                          camera (each frame's pose interpolated across
                          more than two frame intervals)
``pose_spike``            one sample off the line through its neighbours  repair             repair, split, reject, warn
``pose_glitch``           two or more consecutive samples each off the    split              split, reject, warn
                          line through its neighbours (an alternating or
                          repeated glitch: no neighbour to repair from)
``pose_jump``             speed between two samples above the limit       split              split, reject, warn
``rotation_jump``         angular speed between two samples above limit   split              split, reject, warn
``pose_acceleration``     acceleration above the limit (not at a jump)    warn               warn, reject
``vio_frozen``            pose bit-constant while the camera image moves  split              split, reject, warn
``vio_drift``             the pose moves while the camera image is still  warn               warn, split, reject
``episode_still``         camera and pose still over the whole episode    warn               warn, reject
``gripper_dead``          zero variance over the episode while it moves   reject             reject, warn
``gripper_stuck``         bit-constant for a stretch while the pose moves warn               warn, reject
``gripper_out_of_range``  a width outside the device's range              reject             reject, warn
``clock_step``            a stream's clock jumps forward against arrival  reject             reject, warn
``clock_reversal``        a stream's clock runs backwards                 reject             reject, warn
``clock_skew``            a stream's clock runs faster or slower than the reject             reject, warn
                          pose clock (its offset, measured in windows,
                          drifts: :func:`dpflow_core.offsets.clock_skew`)
``quaternion_convention`` the pose's rotations disagree with the IMU's    reject             reject, warn
                          gyro or gravity, another reading agrees
                          (:mod:`dpflow_core.recordings.orientation`)
``pose_mirrored``         the positions' accelerations disagree with the  reject             reject, warn
                          accelerometer, one axis mirrored agrees
                          (:func:`~dpflow_core.recordings.orientation.check_translation`)
``imu_reversed``          the gyro fits the pose only negated (reversed)  reject             reject, warn
``camera_pose_mismatch``  the camera fits the pose at no offset (another  reject             reject, warn
                          recording's: :mod:`.camera_pose`)
``gripper_offset``        the gripper's stamps off the camera's clock     reject             reject, warn
``imu_dead``              gyro or accelerometer constant over the         warn               warn, reject
                          episode while the pose moves or turns
``imu_out_of_range``      a sample beyond the sensor's range, or a        warn               warn, reject
                          gravity that is not 1 g (units)
``imu_not_finite``        IMU samples holding NaN or inf (left out)       warn               warn, reject
``imu_disagrees``         pose and IMU disagree, no reading explains it   warn               warn, reject
========================  ==============================================  =================  ==============

``repair`` replaces a spike by the interpolation of its neighbours and records the original value
(provenance); ``split`` drops the samples' time span and cuts the episode there (each piece must
still reach the minimum episode length); ``reject`` rejects the episode with the finding as reason;
``warn`` keeps the data and lists the finding. The clock rules need the arrival (log) time and
run where messages are read in file order (:mod:`dpflow_core.recordings.inspection`); the others
run on capture-ordered samples at conversion (:func:`dpflow_core.conversion.align_episode`) and in
the quality report (:mod:`dpflow_core.report`).

Over 500 lines because the rules share their options, finding and policies: one table of physics.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

#: Policies each class accepts; the first is its default.
POLICIES: dict[str, tuple[str, ...]] = {
    "pose_units": ("reject", "warn"),
    "pose_far_origin": ("reject", "warn"),
    "pose_rate_low": ("reject", "warn"),
    "pose_spike": ("repair", "split", "reject", "warn"),
    "pose_glitch": ("split", "reject", "warn"),
    "pose_jump": ("split", "reject", "warn"),
    "rotation_jump": ("split", "reject", "warn"),
    "pose_acceleration": ("warn", "reject"),
    "vio_frozen": ("split", "reject", "warn"),
    "vio_drift": ("warn", "split", "reject"),
    "episode_still": ("warn", "reject"),
    "gripper_dead": ("reject", "warn"),
    "gripper_stuck": ("warn", "reject"),
    "gripper_out_of_range": ("reject", "warn"),
    "clock_step": ("reject", "warn"),
    "clock_reversal": ("reject", "warn"),
    "clock_skew": ("reject", "warn"),
    "quaternion_convention": ("reject", "warn"),
    "pose_mirrored": ("reject", "warn"),
    "imu_reversed": ("reject", "warn"),
    "camera_pose_mismatch": ("reject", "warn"),
    "gripper_offset": ("reject", "warn"),
    "imu_dead": ("warn", "reject"),
    "imu_not_finite": ("warn", "reject"),
    "imu_disagrees": ("warn", "reject"),
    "imu_out_of_range": ("warn", "reject"),
}


@dataclass(frozen=True)
class PlausibilityOptions:
    """Thresholds of the plausibility rules (physical units) and the policy of each class.

    Attributes:
        max_speed_mps: fastest a handheld gripper's camera moves between two pose samples, m/s.
        max_angular_speed_rps: fastest it turns between two pose samples, rad/s.
        max_extent_m: largest extent (bounding-box diagonal, m) of one episode's pose track; beyond it, or
            with a median speed above ``max_speed_mps``, the positions are in other units (``pose_units``).
        max_position_resolution_m: the coarsest float32 resolution (m, the spacing of float32 numbers at the
            track's largest coordinate) the dataset may store a position at: 1e-4 holds up to 1024 m from the
            origin; beyond it the track is ``pose_far_origin`` (a UTM-like origin 500 km away: 3 cm steps).
        max_accel_mps2: largest acceleration of the camera, m/s^2 (a hand: well under 30).
        min_pose_rate_fraction: the pose track's median rate must be at least this fraction of the camera's
            (``pose_rate_low``): at 0.5 a frame's pose is interpolated across at most two frame intervals. A
            hand accelerating at 3 m/s^2 leaves a linear interpolation a * dt^2 / 8 off: 15 mm between 5 Hz
            samples, 1.7 mm at 15 Hz.
        spike_min_m: a sample this far (m) from the interpolation of its neighbours, while the
            neighbours are within a third of that of each other, is a single-sample outlier.
        spike_min_rad: the same for the orientation, radians.
        frozen_min_s: a pose bit-constant (below ``frozen_eps``) for at least this long, s ...
        frozen_motion: ... while the camera image changes by at least this much per frame
            (mean absolute change of the 8x8-block grey thumbnail, grey levels 0-255; median over the stretch), is
            a frozen VIO. Measured: 1.2 s freezes of 16 simulated-world episodes 0.29 to 0.77, of a random-motion
            sample 0.55; the world's own bit-constant pauses (a still hand, 0.43 s, 17 episodes) 0.016 to 0.080.
        gripper_range_m: (low, high) widths the device can report, metres.
        gripper_stuck_s: a width bit-constant for at least this long (s) while the pose moves
            ``moving_m`` is stuck; constant over the whole episode is ``gripper_dead``.
        moving_m: path length (m) of the pose over a stretch that counts as "the gripper moves"; also the
            displacement (m, largest distance from the stretch's first pose) that a still camera's pose
            may not reach (``vio_drift``) and that an entirely still episode stays under (``episode_still``).
        moving_rad: the same for the orientation, radians (largest angle from the first pose).
        still_motion: a camera whose image changes by less than this per frame (median over 5 frames; the
            measure of ``frozen_motion``) is still: moving sample and simulated tracks give medians of 0.6 to
            0.8 and 5th percentiles of 0.07 to 0.18, a still one 0.01.
        still_min_s: a camera still for at least this long (s) may not see its pose move (``vio_drift``).
        clock_step_s: a change of a stream's capture-minus-arrival offset by more than this (s),
            persisting over the next samples, is a clock step (forward) or reversal (backward).
        max_clock_skew: largest drift of a stream's offset against the pose clock, seconds per second
            (``clock_skew``; 0.005: 5 ms a second, 0.1 s over a 20 s episode).
        convention_window_s: window (s) over which the pose's rotation and the gyro's integral (and
            the mean specific force and the up axis) are compared (:mod:`dpflow_core.recordings.orientation`).
        mirror_min_residual, mirror_ratio: the declared positions are mirrored (``pose_mirrored``) when their
            accelerations leave more than ``mirror_min_residual`` of the accelerometer's window means unexplained
            and a reading with one axis flipped ``mirror_ratio`` times less. Measured on world recordings: the
            right reading 1e-5 to 3e-5, a mirrored one 1.2e-4 to 5e-3; an inconsistent IMU 0.05-0.17 for every reading.
        convention_min_residual, convention_ratio: the declared quaternion reading disagrees with the
            IMU when it leaves more than ``convention_min_residual`` of the IMU signal unexplained and
            ``convention_ratio`` times more than another reading does.
        reversed_min_residual, reversed_ratio: ``imu_reversed``'s thresholds (measured in :mod:`.orientation`).
        camera_fit_min_share, camera_fit_min_ceiling, camera_fit_min_rotation_rps: ``camera_pose_mismatch``'s
            (shares of the fast ``R^2`` an honest camera reaches, rad/s; measured in :mod:`.camera_pose`).
        gripper_offset_warn_s, gripper_offset_max_s: ``gripper_offset``'s warning and policy limits, s (:mod:`.gripper_timing`).
        imu_gyro_range_rps: the IMU gyro's full scale, rad/s (2000 deg/s, the usual MEMS setting).
        imu_accel_range_mps2: the accelerometer's full scale, m/s^2 (16 g).
        imu_gravity_mps2: (low, high) median specific-force magnitude of a handheld device, m/s^2:
            1 g give or take the hand's own acceleration; a median near 1 is a sensor writing g, not m/s^2.
        policies: class -> policy (see :data:`POLICIES`); missing classes take their default.
    """

    max_speed_mps: float = 3.0
    max_angular_speed_rps: float = 20.0
    max_accel_mps2: float = 60.0
    max_extent_m: float = 20.0
    max_position_resolution_m: float = 1e-4
    min_pose_rate_fraction: float = 0.5
    spike_min_m: float = 0.03
    spike_min_rad: float = 0.3
    frozen_min_s: float = 0.3
    frozen_motion: float = 0.15
    frozen_eps: float = 1e-7
    gripper_range_m: tuple[float, float] = (-0.005, 0.12)
    gripper_stuck_s: float = 1.0
    moving_m: float = 0.05
    moving_rad: float = 0.3
    still_motion: float = 0.1
    still_min_s: float = 1.0
    clock_step_s: float = 0.1
    max_clock_skew: float = 0.005
    convention_window_s: float = 0.25
    convention_min_residual: float = 0.02
    convention_ratio: float = 10.0
    mirror_min_residual: float = 1e-4
    mirror_ratio: float = 5.0
    reversed_min_residual: float = 5e-4
    reversed_ratio: float = 3.0
    camera_fit_min_share: float = 0.8
    camera_fit_min_ceiling: float = 0.3
    camera_fit_min_rotation_rps: float = 0.06
    gripper_offset_warn_s: float = 0.1
    gripper_offset_max_s: float = 0.25
    imu_gyro_range_rps: float = 34.9
    imu_accel_range_mps2: float = 156.9
    imu_gravity_mps2: tuple[float, float] = (7.0, 13.0)
    policies: dict[str, str] = field(default_factory=dict)

    def policy(self, code: str) -> str:
        """The policy of class ``code`` (its default when not set)."""
        return self.policies.get(code, POLICIES[code][0])

    def validate(self) -> "PlausibilityOptions":
        """Raise ValueError naming an unknown class or a policy the class does not accept."""
        for code, policy in self.policies.items():
            if code not in POLICIES:
                raise ValueError(f"unknown plausibility class {code!r} (known: {', '.join(POLICIES)})")
            if policy not in POLICIES[code]:
                raise ValueError(f"plausibility class {code!r} takes policy {' | '.join(POLICIES[code])}, got {policy!r}")
        lo, hi = self.gripper_range_m
        if not lo < hi:
            raise ValueError(f"gripper_range_m must be (low, high) with low < high, got {self.gripper_range_m!r}")
        return self

    def to_dict(self) -> dict:
        """JSON form with every policy filled in (what the metadata records)."""
        d = asdict(self)
        d["gripper_range_m"] = list(self.gripper_range_m)
        d["policies"] = {code: self.policy(code) for code in POLICIES}
        return d

    @classmethod
    def from_dict(cls, d: dict | None) -> "PlausibilityOptions":
        """The inverse of :meth:`to_dict` (None: the defaults)."""
        if not d:
            return cls()
        d = dict(d)
        if "gripper_range_m" in d:
            d["gripper_range_m"] = tuple(d["gripper_range_m"])
        return cls(**d).validate()


@dataclass(frozen=True)
class Finding:
    """One implausible stretch of one stream.

    Attributes:
        code: the class (a key of :data:`POLICIES`).
        stream: ``pose``, ``gripper``, ``camera`` or a topic name.
        at_s: start, seconds from the episode start (the earliest capture time of its streams).
        end_s: end of the stretch, seconds (equal to ``at_s`` for one sample).
        value: the figure measured (m/s, rad/s, m/s^2, m, s); limit: the threshold it broke.
        unit: unit of ``value`` and ``limit``.
        policy: what the class's policy is; action: what was done (``repaired``, ``split``,
            ``rejected``, ``warned``).
        detail: extra figures (e.g. the original and the repaired value of a spike).
    """

    code: str
    stream: str
    at_s: float
    end_s: float
    value: float
    limit: float
    unit: str
    policy: str
    action: str
    detail: dict = field(default_factory=dict)

    def describe(self) -> str:
        """One sentence with the stream, the time and the figure."""
        span = f"at {self.at_s:.3f} s" if self.end_s == self.at_s else f"from {self.at_s:.3f} to {self.end_s:.3f} s"
        why = f" ({self.detail['why']})" if "why" in self.detail else ""
        return (f"{self.code}: {self.stream} {span}: {self.value:.4g} {self.unit} (limit {self.limit:g} {self.unit})"
                f"{why}; {self.action}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["at_s"], d["end_s"] = round(self.at_s, 4), round(self.end_s, 4)
        d["value"] = float(self.value)
        d["reason"] = self.describe()
        return d


_ACTION = {"repair": "repaired", "split": "split", "reject": "rejected", "warn": "warned"}


def new_finding(opts: PlausibilityOptions, code: str, stream: str, a: float, b: float, value: float, limit: float,
                unit: str, **detail) -> Finding:
    """A :class:`Finding` of class ``code`` with the policy ``opts`` sets for it and its action."""
    policy = opts.policy(code)
    return Finding(code, stream, float(a), float(b), float(value), float(limit), unit, policy, _ACTION[policy], detail)


def _angles(q: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Angle (rad) between unit quaternions row by row; q and -q are the same rotation."""
    dots = np.abs(np.sum(q * r, axis=1))
    return 2 * np.arccos(np.clip(dots, 0.0, 1.0))


@dataclass
class PoseVerdict:
    """What :func:`check_pose` found and did.

    Attributes:
        findings: every finding, in time order per class.
        position_m: (M, 3) float64, positions with repaired spikes; quat_xyzw: (M, 4) likewise.
        drop_ns: [(a, b)] capture-time intervals (ns, open) whose frames must not be kept; the
            episode is cut at each.
    """

    findings: list[Finding]
    position_m: np.ndarray
    quat_xyzw: np.ndarray
    drop_ns: list[tuple[int, int]]


def check_pose(ts_ns: np.ndarray, position_m: np.ndarray, quat_xyzw: np.ndarray, t0_ns: int,
               opts: PlausibilityOptions = PlausibilityOptions(),
               motion_ts_ns: np.ndarray | None = None, motion: np.ndarray | None = None,
               valid: np.ndarray | None = None) -> PoseVerdict:
    """Check a capture-ordered pose track: spikes, jumps, acceleration, frozen VIO.

    Args:
        ts_ns: (M,) int64 capture times, strictly increasing. position_m: (M, 3) m. quat_xyzw: (M, 4) unit.
        t0_ns: the episode start (findings are timed from it).
        motion_ts_ns, motion: (K,) capture times and per-frame image change of the camera
            (:func:`frame_motion`); None when the frames were not decoded (frozen VIO is then
            judged by the pose alone and only warned).
        valid: (M,) bool, the samples VIO vouches for (``pose_valid``, and the score); the rules judge those
            only. An invalid stretch is ``pose_invalid`` (its own policy, ``invalid_pose_policy``), never a
            jump to the garbage (often zeros) VIO writes while it has lost tracking. None: all valid.

    Returns:
        The verdict (findings, repaired arrays of all M samples, intervals to drop).
    """
    if valid is not None and not np.all(valid):
        idx = np.flatnonzero(np.asarray(valid, dtype=bool))
        pos, quat = np.array(position_m, dtype=np.float64), np.array(quat_xyzw, dtype=np.float64)
        sub = check_pose(np.asarray(ts_ns, dtype=np.int64)[idx], pos[idx], quat[idx], t0_ns, opts, motion_ts_ns, motion)
        pos[idx], quat[idx] = sub.position_m, sub.quat_xyzw
        return PoseVerdict(sub.findings, pos, quat, sub.drop_ns)
    ts = np.asarray(ts_ns, dtype=np.int64)
    pos, quat = np.array(position_m, dtype=np.float64), np.array(quat_xyzw, dtype=np.float64)
    rel = lambda ns: (int(ns) - t0_ns) / 1e9  # noqa: E731
    findings: list[Finding] = []
    drop: list[tuple[int, int]] = []
    m = len(ts)
    if m < 3:
        return PoseVerdict(findings, pos, quat, drop)
    units = _units(ts, pos, rel, opts)
    if units is not None:  # every step would be a jump: one finding for the track, not one per sample
        return PoseVerdict([units], pos, quat, drop)
    far = _far_origin(ts, pos, rel, opts)
    if far is not None:  # the rules below still hold (float64 here); the dataset's float32 would not
        findings.append(far)
    slow = _rate_low(ts, motion_ts_ns, rel, opts)
    if slow is not None:
        findings.append(slow)

    # Single-sample outliers: far from the line through both neighbours, which agree with each other.
    dt = np.diff(ts).astype(np.float64)
    w = (dt[:-1] / (dt[:-1] + dt[1:]))[:, None]
    line = pos[:-2] + w * (pos[2:] - pos[:-2])
    dev = np.linalg.norm(pos[1:-1] - line, axis=1)
    across = np.linalg.norm(pos[2:] - pos[:-2], axis=1)
    rot_dev = np.minimum(_angles(quat[1:-1], quat[:-2]), _angles(quat[1:-1], quat[2:]))
    rot_across = _angles(quat[:-2], quat[2:])
    spike = ((dev > opts.spike_min_m) & (across < dev / 3)) | ((rot_dev > opts.spike_min_rad) & (rot_across < rot_dev / 3))
    # A spike beside another is no single outlier: each was judged against a neighbour that is itself off
    # (x, x + d, x, x + d ... flags every sample), so repairing them would move the good samples onto the
    # glitch. Such a run is a glitch of its own, dropped whole (or rejected) instead.
    beside = np.zeros_like(spike)
    beside[1:] |= spike[:-1]
    beside[:-1] |= spike[1:]
    for a, b in _runs(spike & beside):
        first, last = a + 1, b  # pose indices of the run (spike[k] judges sample k + 1)
        f = new_finding(opts, "pose_glitch", "pose", rel(ts[first]), rel(ts[last]), float(dev[a:b].max()),
                        opts.spike_min_m, "m", samples=int(b - a), rotation_rad=round(float(rot_dev[a:b].max()), 5))
        if f.policy == "split":  # the neighbours too: beside a glitch they may be off by less than spike_min_m
            drop.append((int(ts[max(first - 2, 0)]), int(ts[min(last + 2, m - 1)])))
        findings.append(f)
    spike &= ~beside
    for i in np.flatnonzero(spike) + 1:
        f = new_finding(opts, "pose_spike", "pose", rel(ts[i]), rel(ts[i]), max(dev[i - 1], 0.0), opts.spike_min_m, "m",
                     rotation_rad=round(float(rot_dev[i - 1]), 5), original_position_m=pos[i].round(6).tolist())
        if f.policy == "repair":
            pos[i] = line[i - 1]
            a, b = quat[i - 1], quat[i + 1]
            q = (1 - w[i - 1, 0]) * a + w[i - 1, 0] * (b if np.dot(a, b) >= 0 else -b)
            quat[i] = q / np.linalg.norm(q)
            f.detail["repaired_position_m"] = pos[i].round(6).tolist()
        elif f.policy == "split":
            drop.append((int(ts[i - 1]), int(ts[i + 1])))
        findings.append(f)

    # Jumps: speed (or angular speed) between consecutive samples above what a hand does.
    step = np.linalg.norm(np.diff(pos, axis=0), axis=1)
    speed = step / (dt / 1e9)
    turn = _angles(quat[:-1], quat[1:]) / (dt / 1e9)
    jumps = set()
    for code, fast, limit, unit in (("pose_jump", speed, opts.max_speed_mps, "m/s"),
                                    ("rotation_jump", turn, opts.max_angular_speed_rps, "rad/s")):
        for i in np.flatnonzero(fast > limit):
            f = new_finding(opts, code, "pose", rel(ts[i]), rel(ts[i + 1]), fast[i], limit, unit,
                         step_m=round(float(step[i]), 5))
            if f.policy == "split":
                drop.append((int(ts[i]), int(ts[i + 1])))
            jumps.update((int(i) - 1, int(i), int(i) + 1))
            findings.append(f)

    # Acceleration away from the jumps (a jump is one finding, not three).
    v = np.diff(pos, axis=0) / (dt[:, None] / 1e9)
    acc = np.linalg.norm(np.diff(v, axis=0), axis=1) / ((dt[:-1] + dt[1:]) / 2e9)
    over = [i for i in np.flatnonzero(acc > opts.max_accel_mps2) if i not in jumps and i + 1 not in jumps]
    if over:
        k = max(over, key=lambda i: acc[i])
        findings.append(new_finding(opts, "pose_acceleration", "pose", rel(ts[over[0] + 1]), rel(ts[over[-1] + 1]),
                                 acc[k], opts.max_accel_mps2, "m/s^2", samples=len(over),
                                 at_max_s=round(rel(ts[k + 1]), 4)))

    # Frozen VIO: bit-constant pose for frozen_min_s while the camera image moves.
    still = (np.max(np.abs(np.diff(pos, axis=0)), axis=1) <= opts.frozen_eps) & \
            (np.max(np.abs(np.diff(quat, axis=0)), axis=1) <= opts.frozen_eps)
    for a, b in _runs(still):
        # samples a..b are equal (b = index after the last equal step)
        dur = (ts[b] - ts[a]) / 1e9
        if dur < opts.frozen_min_s:
            continue
        moving = None
        if motion is not None and motion_ts_ns is not None and len(motion):
            inside = (motion_ts_ns > ts[a]) & (motion_ts_ns <= ts[b])
            moving = float(np.median(motion[inside])) if inside.any() else None
        if moving is not None and moving < opts.frozen_motion:
            continue  # the camera is still too: a still hand, not a frozen VIO
        f = new_finding(opts, "vio_frozen", "pose", rel(ts[a]), rel(ts[b]), dur, opts.frozen_min_s, "s",
                     camera_motion=None if moving is None else round(moving, 3))
        if moving is None and f.policy != "warn":
            f = Finding(**{**asdict(f), "policy": "warn", "action": "warned",
                           "detail": {**f.detail, "note": "camera motion not measured: warned only"}})
        if f.policy == "split":
            end = int(ts[b + 1]) if b + 1 < m else int(ts[b]) + 1
            drop.append((int(ts[a]), end))
        findings.append(f)
    if motion is not None and motion_ts_ns is not None and len(motion) >= 5:
        still_findings, still_drop = _still_camera(ts, pos, quat, t0_ns, opts, np.asarray(motion_ts_ns, np.int64),
                                                   np.asarray(motion, np.float64))
        findings += still_findings
        drop += still_drop
    return PoseVerdict(findings, pos, quat, sorted(drop))


def _still_camera(ts: np.ndarray, pos: np.ndarray, quat: np.ndarray, t0_ns: int, opts: PlausibilityOptions,
                  motion_ts: np.ndarray, motion: np.ndarray) -> tuple[list[Finding], list[tuple[int, int]]]:
    """The mirror of a frozen VIO: stretches of at least ``still_min_s`` where the camera image is still
    (the median change of 5 frames below ``still_motion``) while the pose moves ``moving_m`` or turns
    ``moving_rad`` from where the stretch began (``vio_drift``), and a whole episode still in both
    (``episode_still``: nothing was demonstrated). Returns the findings and the spans to drop."""
    rel = lambda ns: (int(ns) - t0_ns) / 1e9  # noqa: E731
    smooth = np.median(sliding_window_view(np.pad(motion[1:], 2, mode="edge"), 5), axis=1)
    still = np.concatenate([[smooth[0] < opts.still_motion], smooth < opts.still_motion])
    findings: list[Finding] = []
    drop: list[tuple[int, int]] = []
    for a, b in _runs(still):
        lo, hi = int(motion_ts[a]), int(motion_ts[b - 1])
        if (hi - lo) / 1e9 < opts.still_min_s:
            continue
        sel = np.flatnonzero((ts >= lo) & (ts <= hi))
        if len(sel) < 2:
            continue
        away = np.linalg.norm(pos[sel] - pos[sel[0]], axis=1)
        turn = _angles(quat[sel], np.broadcast_to(quat[sel[0]], quat[sel].shape))
        k = int(np.argmax(away))
        camera = round(float(np.median(motion[a:b])), 3)
        if away[k] >= opts.moving_m or float(turn.max()) >= opts.moving_rad:
            past = np.flatnonzero((away >= opts.moving_m) | (turn >= opts.moving_rad))
            f = new_finding(opts, "vio_drift", "pose", rel(lo), rel(hi), away[k], opts.moving_m, "m",
                            turn_rad=round(float(turn.max()), 4), camera_motion=camera,
                            beyond_limit_at_s=round(rel(ts[sel[past[0]]]), 4),
                            why=f"the pose moves {away[k]:.3f} m and turns {np.degrees(turn.max()):.0f} deg while the "
                                f"camera image is still (change {camera:.3f} per frame, below {opts.still_motion:g})")
            if f.policy == "split":
                drop.append((lo - 1, hi + 1))
            findings.append(f)
        elif a == 0 and b == len(still):
            findings.append(new_finding(opts, "episode_still", "pose", rel(lo), rel(hi), away[k], opts.moving_m, "m",
                                        turn_rad=round(float(turn.max()), 4), camera_motion=camera,
                                        why=f"camera and pose still for the whole {(hi - lo) / 1e9:.1f} s (image change "
                                            f"{camera:.3f} per frame, pose within {away[k] * 1e3:.1f} mm and "
                                            f"{np.degrees(turn.max()):.1f} deg): nothing is demonstrated"))
    return findings, drop


def _units(ts: np.ndarray, pos: np.ndarray, rel, opts: PlausibilityOptions) -> Finding | None:
    """``pose_units`` when the track's median speed between samples is above ``max_speed_mps`` or its extent
    above ``max_extent_m`` (positions in millimetres or centimetres, each named when dividing by 1000 or 100
    makes both plausible); None otherwise."""
    speed = float(np.median(np.linalg.norm(np.diff(pos, axis=0), axis=1) / (np.diff(ts) / 1e9)))
    extent = float(np.linalg.norm(np.ptp(pos, axis=0)))
    if not (speed > opts.max_speed_mps or extent > opts.max_extent_m):
        return None
    fits = [(k, name) for k, name in ((1000, "millimetres"), (100, "centimetres"))
            if speed / k <= opts.max_speed_mps and extent / k <= opts.max_extent_m]
    hint = (f"; they look like {' or '.join(n for _, n in fits)}, not metres (x{' or x'.join(str(k) for k, _ in fits)})"
            if fits else "")
    return new_finding(opts, "pose_units", "pose", rel(ts[0]), rel(ts[-1]), speed, opts.max_speed_mps, "m/s",
                       extent_m=round(extent, 4), max_extent_m=opts.max_extent_m,
                       why=f"median speed over {len(ts) - 1} steps, extent {extent:.4g} m (limit {opts.max_extent_m:g} m)"
                           f"{hint}")


def _far_origin(ts: np.ndarray, pos: np.ndarray, rel, opts: PlausibilityOptions) -> Finding | None:
    """``pose_far_origin`` when the float32 spacing at the track's largest coordinate (what the dataset's
    ``robot0_eef_pos`` can resolve there) exceeds ``max_position_resolution_m``; None otherwise."""
    k = np.unravel_index(int(np.argmax(np.abs(pos))), pos.shape)
    far = float(abs(pos[k]))
    step = float(np.spacing(np.float32(far)))
    if step <= opts.max_position_resolution_m:
        return None
    axis = "xyz"[k[1]]
    return new_finding(opts, "pose_far_origin", "pose", rel(ts[0]), rel(ts[-1]), step, opts.max_position_resolution_m,
                       "m", max_abs_m=round(far, 3), axis=axis,
                       why=f"{axis} reaches {pos[k]:.6g} m: the dataset's float32 positions resolve only {step * 1e3:.3g} mm "
                           "there (a world frame far from the origin, e.g. UTM); re-origin the track near the "
                           "workspace (subtract its first pose) before converting")


def _rate_low(ts: np.ndarray, camera_ts_ns: np.ndarray | None, rel, opts: PlausibilityOptions) -> Finding | None:
    """``pose_rate_low`` when the pose's median rate is under ``min_pose_rate_fraction`` of the camera's."""
    if camera_ts_ns is None or len(camera_ts_ns) < 3:
        return None
    pose_hz = 1e9 / float(np.median(np.diff(ts)))
    camera_hz = 1e9 / float(np.median(np.diff(np.asarray(camera_ts_ns, np.int64))))
    if pose_hz >= opts.min_pose_rate_fraction * camera_hz:
        return None
    return new_finding(opts, "pose_rate_low", "pose", rel(ts[0]), rel(ts[-1]), pose_hz,
                       opts.min_pose_rate_fraction * camera_hz, "Hz", camera_hz=round(camera_hz, 3),
                       why=f"the camera runs at {camera_hz:.3g} Hz: each frame's pose would be interpolated across "
                           f"{camera_hz / pose_hz:.1f} frame intervals, smoothing the hand's motion out of the actions")


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(start, stop) of each run of True in ``mask`` (stop exclusive)."""
    padded = np.concatenate([[False], mask, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return [(int(a), int(b)) for a, b in zip(edges[0::2], edges[1::2])]


def _path_length(pos: np.ndarray) -> float:
    return float(np.sum(np.linalg.norm(np.diff(pos, axis=0), axis=1))) if len(pos) > 1 else 0.0


def check_gripper(ts_ns: np.ndarray, width_m: np.ndarray, pose_ts_ns: np.ndarray, position_m: np.ndarray, t0_ns: int,
                  opts: PlausibilityOptions = PlausibilityOptions()) -> list[Finding]:
    """Check a capture-ordered gripper width: range, zero variance, stuck stretches.

    Args:
        ts_ns: (G,) int64 capture times; width_m: (G,) metres.
        pose_ts_ns, position_m: the pose track (M,), (M, 3) m: is the gripper moving meanwhile.
        t0_ns: the episode start.
    """
    ts, width = np.asarray(ts_ns, dtype=np.int64), np.asarray(width_m, dtype=np.float64)
    rel = lambda ns: (int(ns) - t0_ns) / 1e9  # noqa: E731
    findings: list[Finding] = []
    if len(ts) < 2:
        return findings
    lo, hi = opts.gripper_range_m
    # NaN/inf widths are conversion's own ``not_finite`` error, the more precise reason
    out = np.flatnonzero(np.isfinite(width) & ((width < lo) | (width > hi)))
    if len(out):
        k = out[np.argmax(np.abs(width[out] - (lo + hi) / 2))]
        findings.append(new_finding(opts, "gripper_out_of_range", "gripper", rel(ts[out[0]]), rel(ts[out[-1]]),
                                 width[k], hi if width[k] > hi else lo, "m", samples=int(len(out)), range_m=[lo, hi]))

    def moved(a_ns: int, b_ns: int) -> float:
        return _path_length(np.asarray(position_m)[(pose_ts_ns >= a_ns) & (pose_ts_ns <= b_ns)])

    if np.ptp(width) <= opts.frozen_eps:
        path = moved(int(ts[0]), int(ts[-1]))
        if path >= opts.moving_m:
            findings.append(new_finding(opts, "gripper_dead", "gripper", rel(ts[0]), rel(ts[-1]), float(np.std(width)), 0.0,
                                     "m", constant_m=float(width[0]), pose_path_m=round(path, 4)))
        return findings
    for a, b in _runs(np.abs(np.diff(width)) <= opts.frozen_eps):
        dur = (ts[b] - ts[a]) / 1e9
        if dur >= opts.gripper_stuck_s:
            path = moved(int(ts[a]), int(ts[b]))
            if path >= opts.moving_m:
                findings.append(new_finding(opts, "gripper_stuck", "gripper", rel(ts[a]), rel(ts[b]), dur,
                                         opts.gripper_stuck_s, "s", constant_m=float(width[a]), pose_path_m=round(path, 4)))
    return findings


def check_imu(ts_ns: np.ndarray | None, gyro_rps: np.ndarray | None, accel_mps2: np.ndarray | None,
              pose_ts_ns: np.ndarray, position_m: np.ndarray, quat_xyzw: np.ndarray, t0_ns: int,
              opts: PlausibilityOptions = PlausibilityOptions()) -> list[Finding]:
    """Liveness and range of the optional IMU (it is not trained on, but the offsets and the quaternion
    check read it, and a lab keeps it for other policies): ``imu_dead``, a gyro or accelerometer whose
    every axis is constant (``frozen_eps``) over the episode while the pose moves ``moving_m`` or turns
    0.3 rad; ``imu_out_of_range``, samples beyond the sensor's full scale, or a median specific-force
    magnitude outside ``imu_gravity_mps2`` (a still or handheld device feels 1 g: a median of 1.0 is a
    driver writing g instead of m/s^2, 0 a dead axis set).

    Args:
        ts_ns: (I,) int64 capture times, or None without an IMU (no finding). gyro_rps, accel_mps2: (I, 3).
        pose_ts_ns, position_m (M, 3) m, quat_xyzw (M, 4): the pose track, capture order. t0_ns: the start.
    """
    if ts_ns is None or gyro_rps is None or accel_mps2 is None or len(ts_ns) < 2:
        return []
    ts = np.asarray(ts_ns, dtype=np.int64)
    rel = lambda ns: (int(ns) - t0_ns) / 1e9  # noqa: E731
    gyro, acc = np.asarray(gyro_rps, np.float64), np.asarray(accel_mps2, np.float64)
    findings: list[Finding] = []
    finite = np.isfinite(gyro).all(axis=1) & np.isfinite(acc).all(axis=1)
    if not finite.all():  # the offsets and the quaternion check leave these samples out
        bad = np.flatnonzero(~finite)
        findings.append(new_finding(opts, "imu_not_finite", "imu", rel(ts[bad[0]]), rel(ts[bad[-1]]), float(len(bad)), 0.0,
                                    "samples", samples=int(len(bad)), of=int(len(ts)),
                                    why=f"{len(bad)} of {len(ts)} IMU samples hold NaN/inf (left out of the offsets and "
                                        "the quaternion check)"))
        ts, gyro, acc = ts[finite], gyro[finite], acc[finite]
        if len(ts) < 2:
            return findings
    q = np.asarray(quat_xyzw, np.float64)
    turn = float(np.max(_angles(q, np.broadcast_to(q[0], q.shape)))) if len(q) else 0.0
    path = _path_length(np.asarray(position_m, np.float64))
    for name, vals, unit in (("gyro", gyro, "rad/s"), ("accelerometer", acc, "m/s^2")):
        if np.all(np.ptp(vals, axis=0) <= opts.frozen_eps) and (path >= opts.moving_m or turn >= opts.moving_rad):
            findings.append(new_finding(opts, "imu_dead", "imu", rel(ts[0]), rel(ts[-1]), float(np.max(np.ptp(vals, axis=0))),
                                        opts.frozen_eps, unit, sensor=name, constant=[float(v) for v in vals[0]],
                                        pose_path_m=round(path, 4), pose_turn_rad=round(turn, 4),
                                        why=f"{name} constant at {[round(float(v), 4) for v in vals[0]]} {unit} while the "
                                            f"pose moves {path:.2f} m and turns {np.degrees(turn):.0f} deg"))
    for name, vals, full, unit in (("gyro", gyro, opts.imu_gyro_range_rps, "rad/s"),
                                   ("accelerometer", acc, opts.imu_accel_range_mps2, "m/s^2")):
        out = np.flatnonzero(np.max(np.abs(vals), axis=1) > full)
        if len(out):
            findings.append(new_finding(opts, "imu_out_of_range", "imu", rel(ts[out[0]]), rel(ts[out[-1]]),
                                        float(np.max(np.abs(vals[out]))), full, unit, sensor=name, samples=int(len(out))))
    g = float(np.median(np.linalg.norm(acc, axis=1)))
    lo, hi = opts.imu_gravity_mps2
    if not lo <= g <= hi and not any(f.code == "imu_dead" and f.detail["sensor"] == "accelerometer" for f in findings):
        findings.append(new_finding(opts, "imu_out_of_range", "imu", rel(ts[0]), rel(ts[-1]), g, lo if g < lo else hi,
                                    "m/s^2", sensor="accelerometer", median_specific_force_mps2=round(g, 4),
                                    why=f"median specific force {g:.3g} m/s^2 where a handheld device feels 9.81"
                                        + (" (g written instead of m/s^2?)" if 0.7 <= g <= 1.3 else "")))
    return findings


def check_clock(ts_ns: np.ndarray, log_ns: np.ndarray, t0_ns: int, stream: str,
                opts: PlausibilityOptions = PlausibilityOptions(), window: int = 9) -> list[Finding]:
    """Steps and reversals of a stream's capture clock, against its arrival (log) clock.

    Method: in file order, the offset ``capture - arrival`` of a healthy stream wanders by the
    transport delay only; where the median offset of the next ``window`` messages differs from
    that of the previous ``window`` by more than ``clock_step_s``, the capture clock stepped
    there (forward: ``clock_step``; backward: ``clock_reversal``), by that difference. Medians make
    a single late message (a log-time inversion) no step.

    Args:
        ts_ns, log_ns: (N,) int64 capture and log times in file order. t0_ns: the episode start.
        stream: the topic, for the findings.
    """
    t = np.asarray(ts_ns, dtype=np.int64)
    lt = np.asarray(log_ns, dtype=np.int64)
    n = len(t)
    if n < 2 * window + 1:
        return []
    order = np.argsort(lt, kind="stable")
    off = (t[order] - lt[order]).astype(np.float64) / 1e9
    med = np.median(sliding_window_view(off, window), axis=1)  # med[j]: messages j .. j+window-1
    before, after = med[: n - 2 * window + 1], med[window:]
    change = after - before  # at boundary i = j + window (first message after the step)
    findings: list[Finding] = []
    i = 0
    while i < len(change):
        if abs(change[i]) > opts.clock_step_s:
            # The step lies where one message's offset differs most from the one before, in its direction.
            sign = np.sign(change[i])
            lo, hi = i + 1, min(i + 2 * window, n - 1)
            b = lo + int(np.argmax(sign * np.diff(off[lo - 1 : hi + 1])))
            size = float(np.median(off[b : b + window]) - np.median(off[max(0, b - window) : b]))
            k = order[b - 1]  # the last message on the old clock: the time is the healthy clock's
            code = "clock_step" if size > 0 else "clock_reversal"
            at = (int(t[k]) - t0_ns) / 1e9
            findings.append(new_finding(opts, code, stream, at, at, size, opts.clock_step_s, "s", message_index=int(b)))
            i = b + window
        else:
            i += 1
    return findings


def frame_motion(rgb: np.ndarray, prev: np.ndarray | None) -> tuple[float, np.ndarray]:
    """Image change of one frame against the previous one: mean absolute difference (grey levels)
    of 8x8-block grey thumbnails (block means average sensor and codec noise away), and this
    frame's thumbnail to pass as ``prev`` next. ``rgb``: (H, W, 3) uint8."""
    h, w = rgb.shape[:2]
    by, bx = max(1, h // 8), max(1, w // 8)
    g = rgb[: by * (h // by), : bx * (w // bx)].astype(np.float32).mean(axis=2)
    thumb = g.reshape(h // by, by, w // bx, bx).mean(axis=(1, 3))
    return (0.0 if prev is None else float(np.mean(np.abs(thumb - prev)))), thumb


def decide(findings: list[Finding]) -> Finding | None:
    """The first finding whose policy rejects the episode, or None."""
    return next((f for f in findings if f.action == "rejected"), None)

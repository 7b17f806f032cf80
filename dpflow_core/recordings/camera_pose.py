"""Does the camera belong to the pose track? (the plausibility class ``camera_pose_mismatch``)

A camera stream from another episode (a copy re-stamped onto this one's clock, or a hand-edited
manifest that pairs stem A's video with stem B's VIO) parses, overlaps and converts: each frame
meets a pose, just not the one it saw (a byte-identical copy is already ``duplicate_episode``). The
camera offset's scan (:func:`dpflow_core.offsets.camera_offset`) asks how much of the image motion the
VIO motion explains at each lag; its raw ``R^2`` cannot tell: two unrelated slow, smooth motions fit
each other as well as an honest pair, and demonstrations of one task resemble each other in time
(measured below). The fast part of the motion (each signal less its centred mean over 0.5 s,
:attr:`~dpflow_core.offsets.OffsetEstimate.fast_r2`) is the hand's own: an honest camera follows it as
far as its tracking noise lets it (``fast_ceiling``, the share of the fast image motion above its
frame-to-frame noise), another recording's does not.

Rule: the camera is ``camera_pose_mismatch`` when the VIO's high-passed angular speed reaches
``camera_fit_min_rotation_rps`` (RMS, rad/s) and the camera's fast image motion stands above its noise
(``fast_ceiling`` at least ``camera_fit_min_ceiling``), yet the best high-passed ``R^2`` at any offset
within +-0.8 s stays under ``camera_fit_min_share`` of ``fast_ceiling``. Without that much fast motion,
or with frames tracked narrower than 48 px (:attr:`~dpflow_core.offsets.OffsetOptions.fast_window_s`),
there is no finding: it cannot be judged.

Measured (the camera of episode i against the poses of episode j, i != j, its stamps moved onto j's
clock, every ordered pair of a group; share = ``fast_r2 / fast_ceiling``):

- world recordings (``record_task``, both tasks, 64 x 64 px), 64 honest episodes: share 1.09-1.27, ceiling
  0.61-0.86, fast rotation 0.081-0.195 rad/s, ``fast_r2`` 0.77-0.95 (raw ``R^2`` 0.90-0.99); 112 swapped pairs
  of 16 of them (8 a task): share 0.16-0.60, ``fast_r2`` 0.11-0.49 (raw ``R^2`` 0.23-0.85). Tracked at 48 px:
  honest 1.06-1.23, swapped 0.14-0.61. The README's main job's recordings (128 x 128 px, 16 episodes) converted
  at 96 x 96 and 224 x 224: share 1.09-1.21, ceiling 0.69-0.85, none refused;
- a world camera held still against moving world poses (16): ceiling 0.00-0.02;
- random-motion samples (``samples.write_episode``, 5 s at 96 x 72 and 8 s at 160 x 120 px), 16 honest and
  112 swapped: fast rotation 0.010-0.034 rad/s, share 0.03-2.5 either way (raw ``R^2`` 0.53-0.97 either way);
- tracked at 32 px (the world's frames converted at 32 x 32), the share of honest (0.79-3.0) and swapped
  (0.22-1.65) cameras overlaps: the tracker's noise hides the fast motion, hence the 48 px floor.

So ``camera_fit_min_share`` 0.8 lies 1.3 times under the least honest share and over the largest swapped one;
``camera_fit_min_ceiling`` 0.3 is 1.9 times under the world's least and 15 times over a still camera's; and
``camera_fit_min_rotation_rps`` 0.06 is 1.8 times the samples' slow motion (which is never judged) and 1.35
times under the world's least (one episode converted in the tests reaches 0.074, its share 1.1). An offset
beyond +-0.8 s looks the same as another recording (the reason says so). The IMU is the witness: when its gyro
fits the same pose track (``imu_offset`` measured) the camera is the stranger, and the reason says so; when it
does not, the pose track may be.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np


def check_camera_pose(offsets: Mapping[str, Any], t0_ns: int, pose_ts_ns: np.ndarray, opts: Any = None) -> list:
    """``camera_pose_mismatch`` findings of one episode (module docstring).

    Args:
        offsets: :func:`dpflow_core.offsets.measure_offsets`' result (its ``camera_offset`` and ``imu_offset``
            dicts; ``camera_offset``'s ``fast_*`` figures None: nothing to judge).
        t0_ns: the episode start; pose_ts_ns: (M,) int64 the pose stamps (the finding spans them).
        opts: a :class:`~dpflow_core.recordings.plausibility.PlausibilityOptions` (None: the defaults).

    Returns:
        ``[Finding]`` (value: ``fast_r2``, limit: ``camera_fit_min_share`` x ``fast_ceiling``) or ``[]``.
    """
    from dpflow_core.offsets import DEFAULT_OPTIONS
    from dpflow_core.recordings.plausibility import PlausibilityOptions, new_finding

    reach = 2 * DEFAULT_OPTIONS.search_s  # the fast scan's
    opts = PlausibilityOptions() if opts is None else opts
    cam, imu = offsets.get("camera_offset") or {}, offsets.get("imu_offset") or {}
    r2, ceiling, turn = cam.get("fast_r2"), cam.get("fast_ceiling"), cam.get("fast_rotation_rps")
    if r2 is None or ceiling is None or turn is None or not len(pose_ts_ns):
        return []
    limit = opts.camera_fit_min_share * ceiling
    if turn < opts.camera_fit_min_rotation_rps or ceiling < opts.camera_fit_min_ceiling or r2 >= limit:
        return []
    if imu.get("status") == "measured":
        witness = (f"the IMU's gyro fits the same poses (R^2 {imu['r2']:.2f} at {imu['offset_s']:+.3f} s): the camera "
                   "stream, not the pose track, belongs to another recording")
    else:
        witness = (f"the IMU does not vouch for the poses either ({imu.get('status', 'absent')}): the pose track may be "
                   "the stranger")
    a, b = (int(pose_ts_ns[0]) - t0_ns) / 1e9, (int(pose_ts_ns[-1]) - t0_ns) / 1e9
    return [new_finding(
        opts, "camera_pose_mismatch", "camera vs pose", a, b, r2, limit, "R^2", fast_ceiling=ceiling,
        fast_rotation_rps=turn, raw_r2=cam.get("r2"), imu_status=imu.get("status"),
        why=f"the camera's fast image motion is not explained by the pose track's fast rotation ({turn:.2f} rad/s RMS) at "
            f"any offset within +-{reach:g} s: best high-passed R^2 {r2:.2f}, where its image motion stands {ceiling:.2f} "
            f"above its noise (an honest camera reaches {opts.camera_fit_min_share:g} of that or more); the camera "
            f"belongs to another recording (or lags by more than {reach:g} s); {witness}")]

"""What one recording shows about how it was demonstrated: the figures the curation checks compare.

Read from a ``<STEM>_vio.mcap`` alone (pose, gripper encoder, camera), never from any
simulator file: the same figures exist for a lab's real recordings.

- *Still stretches*: where the hand and the fingers stand still. The pose is resampled
  at :data:`GRID_HZ` and smoothed over :data:`SMOOTH_S` (a hand's 1.5-4 Hz tremor averages
  out; a hold does not); a stretch is still while the smoothed speed, the angular speed and
  the finger speed stay under the settings' limits.
- *Gripper events*: closings and openings of the fingers, found with hysteresis between
  30 % and 70 % of the episode's own width range (the encoder's noise never toggles it).
- *Approach loops*: descents of the camera height (VIO ``Z`` is against gravity) by at
  least :data:`LOOP_DEPTH_M` after a rise of as much: a hand that comes down, goes back up
  and comes down again.
- *Release scene*: a saturation-weighted hue histogram (:func:`colour_histogram`) of the wrist camera's frame
  at the first opening after a grasp: what lies under the gripper where it lets go.
- *Track*: positions on the grid, relative to the first pose, for finding the same
  demonstration recorded twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy.spatial.transform import Rotation, Slerp

from dpflow_core.recordings.reader import read_streams
from dpflow_core.recordings.topics import DAS_DEFAULT, TopicMap

#: Rate (Hz) of the grid the pose and the gripper are resampled on.
GRID_HZ = 30.0
#: Window (s) of the moving average the speeds are measured on.
SMOOTH_S = 0.5
#: Depth (m) of a descent, and of the rise before it, that counts as an approach loop.
LOOP_DEPTH_M = 0.02
#: Thumbnail size (pixels) the release frame is decoded at.
THUMB = (32, 32)


@dataclass
class EpisodeFeatures:
    """Figures of one recording (times in seconds from its first camera frame, lengths in metres).

    Attributes:
        stem, path: the episode and its ``_vio.mcap``.
        duration_s: first to last camera frame.
        start_ns: capture time (ns) of the first camera frame.
        still: ``[start_s, end_s]`` stretches where hand and fingers stand still (any length).
        closings_s, openings_s: times of the gripper's closings and openings.
        release_rise_m: height of the camera at the first opening after a closing, minus its height
            at that closing (None without such a pair).
        approach_loops: descents of at least :data:`LOOP_DEPTH_M` after a rise of as much (:func:`approach_loops`).
        release_hist: (13,) float64 :func:`colour_histogram` of the release frame, or None.
        grid_t_s: (K,) times of the grid; track_m: (K, 3) positions relative to the first pose;
            grid_width_m: (K,) gripper width on the grid.
    """

    stem: str
    path: str
    duration_s: float
    start_ns: int
    still: list[list[float]]
    closings_s: list[float]
    openings_s: list[float]
    release_rise_m: float | None
    approach_loops: int
    release_hist: np.ndarray | None = field(repr=False)
    grid_t_s: np.ndarray = field(repr=False)
    track_m: np.ndarray = field(repr=False)
    grid_width_m: np.ndarray = field(repr=False)

    def summary(self) -> dict:
        """JSON-ready figures (no arrays)."""
        return {
            "duration_s": round(self.duration_s, 3), "still_s": [[round(a, 3), round(b, 3)] for a, b in self.still],
            "closings_s": [round(t, 3) for t in self.closings_s], "openings_s": [round(t, 3) for t in self.openings_s],
            "release_rise_m": None if self.release_rise_m is None else round(self.release_rise_m, 4),
            "approach_loops": self.approach_loops,
        }


def _smooth(x: np.ndarray, n: int) -> np.ndarray:
    if n <= 1 or len(x) < n:
        return x
    kernel = np.ones(n) / n
    pad = np.pad(x, [(n // 2, n - 1 - n // 2)] + [(0, 0)] * (x.ndim - 1), mode="edge")
    return np.stack([np.convolve(pad[:, k], kernel, "valid") for k in range(x.shape[1])], 1) if x.ndim > 1 \
        else np.convolve(pad, kernel, "valid")


def _runs(mask: np.ndarray, t: np.ndarray) -> list[list[float]]:
    """``[start_s, end_s]`` of each run of True in ``mask`` (times ``t``)."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return [[float(t[a]), float(t[b - 1])] for a, b in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1))]


def gripper_events(t: np.ndarray, width: np.ndarray) -> tuple[list[float], list[float]]:
    """Times (s) of closings and openings of ``width`` (m) at times ``t``, with hysteresis between 30 %
    and 70 % of its 2nd-98th percentile range; none when that range is under 1 cm."""
    lo, hi = np.percentile(width, [2, 98])
    if hi - lo < 0.01:
        return [], []
    low, high = lo + 0.3 * (hi - lo), lo + 0.7 * (hi - lo)
    state = "open" if width[0] >= low else "closed"
    closings, openings = [], []
    for ti, w in zip(t, width):
        if state == "open" and w < low:
            state = "closed"
            closings.append(float(ti))
        elif state == "closed" and w > high:
            state = "open"
            openings.append(float(ti))
    return closings, openings


def approach_loops(z: np.ndarray, depth: float = LOOP_DEPTH_M) -> int:
    """Descents of ``z`` (m) by at least ``depth`` that follow a rise of at least ``depth`` (a zig-zag:
    the direction changes only after ``depth`` of travel). A pick-and-place has one (to the place)."""
    descents, direction = 0, 0
    hi = lo = float(z[0])
    for v in map(float, z):
        hi, lo = max(hi, v), min(lo, v)
        if direction >= 0 and hi - v >= depth:
            descents += direction > 0
            direction, lo = -1, v
        elif direction <= 0 and v - lo >= depth:
            direction, hi = 1, v
    return descents


def colour_histogram(rgb: np.ndarray) -> np.ndarray:
    """(13,) float64 histogram of an (H, W, 3) uint8 RGB image summing to 1: 12 hue bins of 30 degrees,
    each pixel weighted by its saturation, and a 13th bin for the unsaturated rest. Lighting and a
    texture's grey levels barely move it; a coloured object or surface under the camera does, and a
    rotation of the view does not at all."""
    import cv2

    hsv = cv2.cvtColor(np.ascontiguousarray(rgb, dtype=np.uint8), cv2.COLOR_RGB2HSV).reshape(-1, 3).astype(np.float64)
    sat = hsv[:, 1] / 255.0
    hist = np.append(np.bincount((hsv[:, 0] // 15).astype(int), weights=sat, minlength=12)[:12], (1 - sat).sum())
    return hist / max(hist.sum(), 1e-12)


def episode_features(vio_mcap: str | Path, settings, stem: str | None = None, topics: TopicMap = DAS_DEFAULT
                     ) -> EpisodeFeatures:
    """The figures of one ``<STEM>_vio.mcap`` (module docstring).

    Args:
        vio_mcap: the recording. settings: a :class:`~dpflow_core.curation.CurationSettings` (the
            stillness limits). stem: default the file name without ``_vio.mcap``.

    Raises:
        RecordingError: the file cannot be read (:func:`~dpflow_core.recordings.reader.read_streams`).
        ConversionError: its camera stream does not decode.
    """
    from dpflow_core.conversion.decode import decode_camera

    path = Path(vio_mcap)
    stem = stem or path.name.removesuffix(".mcap").removesuffix("_vio")
    s = read_streams(path, topics)
    t0 = int(s.camera_ts_ns[0])
    rel = lambda ns: (np.asarray(ns, np.int64) - t0) / 1e9  # noqa: E731
    duration = float(rel(s.camera_ts_ns[-1]))
    pose_s, grip_s = rel(s.pose_ts_ns), rel(s.gripper_ts_ns)
    t = np.arange(0.0, duration + 1e-9, 1.0 / GRID_HZ)
    tc = np.clip(t, pose_s[0], pose_s[-1])
    pos = np.stack([np.interp(tc, pose_s, s.position_m[:, k]) for k in range(3)], 1)
    rot = Slerp(pose_s, Rotation.from_quat(s.quat_xyzw))(tc)
    width = np.interp(t, grip_s, s.gripper_width_m)
    n = max(1, int(round(SMOOTH_S * GRID_HZ)))
    dt = 1.0 / GRID_HZ
    speed = np.linalg.norm(np.gradient(_smooth(pos, n), dt, axis=0), axis=1)
    turn = np.concatenate([[0.0], (rot[1:] * rot[:-1].inv()).magnitude() / dt]) if len(t) > 1 else np.zeros(1)
    finger = np.abs(np.gradient(_smooth(width, n), dt)) if len(t) > 1 else np.zeros(1)
    still = (speed < settings.idle_speed_mps) & (_smooth(turn, n) < settings.idle_angular_rps) \
        & (finger < settings.idle_finger_mps)
    closings, openings = gripper_events(t, _smooth(width, 3))
    rise, hist = None, None
    release = next(((c, o) for c in closings for o in openings if o > c), None)
    if release is not None:
        c, o = release
        z = pos[:, 2]
        rise = float(np.interp(o, t, z) - np.interp(c, t, z))
        frames, *_, frame_ns = decode_camera(s.camera_packets, THUMB, "h264", None, path, s.camera_ts_ns,
                                             decode_order=s.camera_decode_order)
        frame_s = rel(frame_ns)
        hist = colour_histogram(frames[int(np.clip(np.searchsorted(frame_s, o), 0, len(frames) - 1))])
    return EpisodeFeatures(
        stem=stem, path=str(path), duration_s=duration, start_ns=t0, still=_runs(still, t),
        closings_s=closings, openings_s=openings, release_rise_m=rise,
        approach_loops=approach_loops(_smooth(pos[:, 2], n)), release_hist=hist,
        grid_t_s=t, track_m=pos - pos[0], grid_width_m=width,
    )

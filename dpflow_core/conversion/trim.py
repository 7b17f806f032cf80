"""Which frames of an episode are kept: the streams' common clock and overlap, the valid poses, the coverage.

Takes the capture times (ns) of the camera's frames and of the pose and gripper samples; gives the
:class:`Timeline` (start, end, overlap, per-stream figures) and, by :func:`keep_valid_poses`, the rows of the
camera kept under the ``invalid_pose_policy`` with the report's ``pose_invalid`` entry and the coverage (the
kept frames' share of the recording), or the reason the episode is rejected. Used by
:func:`~dpflow_core.conversion.align.align_episode`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from dpflow_core.conversion.settings import ConversionSettings
from dpflow_core.errors import ConversionError


def longest_true_run(mask: np.ndarray) -> tuple[int, int]:
    """(start, stop) of the longest run of True in a 1-D bool array; (0, 0) when none."""
    padded = np.concatenate([[False], mask, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    starts, stops = edges[0::2], edges[1::2]
    if len(starts) == 0:
        return 0, 0
    k = int(np.argmax(stops - starts))
    return int(starts[k]), int(stops[k])


def true_runs_s(mask: np.ndarray, t_s: np.ndarray) -> list[list[float]]:
    """[start_s, end_s] of each run of True in ``mask`` (times from ``t_s``)."""
    padded = np.concatenate([[False], mask, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return [[round(float(t_s[a]), 4), round(float(t_s[b - 1]), 4)] for a, b in zip(edges[0::2], edges[1::2])]


class Timeline:
    """The episode's clock: ``origin`` / ``end`` (ns, the earliest start and latest end of camera, pose and
    gripper), ``span_s`` (s), ``overlap`` ((start, end) ns where all three run), ``stream_info`` (start/end
    seconds and counts per stream) and :meth:`rel` (ns -> seconds from ``origin``); built from the recording's
    ``path``, its streams (:class:`~dpflow_core.recordings.reader.EpisodeStreams`) and ``cam_ns``, the (N,)
    int64 capture times of the decoded frames, kept as ``cam_ns`` beside the pose's ``pose_ts_ns``.

    Raises:
        ConversionError: ``clock_domains_differ`` when the streams' clocks differ, ``no_overlap``.
    """

    def __init__(self, path: Path, streams: Any, cam_ns: np.ndarray):
        from dpflow_core.recordings.inspection import clock_domain_note

        self.path, self.cam_ns, self.pose_ts_ns = path, cam_ns, streams.pose_ts_ns
        starts = (int(cam_ns[0]), int(streams.pose_ts_ns[0]), int(streams.gripper_ts_ns[0]))
        self.origin = int(min(streams.camera_ts_ns[0], streams.pose_ts_ns[0], streams.gripper_ts_ns[0]))
        self.end = int(max(streams.camera_ts_ns[-1], streams.pose_ts_ns[-1], streams.gripper_ts_ns[-1]))
        self.span_s = max((self.end - self.origin) / 1e9, 1e-9)
        self.overlap = (max(starts), min(int(cam_ns[-1]), int(streams.pose_ts_ns[-1]), int(streams.gripper_ts_ns[-1])))
        self.stream_info = {
            name: {"start_s": round(float(self.rel(ts[0])), 4), "end_s": round(float(self.rel(ts[-1])), 4),
                   "count": int(len(ts))}
            for name, ts in (("camera", cam_ns), ("pose", streams.pose_ts_ns), ("gripper", streams.gripper_ts_ns))
        }
        clocks = clock_domain_note(dict(zip(("camera", "pose", "gripper"), starts)))
        if clocks:
            raise ConversionError(f"{clocks}: the streams do not share a clock, so they cannot be aligned; re-export "
                                  "the recording with every header.timestamp on one clock", path,
                                  code="clock_domains_differ")
        if self.overlap[1] <= self.overlap[0]:
            raise ConversionError(f"camera, pose and gripper streams do not overlap: {fmt_streams(self.stream_info)}",
                                  path, code="no_overlap")

    def rel(self, ns: Any) -> np.ndarray:
        """Seconds from ``origin`` of capture times ``ns`` (int or array, ns)."""
        return (np.asarray(ns, dtype=np.int64) - self.origin) / 1e9


def keep_valid_poses(clock: Timeline, in_overlap: np.ndarray, pose_ok: np.ndarray, settings: ConversionSettings,
                     min_frames: int) -> tuple[int, int, dict, float]:
    """The frames kept, ``(lo, hi)`` rows of the camera, after trimming to the overlap and applying
    ``invalid_pose_policy``; the report's ``pose_invalid`` entry and the kept frames' coverage of the recording
    (0-1, of ``clock.span_s``).

    Args:
        clock: the episode's :class:`Timeline`.
        in_overlap: (N,) bool, the camera frames inside the streams' overlap.
        pose_ok: (P,) bool, the pose samples that count as valid (``pose_valid`` and the score); a frame is
            pose-valid when both bracketing pose samples are.
        settings: ``invalid_pose_policy``, ``min_pose_score`` (named in the reasons), ``min_overlap_fraction``.
        min_frames: fewest frames kept (at least 2).

    Raises:
        ConversionError: ``pose_invalid``, ``too_short`` or ``low_coverage`` (see :func:`align_episode`).
    """
    path, cam_ns, pose_t = clock.path, clock.cam_ns, clock.pose_ts_ns
    lo, hi = longest_true_run(in_overlap)
    right = np.clip(np.searchsorted(pose_t, cam_ns, side="left"), 0, len(pose_t) - 1)
    left = np.clip(np.searchsorted(pose_t, cam_ns, side="right") - 1, 0, len(pose_t) - 1)
    frame_valid = pose_ok[left] & pose_ok[right]
    invalid_in_overlap = in_overlap & ~frame_valid
    min_pose_score, min_overlap_fraction = settings.min_pose_score, settings.min_overlap_fraction
    what = "pose_valid false" if min_pose_score <= 0 else f"pose_valid false or score < {min_pose_score:g}"
    n_overlap = max(int(np.count_nonzero(in_overlap)), 1)

    def pose_reason() -> str:
        stretches = ", ".join(f"{a:.2f}-{b:.2f} s" for a, b in invalid_info["stretches_s"])
        pct = 100 * invalid_info["invalid_frames"] / n_overlap
        return f"{what} for {pct:.0f} % of the episode, {stretches} (VIO lost tracking)"

    invalid_info = {
        "policy": settings.invalid_pose_policy,
        "min_pose_score": min_pose_score,
        "invalid_frames": int(np.count_nonzero(invalid_in_overlap)),
        "stretches_s": true_runs_s(invalid_in_overlap, clock.rel(cam_ns)),
        "dropped_frames": 0,
        "dropped_s": 0.0,
    }
    if invalid_info["invalid_frames"]:
        if settings.invalid_pose_policy == "reject":
            raise ConversionError(f"{pose_reason()} and invalid_pose_policy is 'reject'", path, code="pose_invalid")
        a, b = longest_true_run(in_overlap & frame_valid)
        kept_before = cam_ns[hi - 1] - cam_ns[lo]
        invalid_info["dropped_frames"] = int((hi - lo) - (b - a))
        invalid_info["dropped_s"] = round(float((kept_before - (cam_ns[b - 1] - cam_ns[a] if b > a else 0)) / 1e9), 4)
        lo, hi = a, b
    minimum = max(min_frames, 2)
    if hi - lo < minimum and invalid_info["invalid_frames"]:
        raise ConversionError(f"{pose_reason()}: only {hi - lo} frames with valid poses remain (minimum {minimum})",
                              path, code="pose_invalid")
    if hi - lo < minimum:
        raise ConversionError(
            f"only {hi - lo} frames remain after trimming (minimum {minimum}): "
            f"{fmt_streams(clock.stream_info)}, pose invalid {invalid_info['stretches_s']} s", path, code="too_short")
    kept_ns = cam_ns[lo:hi]
    coverage = (int(kept_ns[-1]) - int(kept_ns[0])) / 1e9 / clock.span_s
    if coverage < min_overlap_fraction and invalid_info["invalid_frames"]:
        raise ConversionError(
            f"{pose_reason()}: the longest valid stretch, {clock.rel(kept_ns[0]):.2f}-{clock.rel(kept_ns[-1]):.2f} s, "
            f"covers only {coverage:.0%} of the recording (minimum {min_overlap_fraction:.0%})", path,
            code="pose_invalid")
    if coverage < min_overlap_fraction:
        raise ConversionError(
            f"the aligned frames cover only {coverage:.0%} of the recording "
            f"({(int(kept_ns[-1]) - int(kept_ns[0])) / 1e9:.2f} s of {clock.span_s:.2f} s; minimum "
            f"{min_overlap_fraction:.0%}): {fmt_streams(clock.stream_info)}", path, code="low_coverage")
    return lo, hi, invalid_info, coverage


def fmt_streams(info: dict) -> str:
    """``"camera 0.00-9.97 s, pose ..."``: each stream's span from a :class:`Timeline`'s ``stream_info``."""
    return ", ".join(f"{k} {v['start_s']:.2f}-{v['end_s']:.2f} s" for k, v in info.items())

"""Holes in the camera stream: find the intervals longer than a frame period, and decide where an
episode is cut so that no hole longer than ``max_gap_s`` is bridged by interpolation.

Takes the kept frames' times (s, float64, from the first frame) and the median frame period (s);
gives the gaps (``at_s``, ``duration_s``, ``missing_frames``, ``row``, ``action``), the segments to
keep as ``(start, stop)`` rows, and the report entry ``long_gaps`` written into the dataset metadata;
and the pieces left when the implausible stretches the plausibility rules found are cut out
(:func:`cut_implausible`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dpflow_core.errors import ConversionError


def find_gaps(t_s: np.ndarray, period_s: float, factor: float = 1.5) -> list[dict]:
    """Intervals of ``t_s`` longer than ``factor`` periods: ``at_s`` (time of the frame before
    the gap), ``duration_s``, ``missing_frames`` and ``row`` (index of that frame)."""
    dt = np.diff(t_s)
    out = []
    for i in np.flatnonzero(dt > factor * period_s):
        out.append(
            {
                "at_s": round(float(t_s[i]), 4),
                "duration_s": round(float(dt[i]), 4),
                "missing_frames": int(round(dt[i] / period_s)) - 1,
                "row": int(i),
            }
        )
    return out


def _fmt_gaps(gaps: list[dict]) -> str:
    return ", ".join(f"{g['duration_s']:.2f} s after {g['at_s']:.2f} s" for g in gaps)


def plan_segments(
    t_s: np.ndarray, period_s: float, max_gap_s: float, gap_policy: str, min_segment_frames: int, path: Path,
) -> tuple[list[dict], list[tuple[int, int]] | None, dict]:
    """Every gap of ``t_s`` and what happens at those longer than ``max_gap_s`` seconds.

    Args:
        t_s: (N,) float64 frame times, seconds. period_s: median frame interval, seconds.
        max_gap_s: holes longer than this are never bridged.
        gap_policy: ``"split"`` (cut there; pieces shorter than ``min_segment_frames`` frames
            are dropped) or ``"reject"``.
        path: the recording, for errors.

    Returns:
        ``(gaps, segments, long_gaps)``: all gaps longer than 1.5 periods, each with ``action``
        (``"interpolated"`` for short ones, ``"split"`` or ``"rejected"``); the ``(start, stop)``
        rows to keep, or None when the episode is kept whole; and ``{max_gap_s, policy, gaps,
        segments: [{rows, frames, start_s, end_s, kept}]}``.

    Raises:
        ConversionError: ``camera_gap`` (a long hole under ``"reject"``: the reason gives each
            hole's length, time and missing frames) or ``too_short`` (no piece long enough).
    """
    gaps = find_gaps(t_s, period_s)
    long = [g for g in gaps if g["duration_s"] > max_gap_s]
    segments = None
    info: dict = {"max_gap_s": max_gap_s, "policy": gap_policy, "gaps": [], "segments": []}
    if long:
        if gap_policy == "reject":
            raise ConversionError(
                f"camera stream has {len(long)} hole{'s' if len(long) > 1 else ''} longer than {max_gap_s:g} s "
                f"({_fmt_gaps(long)}; {sum(g['missing_frames'] for g in long)} frames missing) and gap_policy is "
                "'reject': the pose would be bridged across the hole",
                path,
                code="camera_gap",
            )
        cuts = [0, *(g["row"] + 1 for g in long), len(t_s)]
        for a, b in zip(cuts[:-1], cuts[1:]):
            info["segments"].append({"rows": [a, b], "frames": b - a, "start_s": round(float(t_s[a]), 4),
                                     "end_s": round(float(t_s[b - 1]), 4), "kept": b - a >= min_segment_frames})
        segments = [tuple(seg["rows"]) for seg in info["segments"] if seg["kept"]]
        if not segments:
            raise ConversionError(
                f"camera stream has holes longer than {max_gap_s:g} s ({_fmt_gaps(long)}); split there, no segment "
                f"has the minimum {min_segment_frames} frames (segments of "
                f"{', '.join(str(seg['frames']) for seg in info['segments'])} frames)",
                path,
                code="too_short",
            )
    for g in gaps:
        g["action"] = ("split" if gap_policy == "split" else "rejected") if g in long else "interpolated"
    info["gaps"] = [g for g in gaps if g in long]
    return gaps, segments, info


def cut_implausible(kept_ns: np.ndarray, segments: list[tuple[int, int]] | None, drop_ns: list[tuple[int, int]],
                    min_segment_frames: int, path: Path, findings: list) -> tuple[list[tuple[int, int]] | None, dict]:
    """The pieces left when the frames inside the implausible intervals are dropped.

    Args:
        kept_ns: (N,) int64 capture times of the kept frames. segments: the pieces after the camera
            gaps (rows, or None: the whole episode). drop_ns: open intervals (ns) whose frames go; the
            episode is cut at each, even when no frame lies inside. findings: the plausibility findings.

    Returns:
        (segments or None when nothing was cut, ``report["plausibility"]``: findings, dropped frames,
        pieces with rows, frames and whether each reached ``min_segment_frames``).

    Raises:
        ConversionError: ``too_short`` when no piece reaches ``min_segment_frames`` frames.
    """
    info = {"findings": [f.to_dict() for f in findings], "dropped_frames": 0, "segments": []}
    if not drop_ns:
        return segments, info
    n = len(kept_ns)
    bad = np.zeros(n, dtype=bool)
    cut_after = np.zeros(n, dtype=bool)
    for a, b in drop_ns:
        bad |= (kept_ns > a) & (kept_ns < b)
        k = int(np.searchsorted(kept_ns, a, side="right")) - 1  # last frame at or before a
        if 0 <= k < n - 1 and kept_ns[k + 1] >= b:
            cut_after[k] = True
    pieces = []
    for a, b in segments or [(0, n)]:
        start = None
        for r in range(a, b):
            if bad[r]:
                if start is not None:
                    pieces.append((start, r))
                start = None
                continue
            if start is None:
                start = r
            if cut_after[r] or r == b - 1:
                pieces.append((start, r + 1))
                start = None
    info["dropped_frames"] = int(np.count_nonzero(bad))
    info["segments"] = [{"rows": [a, b], "frames": b - a, "kept": b - a >= min_segment_frames} for a, b in pieces]
    kept = [p for p in pieces if p[1] - p[0] >= min_segment_frames]
    if not kept:
        raise ConversionError(
            f"{'; '.join(f.describe() for f in findings if f.action == 'split')}: cut there, no piece has the minimum "
            f"{min_segment_frames} frames (pieces of {', '.join(str(b - a) for a, b in pieces) or 'no'} frames)",
            path, code="too_short")
    return kept, info

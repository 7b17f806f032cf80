"""What :func:`~dpflow_core.recordings.inspect_recording` checks beyond a stream's presence and order:
a capture clock that froze, camera topics the dataset has no key for, a calibration no camera can have,
and a ``_vio.json`` whose counts disagree with the recording (the last one at pairing,
:func:`dpflow_core.pairing.checks.check_candidate`).

Each check returns what it found as figures or one sentence naming the topic (or file), the time and
the figure; the caller files it as an error or a warning (docs/formats.md, "Reject and warning codes").
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

#: Schema names (their last dotted component) of image streams: a topic carrying one is a camera.
IMAGE_SCHEMAS = ("CompressedImage", "CompressedVideo", "RawImage", "Image")
#: A run of at least this many consecutive messages (file order) stamped with one capture time ...
FROZEN_MIN_MESSAGES = 10
#: ... that arrived over at least this many seconds is a frozen clock, not a resent message.
FROZEN_MIN_ARRIVAL_S = 0.1


def frozen_clock(ts_ns: np.ndarray, log_ns: np.ndarray, min_messages: int = FROZEN_MIN_MESSAGES,
                 min_arrival_s: float = FROZEN_MIN_ARRIVAL_S) -> tuple[int, int, int, float] | None:
    """The longest run of consecutive messages (file order) that share one capture stamp while they
    arrive over time: a capture clock that stopped (a driver that stamps every message with its start).

    Args:
        ts_ns, log_ns: (N,) int64 capture (``header.timestamp``) and arrival (``log_time``) times, file order.
        min_messages, min_arrival_s: the least run, in messages and in seconds of arrival, that counts.

    Returns:
        ``(first message index, messages, the stamp (ns), arrival span (s))``, or None.
    """
    t = np.asarray(ts_ns, dtype=np.int64)
    if len(t) < min_messages:
        return None
    starts = np.flatnonzero(np.concatenate([[True], np.diff(t) != 0]))
    lengths = np.diff(np.concatenate([starts, [len(t)]]))
    k = int(np.argmax(lengths))
    a, n = int(starts[k]), int(lengths[k])
    lt = np.asarray(log_ns, dtype=np.int64)[a : a + n]
    span = (int(lt.max()) - int(lt.min())) / 1e9
    if n < min_messages or span < min_arrival_s:
        return None
    return a, n, int(t[a]), span


def frozen_clock_reason(file_name: str, topic: str, frozen: tuple[int, int, int, float], n_messages: int,
                        t0_ns: int) -> str:
    """One sentence for :func:`frozen_clock`'s finding (``t0_ns``: the start times are counted from)."""
    a, n, stamp, span = frozen
    which = f"all {n} messages" if n == n_messages else f"{n} of {n_messages} messages (from message {a})"
    return (f"{file_name}: {topic} capture clock frozen: {which} stamped {stamp} ns ({(stamp - t0_ns) / 1e9:.3f} s) "
            f"while they arrived over {span:.3f} s: the stream has no capture times to align by (a constant "
            "clock, not a reversal)")


def other_cameras(schemas: Mapping[str, str], converted: str) -> list[str]:
    """Topics other than ``converted`` whose schema (``{topic: schema name}``) is an image schema
    (:data:`IMAGE_SCHEMAS`): cameras the dataset has no key for, sorted."""
    return sorted(t for t, name in schemas.items()
                  if t != converted and (name or "").rsplit(".", 1)[-1] in IMAGE_SCHEMAS)


def calibration_problems(width: int, height: int, k: Sequence[float], frame_size: tuple[int, int] | None) -> list[str]:
    """What no camera can have in a ``foxglove.CameraCalibration``: a zero image size, one that differs
    from the decoded frames' ``frame_size`` ``(width, height)`` px (None: not decoded), an intrinsic
    matrix ``K`` without 9 values, a focal length (``K[0]``, ``K[4]``, px) that is not finite and positive,
    or a principal point (``K[2]``, ``K[5]``) outside the image. Returns the problems, [] when none."""
    out = []
    if width <= 0 or height <= 0:
        out.append(f"image size {width} x {height} px")
    elif frame_size is not None and (width, height) != tuple(frame_size):
        out.append(f"image size {width} x {height} px, but the frames are {frame_size[0]} x {frame_size[1]} px")
    if len(k) != 9:
        return out + [f"K has {len(k)} values, not 9"]
    for name, v in (("fx", k[0]), ("fy", k[4])):
        if not (math.isfinite(v) and v > 0):
            out.append(f"focal length {name} = {v:g} px")
    for name, v, size in (("cx", k[2], width), ("cy", k[5], height)):
        if size > 0 and not (math.isfinite(v) and 0 <= v <= size):
            out.append(f"principal point {name} = {v:g} px outside 0..{size}")
    return out


def status_count_problem(vio_status: Any, json_name: str, vio_name: str, n_pose: int, n_camera: int) -> str | None:
    """A ``_vio.json`` whose counts disagree with its ``_vio.mcap``: ``pose_count`` (when there is one) not
    its pose messages, or ``frame_count`` neither its pose nor its camera messages (the schema is not
    published: VIO counts the frames it processed, one pose each). None when they agree or are absent."""
    if not isinstance(vio_status, dict):
        return None
    counts = {k: vio_status.get(k) for k in ("frame_count", "pose_count")}
    counts = {k: v for k, v in counts.items() if isinstance(v, int) and not isinstance(v, bool)}
    wrong = [f"{k} {v}" for k, v in counts.items()
             if (k == "pose_count" and v != n_pose) or (k == "frame_count" and v not in (n_pose, n_camera))]
    if not wrong:
        return None
    return (f"{json_name} says {' and '.join(wrong)} but {vio_name} holds {n_pose} pose and {n_camera} camera "
            "messages: the status file describes another run or the recording lost messages")

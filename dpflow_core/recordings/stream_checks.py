"""What :func:`~dpflow_core.recordings.inspect_recording` checks beyond a stream's presence and order:
a capture clock that froze or counts in another unit, camera topics the dataset has no key for, a calibration no camera can have,
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


#: A capture clock counting in another unit than ns advances this many times too fast or slow (a
#: power of 1000) against the others; named by what its stamps then look like.
UNIT_NAMES = {-3: "microseconds", -6: "milliseconds", -9: "seconds", 3: "picoseconds"}


def power_of_1000(ratio: float) -> int:
    """``3k`` when ``ratio`` is within a factor of 3 of ``1000^k`` (k != 0), else 0."""
    power = 3 * round(math.log10(ratio) / 3)
    return power if abs(math.log10(ratio) - power) <= 0.5 else 0


def timestamp_units(streams: Mapping[str, tuple[Sequence[int], Sequence[int]]], file_name: str) -> dict[str, str]:
    """Streams whose capture stamps run a power of 1000 too slow or fast against the other streams (stamps
    in ms where ns are expected, formats.md section 1), each with one sentence naming the file, the topic,
    both spans and first stamps and the unit they look like. Pairing (:func:`~dpflow_core.recordings.inspect_recording`,
    code ``timestamp_units``) and the reader (:func:`~dpflow_core.recordings.reader.read_streams`, so a
    hand-made manifest meets the same reason at conversion) both ask this.

    Method: each stream's span of capture times against the median span of the other streams with at least
    two messages (streams that start late or end early stay within a factor of 3 of it; a unit differs by
    1000^k), confirmed by its span of arrival (log) times when those advance.

    Args:
        streams: topic -> (capture times, arrival times), ns, file order.
        file_name: the recording's name, for the sentences.
    """
    stats = {t: (np.asarray(ts, dtype=np.int64), np.asarray(lt, dtype=np.int64)) for t, (ts, lt) in streams.items()
             if len(ts) > 1}
    spans = {t: int(ts.max()) - int(ts.min()) for t, (ts, _lt) in stats.items()}
    off: dict[str, str] = {}
    for topic, span in spans.items():
        # The median of the *other* streams: with two of four streams off, its own span would pull it halfway.
        others = [v for t, v in spans.items() if t != topic and v > 0]
        if span <= 0 or not others:
            continue
        ref = float(np.median(others))
        power = power_of_1000(span / ref)
        ts, lt = stats[topic]
        log_span = int(lt.max()) - int(lt.min())
        # Where the arrival clock ticks, it must agree: two streams of four off leave the median between.
        if power == 0 or (log_span > 0 and power_of_1000(span / log_span) != power):
            continue
        against_log = f", {span / log_span:.3g} x its arrival times'" if log_span > 0 else ""
        unit = UNIT_NAMES.get(power, f"1e{-power} ns units")
        firsts = [int(o.min()) for t, (o, _lt) in stats.items() if t != topic and t not in off]
        first = f"; first stamp {int(ts.min()):.3g} ns against {float(np.median(firsts)):.3g} ns" if firsts else ""
        off[topic] = (f"{file_name}: {topic} capture stamps advance {span / ref:.3g} x as fast as the other streams'"
                      f"{against_log} (span {span / 1e9:.6g} s against {ref / 1e9:.6g} s{first}): they look like {unit}, "
                      "not nanoseconds; re-export the recording with header.timestamp in ns")
    return off


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

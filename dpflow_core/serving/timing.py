"""The timing contract between a robot and a served policy: timestamped streams in, timed actions out.

A robot computer does not sample its sensors on the dataset's grid. It sends,
per stream, the recent values with their *capture* timestamps (seconds, on the
robot computer's clock, already corrected for the sensor's own delay), and
:func:`align_observation` cuts from them exactly the observation that training
cut from the replay buffer (:mod:`dpflow_core.train.data`):

- the *anchor* ``t`` is the newest frame of the first image key (for a policy
  without cameras: the newest sample of ``robot0_eef_pos``);
- image key frames are read at ``t - k * obs_down_sample_steps / f`` for
  ``k = n_obs_steps-1 .. 0`` (``f`` the dataset frequency), each the frame
  nearest that time, which must lie within half a period of it (training reads
  whole steps, never a blend of frames);
- low-dimensional keys are read at those times plus their latency shift,
  ``spec.latency(key) / f`` seconds (``(camera_obs_latency - key latency)``):
  the newest pose is newer than the newest frame, as on the robot. Positions
  and widths are interpolated linearly, rotations slerped
  (:func:`dpflow_core.train.data.interpolate`, the function training samples with);
- the *current* pose, the one every relative pose and action is expressed in,
  is the pose read for ``k = 0``: the newest frame's time plus the pose latency shift;
- times before a stream's first sample read the first sample: training's edge
  padding at an episode start, so a client may start with one frame.

The actions of the returned chunk are for ``t + k * action_dt_s``
(:meth:`dpflow_core.inference.Policy.predict_action` returns these times):
action 0 is for the anchor frame's capture time, so by the time the answer
arrives the first few lie in the past. A client executing them UMI-style keeps
only those after ``now + its execution latency`` (:func:`actions_to_execute`).
docs/serving.md draws the timeline.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpflow_core.errors import DpflowError
from dpflow_core.serving.settings import ServeSettings
from dpflow_core.train.data import ROT_KEY, ROT_WRT_START_KEY, START_POSE_KEY, interpolate

#: Default oldest accepted anchor frame, seconds before ``now_s`` (``ServeSettings.max_age_s``).
MAX_AGE_S = ServeSettings.max_age_s


class ObservationError(DpflowError):
    """A request's observation is malformed: a missing key, a wrong shape or dtype, unordered timestamps."""

    code = "bad_observation"


class StaleObservationError(ObservationError):
    """A request's timestamps are too old (or in the future) for the ``now_s`` it was judged at."""

    code = "stale_observation"


@dataclass(frozen=True)
class Stream:
    """Recent samples of one sensor stream.

    Attributes:
        timestamp_s: ``(N,)`` float64 capture times, seconds, strictly increasing.
        value: ``(N, ...)``: frames ``(N, H, W, 3)`` uint8 RGB, positions ``(N, 3)`` m,
            rotation vectors ``(N, 3)`` rad, gripper widths ``(N, 1)`` m.
    """

    timestamp_s: np.ndarray
    value: np.ndarray

    @classmethod
    def coerce(cls, key: str, raw: Any) -> Stream:
        """A :class:`Stream` from itself or from the wire's ``{"timestamp": (N,), "value": (N, ...)}``.

        Raises:
            ObservationError: not such a dict, arrays of different lengths, empty,
                non-finite or not strictly increasing timestamps.
        """
        if isinstance(raw, Stream):
            ts, value = raw.timestamp_s, raw.value
        elif isinstance(raw, Mapping) and "timestamp" in raw and "value" in raw:
            ts, value = raw["timestamp"], raw["value"]
        else:
            raise ObservationError(f"stream {key!r} must be {{'timestamp': (N,), 'value': (N, ...)}}, got {_kind(raw)}")
        ts = np.asarray(ts, dtype=np.float64).reshape(-1)
        value = np.asarray(value)
        if len(ts) == 0 or value.ndim == 0 or len(value) != len(ts):
            raise ObservationError(
                f"stream {key!r}: {len(ts)} timestamps for values of shape {value.shape} (need N >= 1 of each)"
            )
        if not np.all(np.isfinite(ts)):
            raise ObservationError(f"stream {key!r}: timestamps must be finite")
        if np.any(np.diff(ts) <= 0):
            raise ObservationError(f"stream {key!r}: timestamps must be strictly increasing, got {ts.tolist()}")
        return cls(ts, value)


def _kind(raw: Any) -> str:
    if isinstance(raw, np.ndarray):
        return f"an array {raw.dtype} {raw.shape}"
    return type(raw).__name__


def stream_keys(spec) -> tuple[list[str], list[str]]:
    """``(image keys, low-dimensional stream keys)`` a policy of ``spec`` needs, in the spec's order.

    The low-dimensional ones always include the pose (the current pose comes from
    it), and never the derived ``robot0_eef_rot_axis_angle_wrt_start``.
    """
    lowdim = [k for k in ("robot0_eef_pos", ROT_KEY) if k not in spec.lowdim_keys]
    lowdim = [k for k in spec.lowdim_keys if k != ROT_WRT_START_KEY] + lowdim
    return list(spec.rgb_keys), lowdim


def align_observation(
    streams: Mapping[str, Any],
    policy,
    now_s: float,
    max_age_s: float = MAX_AGE_S,
    image_shapes: Mapping[str, tuple[int, int, int]] | None = None,
) -> dict[str, np.ndarray]:
    """Cut the observation ``Policy.predict_action`` takes from timestamped streams, as training cuts samples.

    Args:
        streams: per key a :class:`Stream` or ``{"timestamp": (N,) s, "value": (N, ...)}``:
            every image key of the policy, ``robot0_eef_pos`` (m) and
            ``robot0_eef_rot_axis_angle`` (rad) (the camera pose in the dataset's
            world frame), every other low-dimensional key (``robot0_gripper_width``
            (N, 1) m); ``robot0_demo_start_pose`` a plain ``(6,)`` array when the
            policy observes the rotation w.r.t. the episode start. Other keys are ignored.
        policy: a :class:`~dpflow_core.inference.Policy` (its ``spec`` and ``frequency_hz``).
        now_s: the time the observation is judged at, on the streams' clock (seconds).
        max_age_s: the anchor frame may be at most this old at ``now_s``.
        image_shapes: per image key the ``(H, W, 3)`` trained on; None: not checked.

    Returns:
        ``{key: (To, ...)}`` for each image key (uint8) and low-dimensional stream key
        (float64), ``robot0_demo_start_pose`` when given, and ``timestamp`` ``(To,)``
        float64, the times of the image frames (the anchor times); oldest first.

    Raises:
        ObservationError: a key missing, a wrong shape or dtype, non-finite values,
            unordered timestamps, no frame within half a period of a needed time.
        StaleObservationError: the anchor is older than ``max_age_s`` at ``now_s``, a
            stream's newest sample is older than the time it must be read at by more
            than a period, or a timestamp lies after ``now_s`` by more than a period.
    """
    spec, freq = policy.spec, float(policy.frequency_hz)
    period = 1.0 / freq
    rgb_keys, lowdim_keys = stream_keys(spec)
    missing = [k for k in rgb_keys + lowdim_keys if k not in streams]
    if ROT_WRT_START_KEY in spec.lowdim_keys and START_POSE_KEY not in streams:
        missing.append(START_POSE_KEY)
    if missing:
        raise ObservationError(f"observation lacks streams {missing} (this policy reads {rgb_keys + lowdim_keys})")
    parsed = {k: Stream.coerce(k, streams[k]) for k in rgb_keys + lowdim_keys}
    for key in rgb_keys:
        _check_frames(key, parsed[key].value, None if image_shapes is None else image_shapes.get(key))
    for key in lowdim_keys:
        v = parsed[key].value
        want = 3 if key in ("robot0_eef_pos", ROT_KEY) else (1 if "gripper" in key else None)
        if v.ndim != 2 or (want is not None and v.shape[1] != want) or v.dtype.kind not in "fiu":
            raise ObservationError(f"stream {key!r} values must be numeric (N, {want or 'D'}), got {v.dtype} {v.shape}")
        if not np.all(np.isfinite(v)):
            raise ObservationError(f"stream {key!r} holds non-finite values")

    now = float(now_s)
    if not math.isfinite(now):
        raise ObservationError(f"now_s must be a finite time in seconds, got {now_s!r}")
    anchor = float(parsed[rgb_keys[0] if rgb_keys else "robot0_eef_pos"].timestamp_s[-1])
    if now - anchor > max_age_s:
        raise StaleObservationError(
            f"the newest frame was captured at {anchor:.6f} s, {now - anchor:.3f} s before now ({now:.6f} s): "
            f"older than the {max_age_s:g} s accepted"
        )
    for key, s in parsed.items():
        if s.timestamp_s[-1] > now + period:
            raise StaleObservationError(
                f"stream {key!r} has a sample at {s.timestamp_s[-1]:.6f} s, after now ({now:.6f} s): "
                "timestamps and now_s must come from one clock"
            )
    offsets = np.arange(spec.n_obs_steps - 1, -1, -1, dtype=np.float64) * spec.obs_down_sample_steps * period
    times = anchor - offsets

    out: dict[str, np.ndarray] = {}
    for key in rgb_keys:
        ts = parsed[key].timestamp_s
        want = np.maximum(times, ts[0])  # before the first frame: edge padding, as at an episode start
        nearest = np.abs(ts[None, :] - want[:, None]).argmin(axis=1)
        gap = np.abs(ts[nearest] - want)
        if np.any(gap > 0.5 * period + 1e-9):
            k = int(np.argmax(gap))
            raise ObservationError(
                f"stream {key!r} has no frame within half a period ({0.5 * period:.4f} s) of {want[k]:.6f} s "
                f"(nearest at {ts[nearest[k]]:.6f} s)"
            )
        out[key] = np.ascontiguousarray(parsed[key].value[nearest])
    for key in lowdim_keys:
        s = parsed[key]
        want = times + spec.latency(key) * period
        late = want[-1] - s.timestamp_s[-1]
        if late > period + 1e-9:
            raise StaleObservationError(
                f"stream {key!r} is needed at {want[-1]:.6f} s (the newest frame + its latency shift of "
                f"{spec.latency(key) * period:.4f} s) but its newest sample is {late:.4f} s older"
            )
        pos = np.interp(want, s.timestamp_s, np.arange(len(s.timestamp_s), dtype=np.float64))
        out[key] = interpolate(s.value, pos, rotation=key == ROT_KEY)
    if START_POSE_KEY in streams and ROT_WRT_START_KEY in spec.lowdim_keys:
        start = np.asarray(streams[START_POSE_KEY], dtype=np.float64)
        if start.shape != (6,) or not np.all(np.isfinite(start)):
            raise ObservationError(f"{START_POSE_KEY} must be a finite (6,) [pos m, rotvec rad], got {start.shape}")
        out[START_POSE_KEY] = start
    out["timestamp"] = times
    return out


def _check_frames(key: str, frames: np.ndarray, shape: tuple[int, int, int] | None) -> None:
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ObservationError(f"stream {key!r} must hold uint8 (N, H, W, 3) RGB frames, got {frames.dtype} {frames.shape}")
    if shape is not None and tuple(frames.shape[1:]) != tuple(shape):
        raise ObservationError(f"stream {key!r} frames are {tuple(frames.shape[1:])}, the policy was trained on {tuple(shape)}")


def actions_to_execute(
    timestamp_s: np.ndarray, now_s: float, exec_latency_s: float = 0.0
) -> np.ndarray:
    """Indices of the chunk's actions still worth sending to the robot at ``now_s`` (UMI's rule).

    Args:
        timestamp_s: ``(H,)`` the actions' target times (the response's ``timestamp``).
        now_s: the robot computer's time now, on the clock of the observation's timestamps.
        exec_latency_s: how long a command takes to reach the controller.

    Returns:
        ``(K,)`` int64 indices, in order, of the actions whose time is after
        ``now_s + exec_latency_s``; empty when the whole chunk is in the past.
    """
    ts = np.asarray(timestamp_s, dtype=np.float64).reshape(-1)
    return np.nonzero(ts > float(now_s) + float(exec_latency_s))[0]

"""LeRobot v2.1 export and openpi-style norm stats (formats.md section 4).

pi0 / openpi and LeRobot users train from a LeRobot dataset, and their chain is
convert -> LeRobot dataset -> compute norm stats -> train. The statistics step
needs the converted dataset's own metadata: run on recordings that were never
converted (or on another format version) it fails late or appears to hang while
a Hub download is attempted. Here the chain is explicit:

* :func:`export_lerobot` decodes and aligns each accepted episode of a pairing
  manifest with :func:`dpflow_core.conversion.align_episode` (the same code as
  the ``dataset.npz`` conversion, in worker processes) and writes a LeRobot
  v2.1 dataset with :class:`LeRobotWriter`::

      meta/info.json              codebase_version "v2.1", fps, features, totals, path templates
      meta/episodes.jsonl         {"episode_index", "tasks": [str], "length"}
      meta/tasks.jsonl            {"task_index", "task"}
      meta/episodes_stats.jsonl   {"episode_index", "stats": {feature: {min, max, mean, std, count}}}
      data/chunk-000/episode_000000.parquet
      videos/chunk-000/observation.images.camera0/episode_000000.mp4   (H.264, yuv420p)

  Layout, keys and per-episode statistics follow LeRobot's v2.1 dataset code
  (``lerobot/datasets/utils.py``, ``compute_stats.py`` and ``video_utils.py`` of
  lerobot 0.3.x): ``timestamp = frame_index / fps`` so that LeRobot's check that
  consecutive timestamps are ``1/fps`` apart (tolerance 1e-4 s) holds, and each
  video frame is stored at exactly that time. ``fps`` is the measured frequency
  of the recordings (1 / the median frame interval, the rule of the npz's
  ``frequency_hz``), not a nominal rate.

* :func:`compute_openpi_norm_stats` reads only the parquet columns of the state
  and the actions (never a video) and returns openpi's ``norm_stats.json``
  content: mean, std, q01, q99 per dimension. It validates ``meta/info.json``
  first and fails at once, naming the file and the field, when the dataset was
  not converted, has another ``codebase_version``, inconsistent features or no
  frames. Nothing here opens a network connection.

The state of every frame is ``[eef position (m, 3), eef rotation vector (rad, 3),
gripper width (m, 1)]`` (7 float32); the action follows :data:`ACTION_RULES`.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import hashlib
import json
import math
import multiprocessing
import os
import shutil
from collections import deque
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import av
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq
from scipy.spatial.transform import Rotation

from dpflow_core import __version__
from dpflow_core.conversion import CONVERTER_VERSION, INVALID_POSE_POLICIES, align_job_episode, alignment_job, load_inputs
from dpflow_core.errors import ConversionError, DatasetError, DpflowError
from dpflow_core.topics import DAS_DEFAULT, TopicMap

#: The LeRobot dataset format version written and expected by default.
CODEBASE_VERSION = "v2.1"
#: Episodes per chunk folder (LeRobot's default).
CHUNKS_SIZE = 1000
INFO_PATH = "meta/info.json"
EPISODES_PATH = "meta/episodes.jsonl"
TASKS_PATH = "meta/tasks.jsonl"
EPISODES_STATS_PATH = "meta/episodes_stats.jsonl"
#: dpflow's own record of the export (inputs, hashes, alignment reports); not read by LeRobot.
PROVENANCE_PATH = "meta/dpflow.json"
DATA_PATH = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
VIDEO_PATH = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"

STATE_KEY = "observation.state"
ACTION_KEY = "action"
#: Video feature key of the centre camera (camera0).
CAMERA_KEY = "observation.images.camera0"
#: Names of the 7 state (and action) dimensions: metres, radians (rotation vector), metres.
STATE_NAMES = ("eef_pos_x", "eef_pos_y", "eef_pos_z", "eef_rot_x", "eef_rot_y", "eef_rot_z", "gripper_width")
#: ``next_state``: action[t] = state[t+1]; ``delta``: position and gripper differences
#: state[t+1] - state[t] and the rotation R[t+1] R[t]^-1 as a rotation vector (world
#: frame). The last frame holds: its action is its own state (``next_state``) or zero (``delta``).
ACTION_RULES = ("next_state", "delta")
#: Columns LeRobot adds to every frame, with their dtype.
INDEX_FEATURES = {
    "timestamp": "float32",
    "frame_index": "int64",
    "episode_index": "int64",
    "index": "int64",
    "task_index": "int64",
}
#: Norm-stats key of openpi -> LeRobot feature keys accepted for it, in order of preference.
OPENPI_NORM_KEYS = {"state": (STATE_KEY, "state"), "actions": (ACTION_KEY, "actions")}
ROBOT_TYPE = "das_gripper"

#: Time base of the MP4 video streams: frame i is stored at round(i * 90000 / fps) ticks,
#: within 5.6 microseconds of i / fps (LeRobot's video tolerance is 100 microseconds).
_VIDEO_TIME_BASE = Fraction(1, 90_000)


@dataclass(frozen=True)
class VideoSpec:
    """How camera frames are encoded (PyAV, libx264).

    Attributes:
        codec: FFmpeg encoder name.
        pix_fmt: pixel format of the stream (yuv420p plays everywhere).
        crf: constant rate factor (lower is better quality, larger files).
        gop_size: frames between key frames; small values make random access
            cheap (LeRobot's loaders seek to a key frame and decode forward).
        preset: x264 speed preset.
    """

    codec: str = "libx264"
    pix_fmt: str = "yuv420p"
    crf: int = 23
    gop_size: int = 2
    preset: str = "veryfast"


@dataclass(frozen=True)
class LeRobotExport:
    """Result of writing a LeRobot dataset.

    Attributes:
        path: the dataset folder.
        fps: frame rate written to ``meta/info.json`` (Hz, the measured frequency).
        n_episodes, total_frames: totals.
        video_keys: video feature keys.
        image_size: [W, H] of the videos, pixels.
        action_rule: one of :data:`ACTION_RULES`.
        task: the task text of every episode.
        stems: the recording stem of each episode, by episode index.
        skipped: stem -> reason, for episodes left out (not aligned, or off the dataset's frequency).
        export_key: content address of the export (:func:`export_key`), when made from a manifest.
        reused: True when :func:`export_lerobot` found this export already in place.
    """

    path: Path
    fps: float
    n_episodes: int
    total_frames: int
    video_keys: list[str]
    image_size: list[int]
    action_rule: str
    task: str
    stems: list[str]
    skipped: dict[str, str] = field(default_factory=dict)
    export_key: str | None = None
    reused: bool = False

    def contract(self) -> dict:
        """The ``lerobot_dataset`` asset value (plain dict)."""
        return {
            "path": str(self.path),
            "codebase_version": CODEBASE_VERSION,
            "fps": self.fps,
            "n_episodes": self.n_episodes,
            "total_frames": self.total_frames,
            "video_keys": list(self.video_keys),
            "image_size": list(self.image_size),
            "action_rule": self.action_rule,
            "task": self.task,
            "export_key": self.export_key,
        }


@dataclass(frozen=True)
class NormStats:
    """openpi normalisation statistics of one vector, each (D,) float64.

    ``std`` is the population standard deviation; ``q01``/``q99`` are the exact
    1st and 99th percentiles (numpy's default linear interpolation), where
    openpi's own tool approximates them with 5000-bin histograms.
    """

    mean: np.ndarray
    std: np.ndarray
    q01: np.ndarray
    q99: np.ndarray

    def to_json(self) -> dict[str, list[float]]:
        """``{"mean": [...], "std": [...], "q01": [...], "q99": [...]}`` as Python floats."""
        return {k: [float(x) for x in getattr(self, k)] for k in ("mean", "std", "q01", "q99")}


# --------------------------------------------------------------------------- episode content


def episode_state(eef_pos: np.ndarray, eef_rot_axis_angle: np.ndarray, gripper_width: np.ndarray) -> np.ndarray:
    """The state vector of every frame.

    Args:
        eef_pos: (N, 3) position, metres.
        eef_rot_axis_angle: (N, 3) rotation vector, radians.
        gripper_width: (N, 1) or (N,) gripper width, metres.

    Returns:
        (N, 7) float32 ``[x, y, z, rx, ry, rz, width]`` (see :data:`STATE_NAMES`).

    Raises:
        ConversionError: when the lengths differ or a value is not finite.
    """
    pos = np.asarray(eef_pos, dtype=np.float64).reshape(-1, 3)
    rot = np.asarray(eef_rot_axis_angle, dtype=np.float64).reshape(-1, 3)
    width = np.asarray(gripper_width, dtype=np.float64).reshape(-1, 1)
    if not len(pos) == len(rot) == len(width):
        raise ConversionError(f"state arrays differ in length: pos {len(pos)}, rot {len(rot)}, gripper {len(width)}")
    state = np.concatenate([pos, rot, width], axis=1)
    if not np.all(np.isfinite(state)):
        raise ConversionError(f"state has {np.count_nonzero(~np.isfinite(state))} non-finite values")
    return state.astype(np.float32)


def episode_actions(state: np.ndarray, rule: str = "next_state") -> np.ndarray:
    """Actions of every frame from the state track.

    Args:
        state: (N, 7) float32 states (:func:`episode_state`).
        rule: ``"next_state"`` or ``"delta"`` (see :data:`ACTION_RULES`).

    Returns:
        (N, 7) float32 actions.

    Raises:
        ConversionError: for an unknown rule or a state that is not (N, 7).
    """
    if rule not in ACTION_RULES:
        raise ConversionError(f"unknown action rule {rule!r}; use one of {', '.join(ACTION_RULES)}")
    s = np.asarray(state, dtype=np.float64)
    if s.ndim != 2 or s.shape[1] != len(STATE_NAMES):
        raise ConversionError(f"state must be (N, {len(STATE_NAMES)}), got {s.shape}")
    nxt = np.concatenate([s[1:], s[-1:]], axis=0)
    if rule == "next_state":
        return nxt.astype(np.float32)
    action = nxt - s
    if len(s) > 1:
        rel = Rotation.from_rotvec(nxt[:, 3:6]) * Rotation.from_rotvec(s[:, 3:6]).inv()
        action[:, 3:6] = rel.as_rotvec()
    action[-1] = 0.0
    return action.astype(np.float32)


def feature_stats(values: np.ndarray) -> dict[str, np.ndarray]:
    """LeRobot per-episode statistics of a low-dimensional feature.

    Args:
        values: (N,) or (N, D) numbers.

    Returns:
        ``min``, ``max``, ``mean``, ``std`` (population), each (D,) — (1,) for a
        1-D column — and ``count`` = [N].
    """
    v = np.asarray(values)
    v2 = v.reshape(len(v), -1)
    stats = {
        "min": v2.min(axis=0),
        "max": v2.max(axis=0),
        "mean": v2.mean(axis=0, dtype=np.float64),
        "std": v2.std(axis=0, dtype=np.float64),
    }
    stats["count"] = np.array([len(v)], dtype=np.int64)
    return stats


def image_stats(frames: np.ndarray) -> dict[str, np.ndarray]:
    """LeRobot per-episode statistics of a camera, over every pixel of every frame.

    Args:
        frames: (N, H, W, 3) uint8 RGB.

    Returns:
        ``min``, ``max``, ``mean``, ``std`` per channel, each (3, 1, 1) float64
        scaled to [0, 1] (value / 255), and ``count`` = [N]. Exact: computed
        from per-channel histograms of the uint8 values.
    """
    f = np.asarray(frames)
    if f.dtype != np.uint8 or f.ndim != 4 or f.shape[-1] != 3:
        raise ConversionError(f"frames must be (N, H, W, 3) uint8, got {f.shape} {f.dtype}")
    levels = np.arange(256, dtype=np.float64)
    out = {k: np.zeros((3, 1, 1)) for k in ("min", "max", "mean", "std")}
    for c in range(3):
        hist = np.bincount(f[..., c].ravel(), minlength=256).astype(np.float64)
        n = hist.sum()
        present = np.flatnonzero(hist)
        mean = float(hist @ levels) / n
        var = float(hist @ (levels - mean) ** 2) / n
        out["min"][c, 0, 0] = present[0] / 255.0
        out["max"][c, 0, 0] = present[-1] / 255.0
        out["mean"][c, 0, 0] = mean / 255.0
        out["std"][c, 0, 0] = math.sqrt(var) / 255.0
    out["count"] = np.array([len(f)], dtype=np.int64)
    return out


def _jsonable(stats: Mapping[str, Mapping[str, np.ndarray]]) -> dict:
    return {key: {k: np.asarray(v).tolist() for k, v in s.items()} for key, s in stats.items()}


def measured_fps(timestamps_s: Iterable[np.ndarray]) -> float:
    """The measured frame rate of a dataset: 1 / the median frame interval over all episodes.

    The same rule as the ``dataset.npz`` conversion (``frequency_hz``), so both
    exports of one manifest state the same frequency.

    Args:
        timestamps_s: per episode, (N,) float64 frame times in seconds.

    Raises:
        ConversionError: when there is no interval or the median is not positive.
    """
    dts = [np.diff(np.asarray(t, dtype=np.float64)) for t in timestamps_s]
    all_dts = np.concatenate(dts) if dts else np.empty(0)
    if len(all_dts) == 0:
        raise ConversionError("cannot measure the frame rate: no episode has two frames")
    median = float(np.median(all_dts))
    if not median > 0:
        raise ConversionError(f"cannot measure the frame rate: median frame interval {median} s")
    return 1.0 / median


# --------------------------------------------------------------------------- video


def encode_video(path: str | Path, frames: np.ndarray, fps: float, spec: VideoSpec = VideoSpec()) -> None:
    """Encode RGB frames to an MP4 (H.264) with frame i at time i / ``fps``.

    Args:
        path: output ``.mp4`` (its folder must exist).
        frames: (N, H, W, 3) uint8 RGB, H and W even (yuv420p).
        fps: frame rate, Hz (need not be an integer).
        spec: encoder settings.

    Raises:
        ConversionError: when a frame size is odd or the encoder fails.
    """
    n, h, w = frames.shape[:3]
    if h % 2 or w % 2:
        raise ConversionError(f"video size {w}x{h} must be even for {spec.pix_fmt}", path)
    ticks = _VIDEO_TIME_BASE.denominator / fps
    try:
        with av.open(str(path), "w", format="mp4") as container:
            stream = container.add_stream(spec.codec, rate=Fraction(fps).limit_denominator(100_000))
            stream.width, stream.height, stream.pix_fmt = w, h, spec.pix_fmt
            stream.time_base = _VIDEO_TIME_BASE
            stream.codec_context.time_base = _VIDEO_TIME_BASE
            stream.codec_context.gop_size = spec.gop_size
            stream.codec_context.max_b_frames = 0
            stream.options = {"crf": str(spec.crf), "preset": spec.preset, "bf": "0"}
            for i in range(n):
                frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(frames[i]), format="rgb24")
                frame.pts = round(i * ticks)
                frame.time_base = _VIDEO_TIME_BASE
                container.mux(stream.encode(frame))
            container.mux(stream.encode(None))
    except (av.FFmpegError, ValueError) as exc:
        raise ConversionError(f"video encoding failed: {exc}", path) from exc


def retime_video(src: str | Path, dst: str | Path, fps: float) -> int:
    """Copy an MP4 without re-encoding, storing frame i at time i / ``fps``.

    The frame order is the presentation order of ``src`` (no B-frames, so decode
    order equals presentation order).

    Returns:
        The number of frames written.

    Raises:
        ConversionError: when ``src`` cannot be read or has no video stream.
    """
    ticks = _VIDEO_TIME_BASE.denominator / fps
    try:
        with av.open(str(src)) as ic, av.open(str(dst), "w", format="mp4") as oc:
            if not ic.streams.video:
                raise ConversionError("no video stream", src)
            ins = ic.streams.video[0]
            out = oc.add_stream_from_template(ins)
            out.time_base = _VIDEO_TIME_BASE
            packets = [p for p in ic.demux(ins) if p.size]
            order = sorted(range(len(packets)), key=lambda k: packets[k].pts)
            rank = np.empty(len(packets), dtype=np.int64)
            rank[order] = np.arange(len(packets))
            for k, packet in enumerate(packets):
                packet.pts = packet.dts = round(int(rank[k]) * ticks)
                packet.time_base = _VIDEO_TIME_BASE
                packet.stream = out
                oc.mux(packet)
            return len(packets)
    except av.FFmpegError as exc:
        raise ConversionError(f"cannot rewrite video timestamps: {exc}", src) from exc


def video_info(path: str | Path, fps: float) -> dict:
    """The ``info`` block of a LeRobot video feature, read from the written file.

    Returns:
        ``{"video.fps", "video.height", "video.width", "video.codec",
        "video.pix_fmt", "video.is_depth_map", "video.channels", "has_audio"}``.
    """
    with av.open(str(path)) as c:
        s = c.streams.video[0]
        return {
            "video.fps": fps,
            "video.height": s.height,
            "video.width": s.width,
            "video.codec": s.codec_context.codec.canonical_name,
            "video.pix_fmt": s.pix_fmt,
            "video.is_depth_map": False,
            "video.channels": 3,
            "has_audio": bool(c.streams.audio),
        }


# --------------------------------------------------------------------------- writer


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _list_column(values: np.ndarray) -> pa.Array:
    v = np.ascontiguousarray(values, dtype=np.float32)
    offsets = np.arange(0, v.size + 1, v.shape[1], dtype=np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(v.reshape(-1)))


@dataclass
class _Episode:
    stem: str
    state: np.ndarray
    action: np.ndarray
    timestamps_s: np.ndarray
    image_stats: dict[str, dict[str, np.ndarray]]
    staged_videos: dict[str, Path]
    record: dict

    @property
    def frequency_hz(self) -> float:
        return 1.0 / float(np.median(np.diff(self.timestamps_s)))


class LeRobotWriter:
    """Writes a LeRobot v2.1 dataset, episode by episode, atomically.

    Everything is written into a temporary folder beside ``out_dir`` and renamed
    to ``out_dir`` by :meth:`finish`; :meth:`abort` (or leaving a ``with`` block
    on an exception) removes it. Videos are encoded as episodes arrive; the
    low-dimensional data (state, action, frame times: about 64 bytes a frame)
    stays in memory until :meth:`finish`, because ``fps`` (measured over all
    episodes, :func:`measured_fps`) defines the timestamps; the videos are then
    re-timed without re-encoding.

    Args:
        out_dir: the dataset folder to create; must not exist.
        task: the task text of every episode (``meta/tasks.jsonl``).
        action_rule: one of :data:`ACTION_RULES`.
        robot_type: ``robot_type`` in ``meta/info.json``.
        video: encoder settings.

    Raises:
        ConversionError: when ``out_dir`` exists, ``task`` is empty or the rule is unknown.
    """

    def __init__(
        self,
        out_dir: str | Path,
        task: str,
        action_rule: str = "next_state",
        robot_type: str = ROBOT_TYPE,
        video: VideoSpec = VideoSpec(),
    ):
        self.out_dir = Path(out_dir).absolute()
        if self.out_dir.exists():
            raise ConversionError(
                "output folder already exists; choose a new one (nothing is overwritten)", self.out_dir, code="output_exists"
            )
        if not task or not task.strip():
            raise ConversionError("task text is empty", code="bad_option")
        if action_rule not in ACTION_RULES:
            raise ConversionError(f"unknown action rule {action_rule!r}; use one of {', '.join(ACTION_RULES)}", code="bad_option")
        self.task = task
        self.action_rule = action_rule
        self.robot_type = robot_type
        self.video = video
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        self.tmp_dir = self.out_dir.with_name(f".{self.out_dir.name}.tmp-{os.getpid()}")
        if self.tmp_dir.exists():
            shutil.rmtree(self.tmp_dir)
        self.staging_dir = self.tmp_dir / ".staging"
        self.staging_dir.mkdir(parents=True)
        self._episodes: list[_Episode] = []
        self._camera_shapes: dict[str, tuple[int, int]] = {}

    def __enter__(self) -> "LeRobotWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def __len__(self) -> int:
        return len(self._episodes)

    def add_episode(
        self,
        state: np.ndarray,
        cameras: Mapping[str, np.ndarray],
        timestamps_s: np.ndarray,
        stem: str = "",
        record: dict | None = None,
    ) -> None:
        """Add one episode; its videos are encoded now.

        Args:
            state: (N, 7) state of each frame (:func:`episode_state`), N >= 2.
            cameras: video key -> (N, H, W, 3) uint8 RGB frames; every episode
                must have the same keys and frame sizes.
            timestamps_s: (N,) float64 capture times of the frames, seconds,
                strictly increasing (only their intervals are used: the frame rate).
            stem: the recording stem (kept in the export summary).
            record: JSON-ready facts about the episode for ``meta/dpflow.json``.

        Raises:
            ConversionError: on too few frames, mismatched arrays, times not
                increasing, a changed camera set or frame size.
        """
        where = f"episode {len(self._episodes)} ({stem or 'no stem'})"
        state = np.asarray(state, dtype=np.float32)
        t = np.asarray(timestamps_s, dtype=np.float64)
        if state.ndim != 2 or state.shape[1] != len(STATE_NAMES) or len(state) < 2:
            raise ConversionError(f"{where}: state must be (N>=2, {len(STATE_NAMES)}), got {state.shape}", code="too_short")
        if t.shape != (len(state),) or not np.all(np.diff(t) > 0):
            raise ConversionError(f"{where}: timestamps must be ({len(state)},) and strictly increasing, got {t.shape}")
        if not cameras:
            raise ConversionError(f"{where}: no camera frames")
        if self._camera_shapes and set(cameras) != set(self._camera_shapes):
            raise ConversionError(f"{where}: cameras {sorted(cameras)} differ from {sorted(self._camera_shapes)}")
        for key, frames in cameras.items():
            if frames.ndim != 4 or len(frames) != len(state) or frames.shape[-1] != 3 or frames.dtype != np.uint8:
                raise ConversionError(f"{where}: camera {key} has {frames.shape} {frames.dtype}, expected ({len(state)}, H, W, 3) uint8")
            hw = (int(frames.shape[1]), int(frames.shape[2]))
            if self._camera_shapes.get(key, hw) != hw:
                raise ConversionError(f"{where}: camera {key} frame size {hw} differs from {self._camera_shapes[key]}")
        staged: dict[str, Path] = {}
        stats: dict[str, dict[str, np.ndarray]] = {}
        provisional_fps = 1.0 / float(np.median(np.diff(t)))
        for key, frames in cameras.items():
            staged[key] = self.staging_dir / f"{key}-{len(self._episodes):06d}.mp4"
            encode_video(staged[key], frames, provisional_fps, self.video)
            stats[key] = image_stats(frames)
            self._camera_shapes[key] = (int(frames.shape[1]), int(frames.shape[2]))
        action = episode_actions(state, self.action_rule)
        self._episodes.append(_Episode(stem, state, action, t, stats, staged, dict(record or {})))

    def abort(self) -> None:
        """Remove the temporary folder; nothing is left behind."""
        shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def _features(self, video_infos: dict[str, dict]) -> dict:
        names = list(STATE_NAMES)
        features: dict[str, dict] = {
            STATE_KEY: {"dtype": "float32", "shape": [len(names)], "names": names},
            ACTION_KEY: {"dtype": "float32", "shape": [len(names)], "names": names},
        }
        for key, (h, w) in self._camera_shapes.items():
            features[key] = {
                "dtype": "video",
                "shape": [h, w, 3],
                "names": ["height", "width", "channels"],
                "info": video_infos[key],
            }
        for key, dtype in INDEX_FEATURES.items():
            features[key] = {"dtype": dtype, "shape": [1], "names": None}
        return features

    def _drop_off_rate(self, tolerance: float) -> dict[str, str]:
        """Drop episodes whose frequency is off the median episode frequency (the npz conversion's rule)."""
        ref = float(np.median([e.frequency_hz for e in self._episodes]))
        kept, dropped = [], {}
        for e in self._episodes:
            dev = abs(e.frequency_hz - ref) / ref
            if dev > tolerance:
                dropped[e.stem] = (
                    f"frequency_mismatch: measured {e.frequency_hz:.3f} Hz differs from the dataset's {ref:.3f} Hz "
                    f"by {dev:.1%} (tolerance {tolerance:.1%})"
                )
                for p in e.staged_videos.values():
                    p.unlink(missing_ok=True)
            else:
                kept.append(e)
        self._episodes = kept
        return dropped

    def finish(self, frequency_tolerance: float = 0.05, provenance: dict | None = None) -> LeRobotExport:
        """Write parquet files, videos and metadata, then rename into place.

        Episodes whose frequency differs from the median episode frequency by
        more than ``frequency_tolerance`` (relative) are left out (one ``fps``
        cannot describe them) and listed in ``skipped``. ``fps`` is
        :func:`measured_fps` of the episodes kept.

        Args:
            frequency_tolerance: relative tolerance, in (0, 1).
            provenance: written to ``meta/dpflow.json`` with each episode's
                ``record`` and the skipped episodes; LeRobot's loaders ignore that file.

        Returns:
            The export summary.

        Raises:
            ConversionError: when no episode is left, or ``out_dir`` appeared meanwhile.
        """
        if not 0 < frequency_tolerance < 1:
            raise ConversionError(f"frequency_tolerance must be in (0, 1), got {frequency_tolerance}", code="bad_option")
        if not self._episodes:
            self.abort()
            raise ConversionError("no episode to write: the dataset would be empty", self.out_dir, code="no_valid_episodes")
        skipped = self._drop_off_rate(frequency_tolerance)
        fps = measured_fps([e.timestamps_s for e in self._episodes])
        root = self.tmp_dir
        (root / "meta").mkdir(exist_ok=True)
        episodes_lines, stats_lines, records = [], [], []
        first_video: dict[str, Path] = {}
        start = 0
        for ep_index, ep in enumerate(self._episodes):
            n = len(ep.state)
            chunk = ep_index // CHUNKS_SIZE
            frame_index = np.arange(n, dtype=np.int64)
            columns = {
                "timestamp": (frame_index / fps).astype(np.float32),
                "frame_index": frame_index,
                "episode_index": np.full(n, ep_index, dtype=np.int64),
                "index": np.arange(start, start + n, dtype=np.int64),
                "task_index": np.zeros(n, dtype=np.int64),
            }
            table = pa.table(
                {
                    STATE_KEY: _list_column(ep.state),
                    ACTION_KEY: _list_column(ep.action),
                    **{k: pa.array(v) for k, v in columns.items()},
                }
            )
            data_path = root / DATA_PATH.format(episode_chunk=chunk, episode_index=ep_index)
            data_path.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(table, data_path)
            for key, staged in ep.staged_videos.items():
                video_path = root / VIDEO_PATH.format(episode_chunk=chunk, video_key=key, episode_index=ep_index)
                video_path.parent.mkdir(parents=True, exist_ok=True)
                written = retime_video(staged, video_path, fps)
                if written != n:
                    raise ConversionError(f"episode {ep_index}: video {key} holds {written} frames, expected {n}", staged)
                staged.unlink()
                first_video.setdefault(key, video_path)
            stats = {STATE_KEY: feature_stats(ep.state), ACTION_KEY: feature_stats(ep.action), **ep.image_stats}
            stats.update({k: feature_stats(v) for k, v in columns.items()})
            episodes_lines.append(json.dumps({"episode_index": ep_index, "tasks": [self.task], "length": n}))
            stats_lines.append(json.dumps({"episode_index": ep_index, "stats": _jsonable(stats)}))
            records.append({"episode_index": ep_index, "stem": ep.stem, "frames": n,
                            "frequency_hz": ep.frequency_hz, **ep.record})
            start += n
        n_episodes = len(self._episodes)
        features = self._features({k: video_info(p, fps) for k, p in first_video.items()})
        info = {
            "codebase_version": CODEBASE_VERSION,
            "robot_type": self.robot_type,
            "total_episodes": n_episodes,
            "total_frames": start,
            "total_tasks": 1,
            "total_videos": n_episodes * len(self._camera_shapes),
            "total_chunks": (n_episodes + CHUNKS_SIZE - 1) // CHUNKS_SIZE,
            "chunks_size": CHUNKS_SIZE,
            "fps": fps,
            "splits": {"train": f"0:{n_episodes}"},
            "data_path": DATA_PATH,
            "video_path": VIDEO_PATH,
            "features": features,
        }
        _atomic_write_text(root / EPISODES_PATH, "\n".join(episodes_lines) + "\n")
        _atomic_write_text(root / EPISODES_STATS_PATH, "\n".join(stats_lines) + "\n")
        _atomic_write_text(root / TASKS_PATH, json.dumps({"task_index": 0, "task": self.task}) + "\n")
        _atomic_write_text(root / INFO_PATH, json.dumps(info, indent=4) + "\n")
        record = {
            **(provenance or {}),
            "fps": fps,
            "action_rule": self.action_rule,
            "frequency_tolerance": frequency_tolerance,
            "episodes": records,
            "skipped": {**(provenance or {}).get("skipped", {}), **skipped},
        }
        _atomic_write_text(root / PROVENANCE_PATH, json.dumps(record, indent=2, default=str) + "\n")
        shutil.rmtree(self.staging_dir)
        try:
            os.rename(root, self.out_dir)
        except OSError as exc:
            self.abort()
            raise ConversionError(f"cannot move the dataset into place: {exc}", self.out_dir, code="output_exists") from exc
        h, w = next(iter(self._camera_shapes.values()))
        return LeRobotExport(
            path=self.out_dir,
            fps=fps,
            n_episodes=n_episodes,
            total_frames=start,
            video_keys=list(self._camera_shapes),
            image_size=[w, h],
            action_rule=self.action_rule,
            task=self.task,
            stems=[e.stem for e in self._episodes],
            skipped=record["skipped"],
            export_key=record.get("export_key"),
        )


def _align_job(job: dict) -> dict:
    """Worker: align one episode with ``align_episode``; frames go to a ``.npy`` memory map.

    Returns the arrays except the frames (``rgb_path``/``rgb_rows`` locate them),
    or ``{"ok": False, "code", "reason"}``; frames never travel through the pipe.
    """
    stem = job["stem"]
    try:
        ep = align_job_episode(job, job["rgb_dir"])
        if hasattr(ep.rgb, "flush"):
            ep.rgb.flush()
        return {
            "ok": True,
            "stem": stem,
            "timestamps_s": ep.timestamps_s,
            "state": episode_state(ep.eef_pos, ep.eef_rot_axis_angle, ep.gripper_width),
            "rgb_path": str(ep.rgb_path),
            "rgb_rows": ep.rgb_rows,
            "report": ep.report,
        }
    except DpflowError as exc:
        return {"ok": False, "stem": stem, "code": exc.code, "reason": str(exc)}


def _aligned_in_order(jobs: list[dict], workers: int) -> Iterator[dict]:
    """Results of :func:`_align_job` in job order; at most ``2 * workers`` jobs in flight
    (bounding the decoded frames waiting on disk)."""
    if workers <= 1 or len(jobs) <= 1:
        yield from map(_align_job, jobs)
        return
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["dpflow_core.lerobot"])
    with cf.ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=ctx) as pool:
        pending: deque = deque()
        it = iter(jobs)
        for job in it:
            pending.append((job, pool.submit(_align_job, job)))
            if len(pending) >= 2 * workers:
                break
        while pending:
            job, fut = pending.popleft()
            try:
                yield fut.result()
            except Exception as exc:  # noqa: BLE001 - a dead worker rejects its episode, not the export
                yield {"ok": False, "stem": job["stem"], "code": "internal_error", "reason": f"{type(exc).__name__}: {exc}"}
            nxt = next(it, None)
            if nxt is not None:
                pending.append((nxt, pool.submit(_align_job, nxt)))


def parse_image_size(value: str) -> tuple[int, int] | None:
    """``"W,H"`` (or ``"WxH"``) -> (W, H); ``"native"`` -> None (the camera's resolution).

    Raises:
        ConversionError: for anything else (``bad_option``).
    """
    if value.strip().lower() == "native":
        return None
    try:
        w, h = (int(v) for v in value.lower().replace("x", ",").split(","))
    except ValueError as exc:
        raise ConversionError(f"image size must be 'W,H' or 'native', got {value!r}", code="bad_option") from exc
    return w, h


def _export_key(inputs: Any, options: dict) -> str:
    doc = {
        "codebase_version": CODEBASE_VERSION,
        "converter_version": CONVERTER_VERSION,
        "options": options,
        "inputs": sorted([e.stem, e.sha256] for e in inputs.episodes),
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def export_key(manifest: Any, task_text: str | None = None, **options: Any) -> str:
    """Content address of the export :func:`export_lerobot` would make (64 hex digits).

    SHA-256 of the accepted inputs' stems and ``_vio.mcap`` hashes, the options
    that change the output (same keywords and defaults as :func:`export_lerobot`),
    the converter version and the LeRobot format version. Use it to name an
    output folder: equal keys mean the same export of the same bytes.
    """
    inputs = load_inputs(manifest)
    defaults = {
        "action_rule": "next_state", "image_size": None, "invalid_pose_policy": "trim",
        "min_overlap_fraction": 0.5, "frequency_tolerance": 0.05, "topics": DAS_DEFAULT, "video": VideoSpec(),
    }
    unknown = set(options) - set(defaults)
    if unknown:
        raise ConversionError(f"unknown export options {sorted(unknown)}", code="bad_option")
    o = {**defaults, **options}
    size = o["image_size"]
    return _export_key(
        inputs,
        {
            "task": task_text if task_text is not None else inputs.task or Path(inputs.root or "dataset").name,
            "action_rule": o["action_rule"],
            "image_size": None if size is None else [int(size[0]), int(size[1])],
            "invalid_pose_policy": o["invalid_pose_policy"],
            "min_overlap_fraction": o["min_overlap_fraction"],
            "frequency_tolerance": o["frequency_tolerance"],
            "topics": {"camera": o["topics"].camera, "pose": o["topics"].pose, "gripper": o["topics"].gripper},
            "video": dataclasses.asdict(o["video"]),
        },
    )


def load_export(dataset_dir: str | Path) -> LeRobotExport:
    """The summary of a dataset written by :class:`LeRobotWriter`, read back from its metadata.

    Raises:
        DatasetError: ``meta/info.json`` or ``meta/dpflow.json`` is missing or
            malformed, or the version is not :data:`CODEBASE_VERSION`.
    """
    layout = validate_lerobot_dataset(dataset_dir)
    path = layout.root / PROVENANCE_PATH
    if not path.is_file():
        raise DatasetError(f"{PROVENANCE_PATH} not found: not written by dpflow", path, code="missing_metadata")
    record = _read_json(path, PROVENANCE_PATH)
    info = layout.info
    try:
        videos = [k for k, ft in info["features"].items() if ft.get("dtype") == "video"]
        h, w = info["features"][videos[0]]["shape"][:2]
        return LeRobotExport(
            path=layout.root.absolute(),
            fps=float(info["fps"]),
            n_episodes=int(info["total_episodes"]),
            total_frames=int(info["total_frames"]),
            video_keys=videos,
            image_size=[int(w), int(h)],
            action_rule=record["action_rule"],
            task=record["options"]["task"] if "options" in record else record.get("task", ""),
            stems=[e["stem"] for e in record["episodes"]],
            skipped=dict(record.get("skipped", {})),
            export_key=record.get("export_key"),
        )
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise DatasetError(f"metadata lacks a field: {exc!r}", path, code="bad_metadata") from exc


def export_lerobot(
    manifest: Any,
    out_dir: str | Path,
    task_text: str | None = None,
    action_rule: str = "next_state",
    image_size: tuple[int, int] | None = None,
    invalid_pose_policy: str = "trim",
    min_overlap_fraction: float = 0.5,
    frequency_tolerance: float = 0.05,
    topics: TopicMap = DAS_DEFAULT,
    verify_sha256: bool = True,
    workers: int = 0,
    video: VideoSpec = VideoSpec(),
    reuse_existing: bool = False,
    progress: Callable[[str, int, int], None] | None = None,
) -> LeRobotExport:
    """Export the accepted episodes of a pairing manifest as a LeRobot v2.1 dataset.

    The manifest is read by :func:`dpflow_core.conversion.load_inputs` and each
    episode decoded and aligned by :func:`dpflow_core.conversion.align_episode`,
    exactly as for ``dataset.npz``, in worker processes: inputs are checked
    against the manifest's size and SHA-256 first. Its state is
    :func:`episode_state`, its actions :func:`episode_actions`, its camera0
    frames the video :data:`CAMERA_KEY`. Episodes that cannot be aligned, or
    whose frequency is off (see :meth:`LeRobotWriter.finish`), are skipped with
    their reason; ``fps`` is :func:`measured_fps`. ``meta/dpflow.json`` records
    the manifest, every input's SHA-256 and every alignment report.

    Args:
        manifest: a pairing manifest (path, ``Manifest``, dict; see ``load_inputs``).
        out_dir: dataset folder to create; must not exist.
        task_text: the task text; default the manifest's task (the task folder name).
        action_rule: one of :data:`ACTION_RULES`.
        image_size: (W, H) of the videos, even numbers; None keeps the camera's size.
        invalid_pose_policy, min_overlap_fraction, topics: see ``align_episode``.
        frequency_tolerance: see :meth:`LeRobotWriter.finish`.
        verify_sha256: hash each input and compare with the manifest.
        workers: alignment worker processes; 0 = the number of CPU cores.
        video: encoder settings.
        reuse_existing: when ``out_dir`` holds an export with the same
            :func:`export_key` (same input hashes and options), return it
            (``reused=True``) instead of failing.
        progress: called as ``progress(stem, done, total)`` after each episode.

    Returns:
        The export summary.

    Raises:
        PairingError: the manifest is missing or malformed.
        ConversionError: ``out_dir`` exists (``output_exists``; with
            ``reuse_existing``: holds another export), an option is
            invalid (``bad_option``), or no episode survived (``no_valid_episodes``).
    """
    if action_rule not in ACTION_RULES:
        raise ConversionError(f"unknown action rule {action_rule!r}; use one of {', '.join(ACTION_RULES)}", code="bad_option")
    if invalid_pose_policy not in INVALID_POSE_POLICIES:
        raise ConversionError(
            f"invalid_pose_policy must be one of {INVALID_POSE_POLICIES}, got {invalid_pose_policy!r}", code="bad_option"
        )
    if image_size is not None:
        w, h = (int(v) for v in image_size)
        if w % 2 or h % 2:
            raise ConversionError(f"image size {w}x{h} must be even (H.264 yuv420p)", code="bad_option")
        image_size = (w, h)
    inputs = load_inputs(manifest)
    task = task_text if task_text is not None else inputs.task or Path(inputs.root or "dataset").name
    options = {
        "task": task,
        "action_rule": action_rule,
        "image_size": None if image_size is None else list(image_size),
        "invalid_pose_policy": invalid_pose_policy,
        "min_overlap_fraction": min_overlap_fraction,
        "frequency_tolerance": frequency_tolerance,
        "topics": {"camera": topics.camera, "pose": topics.pose, "gripper": topics.gripper},
        "video": dataclasses.asdict(video),
    }
    key = _export_key(inputs, options)
    if Path(out_dir).exists():
        if reuse_existing:
            existing = load_export(out_dir)
            if existing.export_key == key:
                return dataclasses.replace(existing, reused=True)
            raise ConversionError(
                f"output folder holds another export (export_key {existing.export_key}, this one {key})",
                out_dir,
                code="output_exists",
            )
        raise ConversionError("output folder already exists; choose a new one (nothing is overwritten)", out_dir, code="output_exists")
    source = inputs.manifests[0] if inputs.manifests else None
    if not inputs.episodes:
        raise ConversionError(f"no valid episodes: the manifest accepts none ({len(inputs.rejected)} rejected)",
                              source, code="no_valid_episodes")
    skipped: dict[str, str] = {}
    n_workers = workers if workers and workers > 0 else (os.cpu_count() or 1)
    with LeRobotWriter(out_dir, task, action_rule, video=video) as writer:
        rgb_dir = writer.staging_dir / "frames"
        rgb_dir.mkdir()
        jobs = [
            alignment_job(e, image_size, topics, invalid_pose_policy, min_overlap_fraction, verify_sha256)
            | {"rgb_dir": str(rgb_dir)}
            for e in inputs.episodes
        ]
        files = {e.stem: e.files for e in inputs.episodes}
        for done, result in enumerate(_aligned_in_order(jobs, n_workers), 1):
            stem = result["stem"]
            if result["ok"]:
                a, b = result["rgb_rows"]
                rgb_path = Path(result["rgb_path"])
                frames = np.load(rgb_path, mmap_mode="r")[a:b]
                writer.add_episode(
                    result["state"], {CAMERA_KEY: frames}, result["timestamps_s"], stem,
                    record={"files": files[stem], "alignment": result["report"]},
                )
                del frames
                rgb_path.unlink()
            else:
                skipped[stem] = f"{result['code']}: {result['reason']}"
            if progress is not None:
                progress(stem, done, len(jobs))
        if not len(writer):
            raise ConversionError(f"no valid episodes: {len(jobs)} found, all rejected: {skipped}", source, code="no_valid_episodes")
        provenance = {
            "export_key": key,
            "manifests": inputs.manifests,
            "root": inputs.root,
            "options": options,
            "converter_version": CONVERTER_VERSION,
            "dpflow_version": __version__,
            "rejected_by_pairing": inputs.rejected,
            "skipped": skipped,
        }
        return writer.finish(frequency_tolerance, provenance)


# --------------------------------------------------------------------------- norm stats


@dataclass(frozen=True)
class LeRobotLayout:
    """The parts of a LeRobot dataset's metadata that norm stats rely on.

    Attributes:
        root: the dataset folder.
        info: ``meta/info.json`` as parsed.
        lengths: episode index -> number of frames (``meta/episodes.jsonl``).
        keys: openpi norm key (``state``, ``actions``) -> LeRobot feature key.
        dims: openpi norm key -> vector length D.
    """

    root: Path
    info: dict
    lengths: dict[int, int]
    keys: dict[str, str]
    dims: dict[str, int]

    def data_file(self, episode_index: int) -> Path:
        """The parquet file of an episode (``data_path`` template of ``info.json``)."""
        chunk = episode_index // int(self.info["chunks_size"])
        return self.root / self.info["data_path"].format(episode_chunk=chunk, episode_index=episode_index)


def _read_json(path: Path, what: str):
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{what} is not valid JSON: {exc}", path, code="bad_metadata") from exc


def validate_lerobot_dataset(dataset_dir: str | Path, expected_version: str = CODEBASE_VERSION) -> LeRobotLayout:
    """Check a LeRobot dataset's metadata before anything is computed from it.

    Reads only ``meta/info.json`` and ``meta/episodes.jsonl`` (local files).

    Args:
        dataset_dir: the dataset folder (the one holding ``meta/``).
        expected_version: the ``codebase_version`` required.

    Returns:
        The validated layout.

    Raises:
        DatasetError: when the folder or ``meta/info.json`` is missing (the
            dataset was never converted), ``codebase_version`` differs from
            ``expected_version`` (both named), a required field or feature is
            missing or malformed, ``meta/episodes.jsonl`` disagrees with the
            totals, or the dataset has no frames.
    """
    root = Path(dataset_dir)
    if not root.is_dir():
        raise DatasetError("dataset folder not found", root, code="missing_dataset")
    info_path = root / INFO_PATH
    if not info_path.is_file():
        raise DatasetError(
            f"{INFO_PATH} not found: this is not a converted LeRobot dataset "
            "(convert the recordings first: dpflow export-lerobot MANIFEST -o DIR)",
            info_path,
            code="missing_metadata",
        )
    info = _read_json(info_path, INFO_PATH)
    if not isinstance(info, dict):
        raise DatasetError("must hold a JSON object", info_path, code="bad_metadata")
    version = info.get("codebase_version")
    if version != expected_version:
        raise DatasetError(
            f"codebase_version is {version!r}, expected {expected_version!r} "
            f"(re-export the dataset with dpflow export-lerobot, or ask for {version!r} explicitly)",
            info_path,
            code="version_mismatch",
        )
    for key, kind in (("features", dict), ("data_path", str), ("chunks_size", int), ("total_episodes", int), ("total_frames", int)):
        if not isinstance(info.get(key), kind) or isinstance(info.get(key), bool):
            raise DatasetError(f"field {key!r} is missing or not a {kind.__name__}", info_path, code="bad_metadata")
    if info["chunks_size"] <= 0:
        raise DatasetError(f"field 'chunks_size' is {info['chunks_size']}, must be positive", info_path, code="bad_metadata")
    features = info["features"]
    keys, dims = {}, {}
    for norm_key, candidates in OPENPI_NORM_KEYS.items():
        found = next((c for c in candidates if c in features), None)
        if found is None:
            raise DatasetError(
                f"features has none of {list(candidates)} (needed for {norm_key!r}); features are {sorted(features)}",
                info_path,
                code="inconsistent_features",
            )
        ft = features[found] if isinstance(features[found], dict) else {}
        shape = ft.get("shape")
        if ft.get("dtype") not in ("float32", "float64"):
            raise DatasetError(
                f"feature {found!r} has dtype {ft.get('dtype')!r}, expected float32 or float64",
                info_path,
                code="inconsistent_features",
            )
        if not (isinstance(shape, list) and len(shape) == 1 and isinstance(shape[0], int) and shape[0] > 0):
            raise DatasetError(f"feature {found!r} has shape {shape!r}, expected [D] with D > 0", info_path, code="inconsistent_features")
        names = ft.get("names")
        if isinstance(names, list) and len(names) != shape[0]:
            raise DatasetError(f"feature {found!r} has shape {shape} but {len(names)} names", info_path, code="inconsistent_features")
        keys[norm_key], dims[norm_key] = found, shape[0]
    if info["total_episodes"] <= 0 or info["total_frames"] <= 0:
        raise DatasetError(
            f"dataset is empty: total_episodes {info['total_episodes']}, total_frames {info['total_frames']}",
            info_path,
            code="empty_dataset",
        )
    episodes_path = root / EPISODES_PATH
    if not episodes_path.is_file():
        raise DatasetError(f"{EPISODES_PATH} not found", episodes_path, code="missing_metadata")
    lengths: dict[int, int] = {}
    for line_no, line in enumerate(episodes_path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            ep, length = record["episode_index"], record["length"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise DatasetError(f"line {line_no} is not an episode record: {exc}", episodes_path, code="bad_metadata") from exc
        if not isinstance(ep, int) or not isinstance(length, int) or length < 0 or ep in lengths:
            raise DatasetError(f"line {line_no}: bad or repeated episode_index/length {ep!r}/{length!r}", episodes_path, code="bad_metadata")
        lengths[ep] = length
    if len(lengths) != info["total_episodes"] or sum(lengths.values()) != info["total_frames"]:
        raise DatasetError(
            f"{len(lengths)} episodes with {sum(lengths.values())} frames, but {INFO_PATH} says "
            f"total_episodes {info['total_episodes']}, total_frames {info['total_frames']}",
            episodes_path,
            code="inconsistent_metadata",
        )
    return LeRobotLayout(root=root, info=info, lengths=dict(sorted(lengths.items())), keys=keys, dims=dims)


def _vectors(arr: pa.Array, col: str, d: int, rows: int, where: Path) -> np.ndarray:
    """(rows, d) float64 from a list column, or DatasetError naming ``where``."""
    if not (pa.types.is_list(arr.type) or pa.types.is_fixed_size_list(arr.type) or pa.types.is_large_list(arr.type)):
        raise DatasetError(f"column {col!r} has type {arr.type}, expected a list of floats", where, code="inconsistent_data")
    if arr.null_count:
        raise DatasetError(f"column {col!r} has {arr.null_count} null rows", where, code="inconsistent_data")
    sizes = pc.list_value_length(arr).to_numpy(zero_copy_only=False)
    if rows and np.any(sizes != d):
        raise DatasetError(
            f"column {col!r} holds vectors of length {sorted(set(sizes.tolist()))}, feature shape is [{d}]",
            where,
            code="inconsistent_data",
        )
    return arr.flatten().to_numpy(zero_copy_only=False).astype(np.float64).reshape(rows, d)


def _read_lowdim_per_file(layout: LeRobotLayout) -> dict[str, np.ndarray]:
    """The careful path: one file at a time, so an error names the file."""
    columns = list(layout.keys.values())
    parts: dict[str, list[np.ndarray]] = {k: [] for k in layout.keys}
    for ep, length in layout.lengths.items():
        path = layout.data_file(ep)
        try:
            names = pq.read_schema(path).names
            table = pq.read_table(path, columns=columns + (["episode_index"] if "episode_index" in names else []))
        except (pa.ArrowInvalid, OSError, KeyError) as exc:
            raise DatasetError(f"cannot read columns {columns}: {exc}", path, code="bad_data") from exc
        if table.num_rows != length:
            raise DatasetError(f"{table.num_rows} rows, but {EPISODES_PATH} says length {length}", path, code="inconsistent_data")
        if "episode_index" in table.column_names:
            found = set(table.column("episode_index").to_pylist())
            if found - {ep}:
                raise DatasetError(f"episode_index column holds {sorted(found)}, expected {ep}", path, code="inconsistent_data")
        for norm_key, col in layout.keys.items():
            parts[norm_key].append(_vectors(table.column(col).combine_chunks(), col, layout.dims[norm_key], length, path))
    return {k: np.concatenate(v, axis=0) for k, v in parts.items()}


def read_lowdim(layout: LeRobotLayout) -> dict[str, np.ndarray]:
    """The state and action columns of every frame, from the parquet files only.

    All files are read in one multi-threaded pyarrow dataset scan; the
    ``episode_index`` column must then equal each episode's index repeated
    ``length`` times (order, row counts and identity in one check). When
    anything does not match, the files are read again one by one so that the
    error names the file at fault.

    Args:
        layout: a validated dataset (:func:`validate_lerobot_dataset`).

    Returns:
        openpi norm key -> (total_frames, D) float64, episodes in index order.

    Raises:
        DatasetError: when a parquet file is missing or unreadable, lacks a
            column, has a row count other than its episode's length or another
            episode's rows, or holds vectors of another length than the feature's shape.
    """
    paths = [layout.data_file(ep) for ep in layout.lengths]
    for ep, path in zip(layout.lengths, paths):
        if not path.is_file():
            raise DatasetError(f"parquet file of episode {ep} not found", path, code="missing_data")
    columns = list(layout.keys.values())
    expected = np.repeat(np.fromiter(layout.lengths.keys(), dtype=np.int64), np.fromiter(layout.lengths.values(), dtype=np.int64))
    try:
        table = pads.dataset([str(p) for p in paths], format="parquet").to_table(columns=[*columns, "episode_index"])
        episode_index = table.column("episode_index").to_numpy()
        if not np.array_equal(episode_index, expected):
            raise ValueError("episode_index does not match meta/episodes.jsonl")
        return {
            k: _vectors(table.column(col).combine_chunks(), col, layout.dims[k], len(expected), layout.root)
            for k, col in layout.keys.items()
        }
    except (pa.ArrowException, OSError, KeyError, ValueError, DatasetError):
        result = _read_lowdim_per_file(layout)
        if sum(len(v) for v in result.values()) != len(expected) * len(result):
            raise DatasetError("parquet rows do not match meta/episodes.jsonl", layout.root, code="inconsistent_data")
        return result


def norm_stats_of(values: np.ndarray) -> NormStats:
    """openpi statistics of (T, D) values: mean, population std, exact q01 and q99, each (D,) float64.

    Raises:
        DatasetError: when there are fewer than 2 rows or a value is not finite.
    """
    v = np.asarray(values, dtype=np.float64)
    if len(v) < 2:
        raise DatasetError(f"need at least 2 frames for statistics, got {len(v)}", code="empty_dataset")
    if not np.all(np.isfinite(v)):
        raise DatasetError(f"{np.count_nonzero(~np.isfinite(v))} values are not finite", code="bad_data")
    q01, q99 = np.quantile(v, [0.01, 0.99], axis=0)
    return NormStats(mean=v.mean(axis=0), std=v.std(axis=0), q01=q01, q99=q99)


def compute_openpi_norm_stats(dataset_dir: str | Path, expected_version: str = CODEBASE_VERSION) -> dict[str, NormStats]:
    """openpi norm stats of a LeRobot dataset, from its parquet columns only.

    Args:
        dataset_dir: the dataset folder.
        expected_version: required ``codebase_version`` of ``meta/info.json``.

    Returns:
        ``{"state": NormStats, "actions": NormStats}``.

    Raises:
        DatasetError: see :func:`validate_lerobot_dataset` and :func:`read_lowdim`.
    """
    return _norm_stats_of_layout(validate_lerobot_dataset(dataset_dir, expected_version))


def _norm_stats_of_layout(layout: LeRobotLayout) -> dict[str, NormStats]:
    try:
        return {k: norm_stats_of(v) for k, v in read_lowdim(layout).items()}
    except DatasetError as exc:
        if exc.path is None:
            raise DatasetError(exc.reason, layout.root, code=exc.code) from exc
        raise


def write_openpi_norm_stats(
    dataset_dir: str | Path,
    output: str | Path | None = None,
    overwrite: bool = False,
    expected_version: str = CODEBASE_VERSION,
) -> Path:
    """Compute and write openpi's ``norm_stats.json`` (``{"norm_stats": {"state": ..., "actions": ...}}``).

    Args:
        dataset_dir: the LeRobot dataset folder.
        output: the ``.json`` file to write, or a folder (an existing one, or any
            path not ending in ``.json``) to write ``norm_stats.json`` into, as in
            openpi's ``assets/<config>/<repo_id>/``; default ``<dataset_dir>/norm_stats.json``.
        overwrite: replace an existing file (an existing file with exactly the
            computed content is kept either way).
        expected_version: required ``codebase_version``.

    Returns:
        The written path.

    Raises:
        DatasetError: invalid dataset (see :func:`compute_openpi_norm_stats`) or
            an existing, different output without ``overwrite`` (``output_exists``).
    """
    out = Path(dataset_dir) / "norm_stats.json" if output is None else Path(output)
    if out.is_dir() or out.suffix.lower() != ".json":
        out = out / "norm_stats.json"
    layout = validate_lerobot_dataset(dataset_dir, expected_version)
    text = json.dumps({"norm_stats": {k: s.to_json() for k, s in _norm_stats_of_layout(layout).items()}}, indent=2) + "\n"
    if out.exists() and not overwrite:
        if out.is_file() and out.read_text() == text:
            return out
        raise DatasetError(
            "a different norm stats file already exists (pass --overwrite (overwrite=True) to replace it)", out, code="output_exists"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write_text(out, text)
    return out

"""The LeRobot writer, v3.0 and v2.1: episodes in, a dataset folder out.

Takes one episode at a time (state, action, timestamps, frames, task text); encodes its videos at
once (one code path for both formats), and at :meth:`LeRobotWriter.finish` gives the dataset in
the chosen layout:

* v2.1 (lerobot 0.3.x): one parquet file and one video per episode, ``meta/episodes.jsonl``,
  ``meta/tasks.jsonl`` and per-episode statistics (min, max, mean, std, count, as lerobot 0.3's
  ``compute_stats.py``) in ``meta/episodes_stats.jsonl``;
* v3.0 (lerobot 0.4.x): ``data/chunk-XXX/file-XXX.parquet`` holding many episodes (one row group
  each) up to ``data_files_size_in_mb``, ``videos/<key>/chunk-XXX/file-XXX.mp4`` concatenating
  episodes up to ``video_files_size_in_mb`` (each episode from a key frame; its place in the file is
  ``videos/<key>/from_timestamp``/``to_timestamp``), ``meta/tasks.parquet``, the episode index
  ``meta/episodes/chunk-000/file-000.parquet`` with per-episode statistics (:mod:`.stats`) and
  ``meta/stats.json`` aggregating them. Layout and column names as lerobot 0.4.4 writes them
  (``lerobot/datasets/lerobot_dataset.py``, ``utils.py``), read there and written here.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dpflow_core.errors import ConversionError
from dpflow_core.export.features import (
    ACTION_KEY, ACTION_RULES, CHUNKS_SIZE, DATA_FILES_SIZE_IN_MB, DATA_PATH, EPISODES_PATH,
    EPISODES_STATS_PATH, FORMATS, INDEX_FEATURES, INFO_PATH, PROVENANCE_PATH, ROBOT_TYPE, STATE_KEY, STATE_NAMES,
    ROT6D_STATE_NAMES, ROTATIONS, TASKS_PATH, V30_CHUNKS_SIZE, V30_DATA_PATH, V30_VERSION,
    V30_VIDEO_PATH, VIDEO_FILES_SIZE_IN_MB, VIDEO_PATH, episode_actions, measured_fps, with_rotation,
)
from dpflow_core.export.stats import camera_stats
from dpflow_core.export.v30 import V30Layout, write_v30
from dpflow_core.export.video import VideoSpec, encode_video, retime_video, video_info
from dpflow_core.files import install_dir, remove_stale_temporaries, temp_name, write_text_atomic
from dpflow_core.results import StageResult


@dataclass(frozen=True)
class LeRobotExport(StageResult):
    """Result of writing a LeRobot dataset; the value of the ``lerobot_dataset`` asset.

    ``to_dict``/``from_dict`` (:class:`~dpflow_core.results.StageResult`): ``from_dict`` also reads
    what the asset stored before its value was typed (no ``stems``, ``skipped``, ``reused``: their
    defaults). Equality leaves ``reused`` out: a reused export is the same export.

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
        codebase_version: the LeRobot format written, one of :data:`FORMATS`.
    """

    path: Path
    fps: float
    n_episodes: int
    total_frames: int
    video_keys: list[str]
    image_size: list[int]
    action_rule: str
    task: str
    stems: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    export_key: str | None = None
    reused: bool = field(default=False, compare=False)
    codebase_version: str = V30_VERSION


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


def _list_column(values: np.ndarray) -> pa.Array:
    """(N, D) float32 -> fixed_size_list<float32>[D], the arrow type of lerobot's ``Sequence(length=D)``."""
    v = np.ascontiguousarray(values, dtype=np.float32)
    return pa.FixedSizeListArray.from_arrays(pa.array(v.reshape(-1)), v.shape[1])


#: Rate the per-episode videos are first encoded at. One rate for every episode keeps the
#: encoder's parameter sets identical, so v3.0 can concatenate episodes without re-encoding;
#: the frames are re-timed to the measured fps afterwards.
_STAGING_FPS = 30.0


@dataclass
class _Episode:
    stem: str
    state: np.ndarray
    action: np.ndarray
    timestamps_s: np.ndarray
    image_stats: dict[str, dict[str, np.ndarray]]
    camera_stats: dict[str, dict[str, np.ndarray]]
    staged_videos: dict[str, Path]
    record: dict

    @property
    def frequency_hz(self) -> float:
        return 1.0 / float(np.median(np.diff(self.timestamps_s)))


class LeRobotWriter:
    """Writes a LeRobot dataset (v3.0 or v2.1), episode by episode, atomically.

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
        codebase_version: ``"v3.0"`` (default) or ``"v2.1"``.
        chunks_size: files per chunk folder (v3.0) or episodes per chunk (v2.1); default lerobot's 1000.
        data_files_size_in_mb, video_files_size_in_mb: v3.0: a data / video file takes episodes
            until it would reach this size (lerobot's defaults 100 and 200 MB).
        rotation: ``rotvec`` (7-D state and action) or ``rot6d`` (10-D), see :data:`ROTATIONS`.

    Raises:
        ConversionError: when ``out_dir`` exists, ``task`` is empty, the rule, the version or a
            size is invalid.
    """

    def __init__(
        self,
        out_dir: str | Path,
        task: str,
        action_rule: str = "next_state",
        robot_type: str = ROBOT_TYPE,
        video: VideoSpec = VideoSpec(),
        codebase_version: str = V30_VERSION,
        chunks_size: int | None = None,
        data_files_size_in_mb: float = DATA_FILES_SIZE_IN_MB,
        video_files_size_in_mb: float = VIDEO_FILES_SIZE_IN_MB,
        rotation: str = "rotvec",
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
        if codebase_version not in FORMATS:
            raise ConversionError(f"unknown LeRobot format {codebase_version!r}; use one of {', '.join(FORMATS)}", code="bad_option")
        if not (data_files_size_in_mb > 0 and video_files_size_in_mb > 0 and (chunks_size is None or chunks_size > 0)):
            raise ConversionError("chunks_size and the file sizes must be positive", code="bad_option")
        if rotation not in ROTATIONS:
            raise ConversionError(f"unknown rotation {rotation!r}; use one of {', '.join(ROTATIONS)}", code="bad_option")
        self.rotation = rotation
        self.codebase_version = codebase_version
        self.chunks_size = int(chunks_size or (V30_CHUNKS_SIZE if codebase_version == V30_VERSION else CHUNKS_SIZE))
        self.data_files_size_in_mb = data_files_size_in_mb
        self.video_files_size_in_mb = video_files_size_in_mb
        self.task = task
        self.action_rule = action_rule
        self.robot_type = robot_type
        self.video = video
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(self.out_dir.parent)  # a killed export's folder, however large
        self.tmp_dir = self.out_dir.with_name(temp_name(self.out_dir.name, unique=False))
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
            state: (N, 7) state of each frame (:func:`episode_state`, rotation vector), N >= 2;
                written 10-D, with the rotation as rot6d, when the writer's ``rotation`` is ``rot6d``.
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
        sampled: dict[str, dict[str, np.ndarray]] = {}
        for key, frames in cameras.items():
            staged[key] = self.staging_dir / f"{key}-{len(self._episodes):06d}.mp4"
            encode_video(staged[key], frames, _STAGING_FPS, self.video)
            if self.codebase_version == V30_VERSION:
                sampled[key] = camera_stats(frames)
            else:
                stats[key] = image_stats(frames)
            self._camera_shapes[key] = (int(frames.shape[1]), int(frames.shape[2]))
        action = with_rotation(episode_actions(state, self.action_rule), self.rotation)
        state = with_rotation(state, self.rotation)
        self._episodes.append(_Episode(stem, state, action, t, stats, sampled, staged, dict(record or {})))

    def abort(self) -> None:
        """Remove the temporary folder; nothing is left behind."""
        shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def _features(self, video_infos: dict[str, dict]) -> dict:
        names = list(ROT6D_STATE_NAMES if self.rotation == "rot6d" else STATE_NAMES)
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
        """Write parquet files, videos and metadata in the writer's format, then rename into place.

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
        episodes, start = [], 0
        for ep_index, ep in enumerate(self._episodes):
            n = len(ep.state)
            frame_index = np.arange(n, dtype=np.int64)
            columns = {
                "timestamp": (frame_index / fps).astype(np.float32),
                "frame_index": frame_index,
                "episode_index": np.full(n, ep_index, dtype=np.int64),
                "index": np.arange(start, start + n, dtype=np.int64),
                "task_index": np.zeros(n, dtype=np.int64),
            }
            table = pa.table({STATE_KEY: _list_column(ep.state), ACTION_KEY: _list_column(ep.action),
                              **{k: pa.array(v) for k, v in columns.items()}})
            episodes.append((ep_index, ep, table, columns, start))
            start += n
        if self.codebase_version == V30_VERSION:
            layout = V30Layout(self.task, tuple(self._camera_shapes), self.chunks_size,
                               self.data_files_size_in_mb, self.video_files_size_in_mb)
            first_video = write_v30(layout, root, fps, episodes)
        else:
            first_video = self._write_v21(root, fps, episodes)
        n_episodes = len(self._episodes)
        info = {
            "codebase_version": self.codebase_version,
            "robot_type": self.robot_type,
            "total_episodes": n_episodes,
            "total_frames": start,
            "total_tasks": 1,
        }
        if self.codebase_version == V30_VERSION:
            info |= {
                "chunks_size": self.chunks_size,
                "data_files_size_in_mb": self.data_files_size_in_mb,
                "video_files_size_in_mb": self.video_files_size_in_mb,
                "fps": fps,
                "splits": {"train": f"0:{n_episodes}"},
                "data_path": V30_DATA_PATH,
                "video_path": V30_VIDEO_PATH,
            }
        else:
            info |= {
                "total_videos": n_episodes * len(self._camera_shapes),
                "total_chunks": (n_episodes + self.chunks_size - 1) // self.chunks_size,
                "chunks_size": self.chunks_size,
                "fps": fps,
                "splits": {"train": f"0:{n_episodes}"},
                "data_path": DATA_PATH,
                "video_path": VIDEO_PATH,
            }
        info["features"] = self._features({k: video_info(p, fps) for k, p in first_video.items()})
        write_text_atomic(root / INFO_PATH, json.dumps(info, indent=4) + "\n")
        records = [{"episode_index": ep_index, "stem": ep.stem, "frames": len(ep.state),
                    "frequency_hz": ep.frequency_hz, **ep.record} for ep_index, ep, *_ in episodes]
        record = {
            **(provenance or {}),
            "codebase_version": self.codebase_version,
            "fps": fps,
            "action_rule": self.action_rule,
            "rotation": self.rotation,
            "frequency_tolerance": frequency_tolerance,
            "episodes": records,
            "skipped": {**(provenance or {}).get("skipped", {}), **skipped},
        }
        write_text_atomic(root / PROVENANCE_PATH, json.dumps(record, indent=2, default=str) + "\n")
        shutil.rmtree(self.staging_dir)
        try:
            installed = install_dir(root, self.out_dir)
        except OSError as exc:
            self.abort()
            raise ConversionError(f"cannot move the dataset into place: {exc}", self.out_dir, code="output_exists") from exc
        if not installed:
            self.abort()
            raise ConversionError("cannot move the dataset into place: another dataset appeared there meanwhile",
                                  self.out_dir, code="output_exists")
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
            codebase_version=self.codebase_version,
        )

    def _write_v21(self, root: Path, fps: float, episodes: list) -> dict[str, Path]:
        """One parquet file and one video per episode, and the ``.jsonl`` metadata."""
        episodes_lines, stats_lines = [], []
        first_video: dict[str, Path] = {}
        for ep_index, ep, table, columns, _ in episodes:
            n = len(ep.state)
            chunk = ep_index // self.chunks_size
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
        write_text_atomic(root / EPISODES_PATH, "\n".join(episodes_lines) + "\n")
        write_text_atomic(root / EPISODES_STATS_PATH, "\n".join(stats_lines) + "\n")
        write_text_atomic(root / TASKS_PATH, json.dumps({"task_index": 0, "task": self.task}) + "\n")
        return first_video

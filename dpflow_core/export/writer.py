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
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

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
from dpflow_core.export.rates import RATE_POLICIES, decode_frames, group_dir, plan_rates, resample_state
from dpflow_core.export.stats import camera_stats, feature_stats, image_stats
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
        skipped: stem -> reason, for episodes left out (not aligned, or off the dataset's rate under ``rate_policy``
            ``reject``).
        export_key: content address of the export (:func:`export_key`), when made from a manifest.
        reused: True when :func:`export_lerobot` found this export already in place.
        codebase_version: the LeRobot format written, one of :data:`FORMATS`.
        resampled: stems of the episodes put on the dataset's rate grid (``rate_policy`` ``resample``).
        rate_groups: the datasets written beside this one for other rates (``rate_policy`` ``group``): each
            ``{"path", "fps", "n_episodes", "total_frames", "stems"}``.
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
    resampled: list[str] = field(default_factory=list)
    rate_groups: list[dict[str, Any]] = field(default_factory=list)


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
    state7: np.ndarray  # the 7-D rotation-vector state as given, from which a resampled episode is made

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
        self._group_tmps: list[Path] = []

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
        self._episodes.append(_Episode(stem, with_rotation(state, self.rotation), action, t, stats, sampled, staged,
                                       dict(record or {}), state))

    def abort(self) -> None:
        """Remove the temporary folders; nothing is left behind."""
        for folder in (self.tmp_dir, *self._group_tmps):
            shutil.rmtree(folder, ignore_errors=True)

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

    def _resampled(self, ep: _Episode, rate_hz: float) -> _Episode:
        """``ep`` on the ``rate_hz`` grid (:mod:`.rates`): state interpolated, frames held and encoded again."""
        grid, state7, source = resample_state(ep.state7, ep.timestamps_s, rate_hz)
        staged, stats, sampled = {}, {}, {}
        for key, path in ep.staged_videos.items():
            held = decode_frames(path, len(ep.timestamps_s))[source]
            staged[key] = path.with_name(f"{path.stem}-{round(rate_hz)}hz.mp4")
            encode_video(staged[key], held, _STAGING_FPS, self.video)
            path.unlink()
            if self.codebase_version == V30_VERSION:
                sampled[key] = camera_stats(held)
            else:
                stats[key] = image_stats(held)
        record = {**ep.record, "resampled": {
            "from_hz": ep.frequency_hz, "to_hz": rate_hz, "frames_before": len(ep.timestamps_s), "frames_after": len(grid),
            "images": "latest frame at or before each step (sample and hold), encoded a second time",
            "low_dim": "position and gripper width linear, rotation slerp; actions made from the resampled state",
        }}
        action = with_rotation(episode_actions(state7, self.action_rule), self.rotation)
        return _Episode(ep.stem, with_rotation(state7, self.rotation), action, grid, stats, sampled, staged, record,
                        state7)

    def finish(self, frequency_tolerance: float = 0.05, provenance: dict | None = None,
               rate_policy: str = "resample") -> LeRobotExport:
        """Write parquet files, videos and metadata in the writer's format, then rename into place.

        An episode at another rate than the task's (the largest group agreeing within
        ``frequency_tolerance``, relative) is resampled onto the task's grid, written as a dataset of
        its own beside ``out_dir`` (``<name>-<rate>hz``), or left out and listed in ``skipped``, by
        ``rate_policy`` (:mod:`.rates`). ``fps`` is :func:`measured_fps` of the episodes written.

        Args:
            frequency_tolerance: relative tolerance, in (0, 1).
            provenance: written to ``meta/dpflow.json`` with each episode's
                ``record`` and the skipped episodes; LeRobot's loaders ignore that file.
            rate_policy: ``"resample"`` (default), ``"group"`` or ``"reject"``.

        Returns:
            The export summary (``resampled`` and ``rate_groups`` say what the policy did).

        Raises:
            ConversionError: when no episode is left, an option is invalid (``bad_option``), or ``out_dir``
                or a rate group's folder appeared meanwhile (``output_exists``).
        """
        if not 0 < frequency_tolerance < 1:
            raise ConversionError(f"frequency_tolerance must be in (0, 1), got {frequency_tolerance}", code="bad_option")
        if rate_policy not in RATE_POLICIES:
            raise ConversionError(f"rate_policy must be one of {RATE_POLICIES}, got {rate_policy!r}", code="bad_option")
        if not self._episodes:
            self.abort()
            raise ConversionError("no episode to write: the dataset would be empty", self.out_dir, code="no_valid_episodes")
        eps = self._episodes
        plan = plan_rates([e.frequency_hz for e in eps], rate_policy, frequency_tolerance)
        skipped = {eps[i].stem: reason for i, reason in plan.rejected.items()}
        for i in plan.rejected:
            for p in eps[i].staged_videos.values():
                p.unlink(missing_ok=True)
        common = {**(provenance or {}), "rate_policy": rate_policy, "frequency_tolerance": frequency_tolerance}
        groups = []  # (temporary folder, final folder, summary)
        for hz, members in plan.groups:  # before the main dataset: its metadata names what they became
            final = group_dir(self.out_dir, hz)
            if final.exists():
                raise ConversionError("rate group folder already exists; choose a new output (nothing is overwritten)",
                                      final, code="output_exists")
            tmp = final.with_name(temp_name(final.name, unique=False))
            self._group_tmps.append(tmp)
            groups.append((tmp, final, self._write(
                tmp, [eps[i] for i in members], {**common, "rate_group_of": str(self.out_dir), "skipped": {}})))
        rate_groups = [{"path": str(final), **{k: g[k] for k in ("fps", "n_episodes", "total_frames", "stems")}}
                       for _, final, g in groups]
        self._episodes = [eps[i] for i in plan.main] + [self._resampled(eps[i], plan.rate_hz) for i in plan.resample]
        warnings = [{"stem": e.stem, "code": "rate_resampled", "reason": (
            f"measured {e.record['resampled']['from_hz']:.3f} Hz, resampled to the dataset's {plan.rate_hz:.3f} Hz "
            f"({e.record['resampled']['frames_before']} -> {e.record['resampled']['frames_after']} frames, "
            "images held, poses interpolated)")} for e in self._episodes if "resampled" in e.record]
        main = self._write(self.tmp_dir, self._episodes, {
            **common, "skipped": {**(provenance or {}).get("skipped", {}), **skipped}, "rate_groups": rate_groups,
            "warnings": warnings})
        shutil.rmtree(self.staging_dir)
        installed = []
        try:
            for tmp, final, _ in groups:
                self._install(tmp, final)
                installed.append(final)
            self._install(self.tmp_dir, self.out_dir)
        except ConversionError:
            for final in installed:  # a rate group is only meaningful beside its dataset
                shutil.rmtree(final, ignore_errors=True)
            raise
        h, w = next(iter(self._camera_shapes.values()))
        return LeRobotExport(
            path=self.out_dir,
            fps=main["fps"],
            n_episodes=main["n_episodes"],
            total_frames=main["total_frames"],
            video_keys=list(self._camera_shapes),
            image_size=[w, h],
            action_rule=self.action_rule,
            task=self.task,
            stems=main["stems"],
            skipped=main["record"]["skipped"],
            export_key=main["record"].get("export_key"),
            codebase_version=self.codebase_version,
            resampled=[e["stem"] for e in warnings],
            rate_groups=rate_groups,
        )

    def _install(self, tmp: Path, final: Path) -> None:
        try:
            installed = install_dir(tmp, final)
        except OSError as exc:
            self.abort()
            raise ConversionError(f"cannot move the dataset into place: {exc}", final, code="output_exists") from exc
        if not installed:
            self.abort()
            raise ConversionError("cannot move the dataset into place: another dataset appeared there meanwhile",
                                  final, code="output_exists")

    def _write(self, root: Path, episodes: list[_Episode], record: dict) -> dict:
        """The dataset of ``episodes`` written into the folder ``root``; its fps, totals, stems and ``record``
        as written to ``meta/dpflow.json``."""
        fps = measured_fps([e.timestamps_s for e in episodes])
        (root / "meta").mkdir(parents=True, exist_ok=True)
        rows, start = [], 0
        for ep_index, ep in enumerate(episodes):
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
            rows.append((ep_index, ep, table, columns, start))
            start += n
        if self.codebase_version == V30_VERSION:
            layout = V30Layout(self.task, tuple(self._camera_shapes), self.chunks_size,
                               self.data_files_size_in_mb, self.video_files_size_in_mb)
            first_video = write_v30(layout, root, fps, rows)
        else:
            first_video = self._write_v21(root, fps, rows)
        n_episodes = len(episodes)
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
        record = {
            **record,
            "codebase_version": self.codebase_version,
            "fps": fps,
            "action_rule": self.action_rule,
            "rotation": self.rotation,
            "episodes": [{"episode_index": ep_index, "stem": ep.stem, "frames": len(ep.state),
                          "frequency_hz": ep.frequency_hz, **ep.record} for ep_index, ep, *_ in rows],
        }
        write_text_atomic(root / PROVENANCE_PATH, json.dumps(record, indent=2, default=str) + "\n")
        return {"fps": fps, "n_episodes": n_episodes, "total_frames": start, "stems": [e.stem for e in episodes],
                "record": record}

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

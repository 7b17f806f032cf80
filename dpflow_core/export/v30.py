"""LeRobot v3.0 files: many episodes per data and video file, the episode index, tasks and global stats.

Takes the episodes a :class:`~dpflow_core.export.writer.LeRobotWriter` collected (state, action and
index columns as arrow tables, per-episode camera statistics, staged per-episode videos); gives
``data/chunk-XXX/file-XXX.parquet``, ``videos/<key>/chunk-XXX/file-XXX.mp4``,
``meta/episodes/chunk-000/file-000.parquet``, ``meta/tasks.parquet`` and ``meta/stats.json``, as
lerobot 0.4.4 writes them (see the writer's module docstring and docs/formats.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dpflow_core.errors import ConversionError
from dpflow_core.export.features import ACTION_KEY, STATE_KEY, STATS_PATH, V30_DATA_PATH, V30_EPISODES_PATH, V30_TASKS_PATH, V30_VIDEO_PATH
from dpflow_core.export.stats import aggregate_stats, vector_stats
from dpflow_core.export.video import concat_videos
from dpflow_core.files import write_text_atomic



@dataclass(frozen=True)
class V30Layout:
    """What the v3.0 files depend on besides the episodes.

    Attributes:
        task: the task text of every episode.
        camera_keys: the video feature keys.
        chunks_size: files per chunk folder.
        data_files_size_in_mb, video_files_size_in_mb: the size a data / video file may reach, MB.
    """

    task: str
    camera_keys: tuple[str, ...]
    chunks_size: int
    data_files_size_in_mb: float
    video_files_size_in_mb: float


def _next_file(chunks_size: int, chunk: int, file: int) -> tuple[int, int]:
    """lerobot's ``update_chunk_file_indices``: the next file index, a new chunk folder after ``chunks_size`` files."""
    return (chunk + 1, 0) if file == chunks_size - 1 else (chunk, file + 1)


def _jsonable(stats) -> dict:
    return {key: {k: np.asarray(v).tolist() for k, v in s.items()} for key, s in stats.items()}


def write_v30(owner: V30Layout, root: Path, fps: float, episodes: list) -> dict[str, Path]:
    """Write the v3.0 files of the episodes into ``root``; return the first video file per key.

    Args:
        owner: task, cameras, chunk and size limits.
        root: the temporary dataset folder.
        fps: the dataset's frame rate, Hz.
        episodes: per episode ``(episode_index, episode, data table, index columns, first global index)``.

    Raises:
        ConversionError: when a video's frame count differs from its episode's length.
    """
    limit_data = owner.data_files_size_in_mb * 1024 * 1024
    limit_video = owner.video_files_size_in_mb * 1024 * 1024
    rows: list[dict] = []
    all_stats: list[dict] = []
    parquet: pq.ParquetWriter | None = None
    data_at, data_bytes = (0, 0), 0
    # per video key: (chunk, file), the episodes' staged files and frame counts in the current file
    video_at = {k: (0, 0) for k in owner.camera_keys}
    video_files: dict[str, list[tuple[tuple[int, int], list[Path]]]] = {k: [((0, 0), [])] for k in owner.camera_keys}
    video_bytes = {k: 0 for k in owner.camera_keys}
    video_frames = {k: 0 for k in owner.camera_keys}
    try:
        for ep_index, ep, table, columns, start in episodes:
            n = len(ep.state)
            if parquet is not None and data_bytes + table.nbytes >= limit_data:
                parquet.close()
                parquet, data_at, data_bytes = None, _next_file(owner.chunks_size, *data_at), 0
            if parquet is None:
                path = root / V30_DATA_PATH.format(chunk_index=data_at[0], file_index=data_at[1])
                path.parent.mkdir(parents=True, exist_ok=True)
                parquet = pq.ParquetWriter(path, table.schema, compression="snappy")
            parquet.write_table(table, row_group_size=max(n, 1))
            data_bytes += table.nbytes
            row = {
                "episode_index": ep_index, "tasks": [owner.task], "length": n,
                "data/chunk_index": data_at[0], "data/file_index": data_at[1],
                "dataset_from_index": start, "dataset_to_index": start + n,
            }
            for key, staged in ep.staged_videos.items():
                size = staged.stat().st_size
                if video_files[key][-1][1] and video_bytes[key] + size >= limit_video:
                    video_at[key] = _next_file(owner.chunks_size, *video_at[key])
                    video_files[key].append((video_at[key], []))
                    video_bytes[key], video_frames[key] = 0, 0
                video_files[key][-1][1].append(staged)
                row |= {
                    f"videos/{key}/chunk_index": video_at[key][0], f"videos/{key}/file_index": video_at[key][1],
                    f"videos/{key}/from_timestamp": video_frames[key] / fps,
                    f"videos/{key}/to_timestamp": (video_frames[key] + n) / fps,
                }
                video_bytes[key] += size
                video_frames[key] += n
            stats = {STATE_KEY: vector_stats(ep.state), ACTION_KEY: vector_stats(ep.action), **ep.camera_stats}
            stats.update({k: vector_stats(v) for k, v in columns.items()})
            all_stats.append(stats)
            row |= {"meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0}
            row |= {f"stats/{feature}/{name}": np.asarray(v).tolist() for feature, s in stats.items() for name, v in s.items()}
            rows.append(row)
    finally:
        if parquet is not None:
            parquet.close()
    first_video: dict[str, Path] = {}
    lengths = [len(ep.state) for _, ep, *_ in episodes]
    for key, files in video_files.items():
        k = 0
        for (chunk, file), sources in files:
            path = root / V30_VIDEO_PATH.format(video_key=key, chunk_index=chunk, file_index=file)
            path.parent.mkdir(parents=True, exist_ok=True)
            counts = concat_videos(sources, path, fps)
            if counts != lengths[k:k + len(sources)]:
                raise ConversionError(f"video {key} holds {counts} frames per episode, expected {lengths[k:k + len(sources)]}", path)
            k += len(sources)
            for p in sources:
                p.unlink()
            first_video.setdefault(key, path)
    episodes_path = root / V30_EPISODES_PATH.format(chunk_index=0, file_index=0)
    episodes_path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), episodes_path)
    _write_tasks_parquet(root / V30_TASKS_PATH, [owner.task])
    write_text_atomic(root / STATS_PATH, json.dumps(_jsonable(aggregate_stats(all_stats)), indent=4) + "\n")
    return first_video


def _write_tasks_parquet(path: Path, tasks: list[str]) -> None:
    """``meta/tasks.parquet`` as lerobot 0.4 writes it: a pandas frame indexed by the task text, with a
    ``task_index`` column (the pandas metadata makes ``pandas.read_parquet`` restore that index)."""
    pandas_meta = {
        "index_columns": ["__index_level_0__"],
        "column_indexes": [{"name": None, "field_name": None, "pandas_type": "unicode", "numpy_type": "object",
                            "metadata": {"encoding": "UTF-8"}}],
        "columns": [
            {"name": "task_index", "field_name": "task_index", "pandas_type": "int64", "numpy_type": "int64", "metadata": None},
            {"name": None, "field_name": "__index_level_0__", "pandas_type": "unicode", "numpy_type": "object", "metadata": None},
        ],
        "creator": {"library": "pyarrow", "version": pa.__version__},
        "pandas_version": "2.2.3",
    }
    table = pa.table({"task_index": pa.array(range(len(tasks)), pa.int64()), "__index_level_0__": pa.array(tasks, pa.string())})
    pq.write_table(table.replace_schema_metadata({b"pandas": json.dumps(pandas_meta).encode()}), path)

"""LeRobot v3.0 and v2.1 exports and openpi norm stats (formats.md section 4).

pi0 / openpi and LeRobot users train from a LeRobot dataset, and their chain is
convert -> LeRobot dataset -> compute norm stats -> train. The statistics step
needs the converted dataset's own metadata: run on recordings that were never
converted (or on another format version) it fails late or appears to hang while
a Hub download is attempted. Here the chain is explicit:

* :func:`export_lerobot` decodes and aligns each accepted episode of a pairing
  manifest with :func:`dpflow_core.conversion.align_episode` (the same code as
  the ``dataset.npz`` conversion, in worker processes) and writes a LeRobot
  dataset with :class:`LeRobotWriter`: v3.0 by default (lerobot >= 0.4: many
  episodes per data and video file, ``meta/episodes/``, ``meta/tasks.parquet``,
  ``meta/stats.json`` with quantiles; see :mod:`.writer`), or v2.1 (lerobot 0.3,
  openpi)::

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
  content: mean, std, q01, q99 per dimension, as openpi's ``compute_norm_stats``
  computes them (:func:`openpi_norm_stats`). It validates ``meta/info.json``
  first and fails at once, naming the file and the field, when the dataset was
  not converted, has another ``codebase_version``, inconsistent features or no
  frames. Nothing here opens a network connection.

The state of every frame is ``[eef position (m, 3), eef rotation vector (rad, 3),
gripper width (m, 1)]`` (7 float32); the action follows :data:`ACTION_RULES`.

Modules: :mod:`~dpflow_core.export.features` (layout, keys, state and action),
:mod:`~dpflow_core.export.video`, :mod:`~dpflow_core.export.writer`, :mod:`~dpflow_core.export.export`
(the job), :mod:`~dpflow_core.export.validation` and :mod:`~dpflow_core.export.openpi` (norm stats).
Their public names are re-exported here.
"""

from __future__ import annotations

from dpflow_core._lazy import lazy_exports

#: openpi's defaults: ``Pi0Config.action_horizon`` and ``TrainConfig.batch_size`` (defined here, not in
#: :mod:`~dpflow_core.export.openpi`, so that the CLI's option defaults load no NumPy, pyarrow or SciPy).
OPENPI_ACTION_HORIZON = 50
OPENPI_BATCH_SIZE = 32
#: The LeRobot v2.1 format (one parquet file and one video per episode; openpi's pinned lerobot reads it).
CODEBASE_VERSION = "v2.1"
#: The LeRobot v3.0 format (many episodes per file; lerobot >= 0.4 reads only this one).
V30_VERSION = "v3.0"
#: Formats :func:`export_lerobot` writes; the first is the default.
FORMATS = (V30_VERSION, CODEBASE_VERSION)

# Names are imported from their module on first use (PEP 562): importing one submodule, or this
# package, does not load the others and their dependencies.
__getattr__, __dir__ = lazy_exports(__name__, {
    'ACTION_KEY': 'features',
    'ACTION_RULES': 'settings',
    'CAMERA_KEY': 'features',
    'CHUNKS_SIZE': 'features',
    'DATA_PATH': 'features',
    'EPISODES_PATH': 'features',
    'EPISODES_STATS_PATH': 'features',
    'INDEX_FEATURES': 'features',
    'INFO_PATH': 'features',
    'OPENPI_NORM_KEYS': 'features',
    'PROVENANCE_PATH': 'features',
    'ROBOT_TYPE': 'features',
    'STATE_KEY': 'features',
    'STATE_NAMES': 'features',
    'TASKS_PATH': 'features',
    'VIDEO_PATH': 'features',
    'episode_actions': 'features',
    'episode_state': 'features',
    'measured_fps': 'features',
    'STATS_PATH': 'features',
    'V30_DATA_PATH': 'features',
    'V30_EPISODES_PATH': 'features',
    'V30_TASKS_PATH': 'features',
    'V30_VIDEO_PATH': 'features',
    'aggregate_stats': 'stats',
    'camera_stats': 'stats',
    'vector_stats': 'stats',
    'VideoSpec': 'video',
    'concat_videos': 'video',
    'encode_video': 'video',
    'retime_video': 'video',
    'video_info': 'video',
    'LeRobotExport': 'writer',
    'LeRobotWriter': 'writer',
    'feature_stats': 'stats',
    'image_stats': 'stats',
    'export_key': 'export',
    'export_lerobot': 'export',
    'load_export': 'export',
    'parse_image_size': 'settings',
    'ExportSettings': 'settings',
    'LeRobotLayout': 'validation',
    'read_lowdim': 'validation',
    'validate_lerobot_dataset': 'validation',
    'NormStats': 'openpi',
    'RunningStats': 'openpi',
    'action_chunks': 'openpi',
    'compute_openpi_norm_stats': 'openpi',
    'norm_stats_of': 'openpi',
    'openpi_norm_stats': 'openpi',
    'write_openpi_norm_stats': 'openpi',
    'OpenpiNormStatsFile': 'openpi',
    'lerobot_path_in': 'export',
})

__all__ = [
    "ACTION_KEY", "ACTION_RULES", "CAMERA_KEY", "CHUNKS_SIZE", "CODEBASE_VERSION", "DATA_PATH", "EPISODES_PATH",
    "EPISODES_STATS_PATH", "INDEX_FEATURES", "INFO_PATH", "OPENPI_NORM_KEYS", "PROVENANCE_PATH", "ROBOT_TYPE",
    "STATE_KEY", "STATE_NAMES", "TASKS_PATH", "VIDEO_PATH", "LeRobotExport", "LeRobotLayout", "LeRobotWriter",
    "NormStats", "VideoSpec", "compute_openpi_norm_stats", "encode_video", "episode_actions", "episode_state",
    "export_key", "export_lerobot", "feature_stats", "image_stats", "load_export", "measured_fps", "norm_stats_of",
    "parse_image_size", "ExportSettings", "read_lowdim", "retime_video", "validate_lerobot_dataset", "video_info",
    "write_openpi_norm_stats", "FORMATS", "STATS_PATH", "V30_DATA_PATH", "V30_EPISODES_PATH", "V30_TASKS_PATH",
    "V30_VERSION", "V30_VIDEO_PATH", "aggregate_stats", "camera_stats", "vector_stats", "concat_videos",
    "RunningStats", "action_chunks", "openpi_norm_stats", "OpenpiNormStatsFile", "lerobot_path_in",
]

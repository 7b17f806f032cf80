"""The LeRobot v3.0 and v2.1 layouts: paths, feature keys, and the state and action of each frame.

Takes an episode's aligned end-effector pose (position m, rotation vector rad) and gripper width (m);
gives the 7-float32 state ``[x, y, z, rx, ry, rz, gripper_width]`` and the action by one of
:data:`ACTION_RULES`. Paths and keys follow ``lerobot/datasets/utils.py`` of lerobot 0.3.3 (v2.1) and 0.4.4 (v3.0).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
from scipy.spatial.transform import Rotation

from dpflow_core.errors import ConversionError
# the format versions live in the package (the CLI's option defaults read them without NumPy or SciPy)
from dpflow_core.export import CODEBASE_VERSION, FORMATS, V30_VERSION  # noqa: F401

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
# v3.0 (lerobot 0.4.x): chunk-XXX/file-XXX files, each holding many episodes.
V30_DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
V30_VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
V30_EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
V30_EPISODES_DIR = "meta/episodes"
V30_TASKS_PATH = "meta/tasks.parquet"
STATS_PATH = "meta/stats.json"
#: lerobot 0.4.x defaults: files per chunk folder, and the size a data / video file may reach (MB).
V30_CHUNKS_SIZE = 1000
DATA_FILES_SIZE_IN_MB = 100
VIDEO_FILES_SIZE_IN_MB = 200
#: Quantiles of lerobot 0.4.x statistics (``compute_stats.DEFAULT_QUANTILES``).
QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)
STATE_KEY = "observation.state"
ACTION_KEY = "action"
#: Video feature key of the centre camera (camera0).
CAMERA_KEY = "observation.images.camera0"
#: Names of the 7 state (and action) dimensions: metres, radians (rotation vector), metres.
STATE_NAMES = ("eef_pos_x", "eef_pos_y", "eef_pos_z", "eef_rot_x", "eef_rot_y", "eef_rot_z", "gripper_width")
#: Names of the 10 dimensions with the rotation as rot6d (``rotation="rot6d"``): metres, the first two
#: columns of the rotation matrix (:func:`dpflow_core.pose.rotvec_to_rot6d`, the trainer's convention), metres.
ROT6D_STATE_NAMES = ("eef_pos_x", "eef_pos_y", "eef_pos_z", *(f"eef_rot6d_{i}" for i in range(6)), "gripper_width")
from dpflow_core.export.settings import ACTION_RULES, ROTATIONS  # noqa: E402,F401 (declared with the settings)
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


def with_rotation(vectors: np.ndarray, rotation: str) -> np.ndarray:
    """(N, 7) ``[pos, rotvec, width]`` vectors (states or actions) in the chosen rotation.

    Args:
        vectors: (N, 7) as :func:`episode_state` / :func:`episode_actions` give them.
        rotation: one of :data:`ROTATIONS`; ``rot6d`` maps the rotation vector (absolute, or the
            relative rotation of a ``delta`` action) to its 6-D form, so a zero ``delta`` rotation
            becomes the identity ``[1, 0, 0, 0, 1, 0]``.

    Returns:
        (N, 7) unchanged for ``rotvec``; (N, 10) float32 ``[pos, rot6d, width]`` for ``rot6d``.

    Raises:
        ConversionError: for an unknown rotation.
    """
    if rotation not in ROTATIONS:
        raise ConversionError(f"unknown rotation {rotation!r}; use one of {', '.join(ROTATIONS)}", code="bad_option")
    v = np.asarray(vectors, dtype=np.float32)
    if rotation == "rotvec":
        return v
    from dpflow_core.pose import rotvec_to_rot6d

    return np.concatenate([v[:, :3], rotvec_to_rot6d(v[:, 3:6].astype(np.float64)).astype(np.float32), v[:, 6:]], axis=1)


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

"""What the policy observes and predicts, and how training samples are cut.

This module is the one place that defines the observation and the action of
dpflow's Diffusion Policy; the trainer, inference (:mod:`dpflow_core.inference`)
and the evaluation stage all use it. It runs over 500 lines because sample
timing, the pose representation and the normaliser statistics fitted on that
representation are one definition: split, they could drift apart. The torch
``Dataset`` that builds batches of these samples is :mod:`dpflow_core.train.batches`.

Vocabulary (Chi et al., Diffusion Policy, RSS 2023; its UMI variant, Chi et
al., RSS 2024):

- *anchor* ``t``: the step of the latest camera frame of a sample.
- ``n_obs_steps`` (To): observation history, ``k = To-1 .. 0`` steps of
  ``obs_down_sample_steps`` before the anchor.
- ``horizon`` (H): number of predicted actions, at ``t + k * action_down_sample_steps``
  for ``k = 0 .. H-1``: the first action is at the anchor's camera time.
- *edge padding*: times before the episode start read the first frame, times
  past the end the last one. Without ``action_padding`` an anchor needs its
  whole action horizon inside the episode, so an episode shorter than
  ``(H - 1) * action_down_sample_steps + 1`` frames gives no sample.
- *observation latency* (as UMI): the camera shows the world
  ``camera_obs_latency`` seconds before the moment the policy acts, the robot
  pose ``robot_obs_latency`` and the gripper width ``gripper_obs_latency``
  seconds before it. A deployed policy therefore sees low-dimensional state
  that is ``camera_obs_latency - *_obs_latency`` seconds *newer* than its
  latest frame. Training reproduces this: low-dimensional keys are read
  ``(camera_obs_latency - key latency) x dataset_frequeny`` steps after the
  camera step, linearly interpolated (positions, widths) or slerped
  (rotations), not rounded to a step. ``task.dataset_frequeny: 0`` turns the
  shifts off.

Which time each sample key reads, for anchor step ``t`` (frequency ``f``,
``d_o = obs_down_sample_steps``, ``d_a = action_down_sample_steps``, latencies in s):

==============================  ================================================
key                             steps read (k = To-1 .. 0, or 0 .. H-1)
==============================  ================================================
``camera0_rgb``                 ``t - k d_o`` (integer steps, never shifted)
``robot0_eef_pos`` / ``_rot_*`` ``t - k d_o + (camera - robot) f``  (interpolated)
``robot0_gripper_width``        ``t - k d_o + (camera - gripper) f``  (interpolated)
``action``                      ``t + k d_a``
==============================  ================================================

Pose representation (``task.pose_repr``, as UMI): every pose is first turned
from the camera pose the dataset holds into the TCP pose (``task.tx_cam_tcp``,
:mod:`dpflow_core.pose`). With ``relative`` (the default) each observed and
predicted pose is expressed in the frame of the *current* pose (the latest
observed one, after its latency shift); with ``abs`` it stays in the dataset's
world frame. Rotations always enter the network as rot6d, so the network's
``robot0_eef_rot_axis_angle`` observation is 6-D and its action is 10-D:
``[pos (3) m, rot6d (6), gripper width (1) m]``. The optional observation
``robot0_eef_rot_axis_angle_wrt_start`` is the rotation relative to the
episode's first pose (``robot0_demo_start_pose``), also as rot6d.
:func:`decode_action` undoes all of it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.spatial.transform import Rotation

from dpflow_core import pose as P
from dpflow_core.errors import DatasetError
from dpflow_core.replay_buffer import ReplayBuffer

log = logging.getLogger(__name__)

POS_KEY = "robot0_eef_pos"
ROT_KEY = "robot0_eef_rot_axis_angle"
GRIPPER_KEY = "robot0_gripper_width"
#: Optional observation: rotation relative to the episode's first pose (rot6d).
ROT_WRT_START_KEY = "robot0_eef_rot_axis_angle_wrt_start"
START_POSE_KEY = "robot0_demo_start_pose"

DEFAULT_RGB_KEYS: tuple[str, ...] = ("camera0_rgb",)
DEFAULT_LOWDIM_KEYS: tuple[str, ...] = (POS_KEY, ROT_KEY, GRIPPER_KEY)
#: The action keys in dataset units: end-effector position (m), rotation vector (rad), gripper width (m).
DEFAULT_ACTION_KEYS: tuple[str, ...] = (POS_KEY, ROT_KEY, GRIPPER_KEY)
POSE_REPRS = ("relative", "abs")
NORM_MODES = ("range", "gaussian")
#: Width of the absolute action in dataset units and of the network's action.
ABS_ACTION_DIM = 7
NET_ACTION_DIM = 10
_IDENTITY = P.as_tuple(np.eye(4))


@dataclass(frozen=True)
class ObsActionSpec:
    """Which keys form the observation and the action, and how samples are cut.

    Attributes:
        rgb_keys: image keys of the replay buffer, each ``(T, H, W, 3)`` uint8.
        lowdim_keys: low-dimensional observation keys: replay-buffer keys ``(T, D)``
            or ``robot0_eef_rot_axis_angle_wrt_start`` (derived).
        action_keys: the dataset keys the action is made of; the pose
            representation needs exactly ``(robot0_eef_pos, robot0_eef_rot_axis_angle,
            robot0_gripper_width)``.
        n_obs_steps: To, observation frames per sample.
        horizon: H, actions per sample.
        obs_down_sample_steps: stride (steps) between observation frames.
        action_down_sample_steps: stride (steps) between actions.
        obs_latency_steps: per low-dimensional key, how many steps (fractional)
            after the camera frame it is read (``(camera - key latency) x frequency``).
        obs_pose_repr, action_pose_repr: ``"relative"`` or ``"abs"``.
        tx_cam_tcp: the 4 x 4 pose of the TCP in the camera frame (nested tuples).
        lowdim_norm: ``"range"`` (to [-1, 1]) or ``"gaussian"`` (mean 0, std 1) for
            positions and widths.
        rot6d_norm: ``"identity"`` (UMI: rot6d passes through) or ``"range"``, which
            stretches the small rotations of a short horizon to [-1, 1] like the positions.
        action_padding: allow anchors whose action horizon runs past the episode end.
    """

    rgb_keys: tuple[str, ...] = DEFAULT_RGB_KEYS
    lowdim_keys: tuple[str, ...] = DEFAULT_LOWDIM_KEYS
    action_keys: tuple[str, ...] = DEFAULT_ACTION_KEYS
    n_obs_steps: int = 2
    horizon: int = 16
    obs_down_sample_steps: int = 1
    action_down_sample_steps: int = 1
    obs_latency_steps: Mapping[str, float] = field(default_factory=dict)
    obs_pose_repr: str = "relative"
    action_pose_repr: str = "relative"
    tx_cam_tcp: tuple[tuple[float, ...], ...] = _IDENTITY
    lowdim_norm: str = "range"
    rot6d_norm: str = "identity"
    action_padding: bool = False

    def __post_init__(self):
        for name in ("n_obs_steps", "horizon", "obs_down_sample_steps", "action_down_sample_steps"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if tuple(self.action_keys) != DEFAULT_ACTION_KEYS:
            raise ValueError(f"action_keys must be {list(DEFAULT_ACTION_KEYS)}, got {list(self.action_keys)}")
        for name in ("obs_pose_repr", "action_pose_repr"):
            if getattr(self, name) not in POSE_REPRS:
                raise ValueError(f"task.pose_repr.{name} must be one of {POSE_REPRS}, got {getattr(self, name)!r}")
        if self.lowdim_norm not in NORM_MODES:
            raise ValueError(f"task.lowdim_norm must be one of {NORM_MODES}, got {self.lowdim_norm!r}")
        if self.rot6d_norm not in ("identity", "range"):
            raise ValueError(f"task.rot6d_norm must be 'identity' or 'range', got {self.rot6d_norm!r}")
        for key, v in self.obs_latency_steps.items():
            if key in self.rgb_keys and float(v) != 0:
                raise ValueError(f"image key {key!r} sits at the anchor: its latency shift must be 0, got {v}")
            if not math.isfinite(float(v)):
                raise ValueError(f"latency steps of {key!r} must be finite, got {v}")
        P.tx_from_config([list(r) for r in self.tx_cam_tcp])

    @property
    def obs_keys(self) -> tuple[str, ...]:
        """All observation keys: images first, then low-dimensional ones."""
        return self.rgb_keys + self.lowdim_keys

    @property
    def min_episode_length(self) -> int:
        """Fewest frames an episode needs to give one sample."""
        return 1 if self.action_padding else (self.horizon - 1) * self.action_down_sample_steps + 1

    def latency(self, key: str) -> float:
        """Shift of low-dimensional key ``key`` after the camera frame, in steps (0 when not configured)."""
        return float(self.obs_latency_steps.get(key, 0.0))

    @property
    def tx(self) -> np.ndarray:
        """``tx_cam_tcp`` as a ``(4, 4)`` float64 array."""
        return np.asarray(self.tx_cam_tcp, dtype=np.float64)

    def net_dim(self, key: str, buffer_dim: int) -> int:
        """Width of observation ``key`` as the network sees it (rotations become rot6d)."""
        return 6 if key in (ROT_KEY, ROT_WRT_START_KEY) else int(buffer_dim)


def resolve_frequency(dataset_frequeny: float | None, buffer: ReplayBuffer) -> float:
    """The frequency (Hz) that scales observation latencies into steps.

    Args:
        dataset_frequeny: ``task.dataset_frequeny`` (the UMI key, misspelling
            included). None: take ``frequency_hz`` from the dataset's metadata;
            0: latency compensation off (warned loudly); a positive number: used
            as given (warned when it differs from the measured frequency by >1%).
        buffer: the opened replay buffer.

    Raises:
        DatasetError: for a negative or non-finite value.
    """
    measured = buffer.frequency_hz
    if dataset_frequeny is None:
        log.info("dataset frequency %.4g Hz taken from %s metadata", measured, buffer.path)
        return measured
    value = float(dataset_frequeny)
    if not math.isfinite(value) or value < 0:
        raise DatasetError(f"task.dataset_frequeny must be >= 0 Hz, got {dataset_frequeny!r}", path=buffer.path)
    if value == 0:
        log.warning(
            "\n" + "!" * 78 + "\n"
            "task.dataset_frequeny=0: observation-latency compensation is OFF.\n"
            f"The dataset was measured at {measured:.4g} Hz; pass task.dataset_frequeny={measured:.6g}\n"
            "(or leave it unset to use the measured value) unless this is intended.\n" + "!" * 78
        )
    elif abs(value - measured) > 0.01 * measured:
        log.warning(
            "task.dataset_frequeny=%s Hz differs from the %.4g Hz measured for %s: latency steps "
            "will be scaled by the value given",
            value,
            measured,
            buffer.path,
        )
    return value


def latency_steps(
    lowdim_keys: Sequence[str],
    camera_obs_latency: float,
    robot_obs_latency: float,
    gripper_obs_latency: float,
    frequency_hz: float,
) -> dict[str, float]:
    """Per low-dimensional key, the steps it is read after the camera frame (UMI's ``latency_steps``).

    ``(camera_obs_latency - robot_obs_latency) x frequency`` for pose keys and
    ``(camera_obs_latency - gripper_obs_latency) x frequency`` for keys naming
    a gripper; fractional (interpolated when sampled), all 0 when the frequency is 0.

    Args:
        lowdim_keys: the observation's low-dimensional keys.
        camera_obs_latency, robot_obs_latency, gripper_obs_latency: seconds.
        frequency_hz: ``task.dataset_frequeny`` as resolved by :func:`resolve_frequency`.

    Raises:
        ValueError: for a negative or non-finite latency.
    """
    lat = {"camera": camera_obs_latency, "robot": robot_obs_latency, "gripper": gripper_obs_latency}
    for name, value in lat.items():
        if not math.isfinite(float(value)) or float(value) < 0:
            raise ValueError(f"task.{name}_obs_latency must be >= 0 s, got {value!r}")
    out = {}
    for key in lowdim_keys:
        own = gripper_obs_latency if "gripper" in key else robot_obs_latency
        out[key] = (float(camera_obs_latency) - float(own)) * float(frequency_hz)
    return out


def split_episodes(
    n_episodes: int, val_ratio: float, seed: int, min_val_episodes: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """Split episodes into training and validation sets.

    ``max(min_val_episodes, round(E * val_ratio))`` episodes (at most E - 1) go to
    validation, drawn with ``numpy.random.default_rng(seed)``; none when ``val_ratio``
    is 0. ``task.val_min_episodes`` sets ``min_val_episodes`` (2 in the shipped configs,
    the fewest an evaluation accepts).

    Returns:
        (train_mask, val_mask): ``(E,)`` bool arrays.

    Raises:
        ValueError: when ``val_ratio`` is outside [0, 1), ``min_val_episodes`` < 1,
            or ``val_ratio`` is positive with fewer than two episodes (the split is by episode).
    """
    if not 0.0 <= val_ratio < 1.0:
        raise ValueError(f"val_ratio must be in [0, 1), got {val_ratio}")
    if int(min_val_episodes) < 1:
        raise ValueError(f"task.val_min_episodes must be >= 1, got {min_val_episodes}")
    val_mask = np.zeros(n_episodes, dtype=bool)
    if val_ratio > 0:
        if n_episodes < 2:
            raise ValueError(f"a validation split by episode needs at least 2 episodes, got {n_episodes}")
        n_val = min(max(1, int(min_val_episodes), round(n_episodes * val_ratio)), n_episodes - 1)
        val_mask[np.random.default_rng(seed).choice(n_episodes, size=n_val, replace=False)] = True
    return ~val_mask, val_mask


def sequence_index(episode_ends: np.ndarray, episode_mask: np.ndarray, spec: ObsActionSpec) -> np.ndarray:
    """All sample anchors of the selected episodes.

    Args:
        episode_ends: ``(E,)`` int64 cumulative episode ends.
        episode_mask: ``(E,)`` bool, the episodes to use.
        spec: the observation/action spec (horizon, strides, padding).

    Returns:
        ``(N, 3)`` int64 rows ``(anchor, episode_start, episode_end)``; ``episode_end`` exclusive.
    """
    ends = np.asarray(episode_ends, dtype=np.int64)
    starts = np.concatenate([[0], ends[:-1]])
    tail = 0 if spec.action_padding else (spec.horizon - 1) * spec.action_down_sample_steps
    rows = []
    for start, end in zip(starts[episode_mask], ends[episode_mask]):
        last = end - 1 - tail
        if last < start:
            continue
        anchors = np.arange(start, last + 1, dtype=np.int64)
        rows.append(np.stack([anchors, np.full_like(anchors, start), np.full_like(anchors, end)], axis=1))
    return np.concatenate(rows) if rows else np.zeros((0, 3), dtype=np.int64)


def obs_positions(spec: ObsActionSpec, key: str, rows: np.ndarray) -> np.ndarray:
    """``(N, To)`` float64 buffer positions (fractional steps) of observation ``key`` for sample ``rows``.

    ``rows``: ``(N, 3)`` ``(anchor, episode_start, episode_end)`` from :func:`sequence_index`.
    Oldest first; clipped to the episode (edge padding).
    """
    rows = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
    offsets = np.arange(spec.n_obs_steps - 1, -1, -1, dtype=np.float64) * spec.obs_down_sample_steps
    f = rows[:, :1] - offsets[None, :] + (0.0 if key in spec.rgb_keys else spec.latency(key))
    return np.clip(f, rows[:, 1:2], rows[:, 2:3] - 1)


def action_positions(spec: ObsActionSpec, rows: np.ndarray) -> np.ndarray:
    """``(N, H)`` int64 buffer indices of the actions of sample ``rows`` (edge-padded at the episode end)."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
    offsets = np.arange(spec.horizon, dtype=np.int64) * spec.action_down_sample_steps
    return np.clip(rows[:, :1] + offsets[None, :], rows[:, 1:2], rows[:, 2:3] - 1)


def obs_indices(spec: ObsActionSpec, key: str, anchor: int, start: int, end: int) -> np.ndarray:
    """``(To,)`` int64 buffer steps nearest to the times observation ``key`` reads for one anchor.

    The sample itself interpolates between steps (:func:`obs_positions`); this is for
    readers that index the buffer directly, such as the evaluation's baselines.
    """
    return np.rint(obs_positions(spec, key, np.array([[anchor, start, end]]))[0]).astype(np.int64)


def action_indices(spec: ObsActionSpec, anchor: int, start: int, end: int) -> np.ndarray:
    """``(H,)`` int64 buffer indices of the actions for one anchor (edge-padded at the episode end)."""
    return action_positions(spec, np.array([[anchor, start, end]]))[0]


def interpolate(arr: np.ndarray, positions: np.ndarray, rotation: bool = False) -> np.ndarray:
    """Values of a per-step signal at fractional buffer ``positions``.

    Args:
        arr: ``(T, D)`` values per step.
        positions: ``(...)`` float positions, each inside its episode (see
            :func:`obs_positions`), so that neighbours never cross an episode end.
        rotation: ``arr`` holds rotation vectors (rad): spherical linear
            interpolation between neighbouring steps (``scipy.spatial.transform``)
            instead of linear.

    Returns:
        ``(..., D)`` float64; exact at integer positions.
    """
    a = np.asarray(arr)
    f = np.asarray(positions, dtype=np.float64)
    i0 = np.floor(f).astype(np.int64)
    w = f - i0
    i1 = np.where(w > 0, i0 + 1, i0)
    v0 = np.asarray(a[i0.reshape(-1)], dtype=np.float64)
    v1 = np.asarray(a[i1.reshape(-1)], dtype=np.float64)
    wf = w.reshape(-1, 1)
    if rotation:
        r0 = Rotation.from_rotvec(v0)
        step = (r0.inv() * Rotation.from_rotvec(v1)).as_rotvec()
        out = (r0 * Rotation.from_rotvec(wf * step)).as_rotvec()
    else:
        out = v0 * (1.0 - wf) + v1 * wf
    return out.reshape(f.shape + (a.shape[-1],))


def lowdim_arrays(buffer: Mapping[str, np.ndarray], spec: ObsActionSpec) -> dict[str, np.ndarray]:
    """The low-dimensional replay-buffer arrays samples are read from, in memory (float64).

    Always the pose and gripper keys (the action and the current pose need
    them), the start pose when ``robot0_eef_rot_axis_angle_wrt_start`` is
    observed, and every other configured low-dimensional key.
    """
    keys = set(DEFAULT_ACTION_KEYS) | {k for k in spec.lowdim_keys if k != ROT_WRT_START_KEY}
    if ROT_WRT_START_KEY in spec.lowdim_keys:
        keys.add(START_POSE_KEY)
    return {k: np.asarray(buffer[k], dtype=np.float64) for k in sorted(keys)}


def read_raw(lowdim: Mapping[str, np.ndarray], spec: ObsActionSpec, rows: np.ndarray) -> dict[str, np.ndarray]:
    """Raw (dataset-frame, dataset-unit) low-dimensional observations and actions of sample ``rows``.

    Returns:
        ``{key: (N, To, D)}`` for the pose and gripper keys and every buffer key
        observed, each at its own latency-shifted, interpolated time;
        ``"robot0_demo_start_pose": (N, 6)`` when needed; ``"action": (N, H, 7)``
        the recorded absolute action.
    """
    rows = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
    out: dict[str, np.ndarray] = {}
    for key, arr in lowdim.items():
        if key == START_POSE_KEY:
            out[key] = arr[rows[:, 0]]
            continue
        out[key] = interpolate(arr, obs_positions(spec, key, rows), rotation=key == ROT_KEY)
    idx = action_positions(spec, rows)
    out["action"] = np.concatenate([lowdim[k][idx] for k in DEFAULT_ACTION_KEYS], axis=-1)
    return out


def _tcp(pos: np.ndarray, rotvec: np.ndarray, spec: ObsActionSpec) -> np.ndarray:
    mat = P.pos_rot_to_mat(pos, rotvec)
    return mat if P.is_identity(spec.tx_cam_tcp) else P.apply_tx(mat, spec.tx)


def encode_obs(raw: Mapping[str, np.ndarray], spec: ObsActionSpec) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Raw low-dimensional observations -> what the network sees, plus the current pose.

    Args:
        raw: ``{key: (N, To, D)}`` in the dataset frame and units (positions m, rotation
            vectors rad, widths m), oldest step first; ``robot0_demo_start_pose``
            ``(N, 6)`` when ``robot0_eef_rot_axis_angle_wrt_start`` is observed.
        spec: the representation.

    Returns:
        ``(obs, base)``: ``{lowdim_key: (N, To, D') float32}`` (rotations as rot6d, poses
        relative to the current TCP pose when ``obs_pose_repr`` is relative) and
        ``base``, ``(N, 4, 4)`` float64, the current (latest observed) TCP pose in the
        dataset's world frame, which :func:`encode_action` and :func:`decode_action` use.
    """
    tcp = _tcp(raw[POS_KEY], raw[ROT_KEY], spec)  # (N, To, 4, 4)
    base = tcp[:, -1]
    shown = P.relative_to(tcp, base[:, None]) if spec.obs_pose_repr == "relative" else tcp
    obs: dict[str, np.ndarray] = {}
    for key in spec.lowdim_keys:
        if key == POS_KEY:
            value = shown[..., :3, 3]
        elif key == ROT_KEY:
            value = P.mat3_to_rot6d(shown[..., :3, :3])
        elif key == ROT_WRT_START_KEY:
            start = raw[START_POSE_KEY]
            start_tcp = _tcp(start[:, :3], start[:, 3:], spec)
            value = P.mat3_to_rot6d(P.relative_to(tcp, start_tcp[:, None])[..., :3, :3])
        else:
            value = raw[key]
        obs[key] = np.asarray(value, dtype=np.float32)
    return obs, base


def encode_action(action: np.ndarray, base: np.ndarray, spec: ObsActionSpec) -> np.ndarray:
    """Recorded absolute actions ``(N, H, 7)`` (dataset frame) -> network actions ``(N, H, 10)`` float32.

    ``[pos (3) m, rot6d (6), gripper width (1) m]`` of the TCP, relative to
    ``base`` (``(N, 4, 4)``, from :func:`encode_obs`) when ``action_pose_repr`` is relative.
    """
    a = np.asarray(action, dtype=np.float64)
    tcp = _tcp(a[..., :3], a[..., 3:6], spec)
    if spec.action_pose_repr == "relative":
        tcp = P.relative_to(tcp, base[:, None])
    return np.concatenate([tcp[..., :3, 3], P.mat3_to_rot6d(tcp[..., :3, :3]), a[..., 6:7]], axis=-1).astype(
        np.float32
    )


def decode_action(net_action: np.ndarray, base: np.ndarray, spec: ObsActionSpec, frame: str = "dataset") -> np.ndarray:
    """Network actions ``(N, H, 10)`` -> absolute actions ``(N, H, 7)`` float64 ``[pos m, rotvec rad, width m]``.

    Undoes :func:`encode_action`: rot6d back to a rotation by Gram-Schmidt, the
    relative pose composed with ``base`` (``(N, 4, 4)``, the current TCP pose),
    and with ``frame="dataset"`` the TCP pose turned back into the camera pose
    the dataset records (``@ inv(tx_cam_tcp)``); ``frame="tcp"`` keeps the TCP pose.

    Raises:
        ValueError: for an unknown ``frame``, or a rot6d whose columns are parallel.
    """
    if frame not in ("dataset", "tcp"):
        raise ValueError(f"frame must be 'dataset' or 'tcp', got {frame!r}")
    a = np.asarray(net_action, dtype=np.float64)
    mat = np.zeros(a.shape[:-1] + (4, 4))
    mat[..., :3, :3] = P.rot6d_to_mat3(a[..., 3:9])
    mat[..., :3, 3] = a[..., :3]
    mat[..., 3, 3] = 1.0
    if spec.action_pose_repr == "relative":
        mat = P.absolute_from(mat, np.asarray(base, dtype=np.float64)[:, None])
    if frame == "dataset" and not P.is_identity(spec.tx_cam_tcp):
        mat = P.apply_tx(mat, np.linalg.inv(spec.tx))
    return np.concatenate([P.mat_to_pose(mat), a[..., 9:10]], axis=-1)


def action_array(buffer: Mapping[str, np.ndarray], spec: ObsActionSpec, index: np.ndarray | slice) -> np.ndarray:
    """The recorded absolute action at buffer ``index``: action keys concatenated, float32 ``(..., 7)``."""
    return np.concatenate([np.asarray(buffer[k][index], dtype=np.float32) for k in spec.action_keys], axis=-1)


def recorded_actions(buffer: Mapping[str, np.ndarray], spec: ObsActionSpec, rows: np.ndarray) -> np.ndarray:
    """The recorded absolute actions ``(N, H, 7)`` float64 of sample ``rows`` (ground truth for evaluation)."""
    idx = action_positions(spec, rows)
    return np.concatenate([np.asarray(buffer[k], dtype=np.float64)[idx] for k in DEFAULT_ACTION_KEYS], axis=-1)


def shape_meta(buffer: ReplayBuffer, spec: ObsActionSpec) -> dict[str, Any]:
    """Shapes the policy is built for: ``{"rgb": {key: [H, W, 3]}, "lowdim": {key: D'}, "action_dim": 10}``.

    ``D'`` is the width the network sees (6 for rotations, as rot6d).

    Raises:
        DatasetError: when a configured key is missing from the buffer, an image
            key is not ``(T, H, W, 3)`` or a low-dimensional key is not ``(T, D)``.
    """
    needed = list(spec.obs_keys) + list(spec.action_keys)
    if ROT_WRT_START_KEY in needed:
        needed = [k for k in needed if k != ROT_WRT_START_KEY] + [START_POSE_KEY]
    for key in needed:
        if key not in buffer:
            raise DatasetError(
                f"the configured key {key!r} is not in the dataset (it has {sorted(buffer)})", path=buffer.path
            )
    rgb = {}
    for key in spec.rgb_keys:
        shape = buffer[key].shape
        if len(shape) != 4 or shape[-1] != 3:
            raise DatasetError(f"image key {key!r} must be (T, H, W, 3), got {shape}", path=buffer.path)
        rgb[key] = [int(shape[1]), int(shape[2]), 3]
    lowdim = {}
    for key in [k for k in needed if k not in spec.rgb_keys]:
        shape = buffer[key].shape
        if len(shape) != 2:
            raise DatasetError(f"low-dimensional key {key!r} must be (T, D), got {shape}", path=buffer.path)
    for key, want in ((POS_KEY, 3), (ROT_KEY, 3), (GRIPPER_KEY, 1)):
        if buffer[key].shape[1] != want:
            raise DatasetError(f"{key!r} must be (T, {want}), got {buffer[key].shape}", path=buffer.path)
    for key in spec.lowdim_keys:
        lowdim[key] = spec.net_dim(key, 6 if key == ROT_WRT_START_KEY else buffer[key].shape[1])
    return {"rgb": rgb, "lowdim": lowdim, "action_dim": NET_ACTION_DIM}


def normalizer_modes(spec: ObsActionSpec, lowdim_dims: Mapping[str, int]) -> dict[str, list[str]]:
    """Per field and dimension how :class:`~dpflow_core.train.normalizer.LinearNormalizer` maps it.

    rot6d (``robot0_eef_rot_axis_angle``, ``..._wrt_start`` and action dims 3-8)
    uses ``spec.rot6d_norm`` (default ``identity``: its entries already lie in
    [-1, 1], as UMI); positions, widths and any other key use ``spec.lowdim_norm``.
    """
    modes = {
        key: [spec.rot6d_norm if key in (ROT_KEY, ROT_WRT_START_KEY) else spec.lowdim_norm] * int(d)
        for key, d in lowdim_dims.items()
    }
    modes["action"] = [spec.lowdim_norm] * 3 + [spec.rot6d_norm] * 6 + [spec.lowdim_norm]
    return modes


def normalizer_stats(
    buffer: ReplayBuffer, spec: ObsActionSpec, episode_mask: np.ndarray | None = None
) -> dict[str, dict[str, np.ndarray]]:
    """Statistics of every low-dimensional field as the network sees it, over the selected episodes.

    Computed on the representation (relative poses, rot6d), over every sample
    anchor of the selected episodes (observations over all To steps, actions
    over all H steps), as UMI fits its normaliser. Reads only the
    low-dimensional arrays (never the images). Fit it on the training episodes
    only, so that held-out episodes stay unseen.

    Args:
        buffer: the replay buffer.
        spec: what to observe and predict.
        episode_mask: ``(E,)`` bool, the episodes to fit on; None = all.

    Returns:
        ``{field: {"min", "max", "mean", "std"}}`` with ``(D,)`` float32 arrays,
        for each low-dimensional observation key and for ``"action"``.

    Raises:
        DatasetError: when the selected episodes give no sample.
    """
    mask = np.ones(len(buffer.episode_ends), bool) if episode_mask is None else np.asarray(episode_mask, bool)
    rows = sequence_index(buffer.episode_ends, mask, spec)
    if len(rows) == 0:
        raise DatasetError(
            f"no sample to fit the normaliser on: the episodes are shorter than {spec.min_episode_length} frames",
            path=getattr(buffer, "path", None),
        )

    def stats(arr: np.ndarray) -> dict[str, np.ndarray]:
        a = np.asarray(arr, dtype=np.float64).reshape(-1, arr.shape[-1])
        return {
            "min": a.min(axis=0).astype(np.float32),
            "max": a.max(axis=0).astype(np.float32),
            "mean": a.mean(axis=0).astype(np.float32),
            "std": a.std(axis=0).astype(np.float32),
        }

    lowdim = lowdim_arrays(buffer, spec)
    obs_parts: dict[str, list[np.ndarray]] = {k: [] for k in spec.lowdim_keys}
    act_parts = []
    for chunk in np.array_split(rows, max(1, len(rows) // 4096 + 1)):
        raw = read_raw(lowdim, spec, chunk)
        obs, base = encode_obs(raw, spec)
        for k in spec.lowdim_keys:
            obs_parts[k].append(obs[k])
        act_parts.append(encode_action(raw["action"], base, spec))
    out = {key: stats(np.concatenate(parts)) for key, parts in obs_parts.items()}
    out["action"] = stats(np.concatenate(act_parts))
    return out

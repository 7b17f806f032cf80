"""What the policy observes and predicts, and how training samples are cut.

This module is the one place that defines the observation and the action of
dpflow's Diffusion Policy; the trainer, the checkpoint loader and the
evaluation stage all use it.

Vocabulary (Chi et al., Diffusion Policy, RSS 2023; the UMI data layout):

- *anchor* ``t``: the step of the latest observation of a sample.
- ``n_obs_steps`` (To): observation history; frames ``t - k * obs_down_sample_steps``
  for ``k = To-1 .. 0``, each shifted back by its key's latency.
- ``horizon`` (H): number of predicted actions, at ``t + k * action_down_sample_steps``
  for ``k = 0 .. H-1``.
- *edge padding*: indices before the episode start repeat the first frame,
  indices past the end repeat the last one. Without ``action_padding`` an
  anchor needs its whole action horizon inside the episode, so an episode
  shorter than ``(H - 1) * action_down_sample_steps + 1`` frames gives no sample.
- *observation latency*: a camera frame stamped ``t`` shows the world some
  time earlier. ``latency_s * dataset_frequency_hz`` (rounded) steps of shift
  make training see what deployment will see. ``task.dataset_frequeny`` (the
  misspelled key of the UMI configs) sets that frequency; 0 turns the
  compensation off.

Default observation: ``camera0_rgb`` frames (uint8, H x W x 3) plus the
low-dimensional ``robot0_eef_pos`` (m), ``robot0_eef_rot_axis_angle`` (rad),
``robot0_gripper_width`` (m). Default action: the absolute 7-D
``[eef_pos (3), eef_rot_axis_angle (3), gripper_width (1)]``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from dpflow_core.errors import DatasetError
from dpflow_core.replay_buffer import ReplayBuffer

log = logging.getLogger(__name__)

DEFAULT_RGB_KEYS: tuple[str, ...] = ("camera0_rgb",)
DEFAULT_LOWDIM_KEYS: tuple[str, ...] = ("robot0_eef_pos", "robot0_eef_rot_axis_angle", "robot0_gripper_width")
#: The action: absolute end-effector position (m), rotation vector (rad) and gripper width (m).
DEFAULT_ACTION_KEYS: tuple[str, ...] = ("robot0_eef_pos", "robot0_eef_rot_axis_angle", "robot0_gripper_width")


@dataclass(frozen=True)
class ObsActionSpec:
    """Which keys form the observation and the action, and how samples are cut.

    Attributes:
        rgb_keys: image keys of the replay buffer, each ``(T, H, W, 3)`` uint8.
        lowdim_keys: low-dimensional observation keys, each ``(T, D)`` float32.
        action_keys: keys concatenated (in order) into the action, each ``(T, D)``.
        n_obs_steps: To, observation frames per sample.
        horizon: H, actions per sample.
        obs_down_sample_steps: stride (steps) between observation frames.
        action_down_sample_steps: stride (steps) between actions.
        obs_latency_steps: per observation key, how many steps it is shifted back.
        action_padding: allow anchors whose action horizon runs past the episode end.
    """

    rgb_keys: tuple[str, ...] = DEFAULT_RGB_KEYS
    lowdim_keys: tuple[str, ...] = DEFAULT_LOWDIM_KEYS
    action_keys: tuple[str, ...] = DEFAULT_ACTION_KEYS
    n_obs_steps: int = 2
    horizon: int = 16
    obs_down_sample_steps: int = 1
    action_down_sample_steps: int = 1
    obs_latency_steps: Mapping[str, int] = field(default_factory=dict)
    action_padding: bool = False

    def __post_init__(self):
        for name in ("n_obs_steps", "horizon", "obs_down_sample_steps", "action_down_sample_steps"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.action_keys:
            raise ValueError("action_keys must not be empty")
        if any(int(v) < 0 for v in self.obs_latency_steps.values()):
            raise ValueError(f"latency steps must be >= 0, got {dict(self.obs_latency_steps)}")

    @property
    def obs_keys(self) -> tuple[str, ...]:
        """All observation keys: images first, then low-dimensional ones."""
        return self.rgb_keys + self.lowdim_keys

    @property
    def min_episode_length(self) -> int:
        """Fewest frames an episode needs to give one sample."""
        return 1 if self.action_padding else (self.horizon - 1) * self.action_down_sample_steps + 1

    def latency(self, key: str) -> int:
        """Latency shift of observation ``key`` in steps (0 when not configured)."""
        return int(self.obs_latency_steps.get(key, 0))


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


def latency_steps(latencies_s: Mapping[str, float], frequency_hz: float) -> dict[str, int]:
    """Per-key latency in steps: ``round(latency seconds x frequency)``; all 0 when frequency is 0."""
    return {key: int(round(float(sec) * frequency_hz)) for key, sec in latencies_s.items()}


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
        ValueError: when ``val_ratio`` is outside [0, 1), or positive with fewer
            than two episodes (the split is by episode).
    """
    if not 0.0 <= val_ratio < 1.0:
        raise ValueError(f"val_ratio must be in [0, 1), got {val_ratio}")
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


def obs_indices(spec: ObsActionSpec, key: str, anchor: int, start: int, end: int) -> np.ndarray:
    """``(To,)`` buffer indices of observation ``key`` for one anchor (oldest first, edge-padded)."""
    offsets = np.arange(spec.n_obs_steps - 1, -1, -1, dtype=np.int64) * spec.obs_down_sample_steps
    return np.clip(anchor - spec.latency(key) - offsets, start, end - 1)


def action_indices(spec: ObsActionSpec, anchor: int, start: int, end: int) -> np.ndarray:
    """``(H,)`` buffer indices of the actions for one anchor (edge-padded at the episode end)."""
    offsets = np.arange(spec.horizon, dtype=np.int64) * spec.action_down_sample_steps
    return np.clip(anchor + offsets, start, end - 1)


def action_array(buffer: Mapping[str, np.ndarray], spec: ObsActionSpec, index: np.ndarray | slice) -> np.ndarray:
    """The action at buffer ``index``: action keys concatenated on the last axis, float32 ``(..., Da)``."""
    return np.concatenate([np.asarray(buffer[k][index], dtype=np.float32) for k in spec.action_keys], axis=-1)


def shape_meta(buffer: ReplayBuffer, spec: ObsActionSpec) -> dict[str, Any]:
    """Shapes the policy is built for: ``{"rgb": {key: [H, W, 3]}, "lowdim": {key: D}, "action_dim": Da}``.

    Raises:
        DatasetError: when a configured key is missing from the buffer, an image
            key is not ``(T, H, W, 3)`` or a low-dimensional key is not ``(T, D)``.
    """
    for key in spec.obs_keys + spec.action_keys:
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
    for key in spec.lowdim_keys + spec.action_keys:
        shape = buffer[key].shape
        if len(shape) != 2:
            raise DatasetError(f"low-dimensional key {key!r} must be (T, D), got {shape}", path=buffer.path)
        if key in spec.lowdim_keys:
            lowdim[key] = int(shape[1])
    action_dim = sum(int(buffer[k].shape[1]) for k in spec.action_keys)
    return {"rgb": rgb, "lowdim": lowdim, "action_dim": action_dim}


def normalizer_stats(
    buffer: ReplayBuffer, spec: ObsActionSpec, episode_mask: np.ndarray | None = None
) -> dict[str, dict[str, np.ndarray]]:
    """Statistics of every low-dimensional field over the steps of the selected episodes.

    Reads only the low-dimensional arrays (never the images). Fit it on the
    training episodes only, so that held-out episodes stay unseen.

    Args:
        buffer: the replay buffer.
        spec: what to observe and predict.
        episode_mask: ``(E,)`` bool, the episodes to fit on; None = all steps.

    Returns:
        ``{field: {"min", "max", "mean", "std"}}`` with ``(D,)`` float32 arrays,
        for each low-dimensional observation key and for ``"action"``.
    """

    def stats(arr: np.ndarray) -> dict[str, np.ndarray]:
        a = np.asarray(arr, dtype=np.float64).reshape(len(arr), -1)
        return {
            "min": a.min(axis=0).astype(np.float32),
            "max": a.max(axis=0).astype(np.float32),
            "mean": a.mean(axis=0).astype(np.float32),
            "std": a.std(axis=0).astype(np.float32),
        }

    index: np.ndarray | slice = slice(None)
    if episode_mask is not None:
        ends = np.asarray(buffer.episode_ends, dtype=np.int64)
        starts = np.concatenate([[0], ends[:-1]])
        index = np.concatenate([np.arange(s, e) for s, e, keep in zip(starts, ends, episode_mask) if keep])
    out = {key: stats(np.asarray(buffer[key])[index]) for key in spec.lowdim_keys}
    out["action"] = stats(action_array(buffer, spec, index))
    return out


class SequenceDataset(Dataset):
    """Training samples over a replay buffer: observation history plus action horizon.

    ``dataset[i]`` is ``{"obs": {rgb_key: (To, H, W, 3) uint8 tensor, lowdim_key:
    (To, D) float32 tensor}, "action": (H, Da) float32 tensor}``. Images stay
    uint8 so that worker processes send 4x less data; the policy converts them.

    Args:
        buffer: the replay buffer (memory-mapped; safe to pass to worker processes).
        spec: what to observe and predict.
        episode_mask: ``(E,)`` bool, the episodes this dataset draws from.
    """

    def __init__(self, buffer: ReplayBuffer, spec: ObsActionSpec, episode_mask: np.ndarray):
        self.buffer = buffer
        self.spec = spec
        self.index = sequence_index(buffer.episode_ends, np.asarray(episode_mask, dtype=bool), spec)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict[str, Any]:
        anchor, start, end = (int(v) for v in self.index[i])
        spec = self.spec
        obs = {}
        for key in spec.rgb_keys:
            obs[key] = torch.from_numpy(
                np.ascontiguousarray(self.buffer[key][obs_indices(spec, key, anchor, start, end)])
            )
        for key in spec.lowdim_keys:
            idx = obs_indices(spec, key, anchor, start, end)
            obs[key] = torch.from_numpy(np.asarray(self.buffer[key][idx], dtype=np.float32))
        action = action_array(self.buffer, spec, action_indices(spec, anchor, start, end))
        return {"obs": obs, "action": torch.from_numpy(action)}

    def collate(self, indices: Sequence[int]) -> dict[str, Any]:
        """One batch built in this process from sample ``indices`` (same layout as a DataLoader batch)."""
        return torch.utils.data.default_collate([self[i] for i in indices])

"""A trained checkpoint as a robot runs it: raw observations in, absolute targets with their times out.

:func:`load_policy` rebuilds the EMA policy of a trainer checkpoint and wraps
it in :class:`Policy`, which does every step between a robot's sensors and the
network, the same ones training did (:mod:`dpflow_core.train.data`):

1. camera poses (the dataset frame) -> TCP poses (``tx_cam_tcp``), then the
   checkpoint's pose representation (relative to the current pose, rot6d);
2. normalisation, DDIM sampling and unnormalisation (the network);
3. rot6d -> rotation, relative -> absolute, TCP -> the requested frame.

Entry points:

- :meth:`Policy.predict_action` for one robot step (or a batch of them);
- :meth:`Policy.predict_samples` and :func:`predict_dataset` for an evaluation:
  absolute predictions ``(N, H, 7)`` ``[pos m, rotvec rad, gripper m]`` in the
  dataset frame for sample anchors of a replay buffer, next to the recorded
  actions ``(N, H, 7)`` of the same anchors. Observations are cut exactly as in
  training (latency shifts, interpolation, edge padding), so what is evaluated
  is what a robot would run. Example::

      from dpflow_core.inference import load_policy, predict_dataset
      policy = load_policy("checkpoints/latest.ckpt")
      result = predict_dataset(policy, ReplayBuffer("dataset.npz"), episodes=[0, 4])
      result.predicted.shape == result.recorded.shape == (N, H, 7)

Nothing here imports Dagster; torch is imported on first use of a policy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dpflow_core.errors import DatasetError, RunError
from dpflow_core.files import atomic_path
from dpflow_core.replay_buffer import ReplayBuffer
from dpflow_core.train import data as D
from dpflow_core.train.data import (
    GRIPPER_KEY,
    POS_KEY,
    ROT_KEY,
    ROT_WRT_START_KEY,
    START_POSE_KEY,
    ObsActionSpec,
    encode_obs,
    recorded_actions,
    sequence_index,
)

ACTION_KEYS = (POS_KEY, ROT_KEY, GRIPPER_KEY)


def executed_action_steps(horizon: int, n_action_steps: int, action_dt_s: float, latency_s: float) -> np.ndarray:
    """Horizon steps a robot executes of one predicted chunk: ``(K,)`` int64, ``K <= n_action_steps``.

    Action ``k`` is for ``k * action_dt_s`` after the anchor frame's capture
    (:meth:`Policy.predict_action`). The policy acts ``latency_s`` after that capture
    (``task.camera_obs_latency``, plus any command latency), so the actions whose time is
    not after it are in the past and dropped, as UMI's controller drops them (it keeps the
    actions after ``now + exec latency``); of the rest the first ``n_action_steps`` are
    executed. Latency 0 drops action 0 alone: its time is the anchor's, now.

    Raises:
        ValueError: ``n_action_steps`` outside [1, horizon], a negative or non-finite latency
            or step, or a latency so long that no action of the chunk is left.
    """
    if not 1 <= int(n_action_steps) <= int(horizon):
        raise ValueError(f"n_action_steps must be in [1, horizon={horizon}], got {n_action_steps}")
    if not (math.isfinite(latency_s) and latency_s >= 0 and math.isfinite(action_dt_s) and action_dt_s > 0):
        raise ValueError(f"latency ({latency_s!r} s) must be >= 0 and the action step ({action_dt_s!r} s) > 0")
    first = int(math.floor(latency_s / action_dt_s + 1e-9)) + 1
    if first >= horizon:
        raise ValueError(
            f"a latency of {latency_s:g} s leaves no action of the {horizon}-step chunk ({action_dt_s:g} s apart) in the future"
        )
    return np.arange(first, min(first + int(n_action_steps), int(horizon)), dtype=np.int64)


class Policy:
    """A trained Diffusion Policy with its representation and normalisation (see the module docstring).

    Build it with :func:`load_policy`. Attributes: ``network`` (the torch module,
    eval mode), ``spec`` (:class:`~dpflow_core.train.data.ObsActionSpec`), ``cfg``
    (the resolved trainer config), ``frequency_hz`` (the dataset's, which times the
    actions), ``checkpoint`` (its payload's ``dataset`` entry: path, SHA-256, ...).
    """

    def __init__(self, network, spec: ObsActionSpec, cfg, frequency_hz: float, dataset: Mapping[str, Any], path: Path):
        self.network = network
        self.spec = spec
        self.cfg = cfg
        self.frequency_hz = float(frequency_hz)
        self.dataset = dict(dataset)
        self.path = path

    @property
    def n_obs_steps(self) -> int:
        return self.spec.n_obs_steps

    @property
    def horizon(self) -> int:
        return self.spec.horizon

    @property
    def action_dt_s(self) -> float:
        """Seconds between consecutive predicted actions (``action_down_sample_steps / frequency``)."""
        return self.spec.action_down_sample_steps / self.frequency_hz

    @property
    def camera_obs_latency_s(self) -> float:
        """``task.camera_obs_latency`` of the checkpoint (s; 0 when absent): from a frame's capture to
        the moment the policy acts on it, the latency training shifted the low-dimensional keys by."""
        from omegaconf import OmegaConf

        return float(OmegaConf.select(self.cfg, "task.camera_obs_latency", default=0.0) or 0.0)

    def executed_steps(self, command_latency_s: float = 0.0) -> np.ndarray:
        """The horizon steps a robot executes of each chunk (:func:`executed_action_steps`), for the
        checkpoint's camera latency plus ``command_latency_s`` (s, command to controller)."""
        return executed_action_steps(
            self.horizon, int(self.network.n_action_steps), self.action_dt_s, self.camera_obs_latency_s + float(command_latency_s)
        )

    def check_obs(self, obs: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], bool]:
        """``({key: (B, To, ...) array}, whether obs was batched)`` of an observation
        :meth:`predict_action` accepts (one robot gets B = 1); the server checks each request
        with it before stacking requests into one batch.

        Raises:
            ValueError: as :meth:`predict_action`.
        """
        spec = self.spec
        needed = list(spec.rgb_keys) + [POS_KEY, ROT_KEY]
        needed += [k for k in spec.lowdim_keys if k not in needed and k != ROT_WRT_START_KEY]
        if ROT_WRT_START_KEY in spec.lowdim_keys:
            needed.append(START_POSE_KEY)
        missing = [k for k in needed if k not in obs]
        if missing:
            raise ValueError(f"observation lacks {missing} (this policy reads {needed})")
        batched = np.asarray(obs[POS_KEY]).ndim == 3
        out = {}
        for key in needed:
            a = np.asarray(obs[key])
            if not batched:
                a = a[None]
            if key == START_POSE_KEY:
                if a.shape[1:] != (6,):
                    raise ValueError(f"{key} must be (6,) or (B, 6) [pos m, rotvec rad], got {a.shape}")
            elif a.shape[1] != spec.n_obs_steps:
                raise ValueError(
                    f"{key} holds {a.shape[1]} steps, the policy needs the last n_obs_steps={spec.n_obs_steps}"
                )
            if key in spec.rgb_keys:
                if a.dtype != np.uint8 or a.ndim != 5 or a.shape[-1] != 3:
                    raise ValueError(f"{key} must be uint8 (To, H, W, 3) RGB frames, got {a.dtype} {a.shape}")
            elif not np.all(np.isfinite(a)):
                raise ValueError(f"{key} holds non-finite values")
            out[key] = a
        return out, batched

    def _run(self, obs: Mapping[str, np.ndarray], generator=None) -> tuple[np.ndarray, np.ndarray]:
        import torch

        lowdim, base = encode_obs(obs, self.spec)
        device = next(self.network.parameters()).device
        net_obs = {k: torch.from_numpy(np.ascontiguousarray(obs[k])).to(device) for k in self.spec.rgb_keys}
        net_obs |= {k: torch.from_numpy(v).to(device) for k, v in lowdim.items()}
        pred = self.network.predict_action(net_obs, generator=generator)["action_pred"]
        return pred.detach().cpu().numpy(), base

    def predict_action(self, obs: Mapping[str, Any], generator=None, frame: str = "tcp") -> dict[str, np.ndarray]:
        """Absolute targets for the next ``horizon`` steps from the last ``n_obs_steps`` observations.

        Args:
            obs: raw observations, oldest step first, for one robot (``(To, ...)``)
                or a batch (``(B, To, ...)``): each image key ``(To, H, W, 3)`` uint8
                RGB at the size trained on; ``robot0_eef_pos`` ``(To, 3)`` m and
                ``robot0_eef_rot_axis_angle`` ``(To, 3)`` rad, the camera pose in the
                dataset's world frame (what Matrix Studio's VIO gives);
                ``robot0_gripper_width`` ``(To, 1)`` m; ``robot0_demo_start_pose``
                ``(6,)`` when the policy observes the rotation w.r.t. the episode
                start; optionally ``timestamp`` ``(To,)`` s, the camera frames' times.
            generator: optional ``torch.Generator`` for the initial noise; for a batch, also
                B of them (or None), each giving its observation the noise it gives it alone.
            frame: ``"tcp"`` (default): TCP poses (``pose @ tx_cam_tcp``), what a
                robot controller targets; ``"dataset"``: camera poses, comparable
                with the recordings.

        Returns:
            ``{"robot0_eef_pos": (H, 3) m, "robot0_eef_rot_axis_angle": (H, 3) rad,
            "robot0_gripper_width": (H, 1) m, "action": (H, 7) the three concatenated,
            "timestamp": (H,) s}`` float64 (with a leading B when ``obs`` was batched).
            Action k is for ``t + k * action_dt_s``, ``t`` the latest camera frame's
            time (``timestamp[-1]``, else 0); a robot executes :meth:`executed_steps` of them.

        Raises:
            ValueError: a key missing, a wrong step count, dtype or shape, non-finite values.
        """
        arrays, batched = self.check_obs(obs)
        net, base = self._run(arrays, generator)
        action = D.decode_action(net, base, self.spec, frame=frame)
        t0 = np.zeros(len(action))
        if "timestamp" in obs:
            ts = np.asarray(obs["timestamp"], dtype=np.float64)
            t0 = (ts[None] if not batched else ts)[:, -1]
        times = t0[:, None] + np.arange(self.horizon) * self.action_dt_s
        out = {
            POS_KEY: action[..., :3],
            ROT_KEY: action[..., 3:6],
            GRIPPER_KEY: action[..., 6:7],
            "action": action,
            "timestamp": times,
        }
        return out if batched else {k: v[0] for k, v in out.items()}

    def predict_samples(
        self, buffer: ReplayBuffer, rows: np.ndarray, batch_size: int = 64, seed: int = 0
    ) -> np.ndarray:
        """Absolute predictions ``(N, H, 7)`` float64 in the dataset frame for sample ``rows`` of ``buffer``.

        ``rows``: ``(N, 3)`` ``(anchor, episode_start, episode_end)`` from
        :func:`~dpflow_core.train.data.sequence_index`. Observations are cut as in
        training; the noise comes from a ``torch.Generator`` seeded with ``seed``
        (the same ``seed`` gives the same predictions on the same device).
        """
        import torch

        from dpflow_core.train.batches import SequenceDataset

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        ds = SequenceDataset(buffer, self.spec, np.zeros(len(buffer.episode_ends), bool))
        ds.index = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
        device = next(self.network.parameters()).device
        gen = torch.Generator(device=device).manual_seed(int(seed))
        out = []
        with torch.no_grad():
            for lo in range(0, len(ds), batch_size):
                s = ds.samples(range(lo, min(lo + batch_size, len(ds))))
                net_obs = {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in s["obs"].items()}
                pred = self.network.predict_action(net_obs, generator=gen)["action_pred"].cpu().numpy()
                out.append(D.decode_action(pred, s["base"], self.spec, frame="dataset"))
        return np.concatenate(out) if out else np.zeros((0, self.horizon, 7))


def load_policy(path: str | Path, device: str = "cpu", use_ema: bool = True) -> Policy:
    """Load a trainer checkpoint as a :class:`Policy` (EMA weights unless ``use_ema=False``).

    Raises:
        RunError: when the file is missing, unreadable, or lacks the weights, config,
            shapes, normaliser or dataset frequency.
    """
    from dpflow_core.train.checkpoint import load_checkpoint, load_network

    network, cfg, spec = load_network(path, device=device, use_ema=use_ema)
    payload = load_checkpoint(path, require_complete=False)
    dataset = payload.get("dataset") or {}
    freq = dataset.get("frequency_hz")
    if freq is None or not math.isfinite(float(freq)) or float(freq) <= 0:
        raise RunError(
            f"checkpoint's dataset entry has no usable frequency_hz ({freq!r}); actions cannot be timed",
            path=path,
            code="checkpoint_incomplete",
        )
    return Policy(network, spec, cfg, float(freq), dataset, Path(path))


@dataclass(frozen=True)
class DatasetPrediction:
    """Predictions of :func:`predict_dataset`.

    Attributes:
        rows: ``(N, 3)`` int64 ``(anchor, episode_start, episode_end)`` of each sample.
        episodes: ``(N,)`` int64 episode index of each sample.
        predicted: ``(N, H, 7)`` float64 absolute ``[pos m, rotvec rad, gripper m]``, dataset frame.
        recorded: ``(N, H, 7)`` float64, the recorded actions at the same steps.
        times_s: ``(N, H)`` float64, seconds from the episode start of each action step.
    """

    rows: np.ndarray
    episodes: np.ndarray
    predicted: np.ndarray
    recorded: np.ndarray
    times_s: np.ndarray


def predict_dataset(
    policy: Policy,
    buffer: ReplayBuffer,
    episodes: Sequence[int] | None = None,
    batch_size: int = 64,
    seed: int = 0,
    max_samples: int | None = None,
) -> DatasetPrediction:
    """Predict every sample anchor of the given episodes (all when None).

    Args:
        policy: from :func:`load_policy`.
        buffer: the replay buffer (the checkpoint's dataset, or one recorded the same way).
        episodes: episode indices; a held-out evaluation passes the validation episodes.
        batch_size: samples per network call.
        seed: noise seed (see :meth:`Policy.predict_samples`).
        max_samples: evenly spaced subset of at most this many anchors (None: all).

    Raises:
        DatasetError: an episode index out of range, or no sample (episodes shorter
            than the horizon needs).
    """
    n = len(buffer.episode_ends)
    chosen = list(range(n)) if episodes is None else [int(e) for e in episodes]
    bad = [e for e in chosen if not 0 <= e < n]
    if bad:
        raise DatasetError(f"episodes {bad} out of range: the dataset has {n} episodes", path=buffer.path)
    mask = np.zeros(n, bool)
    mask[chosen] = True
    rows = sequence_index(buffer.episode_ends, mask, policy.spec)
    if len(rows) == 0:
        raise DatasetError(
            f"episodes {chosen} give no sample: shorter than {policy.spec.min_episode_length} frames",
            path=buffer.path,
        )
    if max_samples is not None and len(rows) > max_samples:
        rows = rows[np.linspace(0, len(rows) - 1, int(max_samples)).round().astype(np.int64)]
    predicted = policy.predict_samples(buffer, rows, batch_size=batch_size, seed=seed)
    recorded = recorded_actions(buffer, policy.spec, rows)
    ends = np.asarray(buffer.episode_ends, dtype=np.int64)
    episode_of = np.searchsorted(ends, rows[:, 0], side="right")
    steps = np.clip(
        rows[:, :1] + np.arange(policy.horizon) * policy.spec.action_down_sample_steps, rows[:, 1:2], rows[:, 2:3] - 1
    )
    ts = np.asarray(buffer["timestamp"], dtype=np.float64) if "timestamp" in buffer else None
    times = ts[steps] if ts is not None else (steps - rows[:, 1:2]) / buffer.frequency_hz
    return DatasetPrediction(rows, episode_of.astype(np.int64), predicted, recorded, times)


AXIS_NAMES = ("x (m)", "y (m)", "z (m)", "rx (rad)", "ry (rad)", "rz (rad)", "gripper (m)")


@dataclass(frozen=True)
class EpisodeReplay:
    """What :func:`replay_episode` measured: ``episode``, ``samples``, ``mse`` (all 7 dims, dataset
    units), ``position_error_m`` and ``rotation_error_rad`` (means over samples and horizon steps),
    and the written ``plot`` path."""

    episode: int
    samples: int
    mse: float
    position_error_m: float
    rotation_error_rad: float
    plot: Path


def replay_episode(
    policy: Policy,
    buffer: ReplayBuffer,
    episode: int,
    out_path: str | Path,
    overwrite: bool = False,
    seed: int = 0,
) -> EpisodeReplay:
    """Replay a recorded episode through the policy and plot predicted against recorded actions.

    Every sample anchor of the episode is predicted (:func:`predict_dataset`); the
    PNG (matplotlib, Agg) has one row per action dimension: the recorded track, and
    the predicted horizon drawn from every ``n_action_steps``-th anchor, as a robot
    executing chunks would follow it. Written to a temporary name, then renamed.

    Raises:
        RunError: ``out_path`` exists and ``overwrite`` is False.
        DatasetError: the episode is out of range or gives no sample.
    """
    from scipy.spatial.transform import Rotation

    from dpflow_core.train.data import action_array

    out = Path(out_path)
    if out.exists() and not overwrite:
        raise RunError("the plot exists already (pass --overwrite to replace it)", path=out, code="exists")
    result = predict_dataset(policy, buffer, episodes=[episode], seed=seed)
    pred, rec = result.predicted, result.recorded
    rot = Rotation.from_rotvec(pred[..., 3:6].reshape(-1, 3)).inv() * Rotation.from_rotvec(rec[..., 3:6].reshape(-1, 3))
    sl = buffer.episode_slice(int(episode))
    track = action_array(buffer, policy.spec, sl)
    ts = np.asarray(buffer["timestamp"][sl], dtype=np.float64) if "timestamp" in buffer else None
    t_rec = ts if ts is not None else np.arange(len(track)) / buffer.frequency_hz

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stride = max(1, int(policy.network.n_action_steps))
    fig, axes = plt.subplots(7, 1, figsize=(9, 12), sharex=True)
    for d, ax in enumerate(axes):
        ax.plot(t_rec, track[:, d], color="black", lw=1.2, label="recorded")
        for i in range(0, len(pred), stride):
            ax.plot(result.times_s[i], pred[i, :, d], color="tab:blue", lw=0.8, alpha=0.8,
                    label="predicted" if i == 0 else None)
        ax.set_ylabel(AXIS_NAMES[d], fontsize=8)
    axes[0].legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("time from the episode start (s)")
    mse = float(((pred - rec) ** 2).mean())
    fig.suptitle(f"episode {episode}: predicted vs recorded ({len(pred)} anchors, MSE {mse:.3g})", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_path(out, suffix=".png") as tmp:
            fig.savefig(tmp, dpi=80)
    finally:
        plt.close(fig)
    return EpisodeReplay(
        int(episode),
        len(pred),
        mse,
        float(np.linalg.norm(pred[..., :3] - rec[..., :3], axis=-1).mean()),
        float(rot.magnitude().mean()),
        out,
    )

"""Trivial predictors the policy must beat: hold the current pose, constant velocity, the mean relative action.

Each takes the replay buffer (any mapping of key to ``(T, D)`` array), the
:class:`~dpflow_core.train.data.ObsActionSpec` and sample rows ``(anchor, episode_start, episode_end)``
(:func:`dpflow_core.train.data.sequence_index`), and returns absolute actions ``(N, H, 7)``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from dpflow_core.errors import DatasetError
from dpflow_core.evaluation.metrics import ABS_ACTION_KEYS, ACTION_GROUPS, POS, ROT


def absolute_actions(buffer: Mapping[str, np.ndarray], index: np.ndarray | slice) -> np.ndarray:
    """The recorded absolute action at buffer ``index``: ``(..., 7)`` float64 ``[pos m, rotvec rad, width m]``.

    Raises:
        DatasetError: when one of :data:`ABS_ACTION_KEYS` is missing or not of width 3, 3, 1.
    """
    for key, width in zip(ABS_ACTION_KEYS, (3, 3, 1)):
        if key not in buffer:
            raise DatasetError(f"evaluation needs the key {key!r}, absent from the dataset", path=getattr(buffer, "path", None))
        if buffer[key].shape[-1] != width:
            raise DatasetError(
                f"evaluation needs {key!r} of width {width}, got shape {buffer[key].shape}", path=getattr(buffer, "path", None)
            )
    return np.concatenate([np.asarray(buffer[k][index], dtype=np.float64) for k in ABS_ACTION_KEYS], axis=-1)


def action_index_matrix(spec, rows: np.ndarray) -> np.ndarray:
    """``(N, H)`` buffer indices of the actions of sample rows ``(anchor, start, end)``."""
    from dpflow_core.train.data import action_indices

    rows = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
    return np.stack([action_indices(spec, *(int(v) for v in row)) for row in rows]) if len(rows) else np.zeros((0, spec.horizon), np.int64)


def _observed_pair(spec, key: str, row: np.ndarray) -> tuple[int, int]:
    """Buffer indices of the latest and the previous observation of ``key`` for one sample row.

    The previous one is ``obs_down_sample_steps`` earlier (edge-padded at the episode start,
    where both may coincide), as the policy's observation history sees it.
    """
    from dpflow_core.train.data import obs_indices

    anchor, start, end = (int(v) for v in row)
    idx = obs_indices(spec, key, anchor, start, end)
    latest = int(idx[-1])
    previous = int(idx[-2]) if len(idx) >= 2 else max(start, latest - int(spec.obs_down_sample_steps))
    return latest, previous


def _current(buffer: Mapping[str, np.ndarray], spec, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(base, width, actions)``: the current TCP pose ``(N, 4, 4)`` and gripper width ``(N,)`` the policy
    sees (latency-shifted, interpolated: :func:`dpflow_core.train.data.encode_obs`) and the recorded
    actions ``(N, H, 7)`` of sample ``rows``."""
    from dpflow_core.train import data as D

    raw = D.read_raw(D.lowdim_arrays(buffer, spec), spec, rows)
    _, base = D.encode_obs(raw, spec)
    return base, raw[D.GRIPPER_KEY][:, -1, 0], raw["action"]


def fit_mean_relative_action(buffer: Mapping[str, np.ndarray], spec, rows: np.ndarray, chunk: int = 4096) -> np.ndarray:
    """The training samples' mean action relative to the current pose, per horizon step: ``(H, 7)`` float64.

    For each sample and step ``k`` the recorded TCP pose ``A_k`` is expressed in the frame of
    the current TCP pose ``B`` (``inv(B) @ A_k``, as the relative representation,
    :mod:`dpflow_core.pose`) and the gripper width as its change from the current width.
    Returns ``[position (3) m, rotation vector (3) rad, width change (1) m]`` per step:
    positions and width changes averaged, rotations by scipy's chordal mean (``Rotation.mean``).
    Expressed in the current pose's frame, it does not depend on the dataset's world frame.

    Args:
        buffer: the replay buffer; spec: the policy's :class:`~dpflow_core.train.data.ObsActionSpec`.
        rows: ``(N, 3)`` sample rows of the training episodes (:func:`dpflow_core.train.data.sequence_index`).

    Raises:
        DatasetError: when ``rows`` is empty.
    """
    from scipy.spatial.transform import Rotation

    from dpflow_core import pose as P

    rows = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
    if not len(rows):
        raise DatasetError("no training sample to fit the mean relative action on", path=getattr(buffer, "path", None))
    pos, rot, grip = [], [], []
    for part in np.array_split(rows, len(rows) // chunk + 1):
        if not len(part):
            continue
        base, width, actions = _current(buffer, spec, part)
        tcp = P.pos_rot_to_mat(actions[..., POS], actions[..., ROT])
        if not P.is_identity(spec.tx_cam_tcp):
            tcp = P.apply_tx(tcp, spec.tx)
        rel = P.relative_to(tcp, base[:, None])
        pos.append(rel[..., :3, 3])
        rot.append(rel[..., :3, :3])
        grip.append(actions[..., 6] - width[:, None])
    pos, rot, grip = np.concatenate(pos), np.concatenate(rot), np.concatenate(grip)
    mean_rot = np.stack([Rotation.from_matrix(rot[:, k]).mean().as_rotvec() for k in range(rot.shape[1])])
    return np.concatenate([pos.mean(axis=0), mean_rot, grip.mean(axis=0)[:, None]], axis=-1)


def mean_relative_baseline(buffer: Mapping[str, np.ndarray], spec, rows: np.ndarray, mean_relative: np.ndarray) -> np.ndarray:
    """The mean relative action applied to each sample's current pose: absolute actions ``(N, H, 7)``.

    Step ``k`` is ``B @ M_k`` (``B`` the current TCP pose, ``M_k`` the pose of
    :func:`fit_mean_relative_action`), turned back into the camera pose the dataset records
    (``@ inv(tx_cam_tcp)``), and the current width plus the mean width change.
    """
    from dpflow_core import pose as P

    rows = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
    m = np.asarray(mean_relative, dtype=np.float64)
    if m.shape != (spec.horizon, 7):
        raise ValueError(f"mean_relative must be (horizon={spec.horizon}, 7), got {m.shape}")
    if not len(rows):
        return np.zeros((0, spec.horizon, 7))
    base, width, _ = _current(buffer, spec, rows)
    mats = P.absolute_from(P.pos_rot_to_mat(m[:, POS], m[:, ROT])[None], base[:, None])
    if not P.is_identity(spec.tx_cam_tcp):
        mats = P.apply_tx(mats, np.linalg.inv(spec.tx))
    return np.concatenate([P.mat_to_pose(mats), (width[:, None] + m[None, :, 6])[..., None]], axis=-1)


def hold_baseline(buffer: Mapping[str, np.ndarray], spec, rows: np.ndarray) -> np.ndarray:
    """The hold baseline, ``(N, H, 7)``: the latest observed pose and width repeated over the horizon.

    Each key's latest observation is the one the policy sees (the key's observation latency
    applied, :func:`dpflow_core.train.data.obs_indices`).
    """
    rows = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
    out = np.empty((len(rows), spec.horizon, 7))
    for key, (_, sl) in zip(ABS_ACTION_KEYS, ACTION_GROUPS):
        latest = np.array([_observed_pair(spec, key, row)[0] for row in rows], dtype=np.int64)
        out[..., sl] = np.asarray(buffer[key][latest], dtype=np.float64)[:, None, :]
    return out


def constant_velocity_baseline(buffer: Mapping[str, np.ndarray], spec, rows: np.ndarray) -> np.ndarray:
    """Constant velocity from the last two observations: ``(N, H, 7)``.

    With latest observation index ``i0`` and previous ``i1`` of a key, action index ``j``
    is ``s = (j - i0) / (i0 - i1)`` observation intervals ahead: positions and widths
    ``x0 + s (x0 - x1)``; rotations ``exp(s log(R0 R1^-1)) R0`` (scipy ``Rotation``, composed
    on SO(3), never added as vectors). Where ``i0 == i1`` (episode start) it holds.
    """
    from scipy.spatial.transform import Rotation

    rows = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
    actions = action_index_matrix(spec, rows).astype(np.float64)
    out = np.empty((len(rows), spec.horizon, 7))
    if not len(rows):
        return out
    for key, (name, sl) in zip(ABS_ACTION_KEYS, ACTION_GROUPS):
        pairs = np.array([_observed_pair(spec, key, row) for row in rows], dtype=np.int64)
        x0 = np.asarray(buffer[key][pairs[:, 0]], dtype=np.float64)
        x1 = np.asarray(buffer[key][pairs[:, 1]], dtype=np.float64)
        gap = (pairs[:, 0] - pairs[:, 1]).astype(np.float64)
        s = np.where(gap[:, None] > 0, (actions - pairs[:, :1]) / np.maximum(gap, 1.0)[:, None], 0.0)  # (N, H)
        if name != "rotation":
            out[..., sl] = x0[:, None, :] + s[..., None] * (x0 - x1)[:, None, :]
            continue
        r0 = Rotation.from_rotvec(x0)
        delta = (r0 * Rotation.from_rotvec(x1).inv()).as_rotvec()  # (N, 3), |.| <= pi
        steps = Rotation.from_rotvec((s[..., None] * delta[:, None, :]).reshape(-1, 3))
        out[..., sl] = (steps * Rotation.from_rotvec(np.repeat(x0, spec.horizon, axis=0))).as_rotvec().reshape(len(rows), spec.horizon, 3)
    return out



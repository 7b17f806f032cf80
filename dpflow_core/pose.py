"""End-effector pose conversions shared by the dataset, the policy, inference and evaluation.

Conventions (those of the replay buffer, formats.md section 2):

- a *pose vector* is ``(..., 6)``: position (m) then rotation vector (rad,
  axis times angle, norm <= pi), the pose of a body frame in a reference frame;
- a *pose matrix* is the ``(..., 4, 4)`` homogeneous transform
  ``[[R, p], [0, 0, 0, 1]]`` mapping body coordinates to reference coordinates;
- *rot6d* is the first two columns of ``R`` stacked column after column,
  ``(..., 6) = [R[:, 0], R[:, 1]]`` (Zhou et al., "On the Continuity of Rotation
  Representations in Neural Networks", CVPR 2019). Unlike a rotation vector it
  is continuous over all of SO(3), which is why networks predict it. It maps back
  through Gram-Schmidt orthonormalisation, so any 6-vector whose two halves are
  not parallel gives a valid rotation;
- *relative* poses are expressed in the frame of a base pose ``B`` (the current,
  latest observed pose): ``rel = inv(B) @ abs`` and ``abs = B @ rel``, the
  "relative" representation of UMI (Chi et al., RSS 2024);
- ``tx_cam_tcp`` is the fixed pose of the tool centre point (TCP) in the camera
  frame; a camera pose ``T_cam`` (what Matrix Studio records) becomes the TCP pose
  ``T_cam @ tx_cam_tcp``.

Rotations go through :class:`scipy.spatial.transform.Rotation`. Every function
works on any leading batch shape and returns float64.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.spatial.transform import Rotation

#: Gram-Schmidt refuses 6-vectors whose first column is shorter than this.
_MIN_NORM = 1e-9


def _last(arr, n: int, name: str) -> np.ndarray:
    a = np.asarray(arr, dtype=np.float64)
    if a.ndim < 1 or a.shape[-1] != n:
        raise ValueError(f"{name} must have shape (..., {n}), got {a.shape}")
    return a


def _mats(arr, name: str) -> np.ndarray:
    a = np.asarray(arr, dtype=np.float64)
    if a.ndim < 2 or a.shape[-2:] != (4, 4):
        raise ValueError(f"{name} must have shape (..., 4, 4), got {a.shape}")
    return a


def pose_to_mat(pose) -> np.ndarray:
    """Pose vectors ``(..., 6)`` [pos m, rotvec rad] -> homogeneous matrices ``(..., 4, 4)``.

    Raises:
        ValueError: when the last axis is not 6.
    """
    p = _last(pose, 6, "pose")
    return pos_rot_to_mat(p[..., :3], p[..., 3:])


def pos_rot_to_mat(pos, rotvec) -> np.ndarray:
    """Positions ``(..., 3)`` (m) and rotation vectors ``(..., 3)`` (rad) -> ``(..., 4, 4)``."""
    pos = _last(pos, 3, "pos")
    rotvec = _last(rotvec, 3, "rotvec")
    batch = np.broadcast_shapes(pos.shape[:-1], rotvec.shape[:-1])
    out = np.zeros(batch + (4, 4))
    out[..., :3, :3] = Rotation.from_rotvec(rotvec.reshape(-1, 3)).as_matrix().reshape(rotvec.shape[:-1] + (3, 3))
    out[..., :3, 3] = pos
    out[..., 3, 3] = 1.0
    return out


def mat_to_pose(mat) -> np.ndarray:
    """Homogeneous matrices ``(..., 4, 4)`` -> pose vectors ``(..., 6)`` (rotation vector norm <= pi).

    Raises:
        ValueError: when the last two axes are not 4 x 4.
    """
    m = _mats(mat, "mat")
    rot = Rotation.from_matrix(m[..., :3, :3].reshape(-1, 3, 3)).as_rotvec().reshape(m.shape[:-2] + (3,))
    return np.concatenate([m[..., :3, 3], rot], axis=-1)


def rotvec_to_rot6d(rotvec) -> np.ndarray:
    """Rotation vectors ``(..., 3)`` (rad) -> rot6d ``(..., 6)`` (first two columns of R)."""
    r = _last(rotvec, 3, "rotvec")
    return mat3_to_rot6d(Rotation.from_rotvec(r.reshape(-1, 3)).as_matrix().reshape(r.shape[:-1] + (3, 3)))


def mat3_to_rot6d(rmat) -> np.ndarray:
    """Rotation matrices ``(..., 3, 3)`` -> rot6d ``(..., 6)`` = ``[R[:, 0], R[:, 1]]``."""
    r = np.asarray(rmat, dtype=np.float64)
    if r.ndim < 2 or r.shape[-2:] != (3, 3):
        raise ValueError(f"rotation matrices must have shape (..., 3, 3), got {r.shape}")
    return np.concatenate([r[..., :, 0], r[..., :, 1]], axis=-1)


def rot6d_to_mat3(rot6d) -> np.ndarray:
    """rot6d ``(..., 6)`` -> rotation matrices ``(..., 3, 3)`` by Gram-Schmidt (Zhou et al. 2019).

    ``b1 = a1 / |a1|``, ``b2 = (a2 - (b1 . a2) b1) / |...|``, ``b3 = b1 x b2``.

    Raises:
        ValueError: when a first column is (near) zero or the two columns are parallel.
    """
    d = _last(rot6d, 6, "rot6d")
    a1, a2 = d[..., :3], d[..., 3:]
    n1 = np.linalg.norm(a1, axis=-1, keepdims=True)
    if np.any(n1 < _MIN_NORM):
        raise ValueError("rot6d: the first column is zero, no rotation can be recovered")
    b1 = a1 / n1
    u2 = a2 - np.sum(b1 * a2, axis=-1, keepdims=True) * b1
    n2 = np.linalg.norm(u2, axis=-1, keepdims=True)
    if np.any(n2 < _MIN_NORM):
        raise ValueError("rot6d: the two columns are parallel, no rotation can be recovered")
    b2 = u2 / n2
    b3 = np.cross(b1, b2)
    return np.stack([b1, b2, b3], axis=-1)


def rot6d_to_rotvec(rot6d) -> np.ndarray:
    """rot6d ``(..., 6)`` -> rotation vectors ``(..., 3)`` (rad, norm <= pi)."""
    m = rot6d_to_mat3(rot6d)
    return Rotation.from_matrix(m.reshape(-1, 3, 3)).as_rotvec().reshape(m.shape[:-2] + (3,))


def relative_to(mat, base) -> np.ndarray:
    """Express poses ``(..., 4, 4)`` in the frame of ``base`` (broadcast): ``inv(base) @ mat``."""
    m, b = _mats(mat, "mat"), _mats(base, "base")
    return np.linalg.inv(b) @ m


def absolute_from(rel, base) -> np.ndarray:
    """Inverse of :func:`relative_to`: ``base @ rel`` (``(..., 4, 4)``, broadcast)."""
    return _mats(base, "base") @ _mats(rel, "rel")


def tx_from_config(value) -> np.ndarray:
    """``task.tx_cam_tcp`` as a ``(4, 4)`` matrix.

    Accepts None (identity), a 4 x 4 nested list, or a mapping with
    ``translation`` (3, m) and ``rotation`` (rotation vector, 3, rad); either
    key may be omitted (zero).

    Raises:
        ValueError: for any other shape, a non-rigid 4 x 4 (rotation not
            orthonormal to 1e-6, last row not ``[0, 0, 0, 1]``) or unknown keys.
    """
    if value is None:
        return np.eye(4)
    if hasattr(value, "keys"):
        unknown = set(value.keys()) - {"translation", "rotation"}
        if unknown:
            raise ValueError(f"task.tx_cam_tcp: unknown keys {sorted(unknown)} (use translation, rotation)")
        t = np.asarray(value.get("translation") or [0.0, 0.0, 0.0], dtype=np.float64)
        r = np.asarray(value.get("rotation") or [0.0, 0.0, 0.0], dtype=np.float64)
        if t.shape != (3,) or r.shape != (3,):
            raise ValueError(f"task.tx_cam_tcp: translation and rotation must be 3 numbers, got {t} and {r}")
        return pos_rot_to_mat(t, r)
    m = np.asarray(value, dtype=np.float64)
    if m.shape != (4, 4):
        raise ValueError(f"task.tx_cam_tcp must be a 4x4 matrix or {{translation, rotation}}, got shape {m.shape}")
    if not np.allclose(m[3], [0, 0, 0, 1], atol=1e-9) or not np.allclose(m[:3, :3] @ m[:3, :3].T, np.eye(3), atol=1e-6):
        raise ValueError(f"task.tx_cam_tcp is not a rigid transform: {m.tolist()}")
    return m


def apply_tx(mat, tx) -> np.ndarray:
    """Poses ``(..., 4, 4)`` of one frame -> poses of a frame attached to it: ``mat @ tx``.

    With ``tx = tx_cam_tcp`` this turns camera poses into TCP poses; with
    ``inv(tx_cam_tcp)`` it turns TCP poses back into camera poses.
    """
    return _mats(mat, "mat") @ _mats(tx, "tx")


def as_tuple(mat: np.ndarray) -> tuple[tuple[float, ...], ...]:
    """A ``(4, 4)`` matrix as nested tuples of floats (hashable, for frozen dataclasses and checkpoints)."""
    return tuple(tuple(float(v) for v in row) for row in np.asarray(mat, dtype=np.float64))


def is_identity(mat: Sequence[Sequence[float]] | np.ndarray) -> bool:
    """Whether a ``(4, 4)`` transform is the identity (to 1e-12)."""
    return bool(np.allclose(np.asarray(mat, dtype=np.float64), np.eye(4), atol=1e-12))

"""Pose conversions: exact round trips on random poses, rotations near pi included."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.spatial.transform import Rotation

from dpflow_core import pose


def _random_poses(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    axes = rng.normal(size=(n, 3))
    axes /= np.linalg.norm(axes, axis=1, keepdims=True)
    angles = rng.uniform(0, np.pi, size=n)
    # a third of them within 1e-4 rad of pi, where rotation vectors flip sign
    angles[: n // 3] = np.pi - rng.uniform(0, 1e-4, size=n // 3)
    return np.concatenate([rng.uniform(-2, 2, size=(n, 3)), axes * angles[:, None]], axis=1)


def _same_rotation(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Geodesic angle (rad) between two sets of rotation vectors."""
    return (Rotation.from_rotvec(a).inv() * Rotation.from_rotvec(b)).magnitude()


def test_pose_vector_matrix_round_trip_and_matrix_against_scipy():
    p = _random_poses(300)
    m = pose.pose_to_mat(p)
    assert m.shape == (300, 4, 4)
    np.testing.assert_allclose(m[:, :3, :3], Rotation.from_rotvec(p[:, 3:]).as_matrix(), atol=1e-12)
    np.testing.assert_allclose(m[:, 3], np.tile([0, 0, 0, 1.0], (300, 1)))
    back = pose.mat_to_pose(m)
    np.testing.assert_allclose(back[:, :3], p[:, :3], atol=1e-12)
    assert _same_rotation(back[:, 3:], p[:, 3:]).max() < 1e-6
    np.testing.assert_allclose(pose.pose_to_mat(back), m, atol=1e-6)


def test_rot6d_is_the_first_two_columns_and_gram_schmidt_inverts_it():
    p = _random_poses(300, seed=1)
    r = Rotation.from_rotvec(p[:, 3:]).as_matrix()
    d6 = pose.rotvec_to_rot6d(p[:, 3:])
    np.testing.assert_allclose(d6[:, :3], r[:, :, 0], atol=1e-12)
    np.testing.assert_allclose(d6[:, 3:], r[:, :, 1], atol=1e-12)
    np.testing.assert_allclose(pose.rot6d_to_mat3(d6), r, atol=1e-9)
    assert _same_rotation(pose.rot6d_to_rotvec(d6), p[:, 3:]).max() < 1e-6
    # a network output is not orthonormal: Gram-Schmidt still gives the nearest-by-construction rotation
    noisy = d6 * 1.7 + np.concatenate([np.zeros((300, 3)), 0.05 * d6[:, :3]], axis=1)
    m = pose.rot6d_to_mat3(noisy)
    np.testing.assert_allclose(m @ np.swapaxes(m, 1, 2), np.broadcast_to(np.eye(3), m.shape), atol=1e-9)
    np.testing.assert_allclose(np.linalg.det(m), 1.0, atol=1e-9)
    np.testing.assert_allclose(m[:, :, 0], r[:, :, 0], atol=1e-9)


def test_relative_absolute_round_trip_and_base_maps_to_identity():
    p = _random_poses(200, seed=2)
    base = pose.pose_to_mat(_random_poses(200, seed=3))
    m = pose.pose_to_mat(p)
    rel = pose.relative_to(m, base)
    np.testing.assert_allclose(pose.absolute_from(rel, base), m, atol=1e-9)
    np.testing.assert_allclose(pose.relative_to(base, base), np.broadcast_to(np.eye(4), base.shape), atol=1e-9)
    # independent check: the relative position is the offset rotated into the base frame
    expected = np.einsum("nji,nj->ni", base[:, :3, :3], p[:, :3] - base[:, :3, 3])
    np.testing.assert_allclose(rel[:, :3, 3], expected, atol=1e-9)
    back = pose.mat_to_pose(pose.absolute_from(rel, base))
    assert _same_rotation(back[:, 3:], p[:, 3:]).max() < 1e-6
    np.testing.assert_allclose(back[:, :3], p[:, :3], atol=1e-6)


def test_tx_cam_tcp_forms_and_application():
    np.testing.assert_array_equal(pose.tx_from_config(None), np.eye(4))
    tx = pose.tx_from_config({"translation": [0.0, 0.0, 0.2], "rotation": [0.0, 0.0, np.pi / 2]})
    np.testing.assert_allclose(pose.tx_from_config(tx.tolist()), tx)
    cam = pose.pos_rot_to_mat(np.array([1.0, 2.0, 3.0]), np.array([np.pi / 2, 0.0, 0.0]))
    tcp = pose.apply_tx(cam, tx)
    # 0.2 m along the camera's z axis, which the camera's 90 deg roll about x turns into -y of the world
    np.testing.assert_allclose(tcp[:3, 3], [1.0, 2.0 - 0.2, 3.0], atol=1e-12)
    np.testing.assert_allclose(pose.apply_tx(tcp, np.linalg.inv(tx)), cam, atol=1e-12)
    with pytest.raises(ValueError, match="not a rigid transform"):
        pose.tx_from_config(np.diag([2.0, 1.0, 1.0, 1.0]).tolist())
    with pytest.raises(ValueError, match="unknown keys"):
        pose.tx_from_config({"translate": [0, 0, 1]})
    with pytest.raises(ValueError, match=r"\(\.\.\., 6\)"):
        pose.pose_to_mat(np.zeros((2, 7)))
    with pytest.raises(ValueError, match="parallel"):
        pose.rot6d_to_mat3(np.array([1.0, 0, 0, 2.0, 0, 0]))

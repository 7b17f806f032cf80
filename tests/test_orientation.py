"""Pose rotations whose quaternion convention disagrees with the IMU's gyro or gravity (issue 28)."""

from __future__ import annotations


import numpy as np
import pytest

from dpflow_core.conversion import ConversionSettings, align_episode
from dpflow_core.errors import ConversionError
from dpflow_core.recordings import read_streams, samples
from dpflow_core.recordings.orientation import DECLARED, orientation_residuals
from dpflow_core.recordings.plausibility import PlausibilityOptions
from fault_fixtures import imu_from_pose, quaternion_reading

SPEC = samples.SampleSpec(seconds=5.0, width=96, height=72, gop_size=15)
CONJ, WXYZ = "conjugate (world-to-camera)", "(w, x, y, z) order"


def _episode(tmp_path, name, seed, extrinsic, reading=None):
    ep = samples.write_episode(tmp_path, name, SPEC, seed=seed)
    imu_from_pose(ep.vio_mcap, ep, extrinsic, seed=seed)
    if reading:
        quaternion_reading(ep.vio_mcap, reading)
    return ep


def _residuals(path, gyro=True, accel=True):
    s = read_streams(path)
    return orientation_residuals(s.pose_ts_ns, s.quat_xyzw, s.imu_ts_ns, s.gyro_rps if gyro else None,
                                 s.accel_mps2 if accel else None)


@pytest.mark.parametrize("seed,extrinsic", [(1, (0.0, 0.0, 0.0)), (2, (np.pi / 2, 0.0, 0.0)), (3, (0.3, -1.2, 2.0))])
def test_a_consistent_imu_agrees_with_the_declared_reading(tmp_path, seed, extrinsic):
    ep = _episode(tmp_path, f"ok{seed}", seed, extrinsic)
    res = _residuals(ep.vio_mcap)
    assert res["gyro"][DECLARED] < 0.005 and res["gyro"][CONJ] > 10 * res["gyro"][DECLARED], res
    a = align_episode(ep.vio_mcap, ConversionSettings(image_size=(48, 36)))
    assert not [f for f in a.report["plausibility"]["findings"] if f["code"] == "quaternion_convention"]


@pytest.mark.parametrize("seed,extrinsic,reading,fits", [
    (1, (0.0, 0.0, 0.0), "conjugate", CONJ),
    (2, (np.pi / 2, 0.0, 0.0), "conjugate", CONJ),
    (3, (0.3, -1.2, 2.0), "wxyz", WXYZ),
    (4, (0.0, 0.0, 0.0), "wxyz", WXYZ),
])
def test_another_reading_is_rejected_naming_the_one_that_fits(tmp_path, seed, extrinsic, reading, fits):
    ep = _episode(tmp_path, f"bad{seed}", seed, extrinsic, reading)
    with pytest.raises(ConversionError) as err:
        align_episode(ep.vio_mcap, ConversionSettings(image_size=(48, 36)))
    assert err.value.code == "quaternion_convention"
    assert fits in str(err.value) and "unexplained" in str(err.value)


def test_gravity_alone_names_a_swapped_order(tmp_path):
    ep = _episode(tmp_path, "grav", 5, (0.2, 0.4, -0.6), "wxyz")
    res = _residuals(ep.vio_mcap, gyro=False)
    assert set(res) == {"gravity"}
    assert res["gravity"][DECLARED] > 10 * res["gravity"][WXYZ], res


def test_warn_policy_keeps_the_episode_and_lists_the_finding(tmp_path):
    ep = _episode(tmp_path, "warn", 6, (0.0, 0.0, 0.0), "conjugate")
    opts = PlausibilityOptions(policies={"quaternion_convention": "warn"})
    a = align_episode(ep.vio_mcap, ConversionSettings(image_size=(48, 36), plausibility=opts))
    (f,) = [f for f in a.report["plausibility"]["findings"] if f["code"] == "quaternion_convention"]
    assert f["action"] == "warned" and f["detail"]["fits"] == CONJ and f["value"] > 0.02


def test_a_noise_only_imu_says_nothing(tmp_path):
    """The sample writer's IMU (noise, gravity fixed while the pose turns) fits no reading: no finding."""
    ep = samples.write_episode(tmp_path, "noise", SPEC, seed=7)
    a = align_episode(ep.vio_mcap, ConversionSettings(image_size=(48, 36)))
    assert not [f for f in a.report["plausibility"]["findings"] if f["code"] == "quaternion_convention"]

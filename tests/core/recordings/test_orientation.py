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
    assert not [f for f in a.report["plausibility"]["findings"] if f["code"] in ("quaternion_convention", "imu_reversed")]


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


@pytest.mark.parametrize("seed", [2, 6, 7, 11])
def test_a_noise_only_imu_says_nothing(tmp_path, seed):
    """The sample writer's IMU (noise, gravity fixed while the pose turns) fits no reading: no finding, neither
    quaternion_convention nor imu_disagrees (its gravity leaves 0.04-0.13 unexplained; its gyro has no rotation)."""
    ep = samples.write_episode(tmp_path, "noise", SPEC, seed=seed)
    a = align_episode(ep.vio_mcap, ConversionSettings(image_size=(48, 36)))
    assert not [f for f in a.report["plausibility"]["findings"]
                if f["code"] in ("quaternion_convention", "imu_disagrees", "imu_reversed")]


def _imu_edit(path, edit):
    from fault_fixtures import IMU, edit_messages

    return edit_messages(path, (IMU,), edit)


@pytest.mark.parametrize("seed,first,count", [(6, 100, 10), (7, 400, 1), (8, 0, 50)])
def test_nan_imu_samples_are_named_and_left_out_not_a_crash(tmp_path, seed, first, count):
    """NaN/inf IMU samples (a driver fault) are named as imu_not_finite, with their count and span, and left
    out: the quaternion check and the offsets still run on the rest (they raised "SVD did not converge")."""
    ep = _episode(tmp_path, f"nan{seed}", seed, (0.0, 0.0, 0.0))

    def poison(_topic, k, msg):
        if first <= k < first + count:
            msg.angular_velocity.x = float("nan")
            msg.linear_acceleration.z = float("inf") if k % 2 else float("nan")

    _imu_edit(ep.vio_mcap, poison)
    s = read_streams(ep.vio_mcap)
    a = align_episode(ep.vio_mcap, ConversionSettings(image_size=(48, 36)))
    found = {f["code"]: f for f in a.report["plausibility"]["findings"]}
    assert "quaternion_convention" not in found
    f = found["imu_not_finite"]
    assert (f["value"], f["action"], f["detail"]["of"]) == (count, "warned", len(s.imu_ts_ns))
    t0 = min(int(s.camera_ts_ns[0]), int(s.pose_ts_ns[0]), int(s.gripper_ts_ns[0]))
    assert f["at_s"] == pytest.approx((int(s.imu_ts_ns[first]) - t0) / 1e9, abs=1e-4)
    assert f["end_s"] == pytest.approx((int(s.imu_ts_ns[first + count - 1]) - t0) / 1e9, abs=1e-4)
    assert a.report["imu_offset"]["status"] != "error" if "imu_offset" in a.report else True


def _flip_gyro(_topic, _k, msg):
    msg.angular_velocity.x, msg.angular_velocity.y, msg.angular_velocity.z = (
        -msg.angular_velocity.x, -msg.angular_velocity.y, -msg.angular_velocity.z)


REVERSED_WHY = "the gyro turns against the pose track: the episode may be time-reversed, or the gyro's sign flipped"


@pytest.mark.parametrize("seed,extrinsic", [(9, (0.0, 0.0, 0.0)), (10, (0.0, 0.0, 0.0)), (12, (0.3, -1.2, 2.0))])
def test_a_flipped_gyro_is_imu_reversed_never_blamed_on_the_poses(tmp_path, seed, extrinsic):
    """A gyro whose sign is flipped (the poses right) fits the track only negated: no proper rotation maps it, so
    before it was at most imu_disagrees (warned) or, where the conjugate reading fitted, quaternion_convention. The
    negated gyro fits the declared reading at the noise level (the declared one leaves 440 to 65,000 times more on
    these tracks): imu_reversed, rejected, naming the negated gyro's residual."""
    ep = _episode(tmp_path, f"flip{seed}", seed, extrinsic)
    _imu_edit(ep.vio_mcap, _flip_gyro)
    with pytest.raises(ConversionError) as err:
        align_episode(ep.vio_mcap, ConversionSettings(image_size=(48, 36)))
    assert err.value.code == "imu_reversed" and REVERSED_WHY in str(err.value), str(err.value)
    assert "the negated gyro leaves" in str(err.value) and err.value.path == str(ep.vio_mcap)
    warned = align_episode(ep.vio_mcap, ConversionSettings(
        image_size=(48, 36), plausibility=PlausibilityOptions(policies={"imu_reversed": "warn"})))
    (f,) = [f for f in warned.report["plausibility"]["findings"] if f["code"] == "imu_reversed"]
    assert f["action"] == "warned" and f["value"] > 0.001 and f["detail"]["negated_gyro_residual"] < 0.001, f


@pytest.mark.parametrize("seed", [13, 14])
def test_a_pose_track_and_imu_played_backwards_are_imu_reversed(tmp_path, seed):
    """The pose and IMU messages' contents in reverse order (stamps ascending, as a recording played backwards
    writes them): the hand's accelerations read the same backwards, its turning does not."""
    from fault_fixtures import IMU, POSE, edit_messages

    ep = _episode(tmp_path, f"back{seed}", seed, (0.0, 0.0, 0.0))
    s = read_streams(ep.vio_mcap)
    gyro, acc, pos, quat = s.gyro_rps[::-1], s.accel_mps2[::-1], s.position_m[::-1], s.quat_xyzw[::-1]

    def backwards(topic, k, msg):
        if topic == IMU:
            msg.angular_velocity.x, msg.angular_velocity.y, msg.angular_velocity.z = (float(v) for v in gyro[k])
            msg.linear_acceleration.x, msg.linear_acceleration.y, msg.linear_acceleration.z = (float(v) for v in acc[k])
        else:
            msg.pose.position.x, msg.pose.position.y, msg.pose.position.z = (float(v) for v in pos[k])
            o = msg.pose.orientation
            o.x, o.y, o.z, o.w = (float(v) for v in quat[k])

    edit_messages(ep.vio_mcap, (IMU, POSE), backwards)
    with pytest.raises(ConversionError) as err:
        align_episode(ep.vio_mcap, ConversionSettings(image_size=(48, 36)))
    assert err.value.code == "imu_reversed" and REVERSED_WHY in str(err.value), str(err.value)


def test_a_conjugated_track_names_both_explanations(tmp_path):
    """The conjugate reading's reason also names the IMU-side explanation (a mirrored IMU looks the same)."""
    ep = _episode(tmp_path, "conjmsg", 1, (0.0, 0.0, 0.0), "conjugate")
    with pytest.raises(ConversionError) as err:
        align_episode(ep.vio_mcap, ConversionSettings(image_size=(48, 36)))
    assert "looks the same to this check: verify the IMU's axes before re-reading the poses" in str(err.value)

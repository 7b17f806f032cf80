"""align_episode: decoding, colour, timestamp alignment, trimming and bad input."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import av
import cv2
import numpy as np
import pytest
from scipy.spatial.transform import Rotation

from dpflow_core.recordings import samples
from dpflow_core.conversion import ConversionSettings, align_episode
from dpflow_core.recordings.schemas import das_messages
from dpflow_core.errors import ConversionError, RecordingError
from dpflow_core.recordings.topics import DAS_DEFAULT
from dpflow_core.recordings.plausibility import PlausibilityOptions

SPEC = samples.SampleSpec(seconds=3.0, width=160, height=120, gop_size=15)
SIZE = (96, 72)


def _write_vio(path: Path, frames_bgr, frame_ns, pose_ns, pos, quat, valid, grip_ns, grip, fps=30.0, arrival_ns=None):
    """Write a minimal ``_vio.mcap`` (camera, pose, gripper) from explicit streams; each message arrives
    (log time) a fixed delay after its capture time, or after ``arrival_ns[topic][i]`` where given."""
    arrival_ns = arrival_ns or {}
    msgs = das_messages()
    t = DAS_DEFAULT
    units = samples.encode_h264(list(frames_bgr), fps, 15)
    records = []
    for seq, (ts, (data, _)) in enumerate(zip(frame_ns, units)):
        at = arrival_ns.get(t.camera, frame_ns)[seq]
        records.append((int(at) + 5_000_000, t.camera, msgs.CompressedImage(
            header=samples.device_header(msgs, t.camera, seq, ts, fps), frame_id="camera0", data=data, format="h264")))
    for seq, ts in enumerate(pose_ns):
        p = msgs.PoseInFrame(header=samples.device_header(msgs, t.pose, seq, ts, fps), frame_id="world",
                             pose_valid=bool(valid[seq]), score=0.9)
        p.pose.position.x, p.pose.position.y, p.pose.position.z = pos[seq]
        p.pose.orientation.x, p.pose.orientation.y, p.pose.orientation.z, p.pose.orientation.w = quat[seq]
        records.append((int(arrival_ns.get(t.pose, pose_ns)[seq]) + 30_000_000, t.pose, p))
    for seq, (ts, w) in enumerate(zip(grip_ns, grip)):
        records.append((int(arrival_ns.get(t.gripper, grip_ns)[seq]) + 1_000_000, t.gripper, msgs.MagneticEncoderMeasurement(
            header=samples.device_header(msgs, t.gripper, seq, ts, 50.0), value=float(w))))
    records.sort(key=lambda r: r[0])
    samples.write_mcap(path, records)
    return path


@pytest.fixture(scope="module")
def episodes(tmp_path_factory):
    root = tmp_path_factory.mktemp("align")
    out = {
        "plain": samples.write_episode(root, "plain", SPEC, seed=3),
        "late_idr": samples.write_episode(root, "late_idr", replace(SPEC, drop_first_idr=True), seed=4),
        "missing2": samples.write_episode(root, "missing2", replace(SPEC, missing_frames=(40, 41)), seed=5),
        "late_early": samples.write_episode(
            root, "late_early", replace(SPEC, camera_start_delay_s=0.4, camera_end_early_s=0.2), seed=6),
        "vio40": samples.write_episode(root, "vio40", replace(SPEC, vio_coverage=(0.3, 0.7)), seed=7),
        "invalid": samples.write_episode(root, "invalid", replace(SPEC, pose_invalid=((0.0, 0.4), (2.4, 2.6))), seed=8),
    }
    return out


def _gt_at(ep, ts_ns):
    gt_t = ep.pose_ts_ns.astype(np.int64)
    idx = np.searchsorted(gt_t, ts_ns)
    assert np.array_equal(gt_t[idx], ts_ns)
    return ep.position_m[idx], Rotation.from_quat(ep.quat_xyzw[idx])


def test_aligned_poses_match_ground_truth_at_frame_times(episodes):
    ep = episodes["plain"]
    a = align_episode(ep.vio_mcap, ConversionSettings(image_size=SIZE))
    assert a.rgb.shape == (len(a), SIZE[1], SIZE[0], 3) and a.rgb.dtype == np.uint8
    assert a.eef_pos.dtype == np.float32 and a.eef_rot_axis_angle.shape == (len(a), 3)
    # every camera frame lies inside the pose and gripper tracks except possibly the edges
    assert len(a) >= len(ep.camera_ts_ns) - 2
    pos, rot = _gt_at(ep, a.camera_ts_ns)
    np.testing.assert_allclose(a.eef_pos, pos, atol=1e-6)
    assert (rot.inv() * Rotation.from_rotvec(a.eef_rot_axis_angle)).magnitude().max() < 1e-6
    assert np.all(np.linalg.norm(a.eef_rot_axis_angle, axis=1) <= np.pi)
    # gripper (50 Hz, own clock) interpolated linearly at the frame times
    ref = np.interp(a.camera_ts_ns.astype(np.float64), ep.gripper_ts_ns.astype(np.float64), ep.gripper_width_m)
    np.testing.assert_allclose(a.gripper_width[:, 0], ref, atol=1e-6)
    np.testing.assert_allclose(a.timestamps_s, (a.camera_ts_ns - a.camera_ts_ns[0]) / 1e9)
    assert a.report["frequency_hz"] == pytest.approx(30.0, rel=0.01)
    assert a.report["gaps"] == [] and a.report["leading_undecodable_packets"] == 0


def test_frames_before_first_idr_are_skipped_and_paired_by_timestamp(episodes):
    ep = episodes["late_idr"]
    a = align_episode(ep.vio_mcap, ConversionSettings(image_size=SIZE))
    # the sample drops the first IDR: the P-frames up to the next IDR (gop 15) cannot decode
    assert a.report["camera_messages"] == len(ep.camera_ts_ns)
    assert a.report["leading_undecodable_packets"] == SPEC.gop_size - 1
    assert a.report["decoded_frames"] == len(ep.camera_ts_ns) - (SPEC.gop_size - 1)
    assert a.camera_ts_ns[0] == ep.camera_ts_ns[SPEC.gop_size - 1]
    pos, _ = _gt_at(ep, a.camera_ts_ns)
    np.testing.assert_allclose(a.eef_pos, pos, atol=1e-6)
    # the first decoded frame matches a reference decode of that access unit's GOP
    assert a.report["trimmed_s"]["start"] > (SPEC.gop_size - 1) / 30 - 0.01


def test_rgb_matches_cv2_area_reference(episodes):
    """The decoder's scaler (area) gives the same image as BGR decode + cv2 INTER_AREA + BGR->RGB."""
    ep = episodes["plain"]
    a = align_episode(ep.vio_mcap, ConversionSettings(image_size=SIZE))
    from dpflow_core.recordings import read_streams

    s = read_streams(ep.vio_mcap)
    ctx = av.CodecContext.create("h264", "r")
    ref = []
    for data in s.camera_packets[:10]:
        for f in ctx.decode(av.Packet(data)):
            bgr = f.to_ndarray(format="bgr24")
            ref.append(cv2.cvtColor(cv2.resize(bgr, SIZE, interpolation=cv2.INTER_AREA), cv2.COLOR_BGR2RGB))
    k = int(np.searchsorted(s.camera_ts_ns, a.camera_ts_ns[0]))
    diff = np.abs(a.rgb[: 10 - k].astype(int) - np.stack(ref[k:10]).astype(int))
    assert diff.mean() < 2.0, diff.mean()
    # and far from the channel-swapped image
    swapped = np.abs(a.rgb[: 10 - k, ..., ::-1].astype(int) - np.stack(ref[k:10]).astype(int))
    assert swapped.mean() > 5 * diff.mean() + 5


@pytest.mark.parametrize("size", [SIZE, None])
def test_one_scaler_per_stream_gives_the_pixels_of_a_new_scaler_per_frame(episodes, size):
    """decode_camera reuses one swscale context for the stream; every frame must equal PyAV's
    per-frame ``VideoFrame.reformat`` (a new context each time) with the same flags, bit for bit."""
    from dpflow_core.conversion.decode import SWS_FLAGS
    from dpflow_core.recordings import read_streams

    ep = episodes["late_idr"]  # leading undecodable packets: the scaler starts at the first IDR
    a = align_episode(ep.vio_mcap, ConversionSettings(image_size=size))
    s = read_streams(ep.vio_mcap)
    ctx = av.CodecContext.create("h264", "r")
    ref = {}
    kw = {} if size is None else {"width": size[0], "height": size[1]}
    for i, data in enumerate(s.camera_packets):
        packet = av.Packet(data)
        packet.pts = i
        try:
            frames = ctx.decode(packet)
        except av.error.InvalidDataError:
            continue
        for f in frames:
            ref[int(s.camera_ts_ns[f.pts])] = f.reformat(format="rgb24", interpolation=SWS_FLAGS, **kw).to_ndarray()
    for f in ctx.decode(None):
        ref[int(s.camera_ts_ns[f.pts])] = f.reformat(format="rgb24", interpolation=SWS_FLAGS, **kw).to_ndarray()
    expected = np.stack([ref[int(t)] for t in a.camera_ts_ns])
    assert len(a) > 60 and expected.shape == a.rgb.shape
    np.testing.assert_array_equal(a.rgb, expected)


def test_known_colour_patches_stay_rgb(tmp_path):
    n, w, h = 12, 160, 120
    rgb = np.zeros((h, w, 3), np.uint8)
    rgb[:, : w // 3] = (210, 30, 30)  # red
    rgb[:, w // 3 : 2 * w // 3] = (30, 210, 30)  # green
    rgb[:, 2 * w // 3 :] = (30, 30, 210)  # blue
    bgr = rgb[..., ::-1].copy()
    t0 = 1_767_000_000_000_000_000
    ts = t0 + np.arange(n, dtype=np.int64) * 33_333_333
    quat = np.tile([0.0, 0.0, 0.0, 1.0], (n, 1))
    path = _write_vio(tmp_path / "c_vio.mcap", [bgr] * n, ts, ts, np.zeros((n, 3)), quat, np.ones(n, bool),
                      ts, np.full(n, 0.05))
    for size in (SIZE, None):
        a = align_episode(path, ConversionSettings(image_size=size))
        W, H = size or (w, h)
        assert a.rgb.shape[1:] == (H, W, 3)
        for col, want in zip((W // 6, W // 2, 5 * W // 6), ((210, 30, 30), (30, 210, 30), (30, 30, 210))):
            got = a.rgb[:, H // 2, col].astype(int)
            assert np.abs(got - np.array(want)).max() <= 8, (size, col, got[0])


def test_slerp_and_linear_interpolation_between_sparse_poses(tmp_path):
    """Poses at 10 Hz, frames at 30 Hz: constant-rate rotation and linear motion are recovered exactly (a pose
    track this sparse is pose_rate_low, refused by default: warned here, and the warning recorded)."""
    n, fps = 60, 30.0
    t0 = 1_767_000_000_000_000_000
    frame_ns = t0 + np.round(np.arange(n) * 1e9 / fps).astype(np.int64) + 5_000_000
    pose_ns = t0 + np.arange(0, 21) * 100_000_000
    ps = (pose_ns - t0) / 1e9
    axis = np.array([0.3, -0.5, 0.8]) / np.linalg.norm([0.3, -0.5, 0.8])
    rate = 1.2  # rad/s, so the rotation passes 2.4 rad: slerp, not component-wise interpolation
    quat = Rotation.from_rotvec(np.outer(ps * rate, axis)).as_quat()
    vel = np.array([0.1, -0.05, 0.02])
    pos = np.array([0.4, 0.0, 0.3]) + np.outer(ps, vel)
    grip_ns = t0 + np.arange(0, 110) * 20_000_000
    grip = 0.02 + 0.03 * (grip_ns - t0) / 1e9
    frames = [np.full((120, 160, 3), 128, np.uint8)] * n
    path = _write_vio(tmp_path / "s_vio.mcap", frames, frame_ns, pose_ns, pos, quat, np.ones(len(ps), bool),
                      grip_ns, grip)
    with pytest.raises(ConversionError, match=r"pose_rate_low: pose from .*: 10 Hz \(limit 15 Hz\)"):
        align_episode(path, ConversionSettings(image_size=SIZE))
    warn = PlausibilityOptions(policies={"pose_rate_low": "warn"})
    a = align_episode(path, ConversionSettings(image_size=SIZE, plausibility=warn))
    assert "pose_rate_low" in [f["code"] for f in a.report["plausibility"]["findings"]]
    fs = (a.camera_ts_ns - t0) / 1e9
    assert a.camera_ts_ns[0] == frame_ns[0] and len(a) == n
    np.testing.assert_allclose(a.eef_pos, np.array([0.4, 0.0, 0.3]) + np.outer(fs, vel), atol=1e-6)
    want = Rotation.from_rotvec(np.outer(fs * rate, axis))
    assert (want.inv() * Rotation.from_rotvec(a.eef_rot_axis_angle)).magnitude().max() < 1e-5
    np.testing.assert_allclose(a.gripper_width[:, 0], 0.02 + 0.03 * fs, atol=1e-6)
    assert a.report["frequency_hz"] == pytest.approx(fps, rel=1e-3)


def test_two_missing_frames_are_reported_as_a_gap(episodes):
    a = align_episode(episodes["missing2"].vio_mcap, ConversionSettings(image_size=SIZE))
    assert len(a.report["gaps"]) == 1
    gap = a.report["gaps"][0]
    assert gap["missing_frames"] == 2 and gap["duration_s"] == pytest.approx(3 / 30, abs=0.005)
    assert a.report["frequency_hz"] == pytest.approx(30.0, rel=0.01)


def test_late_camera_is_trimmed_to_the_overlap(episodes):
    ep = episodes["late_early"]
    a = align_episode(ep.vio_mcap, ConversionSettings(image_size=SIZE))
    tr = a.report["trimmed_s"]
    assert tr["start"] == pytest.approx(0.4, abs=0.05) and tr["end"] == pytest.approx(0.2, abs=0.05)
    assert a.camera_ts_ns[0] == ep.camera_ts_ns[0] and a.camera_ts_ns[-1] == ep.camera_ts_ns[-1]
    assert a.report["duration_s"] == pytest.approx(3.0 - 0.6, abs=0.06)


def test_camera_shorter_than_pose_by_one_frame(tmp_path):
    n = 40
    t0 = 1_767_000_000_000_000_000
    ts = t0 + np.arange(n + 1, dtype=np.int64) * 33_333_333
    quat = np.tile([0.0, 0.0, 0.0, 1.0], (n + 1, 1))
    pos = np.outer(np.arange(n + 1), [0.001, 0, 0])
    frames = [np.full((120, 160, 3), 90, np.uint8)] * n
    path = _write_vio(tmp_path / "short_vio.mcap", frames, ts[:n], ts, pos, quat, np.ones(n + 1, bool),
                      ts, np.full(n + 1, 0.05))
    a = align_episode(path, ConversionSettings(image_size=SIZE))
    assert len(a) == n
    assert a.report["trimmed_s"]["end"] == pytest.approx(1 / 30, abs=1e-3)
    assert a.report["trimmed_s"]["start"] == 0.0
    np.testing.assert_allclose(a.eef_pos[:, 0], np.arange(n) * 0.001, atol=1e-7)


def test_vio_covering_40_percent_is_rejected(episodes):
    with pytest.raises(ConversionError) as err:
        align_episode(episodes["vio40"].vio_mcap, ConversionSettings(image_size=SIZE))
    assert err.value.code == "low_coverage"
    pct = int(re.search(r"cover only (\d+)% of the recording", err.value.reason).group(1))
    assert 37 <= pct <= 43 and "minimum 50%" in err.value.reason and "pose 0.9" in err.value.reason
    # explicit lower bound accepts it, trimmed to the pose track
    a = align_episode(episodes["vio40"].vio_mcap, ConversionSettings(image_size=SIZE, min_overlap_fraction=0.3))
    assert a.report["coverage"] == pytest.approx(0.4, abs=0.03)


def test_invalid_pose_policy(episodes):
    path = episodes["invalid"].vio_mcap
    with pytest.raises(ConversionError) as err:
        align_episode(path, ConversionSettings(image_size=SIZE, invalid_pose_policy="reject"))
    assert err.value.code == "pose_invalid" and "pose_valid false for" in err.value.reason
    a = align_episode(path, ConversionSettings(image_size=SIZE, invalid_pose_policy="trim"))
    inv = a.report["pose_invalid"]
    assert len(inv["stretches_s"]) == 2 and inv["invalid_frames"] >= 15
    # longest valid stretch: 0.4 s .. 2.4 s (the rest is dropped)
    assert a.report["duration_s"] == pytest.approx(2.0, abs=0.1)
    assert inv["dropped_frames"] >= 15
    ep = episodes["invalid"]
    t_rel = (a.camera_ts_ns - ep.camera_ts_ns[0].astype(np.int64)) / 1e9
    assert t_rel[0] >= 0.4 - 0.04 and t_rel[-1] < 2.4
    with pytest.raises(ConversionError, match="invalid_pose_policy"):
        align_episode(path, ConversionSettings(image_size=SIZE, invalid_pose_policy="ignore"))


def test_native_resolution_and_rgb_dir(episodes, tmp_path):
    a = align_episode(episodes["plain"].vio_mcap, ConversionSettings(image_size=None), rgb_dir=tmp_path)
    assert a.rgb.shape[1:] == (SPEC.height, SPEC.width, 3)
    assert a.rgb_path == tmp_path / "plain.rgb.npy" and a.rgb_path.exists()
    stored = np.load(a.rgb_path, mmap_mode="r")
    np.testing.assert_array_equal(stored[a.rgb_rows[0] : a.rgb_rows[1]], a.rgb)


def test_nan_gripper_width_is_rejected(tmp_path):
    n = 30
    t0 = 1_767_000_000_000_000_000
    ts = t0 + np.arange(n, dtype=np.int64) * 33_333_333
    grip = np.full(n, 0.05)
    grip[10] = np.nan
    path = _write_vio(tmp_path / "nan_vio.mcap", [np.full((120, 160, 3), 90, np.uint8)] * n, ts, ts,
                      np.zeros((n, 3)), np.tile([0.0, 0.0, 0.0, 1.0], (n, 1)), np.ones(n, bool), ts, grip)
    # the reader refuses it before any alignment, naming the stream, the sample's time and its index
    with pytest.raises(RecordingError) as err:
        align_episode(path, ConversionSettings(image_size=SIZE))
    assert err.value.code == "not_finite"
    assert "/robot0/sensor/magnetic_encoder: 1 gripper width sample NaN/inf" in err.value.reason
    assert f"the first at {10 * 33_333_333 / 1e9:.3f} s (message 10 of {n})" in err.value.reason
    assert str(path) in str(err.value)


def test_resize_is_at_least_as_accurate_as_cv2_area(tmp_path):
    """Against the source frame resized with INTER_AREA, the frames are as close as decode + cv2 INTER_AREA.

    The content has anti-aliased coloured shapes at arbitrary sub-pixel places over smooth
    gradients, as camera images do (edges aligned to the 2x2 chroma grid would favour
    nearest-neighbour chroma and say nothing about real frames).
    """
    rng = np.random.default_rng(5)
    n, w, h = 12, 160, 120
    ys, xs = np.mgrid[0:h, 0:w]
    sources = []
    for k in range(n):
        img = np.stack([90 + 40 * np.sin(xs / 13.0 + k / 5), 110 + 30 * np.cos(ys / 9.0),
                        120 + 50 * np.sin((xs + ys) / 17.0)], -1).astype(np.uint8)  # BGR
        for _ in range(25):
            colour = rng.integers(20, 236, 3).tolist()
            cx, cy, r = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(3, w / 6)
            cv2.circle(img, (int(cx * 16), int(cy * 16)), int(r * 16), colour, -1, cv2.LINE_AA, shift=4)
        sources.append(img)
    t0 = 1_767_000_000_000_000_000
    ts = t0 + np.arange(n, dtype=np.int64) * 33_333_333
    # the camera moves over the scene, so the pose moves too (a still pose under a changing image is VIO frozen)
    path = _write_vio(tmp_path / "q_vio.mcap", sources, ts, ts, np.linspace(0, 0.05, n)[:, None] * [1.0, 0.0, 0.0], np.tile([0.0, 0.0, 0.0, 1.0], (n, 1)),
                      np.ones(n, bool), ts, 0.05 + 0.02 * np.sin(np.arange(n) / 4.0))
    a = align_episode(path, ConversionSettings(image_size=SIZE))
    from dpflow_core.recordings import read_streams

    ctx = av.CodecContext.create("h264", "r")
    cv2_path = [cv2.cvtColor(cv2.resize(f.to_ndarray(format="bgr24"), SIZE, interpolation=cv2.INTER_AREA),
                             cv2.COLOR_BGR2RGB)
                for d in read_streams(path).camera_packets for f in ctx.decode(av.Packet(d))]
    truth = [cv2.cvtColor(cv2.resize(s, SIZE, interpolation=cv2.INTER_AREA), cv2.COLOR_BGR2RGB) for s in sources]
    ours = np.mean([np.abs(x.astype(int) - t.astype(int)).mean() for x, t in zip(a.rgb, truth)])
    ref = np.mean([np.abs(x.astype(int) - t.astype(int)).mean() for x, t in zip(cv2_path, truth)])
    assert len(a) == n and ours <= ref * 1.02, (ours, ref)


@pytest.mark.parametrize("stream, at, step_s", [("camera", 45, 0.3), ("pose", 30, 0.15), ("gripper", 60, -0.25)])
def test_clock_step_is_refused_at_conversion_without_pairing(tmp_path, stream, at, step_s):
    """A stream's capture clock jumps (forward or back) against its arrival times at message ``at``: the
    reader refuses it naming the stream, the size and the time of the last sample on the old clock, so a
    manifest written by hand (no ``dpflow pair``) cannot convert it into rows paired with wrong samples."""
    n = 90
    t0 = 1_767_000_000_000_000_000
    ts = t0 + np.arange(n, dtype=np.int64) * 33_333_333
    topic = {"camera": DAS_DEFAULT.camera, "pose": DAS_DEFAULT.pose, "gripper": DAS_DEFAULT.gripper}[stream]
    stepped = ts.copy()
    stepped[at:] += int(step_s * 1e9)
    streams = {k: (stepped if k == stream else ts) for k in ("camera", "pose", "gripper")}
    frames = [np.full((120, 160, 3), 60 + k, np.uint8) for k in range(n)]
    path = _write_vio(tmp_path / "step_vio.mcap", frames, streams["camera"], streams["pose"], np.zeros((n, 3)),
                      np.tile([0.0, 0.0, 0.0, 1.0], (n, 1)), np.ones(n, bool), streams["gripper"], np.full(n, 0.05),
                      arrival_ns={topic: ts})
    with pytest.raises(RecordingError) as err:
        align_episode(path, ConversionSettings(image_size=SIZE))
    code = "clock_step" if step_s > 0 else "clock_reversal"
    assert err.value.code == code
    what = "stepped forward" if step_s > 0 else "ran backwards"
    # the last sample on the old clock is message at - 1; times count from the first sample of any stream
    assert f"{topic} capture clock {what} by {abs(step_s):.3f} s at {(at - 1) * 33_333_333 / 1e9:.3f} s" in err.value.reason
    assert str(path) in str(err.value)


def test_no_clock_step_on_a_healthy_recording_with_jittered_arrivals(tmp_path):
    """Arrival delays that wander (up to 40 ms, one message 90 ms late) are no clock step: the reader
    reads every frame at its capture time."""
    n = 90
    t0 = 1_767_000_000_000_000_000
    ts = t0 + np.arange(n, dtype=np.int64) * 33_333_333
    rng = np.random.default_rng(7)
    late = ts + rng.integers(0, 40_000_000, n)
    late[50] += 90_000_000
    frames = [np.full((120, 160, 3), 60 + k, np.uint8) for k in range(n)]
    path = _write_vio(tmp_path / "ok_vio.mcap", frames, ts, ts, np.zeros((n, 3)), np.tile([0.0, 0.0, 0.0, 1.0], (n, 1)),
                      np.ones(n, bool), ts, np.full(n, 0.05), arrival_ns={DAS_DEFAULT.camera: late})
    from dpflow_core.recordings.reader import read_streams

    streams = read_streams(path, DAS_DEFAULT)
    assert len(streams.camera_packets) == n
    np.testing.assert_array_equal(streams.camera_ts_ns, ts)


@pytest.mark.parametrize("resent", [{20, 47}, {1, 2}])
def test_a_resent_camera_message_is_not_decoded_twice(tmp_path, resent):
    """A transport resends P-frame messages (the same payload again, stamped half a frame later): decoding a copy
    would apply its prediction twice and smear every frame to the next key frame. The copies are left out,
    named duplicate_payload, and every kept frame equals the clean recording's, bit for bit, at the same time."""
    import shutil

    from fault_fixtures import CAMERA, resend_messages

    spec = replace(SPEC, gop_size=15)
    ep = samples.write_episode(tmp_path / "clean", "ep", spec, seed=11)
    dup = tmp_path / "dup_vio.mcap"
    shutil.copy(ep.vio_mcap, dup)
    resend_messages(dup, CAMERA, resent, delay_ns=16_666_666)
    settings = ConversionSettings(image_size=SIZE)
    clean, bad = align_episode(ep.vio_mcap, settings), align_episode(dup, settings)
    np.testing.assert_array_equal(bad.timestamps_s, clean.timestamps_s)
    np.testing.assert_array_equal(bad.rgb, clean.rgb)
    found = [d for d in bad.report["damaged_frames"] if d["code"] == "duplicate_payload"]
    # message numbers in the resent file: each copy follows its original
    want = sorted(k + 1 + sum(1 for j in resent if j < k) for k in resent)
    assert [d["message"] for d in found] == want
    assert all("repeats message" in d["reason"] and d["action"] == "dropped" for d in found)

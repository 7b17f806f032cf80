"""What parses but is physically wrong never trains silently (issue 28): the plausibility rules.

Faults come from ``fault_fixtures`` (or are drawn into arrays here) with ground truth: which samples
are wrong, by how much, when. Each class is tried in several sizes, positions and streams; the
checks assert the named class, time and figure, and that no bad row reaches the dataset.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy.spatial.transform import Rotation

from dpflow_core.conversion import ConversionSettings, convert
from dpflow_core.pairing import pair_recordings
from dpflow_core.recordings.plausibility import PlausibilityOptions, check_clock, check_gripper, check_pose
from dpflow_core.recordings.samples import trajectory
from dpflow_core.replay_buffer import ReplayBuffer
from fault_fixtures import (CAMERA, GRIPPER, POSE, clock_shift, gripper_values, interp_truth, pose_invalid_stretch, pose_jump,
                            pose_spikes, vio_freeze)
from recording_fixtures import refresh_vio_result, write_small_episode, write_small_task

SIZE = (32, 24)


def _track(seed: int, seconds: float = 8.0, hz: float = 30.0):
    rng = np.random.default_rng(seed)
    ts = np.round(np.arange(int(seconds * hz)) * 1e9 / hz + rng.normal(0, 3e5, int(seconds * hz))).astype(np.int64)
    ts = np.maximum.accumulate(ts)
    pos, rot, width = trajectory(ts / 1e9, seed)
    return ts, pos, Rotation.from_rotvec(rot).as_quat(), width


# --------------------------------------------------------------------------- the rules on arrays


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_clean_tracks_give_no_finding_with_margin(seed):
    ts, pos, quat, width = _track(seed)
    assert check_pose(ts, pos, quat, 0).findings == []
    assert check_gripper(ts, width + np.random.default_rng(seed).normal(0, 2e-4, len(ts)), ts, pos, 0) == []
    dt = np.diff(ts) / 1e9
    speed = np.linalg.norm(np.diff(pos, axis=0), axis=1) / dt
    opts = PlausibilityOptions()
    assert speed.max() < opts.max_speed_mps / 3  # the margins docs/formats.md states


@pytest.mark.parametrize("index,offset", [(10, (0.5, 0, 0)), (120, (0, -0.05, 0)), (200, (0.1, 0.1, -0.2)), (238, (0, 0, 0.04))])
def test_single_sample_spikes_are_repaired_with_provenance(index, offset):
    ts, pos, quat, _ = _track(4)
    bad = pos.copy()
    bad[index] += offset
    v = check_pose(ts, bad, quat, int(ts[0]))
    assert [(f.code, f.action) for f in v.findings] == [("pose_spike", "repaired")]
    f = v.findings[0]
    assert f.at_s == pytest.approx((ts[index] - ts[0]) / 1e9)
    assert f.value == pytest.approx(np.linalg.norm(offset), rel=0.05)
    assert f.detail["original_position_m"] == pytest.approx(bad[index].tolist(), abs=1e-6)
    assert np.abs(v.position_m - pos).max() < 1e-3  # the repaired track is the true one
    assert v.drop_ns == []


@pytest.mark.parametrize("pose_hz,camera_hz,flagged", [(5.0, 30.0, True), (12.0, 30.0, True), (10.0, 60.0, True),
                                                     (15.0, 30.0, False), (30.0, 30.0, False), (10.0, 10.0, False),
                                                     (200.0, 30.0, False)])
def test_a_pose_track_much_slower_than_the_camera_is_named(pose_hz, camera_hz, flagged):
    """A VIO sampled under half as often as the camera (each frame's pose interpolated across more than two frame
    intervals) is pose_rate_low with both rates; at half the camera's rate or faster nothing is said."""
    ts, pos, quat, _ = _track(8, seconds=6.0, hz=pose_hz)
    cam_ts = np.round(np.arange(int(6.0 * camera_hz)) * 1e9 / camera_hz).astype(np.int64) + 1_000_000
    motion = np.full(len(cam_ts), 0.5)
    v = check_pose(ts, pos, quat, 0, motion_ts_ns=cam_ts, motion=motion)
    slow = [f for f in v.findings if f.code == "pose_rate_low"]
    if not flagged:
        assert slow == []
        return
    assert len(slow) == 1 and slow[0].action == "rejected"
    assert slow[0].value == pytest.approx(pose_hz, rel=0.02) and slow[0].detail["camera_hz"] == pytest.approx(camera_hz, rel=1e-3)
    assert slow[0].limit == pytest.approx(camera_hz / 2, rel=1e-3)


@pytest.mark.parametrize("start,count,offset", [(40, 3, (0.04, 0, 0)), (101, 5, (0, -0.06, 0.02)), (180, 7, (0, 0, 0.05)),
                                                (12, 4, (0.3, 0.1, 0))])
def test_an_alternating_glitch_is_dropped_not_repaired_onto_itself(start, count, offset):
    """Every other sample off by the same offset: each looks like a spike between neighbours that agree, but
    those neighbours are glitched too. Repairing each would move the good samples onto the glitch (40 mm off in
    a new user's trial); the run is one pose_glitch and its span is dropped, every kept sample untouched."""
    ts, pos, quat, _ = _track(7)
    bad = pos.copy()
    glitched = np.arange(start, start + 2 * count - 1, 2)  # count glitched samples, a good one between each
    bad[glitched] += offset
    v = check_pose(ts, bad, quat, int(ts[0]))
    glitches = [f for f in v.findings if f.code == "pose_glitch"]
    assert len(glitches) == 1 and not any(f.code == "pose_spike" for f in v.findings), v.findings
    g = glitches[0]
    assert g.action != "repaired" and g.value == pytest.approx(np.linalg.norm(offset), rel=0.05)
    assert g.detail["samples"] >= 2 * count - 2  # the glitched samples and the good ones between them
    assert np.array_equal(v.position_m, bad)  # nothing moved
    lo, hi = min(a for a, _ in v.drop_ns), max(b for _, b in v.drop_ns)
    kept = (ts < lo) | (ts > hi)
    assert lo <= ts[glitched[0]] and hi >= ts[glitched[-1]] and not kept[glitched].any()
    assert np.abs(v.position_m[kept] - pos[kept]).max() < 1e-12  # no kept row is off the true track


@pytest.mark.parametrize("index,offset", [(60, (0.3, 0, 0)), (150, (0, 0, -1.0)), (30, (0.12, 0.05, 0))])
def test_jumps_cut_the_track_between_the_two_samples(index, offset):
    ts, pos, quat, _ = _track(5)
    bad = pos.copy()
    bad[index:] += offset
    v = check_pose(ts, bad, quat, int(ts[0]))
    assert [f.code for f in v.findings] == ["pose_jump"]
    assert v.findings[0].value > 3.0 and v.findings[0].at_s == pytest.approx((ts[index - 1] - ts[0]) / 1e9)
    assert v.drop_ns == [(int(ts[index - 1]), int(ts[index]))]


def test_rotation_jump_and_acceleration():
    ts, pos, quat, _ = _track(6)
    rot = Rotation.from_quat(quat)
    bad = (Rotation.from_rotvec([0, 0, 1.2]) * rot[100:]).as_quat()
    q = np.concatenate([quat[:100], bad])
    assert [f.code for f in check_pose(ts, pos, q, 0).findings] == ["rotation_jump"]
    # a jerk: the velocity changes by 2.4 m/s within one sample, twice (no spike, no jump)
    t = ts / 1e9
    ramp = 2.4 * (np.clip(t, 3.0, 3.2) - 3.0)
    found = check_pose(ts, pos + np.outer(ramp, [1, 0, 0]), quat, int(ts[0]), PlausibilityOptions(max_speed_mps=10)).findings
    assert [f.code for f in found] == ["pose_acceleration"] and found[0].action == "warned"
    assert found[0].value > 60 and found[0].detail["samples"] == 2
    assert 2.95 < found[0].at_s < 3.05 and 3.15 < found[0].end_s < 3.25


@pytest.mark.parametrize("start,stop", [(30, 50), (100, 200), (200, 239)])
def test_frozen_vio_while_the_camera_moves_is_cut_out(start, stop):
    ts, pos, quat, _ = _track(7)
    bad, badq = pos.copy(), quat.copy()
    bad[start:stop], badq[start:stop] = pos[start], quat[start]
    moving = np.full(len(ts), 6.0)
    v = check_pose(ts, bad, badq, int(ts[0]), motion_ts_ns=ts, motion=moving)
    frozen = [f for f in v.findings if f.code == "vio_frozen"]
    assert len(frozen) == 1 and frozen[0].action == "split"
    assert frozen[0].value == pytest.approx((ts[stop - 1] - ts[start]) / 1e9)
    a, b = next(d for d in v.drop_ns if d[0] == ts[start])
    assert b == (ts[stop] if stop < len(ts) else ts[-1] + 1)
    # the same pose with a still camera is a still hand, not a frozen VIO
    still = check_pose(ts, bad, badq, 0, motion_ts_ns=ts, motion=np.full(len(ts), 0.1)).findings
    assert "vio_frozen" not in [f.code for f in still]
    # without decoded frames it is only warned
    unknown = [f for f in check_pose(ts, bad, badq, 0).findings if f.code == "vio_frozen"]
    assert unknown[0].action == "warned" and "not measured" in unknown[0].detail["note"]


def test_gripper_dead_stuck_and_out_of_range():
    ts, pos, _, width = _track(8)
    t0 = int(ts[0])
    dead = check_gripper(ts, np.full(len(ts), 0.042), ts, pos, t0)
    assert [(f.code, f.action) for f in dead] == [("gripper_dead", "rejected")] and dead[0].detail["constant_m"] == 0.042
    # a dead gripper on a gripper that does not move is no finding: nothing says it should change
    assert check_gripper(ts, np.full(len(ts), 0.042), ts, np.repeat(pos[:1], len(ts), axis=0), t0) == []
    noisy = width + np.random.default_rng(0).normal(0, 2e-4, len(ts))
    for a, b in ((20, 80), (150, 230)):
        stuck = noisy.copy()
        stuck[a:b] = stuck[a]
        f = check_gripper(ts, stuck, ts, pos, t0)
        assert [x.code for x in f] == ["gripper_stuck"] and f[0].at_s == pytest.approx((ts[a] - t0) / 1e9)
    odd = noisy.copy()
    odd[239] = np.nan  # not a range finding: conversion rejects it as not_finite (test_conversion_align)
    assert check_gripper(ts, odd, ts, pos, t0) == []
    for k, value in ((5, 0.5), (100, -0.02), (201, 0.3)):
        odd = noisy.copy()
        odd[k] = value
        f = check_gripper(ts, odd, ts, pos, t0)
        assert [(x.code, x.action) for x in f] == [("gripper_out_of_range", "rejected")]
        assert f[0].at_s == pytest.approx((ts[k] - t0) / 1e9) and f[0].detail["samples"] == 1


@pytest.mark.parametrize("at,shift_s", [(20, 0.4), (150, -0.25), (280, 0.15), (40, -3.0)])
def test_clock_steps_and_reversals_are_named_with_time_and_size(at, shift_s):
    rng = np.random.default_rng(at)
    n = 300
    t = np.arange(n) * 33_333_333 + rng.normal(0, 3e5, n).astype(np.int64)
    log = t + rng.integers(8, 45, n) * 1_000_000
    log[[50, 51]] = log[[51, 50]]  # a log-time inversion is no step
    stepped = t.copy()
    stepped[at:] += int(shift_s * 1e9)
    f = check_clock(stepped, log, 0, "cam")
    assert len(f) == 1 and f[0].code == ("clock_step" if shift_s > 0 else "clock_reversal")
    assert f[0].value == pytest.approx(shift_s, abs=0.02) and f[0].at_s == pytest.approx(t[at - 1] / 1e9)
    assert check_clock(t, log, 0, "cam") == []


def test_options_reject_unknown_classes_and_policies():
    with pytest.raises(ValueError, match="takes policy"):
        PlausibilityOptions(policies={"gripper_dead": "repair"}).validate()
    with pytest.raises(ValueError, match="unknown plausibility class"):
        PlausibilityOptions(policies={"pose_wobble": "warn"}).validate()


# --------------------------------------------------------------------------- recordings end to end


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    base = tmp_path_factory.mktemp("plaus")
    short = write_small_task(base, episodes=5, seed=11)
    d = base / "pick_place"
    # pieces of a split must reach the minimum episode length: 5 s episodes for the jump and the freeze
    long = [write_small_episode(d, f"pick_place_{k:04d}", seed=60 + k, seconds=5.0) for k in (5, 6)]
    refresh_vio_result(d)
    # eps: 0 spikes, 1 jump, 2 frozen VIO, 3 dead gripper, 4 gripper out of range, 5 clock step, 6 clean
    eps = [short[0], long[0], long[1], short[1], short[2], short[3], short[4]]
    spikes = {12: (0.5, 0.0, 0.0), 40: (0.0, 0.0, -0.2)}
    pose_spikes(eps[0].vio_mcap, spikes)
    pose_jump(eps[1].vio_mcap, 70, (0.3, -0.2, 0.0))
    vio_freeze(eps[2].vio_mcap, 60, 75)
    gripper_values(eps[3].vio_mcap, lambda k, v: 0.031)
    gripper_values(eps[4].vio_mcap, lambda k, v: 0.25 if k == 70 else v)
    clock_shift(eps[5].vio_mcap, CAMERA, 30, 400_000_000)
    manifest = pair_recordings(base / "pick_place")
    out = base / "ds" / "dataset.npz"
    result = convert(manifest, out, ConversionSettings(image_size=SIZE), workers=1, cache=False)
    return eps, spikes, manifest, result


def _rows(result):
    """Per dataset episode: its metadata entry, absolute capture times (ns) and positions."""
    buf = ReplayBuffer(result.path)
    meta = json.loads(result.sidecar_path.read_text())
    out = []
    for e, (a, b) in zip(meta["episodes"], buf.episode_slices() if hasattr(buf, "episode_slices") else
                         zip(np.r_[0, buf.episode_ends[:-1]], buf.episode_ends)):
        t = e["start_ts_ns"] + np.round(np.asarray(buf["timestamp"][a:b]) * 1e9).astype(np.int64)
        out.append((e, t, np.asarray(buf["robot0_eef_pos"][a:b], dtype=np.float64)))
    return out


def test_clock_step_is_rejected_at_pairing_with_time_and_size(faulty):
    eps, _, manifest, result = faulty
    rej = {r.stem: r for r in manifest.rejected}
    r = rej[eps[5].stem]
    assert r.code == "clock_step"
    import re

    m = re.search(rf"{CAMERA} capture clock stepped forward by (0\.\d+) s at (\d\.\d+) s \(message 30;", r.reason)
    t29 = (int(eps[5].camera_ts_ns[29]) - int(eps[5].camera_ts_ns[0])) / 1e9
    assert m and abs(float(m[1]) - 0.4) < 0.02 and float(m[2]) == pytest.approx(t29, abs=1e-3), r.reason
    assert "Hz" not in r.reason
    assert eps[5].stem not in [e["stem"] for e, _, _ in _rows(result)]


def test_gripper_faults_are_rejected_naming_stream_time_and_figure(faulty):
    eps, _, _, result = faulty
    rej = {r["stem"]: r for r in result.rejected}
    assert rej[eps[3].stem]["code"] == "gripper_dead" and "gripper from 0.000" in rej[eps[3].stem]["reason"]
    out = rej[eps[4].stem]
    assert out["code"] == "gripper_out_of_range" and "0.25 m (limit 0.12 m)" in out["reason"]
    t70 = (int(eps[4].gripper_ts_ns[70]) - min(int(eps[4].camera_ts_ns[0]), int(eps[4].pose_ts_ns[0]),
                                                int(eps[4].gripper_ts_ns[0]))) / 1e9
    assert f"at {t70:.3f} s" in out["reason"]


def test_no_bad_row_reaches_the_dataset(faulty):
    eps, spikes, _, result = faulty
    by_stem: dict[str, list] = {}
    for e, t, pos in _rows(result):
        by_stem.setdefault(e["stem"], []).append((e, t, pos))
    # spikes: repaired, every row on the true track, both findings recorded with their originals
    (e, t, pos), = by_stem[eps[0].stem]
    assert np.abs(pos - interp_truth(eps[0], t)).max() < 2e-3
    found = e["plausibility"]["findings"]
    assert [f["code"] for f in found] == ["pose_spike", "pose_spike"] and all(f["action"] == "repaired" for f in found)
    # the jump: two episodes, each on the true track or on the true track moved by the offset, never both
    pieces = by_stem[eps[1].stem]
    assert len(pieces) == 2 and pieces[0][0]["plausibility"]["findings"][0]["code"] == "pose_jump"
    offset = np.array([0.3, -0.2, 0.0])
    for k, (e, t, pos) in enumerate(pieces):
        err = np.abs(pos - interp_truth(eps[1], t) - (offset if k else 0)).max()
        assert err < 2e-3, (k, err)
    assert pieces[0][1][-1] <= int(eps[1].pose_ts_ns[69]) < int(eps[1].pose_ts_ns[70]) <= pieces[1][1][0]
    # frozen VIO: no row from inside the frozen stretch, every kept row on the true track
    frozen = by_stem[eps[2].stem]
    lo, hi = int(eps[2].pose_ts_ns[60]), int(eps[2].pose_ts_ns[75])
    for e, t, pos in frozen:
        assert not np.any((t > lo) & (t < hi))
        assert np.abs(pos - interp_truth(eps[2], t)).max() < 2e-3
    assert any(f["code"] == "vio_frozen" and f["action"] == "split" for f in frozen[0][0]["plausibility"]["findings"])
    # the clean episode: untouched
    (e, t, pos), = by_stem[eps[6].stem]
    assert e["plausibility"]["findings"] == [] and np.abs(pos - interp_truth(eps[6], t)).max() < 2e-3


def test_a_slow_pose_track_is_refused_and_an_alternating_glitch_cut_out_end_to_end(tmp_path):
    """Through pairing and conversion: a VIO track thinned to every sixth pose (5 Hz beside the 30 Hz camera) is
    rejected as pose_rate_low naming both rates; an episode whose poses 40-46 alternate 4 cm off keeps no row
    from the glitch and every kept row on the true track."""
    from fault_fixtures import _rewrite

    d = tmp_path / "pick_place"
    eps = [write_small_episode(d, f"pick_place_{k:04d}", seed=80 + k, seconds=5.0) for k in range(3)]
    _rewrite(eps[0].vio_mcap, (POSE,), lambda topic, k, msg, rec: [(rec.log_time, rec.data, rec.publish_time)] if k % 6 == 0 else [])
    pose_spikes(eps[1].vio_mcap, {k: (0.04, 0.0, 0.0) for k in (40, 42, 44, 46)})
    refresh_vio_result(d)
    manifest = pair_recordings(d)
    result = convert(manifest, tmp_path / "ds" / "dataset.npz", ConversionSettings(image_size=SIZE), workers=1, cache=False)
    rej = {r["stem"]: r for r in result.rejected}
    assert rej[eps[0].stem]["code"] == "pose_rate_low", result.rejected
    assert "pose from" in rej[eps[0].stem]["reason"] and "(limit 15" in rej[eps[0].stem]["reason"]
    rows = {}
    for e, t, pos in _rows(result):
        rows.setdefault(e["stem"], []).append((e, t, pos))
    lo, hi = int(eps[1].pose_ts_ns[40]), int(eps[1].pose_ts_ns[46])
    codes = [f["code"] for piece in rows[eps[1].stem] for f in piece[0]["plausibility"]["findings"]]
    assert "pose_glitch" in codes and "pose_spike" not in codes, codes
    for e, t, pos in rows[eps[1].stem]:
        assert not np.any((t >= lo) & (t <= hi))
        assert np.abs(pos - interp_truth(eps[1], t)).max() < 2e-3
    (e, t, pos), = rows[eps[2].stem]
    assert e["plausibility"]["findings"] == []


def test_quality_report_lists_the_findings_per_episode(faulty, tmp_path):
    from dpflow_core.report import episode_quality

    eps, _, manifest, _ = faulty
    q = {e.stem: e for e in episode_quality(manifest.to_dict() if hasattr(manifest, "to_dict") else manifest)}
    assert [f["code"] for f in q[eps[0].stem].findings] == ["pose_spike", "pose_spike"]
    assert any(r.startswith("implausible pose_spike: pose at ") for r in q[eps[0].stem].outlier_reasons)
    assert [f["code"] for f in q[eps[3].stem].findings] == ["gripper_dead"]
    assert q[eps[6].stem].findings == ()


# --------------------------------------------------------------------------- one minimum episode length


@pytest.mark.parametrize("seconds", [0.3, 1.2])
def test_one_minimum_episode_length_rejects_or_warns_with_the_figure(tmp_path, seconds):
    d = tmp_path / "pick_place"
    write_small_task(tmp_path, episodes=2, seed=21)
    short = write_small_episode(d, "pick_place_0002", seed=22, seconds=seconds)
    refresh_vio_result(d)
    manifest = pair_recordings(d)
    result = convert(manifest, tmp_path / "a" / "dataset.npz", ConversionSettings(image_size=SIZE),
                     workers=1, cache=False)
    rej = {r["stem"]: r for r in result.rejected}[short.stem]
    n = int(round(seconds * 30))
    assert rej["code"] == "too_short" and "below the minimum episode length of 46 frames" in rej["reason"]
    assert f"episode has {n - 1} frames" in rej["reason"] or f"episode has {n} frames" in rej["reason"]
    kept = convert(manifest, tmp_path / "b" / "dataset.npz",
                   ConversionSettings(image_size=SIZE, short_episode_policy="warn"), workers=1, cache=False)
    assert kept.n_episodes == 3 and short.stem not in {r["stem"] for r in kept.rejected}
    warned = [w for w in kept.metadata["warnings"] if w.get("stem") == short.stem]
    assert [w["code"] for w in warned] == ["short_episode"] and "below the minimum episode length" in warned[0]["reason"]


def test_formats_md_lists_every_plausibility_class_with_its_default_policy_and_every_threshold():
    """docs/formats.md's plausibility table follows the code: a row per class of ``POLICIES`` whose policy
    cell starts with the class's default, and every ``PlausibilityOptions`` threshold named."""
    import re
    from dataclasses import fields
    from pathlib import Path

    from dpflow_core.recordings.plausibility import POLICIES, PlausibilityOptions

    docs = (Path(__file__).resolve().parents[3] / "docs" / "formats.md").read_text()
    section = docs[docs.index("### Plausibility"):]
    section = section[: section.index("\n## ", 1)] if "\n## " in section[1:] else section
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([a-z_]+)` \|.*$", section, re.M)}
    assert sorted(set(POLICIES) - set(rows)) == []
    for code, accepted in POLICIES.items():
        policy_cell = rows[code].rstrip(" |").rsplit("|", 1)[-1].strip()
        assert policy_cell.startswith(accepted[0]), (code, policy_cell)
    thresholds = [f.name for f in fields(PlausibilityOptions) if f.name != "policies"]
    assert sorted(t for t in thresholds if f"`{t}`" not in section) == []


# --------------------------------------------------------------------------- the IMU: liveness and range


def _imu_of(ts, pos, quat, hz=200.0, seed=0):
    """What an IMU rigidly on the camera reads along a track (ground truth: the track), with noise."""
    from scipy.spatial.transform import Slerp

    t = (ts - ts[0]) / 1e9
    t_imu = np.arange(t[1], t[-2], 1 / hz)
    slerp = Slerp(t, Rotation.from_quat(quat))
    h = 0.01
    r0, r1, r2 = slerp(t_imu - h), slerp(t_imu), slerp(t_imu + h)
    gyro = (r0.inv() * r2).as_rotvec() / (2 * h)
    p = [np.stack([np.interp(t_imu + d, t, pos[:, k]) for k in range(3)], axis=1) for d in (-h, 0.0, h)]
    force = r1.inv().apply((p[2] - 2 * p[1] + p[0]) / h**2 + [0.0, 0.0, 9.81])
    rng = np.random.default_rng(seed)
    return ts[0] + np.round(t_imu * 1e9).astype(np.int64), gyro + rng.normal(0, 0.003, gyro.shape), force + rng.normal(0, 0.03, force.shape)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_imu_faults_named_with_sensor_time_and_figure(seed):
    from dpflow_core.recordings.plausibility import check_imu

    ts, pos, quat, _ = _track(seed)
    its, gyro, acc = _imu_of(ts, pos, quat, seed=seed)
    t0 = int(ts[0])
    assert check_imu(its, gyro, acc, ts, pos, quat, t0) == []  # the true IMU: nothing
    # a dead gyro, then a dead accelerometer (constant on every axis while the hand moves): imu_dead, warned
    (f,) = check_imu(its, np.zeros_like(gyro), acc, ts, pos, quat, t0)
    assert (f.code, f.detail["sensor"], f.policy, f.action) == ("imu_dead", "gyro", "warn", "warned")
    assert f.detail["pose_path_m"] > 0.05
    (f,) = check_imu(its, gyro, np.tile(acc[0], (len(acc), 1)), ts, pos, quat, t0)
    assert (f.code, f.detail["sensor"]) == ("imu_dead", "accelerometer")  # no second, gravity finding
    # specific force written in g: the median magnitude is 1, named with the hint
    (f,) = check_imu(its, gyro, acc / 9.81, ts, pos, quat, t0)
    assert f.code == "imu_out_of_range" and abs(f.value - 1.0) < 0.05 and "g written instead of m/s^2" in f.detail["why"]
    # one gyro sample beyond full scale, at a known time
    k = 100 + 37 * seed
    bad = gyro.copy()
    bad[k, seed % 3] = 50.0
    (f,) = check_imu(its, bad, acc, ts, pos, quat, t0)
    assert (f.code, f.detail["sensor"], f.detail["samples"], f.value, f.unit) == ("imu_out_of_range", "gyro", 1, 50.0, "rad/s")
    assert f.at_s == pytest.approx((its[k] - t0) / 1e9)
    # the reject policy
    (f,) = check_imu(its, np.zeros_like(gyro), acc, ts, pos, quat, t0, PlausibilityOptions(policies={"imu_dead": "reject"}))
    assert f.action == "rejected"


def test_a_still_device_with_a_constant_imu_is_no_finding():
    """A hand at rest: constant pose and an IMU that reads the same all along (no motion to feel)."""
    from dpflow_core.recordings.plausibility import check_imu

    ts = np.arange(90, dtype=np.int64) * 33_333_333
    pos, quat = np.zeros((90, 3)), np.tile([0.0, 0.0, 0.0, 1.0], (90, 1))
    its = np.arange(600, dtype=np.int64) * 5_000_000
    assert check_imu(its, np.zeros((600, 3)), np.tile([0.0, 0.0, 9.81], (600, 1)), ts, pos, quat, 0) == []
    assert check_imu(None, None, None, ts, pos, quat, 0) == []


def test_dead_imu_reaches_the_dataset_as_a_warning_and_is_rejected_when_asked(tmp_path):
    """Through conversion: a recording whose IMU reads zeros (gyro) is converted with an ``imu_dead``
    finding in its episode's plausibility record; with ``imu_dead: reject`` it is rejected, named."""
    from fault_fixtures import IMU, edit_messages

    task = tmp_path / "imu_task"
    write_small_episode(task, "healthy", seed=30)
    ep = write_small_episode(task, "dead_imu", seed=31)

    def dead(_topic, _k, msg):
        msg.angular_velocity.x = msg.angular_velocity.y = msg.angular_velocity.z = 0.0

    edit_messages(ep.vio_mcap, (IMU,), dead)
    refresh_vio_result(task)
    manifest = pair_recordings(task)
    out = convert(manifest, tmp_path / "warn.npz", ConversionSettings(image_size=SIZE))
    episodes = {e["stem"]: e for e in json.loads((tmp_path / "warn.json").read_text())["episodes"]}
    codes = [(f["code"], f["detail"].get("sensor"), f["action"]) for f in episodes["dead_imu"]["plausibility"]["findings"]]
    assert ("imu_dead", "gyro", "warned") in codes, codes
    assert not [f for f in episodes["healthy"]["plausibility"]["findings"] if f["code"].startswith("imu")]
    assert out.n_episodes == 2
    res = convert(manifest, tmp_path / "reject.npz",
                  ConversionSettings(image_size=SIZE, plausibility={"policies": {"imu_dead": "reject"}}))
    assert res.n_episodes == 1 and [(r["stem"], r["code"]) for r in res.rejected] == [("dead_imu", "imu_dead")]
    assert "imu_dead: imu from" in res.rejected[0]["reason"] and "gyro constant at [0.0, 0.0, 0.0] rad/s" in res.rejected[0]["reason"]


# --------------------------------------------------------------------------- invalid poses are no jump


@pytest.mark.parametrize("start,stop,value", [(60, 80, (0, 0, 0)), (10, 30, (0, 0, 0)), (150, 200, (0, 0, 0)),
                                              (100, 103, (5.0, -3.0, 1.0))])
def test_an_invalid_stretch_is_not_judged_as_a_jump(start, stop, value):
    """Issue 28 trial, item 6: pose_valid false with zero poses was reported as pose_jump "split"."""
    ts, pos, quat, _ = _track(5)
    bad = pos.copy()
    bad[start:stop] = value
    valid = np.ones(len(ts), bool)
    valid[start:stop] = False
    blind = check_pose(ts, bad, quat, int(ts[0]))
    assert any(f.code == "pose_jump" for f in blind.findings)  # the garbage, judged as a pose, is a jump
    v = check_pose(ts, bad, quat, int(ts[0]), valid=valid)
    assert v.findings == [] and v.drop_ns == []
    assert np.array_equal(v.position_m[valid], pos[valid]) and v.position_m.shape == pos.shape


@pytest.fixture(scope="module")
def invalid_task(tmp_path_factory):
    base = tmp_path_factory.mktemp("invalid")
    d = base / "pick_place"
    eps = [write_small_episode(d, f"pick_place_{k:04d}", seed=80 + k, seconds=5.0) for k in range(3)]
    refresh_vio_result(d)
    stretches = {eps[0].stem: (40, 60, (0.0, 0.0, 0.0), False), eps[1].stem: (95, 110, (0.0, 0.0, 0.0), True)}
    for e in eps[:2]:
        start, stop, value, identity = stretches[e.stem]
        pose_invalid_stretch(e.vio_mcap, start, stop, value, identity)
    refresh_vio_result(d)
    manifest = pair_recordings(d)
    result = convert(manifest, base / "ds" / "dataset.npz", ConversionSettings(image_size=SIZE), workers=1, cache=False)
    return eps, stretches, manifest, result


def test_an_invalid_stretch_is_pose_invalid_in_the_dataset_and_the_report(invalid_task):
    from dpflow_core.report import episode_quality

    eps, stretches, manifest, result = invalid_task
    assert [a.stem for a in manifest.accepted] == [e.stem for e in eps]
    rows: dict[str, list] = {}
    for e, t, pos in _rows(result):
        rows.setdefault(e["stem"], []).append((e, t, pos))
    quality = {q.stem: q for q in episode_quality(manifest.to_dict())}
    for ep in eps:
        for e, t, pos in rows[ep.stem]:
            codes = [f["code"] for f in e["plausibility"]["findings"]]
            assert "pose_jump" not in codes and "vio_frozen" not in codes, codes
            assert np.abs(pos - interp_truth(ep, t)).max() < 2e-3  # no row from the garbage
        q = quality[ep.stem]
        assert not any(f["code"] in ("pose_jump", "vio_frozen", "pose_spike") for f in q.findings), q.findings
        if ep.stem not in stretches:
            assert q.findings == ()
            continue
        start, stop, _, _ = stretches[ep.stem]
        lo, hi = int(ep.pose_ts_ns[start - 1]), int(ep.pose_ts_ns[stop])
        for _e, t, _pos in rows[ep.stem]:
            assert not np.any((t > lo) & (t < hi))
        (f,) = [f for f in q.findings if f["code"] == "pose_invalid"]
        t0 = min(int(ep.camera_ts_ns[0]), int(ep.pose_ts_ns[0]), int(ep.gripper_ts_ns[0]))
        assert f["value"] == stop - start and f["at_s"] == pytest.approx((int(ep.pose_ts_ns[start]) - t0) / 1e9, abs=1e-3)
        assert any(r.startswith("pose_invalid: pose from ") and f"{stop - start} poses with pose_valid false" in r
                   for r in q.outlier_reasons)

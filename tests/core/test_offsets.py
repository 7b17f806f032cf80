"""Camera-to-VIO and IMU-to-VIO offsets measured from the recording (issue 29), against the simulated
world's known lags: MuJoCo renders each frame at its capture time, the camera stamps it
``camera_latency_s`` later, and the IMU's gyro follows the same state history."""

from __future__ import annotations

import dataclasses

import json

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

import dpflow_core.sim.record as sim_record
from dpflow_core.conversion import ConversionSettings, convert
from dpflow_core.offsets import obs_latencies_s, task_offsets
from dpflow_core.pairing import pair_recordings, save_manifest
from dpflow_core.replay_buffer import ReplayBuffer
from dpflow_core.report import episode_quality, markdown_table
from dpflow_core.sim.record import History, SimRecordingSpec, record_episode
from dpflow_core.sim.tasks import initial_state, new_world, reset_world
from dpflow_core.sim.world import CONTROL_HZ
from dpflow_core.train.app import CONFIG_DIR

FRAME_S = 1 / 30
IMU_SHIFT_S = 0.03
#: stem -> (camera lag s, IMU shift s, still); pick_place_0003 is the outlier of its task.
PICK_PLACE = {"pick_place_0000": (0.05, 0.0, False), "pick_place_0001": (0.05, 0.0, False),
              "pick_place_0002": (0.05, 0.0, False), "pick_place_0003": (0.2, 0.0, False)}
STACK = {"stack_0000": (0.0, 0.0, False), "stack_0001": (0.1, IMU_SHIFT_S, False),
         "stack_0002": (0.1, 0.0, False), "stack_0003": (0.1, 0.0, True)}


def _held_still(world, state, tail_s=0.5, track=None) -> History:
    """A hand holding the gripper still for 4 s: 0.2 mm and 0.2 mrad of tremor."""
    reset_world(world, state)
    t = np.arange(0.0, 4.0, 1 / CONTROL_HZ)
    rng = np.random.default_rng(3)
    g = world.gripper
    return History(t, g.pos + rng.normal(0, 2e-4, (len(t), 3)), g.rotvec + rng.normal(0, 2e-4, (len(t), 3)),
                   np.full(len(t), g.opening), np.tile([b.pos for b in world.blocks], (len(t), 1, 1)),
                   np.tile([b.yaw for b in world.blocks], (len(t), 1)))


def _record(root, task: str, episodes: dict) -> tuple[dict, ReplayBuffer]:
    """Each episode recorded with its own lags into one task folder, paired and converted at 64x64."""
    task_dir = root / task
    task_dir.mkdir(parents=True)
    world = new_world(task, 64, 64)
    real_write, real_demonstrate = sim_record.write_recording, sim_record.demonstrate
    try:
        for k, (stem, (lag, imu_shift, still)) in enumerate(episodes.items()):
            def write(task_dir, stem_, rng, spec, topics, streams, _shift=imu_shift):
                moved = dataclasses.replace(streams, imu_ts_ns=streams.imu_ts_ns + int(round(_shift * 1e9)))
                return real_write(task_dir, stem_, rng, spec, topics, moved)
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(sim_record, "write_recording", write)
                if still:
                    mp.setattr(sim_record, "demonstrate", _held_still)
                record_episode(task_dir, stem, initial_state(task, 7 + k), SimRecordingSpec(
                    width=64, height=64, camera_latency_s=lag), world)
    finally:
        world.close()
    assert sim_record.write_recording is real_write and sim_record.demonstrate is real_demonstrate
    (task_dir / "vio_result.json").write_text(json.dumps({
        "task_name": task, "success_mcap_files": [f"{s}_vio.mcap" for s in episodes], "failed_mcap_files": []}))
    manifest = pair_recordings(task_dir)
    assert len(manifest.accepted) == len(episodes), manifest.rejected
    path, _ = save_manifest(manifest, root / "manifests")
    out = root / f"{task}.npz"
    convert(path, out, ConversionSettings(image_size=(64, 64)), cache=False, workers=1)
    return {"manifest": path, "meta": json.loads((root / f"{task}.json").read_text())}, ReplayBuffer(out)


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("offsets")
    return {"pick_place": _record(root, "pick_place", PICK_PLACE), "stack": _record(root, "stack", STACK)}


def _entries(datasets, task):
    return {e["stem"]: e for e in datasets[task][0]["meta"]["episodes"]}


def test_camera_offset_is_within_a_frame_of_the_known_lag(datasets):
    errors = []
    for task, truth in (("pick_place", PICK_PLACE), ("stack", STACK)):
        for stem, e in _entries(datasets, task).items():
            lag, _, still = truth[stem]
            if still:
                continue
            assert e["camera_offset"]["status"] == "measured", e["camera_offset"]
            assert e["camera_offset_s"] == e["camera_offset"]["offset_s"]
            assert abs(e["camera_offset_s"] - lag) < FRAME_S, (stem, e["camera_offset"])
            assert e["camera_offset"]["r2"] > 0.8 and e["camera_offset"]["contrast"] > 0.1
            assert e["camera_offset"]["rotation_rms_rps"] > 0.05
            errors.append(e["camera_offset_s"] - lag)
    assert len(errors) == 7
    assert np.median(np.abs(errors)) < 0.005, errors


def test_imu_offset_follows_shifted_imu_stamps(datasets):
    for task, truth in (("pick_place", PICK_PLACE), ("stack", STACK)):
        for stem, e in _entries(datasets, task).items():
            _, shift, still = truth[stem]
            if still:
                continue
            assert e["imu_offset"]["status"] == "measured", e["imu_offset"]
            assert abs(e["imu_offset_s"] - shift) < 0.005, (stem, e["imu_offset"])


def test_a_still_episode_is_not_measurable(datasets):
    e = _entries(datasets, "stack")["stack_0003"]
    for stream in ("camera", "imu"):
        assert e[f"{stream}_offset_s"] is None
        assert e[f"{stream}_offset"]["status"] == "not_measurable"
        assert "barely rotates" in e[f"{stream}_offset"]["reason"]
        assert e[f"{stream}_offset"]["rotation_rms_rps"] < 0.05
    summary = datasets["stack"][0]["meta"]["offsets"]
    assert summary["camera"]["not_measurable"] == ["stack_0003"] and summary["camera"]["measured"] == 3


def test_the_outlier_flag_names_the_episode_and_its_figure(datasets):
    meta = datasets["pick_place"][0]["meta"]
    summary = meta["offsets"]
    assert summary["camera"]["median_s"] == pytest.approx(0.05, abs=0.006)
    assert summary["recommendation"]["camera_offset_s"] == summary["camera"]["median_s"]
    [flag] = summary["flagged"]
    assert (flag["stem"], flag["stream"]) == ("pick_place_0003", "camera")
    assert flag["difference_s"] == pytest.approx(0.15, abs=0.012)
    [warning] = [w for w in meta["warnings"] if w["code"] == "offset_outlier"]
    assert warning["stem"] == "pick_place_0003" and f"{flag['difference_s']:+.3f} s" in warning["reason"]
    # stack: the lag-0 camera against a median of 0.1 s, and the IMU shifted by 30 ms against a median of 0
    flagged = {(f["stem"], f["stream"]): f["difference_s"] for f in datasets["stack"][0]["meta"]["offsets"]["flagged"]}
    assert set(flagged) == {("stack_0000", "camera"), ("stack_0001", "imu")}
    assert flagged["stack_0000", "camera"] == pytest.approx(-0.1, abs=0.012)
    assert flagged["stack_0001", "imu"] == pytest.approx(IMU_SHIFT_S, abs=0.005)
    # the figures travel inside the dataset itself (meta__info_json), where the trainer reads them
    assert datasets["pick_place"][1].metadata["offsets"] == summary


def test_quality_report_measures_and_flags_the_offsets(datasets):
    qualities = {q.stem: q for q in episode_quality(datasets["pick_place"][0]["manifest"])}
    for stem, (lag, _, _) in PICK_PLACE.items():
        assert abs(qualities[stem].camera_offset["offset_s"] - lag) < FRAME_S, qualities[stem].camera_offset
        assert abs(qualities[stem].imu_offset["offset_s"]) < 0.005
    offset_flags = {q.stem: [r for r in q.outlier_reasons if " offset " in r] for q in qualities.values()}
    assert {s for s, r in offset_flags.items() if r} == {"pick_place_0003"}
    assert offset_flags["pick_place_0003"][0].startswith("camera offset +0.2")
    assert qualities["pick_place_0003"].is_outlier
    md = markdown_table(list(qualities.values()))
    assert "camera / IMU offset ms" in md and f"{1e3 * qualities['pick_place_0003'].camera_offset['offset_s']:+.1f}" in md
    assert qualities["pick_place_0000"].to_dict()["camera_offset"]["status"] == "measured"


def test_the_trainer_takes_the_measured_latency(datasets):
    from dpflow_core.train.workspace import spec_from_config

    buffer = datasets["pick_place"][1]
    offset = buffer.metadata["offsets"]["recommendation"]["camera_offset_s"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR)):
        cfg = compose("tiny", overrides=["task.dataset_path=x.npz"])
    given = spec_from_config(cfg, 30.0, buffer.metadata).obs_latency_steps
    with open_dict(cfg):
        cfg.task.latency = "measured"
    measured = spec_from_config(cfg, 30.0, buffer.metadata).obs_latency_steps
    assert set(given) == set(measured) and given
    for key in given:  # every low-dimensional key is read L x f steps earlier
        assert measured[key] == pytest.approx(given[key] - offset * 30.0)
    with pytest.raises(ValueError, match="no measured camera offset"):
        spec_from_config(cfg, 30.0, {"episodes": []})
    cfg.task.latency = "guessed"
    with pytest.raises(ValueError, match="task.latency must be one of"):
        spec_from_config(cfg, 30.0, buffer.metadata)


def test_latencies_stay_non_negative_for_an_early_camera():
    task = OmegaConf.create({"camera_obs_latency": 0.125, "robot_obs_latency": 0.0, "gripper_obs_latency": 0.02,
                             "latency": "measured"})
    early = {"offsets": task_offsets([{"stem": "a", "camera_offset_s": -0.2, "camera_offset": {"status": "measured"}}])}
    camera, robot, gripper = obs_latencies_s(task, early)
    assert (camera - robot, camera - gripper) == pytest.approx((0.325, 0.305)) and min(camera, robot, gripper) >= 0


def _scaled(ts: np.ndarray, rate: float) -> np.ndarray:
    """Stamps of a clock running ``rate`` times as fast as the true one, from the stream's first stamp."""
    t0 = int(ts[0])
    return (t0 + np.round((ts.astype(np.int64) - t0) * rate)).astype(np.int64)


#: stem -> (which clock runs off, its rate); the honest one is the control.
SKEWED = {"pick_place_0000": (None, 1.0), "pick_place_0001": ("pose", 1.03), "pick_place_0002": ("camera", 0.99),
          "pick_place_0003": ("imu", 1.02)}


def _record_edited(tmp_path, edits: dict, first_seed: int):
    """World episodes (one per stem of ``edits``, seeds from ``first_seed``) whose streams pass through their edit
    (None: untouched) before they are written; paired and converted at 64 x 64 without the cache."""
    task_dir = tmp_path / "pick_place"
    task_dir.mkdir()
    world = new_world("pick_place", 64, 64)
    real_write = sim_record.write_recording
    try:
        for k, (stem, edit) in enumerate(edits.items()):
            def write(task_dir, stem_, rng, spec, topics, streams, _edit=edit):
                return real_write(task_dir, stem_, rng, spec, topics, streams if _edit is None else _edit(streams))
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(sim_record, "write_recording", write)
                record_episode(task_dir, stem, initial_state("pick_place", first_seed + k),
                               SimRecordingSpec(width=64, height=64), world)
    finally:
        world.close()
    (task_dir / "vio_result.json").write_text(json.dumps({
        "task_name": "pick_place", "success_mcap_files": [f"{s}_vio.mcap" for s in edits], "failed_mcap_files": []}))
    manifest = pair_recordings(task_dir)
    assert len(manifest.accepted) == len(edits), manifest.rejected
    return convert(manifest, tmp_path / "ds.npz", ConversionSettings(image_size=(64, 64)), cache=False, workers=1)


def test_a_clock_running_fast_or_slow_against_the_pose_clock_is_refused(tmp_path):
    """A pose clock 3 % fast, a camera clock 1 % slow or an IMU clock 2 % fast (every stamp of that stream
    scaled from its first, arrival times untouched) converted without a word before: each frame late in the
    episode met a pose 0.1-0.3 s off. The offset, measured in windows of the episode, now drifts by the clock's
    error and the episode is rejected as clock_skew with the drift (within 30 %: 79-93 % of it measured); the honest
    episode measures under 0.2 %."""
    def skew(clock, rate):
        name = f"{clock}_ts_ns"
        return None if clock is None else lambda st: dataclasses.replace(st, **{name: _scaled(getattr(st, name), rate)})

    result = _record_edited(tmp_path, {stem: skew(*spec) for stem, spec in SKEWED.items()}, 40)
    rejected = {r["stem"]: r for r in result.rejected}
    assert set(rejected) == {"pick_place_0001", "pick_place_0002", "pick_place_0003"}, result.rejected
    for stem, (clock, rate) in SKEWED.items():
        if clock is None:
            continue
        r = rejected[stem]
        stream = "camera" if clock == "pose" else clock  # a fast pose clock shows in the camera's offset first
        assert r["code"] == "clock_skew" and f"clock_skew: {stream} from" in r["reason"], r["reason"]
        # the drift measured: the stream's clock against the pose clock's, per second
        expected = rate - 1.0 if clock != "pose" else 1.0 / rate - 1.0
        import re

        m = re.search(r"drifts ([+-][\d.]+) ms a second", r["reason"])
        # measured 79-93 % of the true drift here (each window's offset is a fit over a drifting stretch)
        assert m and float(m[1]) / 1e3 == pytest.approx(expected, rel=0.3), (stem, r["reason"])
    meta = json.loads(result.sidecar_path.read_text())
    (honest,) = meta["episodes"]
    skew = honest["camera_clock_skew"]
    assert skew["status"] == "measured" and abs(skew["skew"]) < 0.002, skew


@pytest.mark.parametrize("axis", [0, 1])
def test_positions_mirrored_in_one_axis_are_refused(tmp_path, axis):
    """Positions written with one world axis flipped while the rotations are right (a left-handed export) parse,
    pair and train: the accelerometer says which axis is backwards, and the episode is rejected as pose_mirrored
    naming it; the untouched episodes beside it convert with no such finding."""
    flip = np.ones(3)
    flip[axis] = -1.0
    name = "xyz"[axis]
    edits = {"pick_place_0000": None, "pick_place_0001": lambda st: dataclasses.replace(st, position_m=st.position_m * flip),
             "pick_place_0002": None}
    result = _record_edited(tmp_path, edits, 60 + 3 * axis)
    (r,) = result.rejected
    assert r["stem"] == "pick_place_0001" and r["code"] == "pose_mirrored", result.rejected
    assert f"the positions read {name} mirrored leave" in r["reason"], r["reason"]
    meta = json.loads(result.sidecar_path.read_text())
    assert sorted(e["stem"] for e in meta["episodes"]) == ["pick_place_0000", "pick_place_0002"]
    for e in meta["episodes"]:
        assert not any(f["code"] == "pose_mirrored" for f in e["plausibility"]["findings"])


def test_one_mis_measured_window_does_not_make_a_clock_skew(tmp_path):
    """World episode stack seed 65 (no clock is skewed in the world): its IMU offset measured +0.18 s in the second
    of four windows and within 4 ms of 0 in the other three. The least-squares line through them drifted 7.2 ms a
    second and the honest episode was refused as clock_skew (1 of 480); the Theil-Sen slope keeps it. A true drift
    still shows through one bad window: 2 % over eight windows, one of them 0.2 s off, measures 2 %."""
    from dpflow_core.offsets import DEFAULT_OPTIONS, OffsetEstimate, clock_skew

    task_dir = tmp_path / "stack"
    task_dir.mkdir()
    world = new_world("stack", 128, 128)
    try:
        record_episode(task_dir, "stack_0065", initial_state("stack", 65), SimRecordingSpec(), world)
    finally:
        world.close()
    (task_dir / "vio_result.json").write_text(json.dumps({
        "task_name": "stack", "success_mcap_files": ["stack_0065_vio.mcap"], "failed_mcap_files": []}))
    r = convert(pair_recordings(task_dir), tmp_path / "ds.npz", ConversionSettings(image_size=(64, 64)), cache=False,
                workers=1)
    assert r.rejected == []
    (e,) = json.loads(r.sidecar_path.read_text())["episodes"]
    offs = [w[2] for w in e["imu_clock_skew"]["windows"]]
    assert max(offs) - sorted(offs)[-2] > 0.1, offs  # the one window far from the others is still there
    assert abs(e["imu_clock_skew"]["skew"]) < 0.002

    pose_ns = np.arange(0, int(20e9), int(1e9 / 30), dtype=np.int64)
    options = dataclasses.replace(DEFAULT_OPTIONS, skew_windows=8)

    def drifting(mask, a_ns, b_ns):
        mid = (a_ns + b_ns) / 2e9
        bad = 0.2 if 7.5 < mid < 10 else 0.0
        return OffsetEstimate("imu", "measured", offset_s=0.02 * mid + bad)

    measured = clock_skew(drifting, pose_ns, None, "imu", options)
    assert measured["skew"] == pytest.approx(0.02, rel=0.02), measured

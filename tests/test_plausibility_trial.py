"""Inputs a new user's trial of issue 28 found still handled wrong, each made by a generator with its
ground truth: offsets beyond the search, still or drifting episodes, positions in millimetres, a
second camera, an absurd calibration, a frozen clock, a status file whose count disagrees."""

from __future__ import annotations

import json

import numpy as np
import pytest

import dpflow_core.sim.record as sim_record
from dpflow_core.conversion import ConversionSettings, convert
from dpflow_core.conversion.decode import decode_camera
from dpflow_core.offsets import ImageMotion, measure_offsets
from dpflow_core.pairing import pair_recordings
from dpflow_core.recordings import read_streams
from dpflow_core.sim.record import SimRecordingSpec, record_episode
from dpflow_core.sim.tasks import initial_state, new_world

# --------------------------------------------------------------------------- offsets beyond the search

#: stem -> (pose stamps late by s, camera stamps late by s); ground truth: the camera's offset against the
#: pose clock is ``camera - pose`` and the IMU's ``-pose`` (its stamps are true).
SHIFTS = {"late_poses": (0.5, 0.0), "late_poses_near": (0.38, 0.0), "late_camera": (0.0, 0.6),
          "early_poses": (-0.45, 0.0), "measurable": (0.1, 0.0)}
LIMIT_S = 0.4


@pytest.fixture(scope="module")
def shifted(tmp_path_factory):
    """Simulated-world recordings (real image motion and IMU) whose pose or camera stamps are shifted."""
    task = tmp_path_factory.mktemp("offsets") / "pick_place"
    task.mkdir()
    world = new_world("pick_place", 64, 64)
    real = sim_record.write_recording
    try:
        for k, (stem, (pose_s, camera_s)) in enumerate(SHIFTS.items()):
            def write(*args, _shift=pose_s, **kw):
                kw["pose_ts_ns"] = kw["pose_ts_ns"] + int(round(_shift * 1e9))
                return real(*args, **kw)
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(sim_record, "write_recording", write)
                record_episode(task, stem, initial_state("pick_place", 7 + k),
                               SimRecordingSpec(width=64, height=64, camera_latency_s=camera_s), world)
    finally:
        world.close()
    (task / "vio_result.json").write_text(json.dumps({"task_name": "pick_place", "failed_mcap_files": [],
                                                      "success_mcap_files": [f"{s}_vio.mcap" for s in SHIFTS]}))
    return task


def _offsets(path):
    s = read_streams(path)
    motion = ImageMotion(len(s.camera_packets))
    cam_ns = decode_camera(s.camera_packets, None, "h264", None, path, s.camera_ts_ns, motion.add,
                           s.camera_decode_order)[-1]
    return measure_offsets(motion, cam_ns, s.pose_ts_ns, s.quat_xyzw, s.position_m, s.pose_valid, s.imu_ts_ns, s.gyro_rps)


@pytest.mark.parametrize("stem", list(SHIFTS))
def test_an_offset_at_or_beyond_the_search_limit_is_never_a_number(shifted, stem):
    pose_s, camera_s = SHIFTS[stem]
    got = _offsets(shifted / f"{stem}_vio.mcap")
    for stream, truth in (("camera", camera_s - pose_s), ("imu", -pose_s)):
        e = got[f"{stream}_offset"]
        if abs(truth) > LIMIT_S - 1 / 30:  # at, within one frame of, or beyond the limit
            assert e["status"] == "not_measurable" and e["at_search_limit"] and got[f"{stream}_offset_s"] is None, e
            assert e["reason"].startswith("at the search limit +-0.4 s: the true offset may lie beyond"), e
        else:
            assert e["status"] == "measured" and not e["at_search_limit"], e
            assert abs(e["offset_s"] - truth) < 1 / 30, (stream, e)


def test_offsets_at_the_search_limit_are_warned_in_the_dataset_and_the_report(shifted, tmp_path):
    from dpflow_core.report import episode_quality

    manifest = pair_recordings(shifted)
    assert len(manifest.accepted) == len(SHIFTS), manifest.rejected
    result = convert(manifest, tmp_path / "dataset.npz", ConversionSettings(image_size=(32, 32)), workers=1, cache=False)
    meta = json.loads(result.sidecar_path.read_text())
    warned = {(w["stem"], w["reason"].split(" offset ")[0].split(": ")[-1])
              for w in meta["warnings"] if w["code"] == "offset_at_search_limit"}
    truth = {(s, stream) for s, (p, c) in SHIFTS.items()
             for stream, off in (("camera", c - p), ("imu", -p)) if abs(off) > LIMIT_S - 1 / 30}
    assert warned == truth
    for w in meta["warnings"]:
        if w["code"] == "offset_at_search_limit":
            assert w["reason"].startswith(f"{w['stem']}_vio.mcap: ") and "may lie beyond" in w["reason"]
    assert {(f["stem"], f["stream"]) for f in meta["offsets"]["at_search_limit"]} == truth
    assert meta["offsets"]["camera"]["measured"] == 1 and meta["offsets"]["camera"]["median_s"] == pytest.approx(-0.1, abs=0.02)
    flagged = {q.stem: q.outlier_reasons for q in episode_quality(manifest.to_dict())}
    for stem, stream in truth:
        assert any(r.startswith(f"{stem}_vio.mcap: {stream} offset not measurable, at the search limit") for r in flagged[stem])
    assert not any("search limit" in r for r in flagged["measurable"])

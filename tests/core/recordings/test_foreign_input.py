"""Recordings written by another writer than dpflow's own generator.

The episodes come from ``tests/foreign_writer.py`` (plain ``mcap`` writer,
hand-built protobuf descriptors, a dated session folder layout); the
non-Matrix-Studio input is a ROS 2 bag in MCAP.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
from pathlib import Path

import cv2
import numpy as np
import pytest
from google.protobuf.descriptor_pb2 import FileDescriptorSet
from mcap.reader import make_reader
from mcap_protobuf.decoder import DecoderFactory
from scipy.spatial.transform import Rotation

import foreign_writer as fw
from dpflow_core.conversion import ConversionSettings, convert
from dpflow_core.dataset import validate_dataset
from dpflow_core.errors import PairingError, RecordingError
from dpflow_core.pairing import load_manifest, pair_recordings
from dpflow_core.recordings import inspect_recording, read_streams
from dpflow_core.replay_buffer import ReplayBuffer
from dpflow_core.recordings.topics import DAS_DEFAULT

SIZE = (48, 32)
MISSING = "not a Matrix Studio recording: missing topics"


@pytest.fixture(scope="module")
def foreign(tmp_path_factory):
    root = tmp_path_factory.mktemp("foreign") / "matrix_out"
    episodes = fw.write_foreign_task(root, task="cup_stack", episodes=2)
    explicit = root.parent / "pairing.json"
    explicit.write_text(json.dumps(fw.explicit_manifest(root, episodes)))
    return {"root": root, "episodes": episodes, "explicit": explicit}


@pytest.fixture(scope="module")
def ros_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ros") / "rosbag2_2024_05_01-12_00_00"
    bag = fw.write_ros2_bag(folder / "rosbag2_2024_05_01-12_00_00_0.mcap")
    (folder / "metadata.yaml").write_text("rosbag2_bagfile_information:\n  version: 8\n  storage_identifier: mcap\n")
    return {"folder": folder, "bag": bag}


def test_writer_shares_no_code_with_dpflow(foreign):
    """The foreign files come from an independent writer with a different schema layout."""
    tree = ast.parse(Path(fw.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(m.split(".")[0] in ("dpflow_core", "dpflow_dagster", "mcap_protobuf") for m in imported), imported

    ep = foreign["episodes"][0]
    with open(ep.vio_mcap, "rb") as f:
        reader = make_reader(f)
        header = reader.get_header()
        summary = reader.get_summary()
    assert header.library == "foreign-writer/0.1"
    schemas = {s.name: s for s in summary.schemas.values()}
    topic_schema = {c.topic: summary.schemas[c.schema_id].name for c in summary.channels.values()}
    assert topic_schema[DAS_DEFAULT.camera] == "foxglove.CompressedVideo"
    assert topic_schema[DAS_DEFAULT.imu] == "foxglove.ImuMeasurement"
    fds = FileDescriptorSet.FromString(schemas["foxglove.PoseInFrame"].data)
    assert [f.name for f in fds.file] == ["google/protobuf/timestamp.proto", "arnold/common/header_v2.proto",
                                          "das/foxglove_bundle.proto"]
    pose = next(m for m in fds.file[2].message_type if m.name == "PoseInFrame")
    assert {f.name: f.number for f in pose.field}["header"] == 16


def test_read_streams_syncs_on_header_timestamp(foreign):
    """Capture times come from header.timestamp, not the foxglove timestamp (arrival) nor log_time."""
    for ep in foreign["episodes"]:
        s = read_streams(ep.vio_mcap)
        assert s.camera_format == "h264"
        np.testing.assert_array_equal(s.camera_ts_ns, ep.camera_ts_ns)
        np.testing.assert_array_equal(s.pose_ts_ns, ep.camera_ts_ns)
        np.testing.assert_array_equal(s.gripper_ts_ns, ep.gripper_ts_ns)
        np.testing.assert_allclose(s.position_m, ep.position_m, atol=1e-12)
        np.testing.assert_allclose(np.abs(np.sum(s.quat_xyzw * ep.quat_xyzw, axis=1)), 1.0, atol=1e-12)
        np.testing.assert_allclose(s.gripper_width_m, ep.gripper_width_m, atol=1e-12)
        assert s.camera_packets[0].startswith((b"\x00\x00\x00\x01", b"\x00\x00\x01"))

    # The foxglove timestamp of the same message holds the (later) arrival time.
    ep = foreign["episodes"][0]
    with open(ep.vio_mcap, "rb") as f:
        reader = make_reader(f, decoder_factories=[DecoderFactory()])
        _, _, _, first = next(reader.iter_decoded_messages(topics=[DAS_DEFAULT.pose]))
    arrival_ns = first.timestamp.seconds * 1_000_000_000 + first.timestamp.nanos
    assert first.header.timestamp == ep.camera_ts_ns[0] and arrival_ns - first.header.timestamp == 45_000_000


def test_inspect_foreign_recording(foreign):
    ep = foreign["episodes"][1]
    vio = inspect_recording(ep.vio_mcap)
    assert vio.errors == []
    assert vio.schemas[DAS_DEFAULT.camera] == "foxglove.CompressedVideo"
    assert vio.rates_hz[DAS_DEFAULT.camera] == pytest.approx(20.0, rel=2e-3)
    assert vio.rates_hz[DAS_DEFAULT.pose] == pytest.approx(20.0, rel=2e-3)
    assert vio.rates_hz[DAS_DEFAULT.gripper] == pytest.approx(50.0, rel=1e-6)
    assert vio.rates_hz[DAS_DEFAULT.imu] == pytest.approx(100.0, rel=1e-6)
    assert vio.expected_hz[DAS_DEFAULT.camera] == 20.0
    assert vio.leading_undecodable_packets == 0 and vio.indexed
    # The IMU schema name is not one dpflow knows, but the IMU is optional: a warning, not a reject.
    assert [p.code for p in vio.warnings] == ["unexpected_schema"] and "foxglove.ImuMeasurement" in vio.warnings[0].reason
    raw = inspect_recording(ep.raw_mcap, required=(DAS_DEFAULT.camera, DAS_DEFAULT.gripper), probe_video=False)
    assert raw.errors == [] and DAS_DEFAULT.pose not in raw.message_counts


def test_session_folder_pairs_as_a_task_folder(foreign):
    """One session folder is a plain task folder; the nested ``vio`` status layout is understood."""
    ep = foreign["episodes"][0]
    m = pair_recordings(ep.folder)
    assert [a.stem for a in m.accepted] == [ep.stem] and m.rejected == []
    assert m.accepted[0].vio_status["vio"]["state"] == "Succeeded"


def test_foreign_layout_pairs_and_converts(foreign, tmp_path):
    root, episodes = foreign["root"], foreign["episodes"]
    with pytest.raises(PairingError) as exc:
        pair_recordings(root)
    assert exc.value.code == "no_recordings" and "2026-11-29" in exc.value.reason

    manifest = pair_recordings(root, explicit_manifest=foreign["explicit"])
    assert manifest.task == "cup_stack"  # from vio_result.json
    assert [a.stem for a in manifest.accepted] == [e.stem for e in episodes] and manifest.rejected == []
    for a, ep in zip(manifest.accepted, episodes):
        assert a.vio_mcap == ep.vio_mcap.resolve() and a.vio_status["software"]["name"] == "MatrixStudio"

    result = convert(manifest, tmp_path / "dataset.npz", ConversionSettings(image_size=SIZE), workers=2)
    assert result.n_episodes == 2 and result.total_steps == 100 and result.rejected == []
    assert all(c.passed for c in validate_dataset(result.path, image_size=SIZE)), validate_dataset(result.path)

    # The measured frequency is the written camera rate: 1 / median frame interval.
    intervals = np.concatenate([np.diff(e.camera_ts_ns) for e in episodes]) / 1e9
    assert result.frequency_hz == pytest.approx(1.0 / np.median(intervals), rel=1e-9)
    assert result.frequency_hz == pytest.approx(20.0, rel=2e-3)

    buf = ReplayBuffer(result.path)
    np.testing.assert_array_equal(buf.episode_ends, [50, 100])
    assert buf["camera0_rgb"].shape == (100, SIZE[1], SIZE[0], 3)
    for k, ep in enumerate(episodes):
        got = buf.get_episode(k)
        # Every camera frame lies inside the pose/gripper overlap, so all are kept, in capture order.
        t = ep.camera_ts_ns
        np.testing.assert_allclose(got["timestamp"], (t - t[0]) / 1e9, atol=1e-9)
        pos, quat, width = ep.truth_at(t)
        np.testing.assert_allclose(got["robot0_eef_pos"], pos, atol=1e-6)
        err = (Rotation.from_rotvec(got["robot0_eef_rot_axis_angle"].astype(np.float64)) * Rotation.from_quat(quat).inv())
        assert np.max(err.magnitude()) < 1e-5
        # Gripper: 50 Hz samples interpolated linearly at the frame times.
        np.testing.assert_allclose(got["robot0_gripper_width"][:, 0], width, atol=1e-4)
        np.testing.assert_allclose(got["robot0_demo_start_pose"][:, :3], np.broadcast_to(pos[0], (50, 3)), atol=1e-6)
        # Frames: the written scene, area-resized, in RGB order; frame k has blue level (37 k) mod 256.
        rendered = [fw.render_frame(96, 64, pos[i, 0], pos[i, 1], width[i], i) for i in range(len(t))]
        want = np.stack([cv2.resize(r, SIZE, interpolation=cv2.INTER_AREA) for r in rendered]).astype(np.float64)
        mae = np.abs(got["camera0_rgb"].astype(np.float64) - want).mean(axis=(1, 2, 3))
        assert mae.max() < 4.0, mae
        blue = np.median(got["camera0_rgb"][:, :, :, 2].reshape(len(t), -1), axis=1)
        np.testing.assert_allclose(blue, (37 * np.arange(len(t))) % 256, atol=4.0)


# --------------------------------------------------------------------------- not a Matrix Studio recording


def test_ros2_bag_rejected_by_reader_and_inspection(ros_folder):
    bag = ros_folder["bag"]
    with pytest.raises(RecordingError) as exc:
        read_streams(bag)
    assert exc.value.code == "missing_topics"
    assert exc.value.reason == f"{MISSING} {DAS_DEFAULT.camera}, {DAS_DEFAULT.pose}, {DAS_DEFAULT.gripper}"
    assert exc.value.path == str(bag)

    report = inspect_recording(bag)
    assert [p.code for p in report.errors] == ["missing_topics"]
    assert report.errors[0].reason.startswith(f"{bag.name}: {MISSING} {DAS_DEFAULT.camera}")
    assert report.encodings == {"/tf": "cdr", "/camera/image_raw/compressed": "cdr", "/imu": "cdr"}
    assert report.message_counts == {"/tf": 10, "/camera/image_raw/compressed": 10, "/imu": 100}


def test_ros2_bag_rejected_by_pairing(ros_folder, foreign, tmp_path):
    # A folder holding the bag (and its metadata.yaml) beside a DAS raw recording still waiting for VIO.
    folder = tmp_path / "mixed"
    shutil.copytree(ros_folder["folder"], folder)
    shutil.copy(foreign["episodes"][0].raw_mcap, folder / "DAS07_waiting.mcap")
    m = pair_recordings(folder)
    assert m.accepted == []
    by_stem = {r.stem: r for r in m.rejected}
    bag = by_stem["rosbag2_2024_05_01-12_00_00_0"]
    assert bag.code == "missing_topics"
    assert bag.reason == f"{ros_folder['bag'].name}: {MISSING} {DAS_DEFAULT.camera}, {DAS_DEFAULT.gripper}"
    assert by_stem["DAS07_waiting"].code == "missing_partner"

    # A complete triple whose MCAP files are bags: rejected by the validation of the _vio.mcap.
    triple = tmp_path / "triple"
    triple.mkdir()
    shutil.copy(ros_folder["bag"], triple / "x.mcap")
    shutil.copy(ros_folder["bag"], triple / "x_vio.mcap")
    (triple / "x_vio.json").write_text('{"status": "success"}')
    m = pair_recordings(triple)
    assert m.accepted == [] and [(r.stem, r.code) for r in m.rejected] == [("x", "missing_topics")]
    assert m.rejected[0].reason.startswith(f"x_vio.mcap: {MISSING} {DAS_DEFAULT.camera}")

    # The same through an explicit manifest.
    explicit = tmp_path / "explicit.json"
    explicit.write_text(json.dumps({"episodes": [{"stem": "bag", "raw_mcap": "x.mcap", "vio_mcap": "x_vio.mcap",
                                                  "vio_json": "x_vio.json"}]}))
    m = pair_recordings(triple, explicit_manifest=explicit)
    assert [(r.stem, r.code) for r in m.rejected] == [("bag", "missing_topics")]


def test_ros2_bag_cli(ros_folder, tmp_path):
    env = {**os.environ, "COLUMNS": "400"}
    out = tmp_path / "manifest.json"
    proc = subprocess.run(["dpflow", "pair", str(ros_folder["folder"]), "-o", str(out)],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 1, proc.stderr  # nothing usable came out: non-zero, reasons summarised
    assert "Traceback" not in proc.stdout + proc.stderr
    assert f"no episode accepted in {ros_folder['folder']}; reasons:\nmissing_topics x1" in proc.stderr
    assert f"missing_topics │ {ros_folder['bag'].name}: {MISSING} {DAS_DEFAULT.camera}" in proc.stdout
    assert "0 accepted, 1 rejected" in proc.stdout
    saved = load_manifest(out)
    assert [(r.code, r.reason.split(": ", 1)[1].startswith(MISSING)) for r in saved.rejected] == [("missing_topics", True)]

    proc = subprocess.run(["dpflow", "inspect-recording", str(ros_folder["bag"])], capture_output=True, text=True, env=env)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stdout + proc.stderr and f"missing_topics: {ros_folder['bag'].name}: {MISSING}" in proc.stdout

    proc = subprocess.run(["dpflow", "convert", str(ros_folder["folder"]), "-o", str(tmp_path / "d.npz")],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr
    assert MISSING in proc.stderr and not (tmp_path / "d.npz").exists()

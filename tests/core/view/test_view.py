"""`dpflow view`: the .rrd read back with Rerun's own reader, and the web viewer in headless Chromium.

The read-back uses ``rerun.chunk.RrdReader`` (rerun-sdk 0.41): every chunk of the file as an Arrow
record batch (index columns and component columns), joined per entity into one table. Rerun's
catalog ``reader()`` gives the same columns as a DataFusion DataFrame but needs the ``datafusion``
package, which the project does not install.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from browser import CHROMIUM, CHROMIUM_ARGS, chromium_missing_reason
from conftest import require_service
from scipy.spatial.transform import Rotation

from dpflow_core.recordings.reader import read_streams
from dpflow_core.recordings.samples import SampleSpec, write_task
from synthetic_dataset import write_synthetic_dataset

REPO = Path(__file__).resolve().parents[3]
DPFLOW = [sys.executable, "-m", "dpflow_core.cli"] if not (Path(sys.executable).parent / "dpflow").exists() \
    else [str(Path(sys.executable).parent / "dpflow")]


def read_rrd(path: Path) -> dict[str, pa.Table]:
    """Entity path -> one Arrow table of all its chunks (static chunks under ``<path>#static``)."""
    from rerun.chunk import RrdReader

    batches: dict[str, list[pa.RecordBatch]] = {}
    for chunk in RrdReader(path).stream():
        key = chunk.entity_path + ("#static" if chunk.is_static else "")
        batches.setdefault(key, []).append(chunk.to_record_batch())
    return {k: pa.concat_tables([pa.Table.from_batches([b]) for b in v], promote_options="permissive")
            for k, v in batches.items()}


def column(table: pa.Table, name: str, index: str) -> tuple[np.ndarray, list]:
    """(index values as int64, cells of ``name``) sorted by the index, rows where ``name`` is set."""
    t = table.filter(pc.is_valid(table[name]))
    idx = t[index].cast(pa.int64()).to_numpy() if pa.types.is_integer(t[index].type) else \
        t[index].to_numpy().astype(np.int64)
    order = np.argsort(idx, kind="stable")
    cells = t[name].to_pylist()
    return idx[order], [cells[i] for i in order]


@pytest.fixture(scope="module")
def episode(tmp_path_factory):
    root = tmp_path_factory.mktemp("view-episode")
    ep = write_task(root, episodes=1, seconds=2.0, seed=3, spec=SampleSpec(width=96, height=64, gop_size=10))[0]
    return ep


def test_episode_read_back_equals_the_recording(episode, tmp_path):
    out = tmp_path / "ep.rrd"
    proc = subprocess.run([*DPFLOW, "view", str(episode.vio_mcap), "-o", str(out)], capture_output=True, text=True,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)
    tables = read_rrd(out)
    streams = read_streams(episode.vio_mcap)

    ts, tr = column(tables["/world/gripper"], "Transform3D:translation", "capture_time")
    assert np.array_equal(ts, streams.pose_ts_ns)
    np.testing.assert_allclose(np.array([c[0] for c in tr]), streams.position_m, atol=1e-6)
    _, quat = column(tables["/world/gripper"], "Transform3D:quaternion", "capture_time")
    np.testing.assert_allclose(np.array([c[0] for c in quat]), streams.quat_xyzw, atol=1e-6)

    ts, width = column(tables["/gripper/width_m"], "Scalars:scalars", "capture_time")
    assert np.array_equal(ts, streams.gripper_ts_ns)
    np.testing.assert_allclose([c[0] for c in width], streams.gripper_width_m, rtol=0, atol=1e-12)

    # Camera: one JPEG per decoded frame, at its own capture time, close to PyAV's own decode.
    ts, blobs = column(tables["/world/gripper/camera0"], "EncodedImage:blob", "capture_time")
    assert np.array_equal(ts, streams.camera_ts_ns)
    import av

    ctx = av.CodecContext.create("h264", "r")
    ref = [f.to_ndarray(format="bgr24") for p in streams.camera_packets for f in ctx.decode(av.Packet(p))]
    ref += [f.to_ndarray(format="bgr24") for f in ctx.decode(None)]
    for k in (0, len(ref) // 2, len(ref) - 1):
        img = cv2.imdecode(np.frombuffer(bytes(blobs[k][0]), np.uint8), cv2.IMREAD_COLOR)
        assert img.shape == ref[k].shape == (64, 96, 3)
        assert np.abs(img.astype(int) - ref[k]).mean() < 8.0  # JPEG of noisy 96 x 64 frames
        # The frame itself is the decoder's: its JPEG is the same bytes as that of an independent decode.
        assert bytes(blobs[k][0]) == cv2.imencode(".jpg", ref[k], [cv2.IMWRITE_JPEG_QUALITY, 90])[1].tobytes()

    # IMU: every message; its count is the writer's (seconds x 200 Hz).
    ts, gyro = column(tables["/imu/angular_velocity_rps"], "Scalars:scalars", "capture_time")
    assert len(ts) == int(streams.message_counts.get("/robot0/sensor/imu", 0) or len(ts)) > 300
    assert all(len(c) == 3 for c in gyro)

    # Per-stream timestamps: the step to the previous capture time, in ms.
    ts, period = column(tables["/timing/gripper/period_ms"], "Scalars:scalars", "capture_time")
    np.testing.assert_allclose([c[0] for c in period], np.diff(streams.gripper_ts_ns) / 1e6)
    assert (ts[0], ts[-1]) == (streams.gripper_ts_ns[1], streams.gripper_ts_ns[-1])
    assert "/world/gripper/camera0#static" in tables and "/world/track#static" in tables


def test_episode_findings_are_annotations_at_their_times(tmp_path):
    """A pose jump made by the shared fault generator is a finding, logged at the jump's capture time."""
    from fault_fixtures import pose_jump

    ep = write_task(tmp_path, episodes=1, seconds=1.5, seed=4, spec=SampleSpec(width=64, height=48))[0]
    pose_jump(ep.vio_mcap, 20, (0.4, 0.0, 0.0))
    proc = subprocess.run([*DPFLOW, "view", str(tmp_path / "pick_place"), "-o", str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    tables = read_rrd(tmp_path / f"{ep.stem}.rrd")
    ts, texts = column(tables["/findings"], "TextLog:text", "capture_time")
    _, levels = column(tables["/findings"], "TextLog:level", "capture_time")
    jump = [k for k, t in enumerate(texts) if t[0].startswith("pose_jump")]
    assert len(jump) == 1, texts
    # The jump lies between pose 19 and pose 20 (file order = capture order in the sample writer).
    assert ts[jump[0]] == int(ep.pose_ts_ns[19]) and levels[jump[0]] == ["WARN"]


def test_dataset_view_shows_rows_windows_and_chunks(tmp_path):
    from dpflow_core.train.data import ObsActionSpec, action_positions, obs_positions, sequence_index

    npz = write_synthetic_dataset(tmp_path / "dataset.npz", n_episodes=3, episode_length=[30, 40, 35])
    proc = subprocess.run([*DPFLOW, "view", str(npz), "--episode", "1", "--every", "3", "--horizon", "8"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = Path(proc.stdout.strip())
    assert out == tmp_path / f"{tmp_path.name}_dataset_episode1.rrd"  # named after the dataset's folder too
    tables = read_rrd(out)
    with np.load(npz) as z:
        pos, rgb, ts = z["data__robot0_eef_pos"][30:70], z["data__camera0_rgb"], z["data__timestamp"][30:70]
        grip = z["data__robot0_gripper_width"][30:70]
        rot = z["data__robot0_eef_rot_axis_angle"][30:70]

    steps, tr = column(tables["/world/gripper"], "Transform3D:translation", "step")
    assert np.array_equal(steps, np.arange(40))
    np.testing.assert_allclose(np.array([c[0] for c in tr]), pos, atol=1e-6)
    _, quat = column(tables["/world/gripper"], "Transform3D:quaternion", "step")
    np.testing.assert_allclose(np.abs(np.sum(np.array([c[0] for c in quat]) * Rotation.from_rotvec(rot).as_quat(), 1)),
                               1.0, atol=1e-5)
    t_ns, g = column(tables["/rows/robot0_gripper_width"], "Scalars:scalars", "time")
    np.testing.assert_allclose(t_ns / 1e9, ts - ts[0], atol=1e-9)
    np.testing.assert_allclose([c[0] for c in g], grip[:, 0], atol=1e-7)

    steps, frames = column(tables["/frames/camera0_rgb"], "Image:buffer", "step")
    assert np.array_equal(steps, np.arange(0, 40, 3))
    assert np.array_equal(np.array(frames[2][0], dtype=np.uint8).reshape(rgb.shape[1:]), rgb[30 + 6])

    spec = ObsActionSpec(horizon=8)
    mask = np.array([False, True, False])
    rows = sequence_index(np.array([30, 70, 105]), mask, spec)
    steps, chunks = column(tables["/world/action_chunk"], "LineStrips3D:strips", "step")
    assert np.array_equal(steps, rows[:, 0] - 30)
    full = np.concatenate([np.zeros((30, 3)), pos])
    for k in (0, len(rows) - 1):
        np.testing.assert_allclose(np.array(chunks[k][0]), full[action_positions(spec, rows[k : k + 1])[0]], atol=1e-6)
    anchor = rows[len(rows) // 2 : len(rows) // 2 + 1]
    window = np.rint(obs_positions(spec, "camera0_rgb", anchor)[0]).astype(int)
    for j, p in enumerate(window):
        img = tables[f"/anchor/obs/camera0_rgb/{j}#static"]["Image:buffer"].to_pylist()[0][0]
        assert np.array_equal(np.array(img, dtype=np.uint8).reshape(rgb.shape[1:]), rgb[p])


def test_two_datasets_views_do_not_collide(tmp_path):
    """A trial's second dataset's episode 0 was refused: every dataset view was dataset_episode0.rrd."""
    from dpflow_core.view.dataset import view_dataset

    views = tmp_path / "views"
    views.mkdir()
    paths = [view_dataset(write_synthetic_dataset(tmp_path / task / "dataset.npz", n_episodes=1, episode_length=12),
                          views).path for task in ("pick_place", "stack")]
    assert paths == [views / "pick_place_dataset_episode0.rrd", views / "stack_dataset_episode0.rrd"]
    assert all(p.is_file() for p in paths)


def test_a_task_folder_view_refuses_before_writing_any(tmp_path):
    """`dpflow view rec/stack -o views` wrote stack_0000.rrd, then stopped at an existing stack_0001.rrd."""
    eps = write_task(tmp_path, episodes=3, seconds=1.0, seed=5, task="stack", spec=SampleSpec(width=64, height=48))
    views = tmp_path / "views"
    views.mkdir()
    for ep in eps[1:]:
        (views / f"{ep.stem}.rrd").write_bytes(b"earlier")
    proc = subprocess.run([*DPFLOW, "view", str(tmp_path / "stack"), "-o", str(views)], capture_output=True,
                          text=True, cwd=tmp_path)
    assert proc.returncode != 0
    assert "2 of the 3 views exist, nothing written" in proc.stderr + proc.stdout
    assert all(str(views / f"{ep.stem}.rrd") in proc.stderr + proc.stdout for ep in eps[1:])
    assert sorted(p.name for p in views.iterdir()) == [f"{ep.stem}.rrd" for ep in eps[1:]]
    assert {(views / f"{ep.stem}.rrd").read_bytes() for ep in eps[1:]} == {b"earlier"}


def test_rollouts_view(tmp_path):
    folder = tmp_path / "eval"
    folder.mkdir()
    records = [{"seed": 5, "success": True, "failure_mode": None, "time_to_success_s": 1.1, "duration_s": 1.4,
                "decisions": 9, "grasp_attempts": 1, "latency": 0.0, "predict_s": 0.02},
               {"seed": 6, "success": False, "failure_mode": "dropped", "time_to_success_s": None, "duration_s": 3.0,
                "decisions": 20, "grasp_attempts": 2, "latency": 0.0, "predict_s": 0.02}]
    (folder / "rollouts.json").write_text(json.dumps(records))
    (folder / "rollouts_oracle.json").write_text(json.dumps(records[:1]))
    (folder / "closed_loop.json").write_text(json.dumps({"policy": {"success_rate": 0.5}}))
    rng = np.random.default_rng(0)
    t = np.arange(25) * 0.1
    trace = {"t_s": t, "tcp_pos": rng.normal(size=(25, 3)), "tcp_rotvec": rng.normal(scale=0.3, size=(25, 3)),
             "opening": np.linspace(0.08, 0.01, 25), "target_pos": rng.normal(size=(25, 3)), "frame_t_s": t[::5],
             "wrist": rng.integers(0, 255, (5, 12, 16, 3), dtype=np.uint8),
             "scene": rng.integers(0, 255, (5, 20, 24, 3), dtype=np.uint8)}
    np.savez(folder / "trace_6.npz", **trace)
    proc = subprocess.run([*DPFLOW, "view", "--rollouts", str(folder), "-o", str(tmp_path / "r.rrd")],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    tables = read_rrd(tmp_path / "r.rrd")
    t_ns, tr = column(tables["/world/seed_6/tcp"], "Transform3D:translation", "time")
    np.testing.assert_allclose(t_ns / 1e9, t, atol=1e-9)
    np.testing.assert_allclose(np.array([c[0] for c in tr]), trace["tcp_pos"], atol=1e-6)
    _, target = column(tables["/world/seed_6/target"], "Points3D:positions", "time")
    np.testing.assert_allclose(np.array([c[0] for c in target]), trace["target_pos"], atol=1e-6)
    t_ns, wrist = column(tables["/cameras/seed_6/wrist"], "Image:buffer", "time")
    np.testing.assert_allclose(t_ns / 1e9, t[::5], atol=1e-9)
    assert np.array_equal(np.array(wrist[3][0], dtype=np.uint8).reshape(12, 16, 3), trace["wrist"][3])
    _, text = column(tables["/outcome/seed_6"], "TextLog:text", "time")
    assert text == [["seed 6: failed (dropped)"]]
    summary = tables["/summary#static"]["TextDocument:text"].to_pylist()[0][0]
    assert "policy: 1 of 2 succeeded" in summary and "oracle: 1 of 1 succeeded" in summary
    np.savez(folder / "trace_5.npz", **{k: v for k, v in trace.items() if k != "scene"})
    proc = subprocess.run([*DPFLOW, "view", "--rollouts", str(folder), "-o", str(tmp_path / "r2.rrd")],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and "trace_5.npz" in proc.stderr and "'scene'" in proc.stderr


def test_serve_in_headless_chromium(episode, tmp_path):
    """The web viewer on loopback draws the 3-D view and the camera view (software WebGL)."""
    reason = chromium_missing_reason()
    if reason:
        require_service("chromium", reason)
    from playwright.sync_api import sync_playwright

    proc = subprocess.Popen([*DPFLOW, "view", str(episode.vio_mcap), "-o", str(tmp_path / "ep.rrd"), "--serve"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        url = None
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line.startswith("viewer: "):
                url = line.split()[1]
            assert line or proc.poll() is None, "dpflow view --serve exited early"
        assert url and url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.status == 200 and b"<html" in r.read(2000).lower()
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 900})
                page.goto(url)
                shot = tmp_path / "viewer.png"
                img = None
                for _ in range(60):  # until the camera panel holds the frame's colours
                    time.sleep(1)
                    page.screenshot(path=str(shot))
                    img = cv2.imread(str(shot))
                    camera_panel, view3d = img[480:880, 0:700], img[60:440, 0:700]
                    if camera_panel.std() > 20 and (np.abs(view3d.astype(int) - view3d[5, 5]).sum(2) > 60).mean() > 0.002:
                        break
                else:
                    pytest.fail(f"the viewer drew no camera frame or 3-D track in 60 s (screenshot {shot})")
            finally:
                browser.close()
        if os.environ.get("DPFLOW_VIEW_SCREENSHOT"):
            Path(os.environ["DPFLOW_VIEW_SCREENSHOT"]).write_bytes(shot.read_bytes())
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(20)
    assert proc.returncode == 0


def test_predict_view_draws_the_checkpoints_chunks_beside_the_recorded_ones(tiny_checkpoint, tmp_path):
    """`dpflow view --predict`: every predicted anchor's chunk and its recorded chunk, read back, equal what
    `predict_dataset` gives for the same checkpoint, episode and noise seed (computed here independently)."""
    from dpflow_core.inference import load_policy, predict_dataset
    from dpflow_core.replay_buffer import ReplayBuffer

    out = tmp_path / "pred.rrd"
    proc = subprocess.run([*DPFLOW, "view", "--predict", str(tiny_checkpoint.checkpoint), str(tiny_checkpoint.dataset),
                           "--episode", "2", "-o", str(out)], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    tables = read_rrd(out)
    expected = predict_dataset(load_policy(tiny_checkpoint.checkpoint), ReplayBuffer(tiny_checkpoint.dataset),
                               episodes=[2], seed=0)
    start = int(np.asarray(ReplayBuffer(tiny_checkpoint.dataset).episode_ends)[1])
    steps, pred = column(tables["/world/predicted_chunk"], "LineStrips3D:strips", "step")
    _, rec = column(tables["/world/recorded_chunk"], "LineStrips3D:strips", "step")
    assert np.array_equal(steps, expected.rows[:, 0] - start)
    for k in (0, len(steps) // 2, len(steps) - 1):
        np.testing.assert_allclose(np.array(pred[k][0]), expected.predicted[k, :, :3], atol=1e-5)
        np.testing.assert_allclose(np.array(rec[k][0]), expected.recorded[k, :, :3], atol=1e-6)
    _, err = column(tables["/prediction/position_error_m"], "Scalars:scalars", "step")
    truth = np.linalg.norm(expected.predicted[..., :3] - expected.recorded[..., :3], axis=-1).mean(1)
    np.testing.assert_allclose([c[0] for c in err], truth, rtol=1e-4, atol=1e-6)


def test_two_runs_latest_checkpoints_get_different_prediction_view_names(tmp_path):
    """Both runs save ``checkpoints/latest.ckpt``: the view names carry each run's folder, so the second
    ``--predict`` view does not land on the first one's file."""
    from dpflow_core.view.dataset import checkpoint_view_name

    a = checkpoint_view_name(tmp_path / "run_a" / "checkpoints" / "latest.ckpt")
    b = checkpoint_view_name(tmp_path / "run_b" / "checkpoints" / "latest.ckpt")
    assert (a, b) == ("run_a_latest", "run_b_latest")
    assert checkpoint_view_name(tmp_path / "epoch=0003.ckpt") == f"{tmp_path.name}_epoch=0003"
    # downloaded by `dpflow checkpoint`: <root>/<run>/<sha16>/latest.ckpt names the run, not only the hash folder
    assert checkpoint_view_name(tmp_path / "run_a" / "1541c4468cacb277" / "latest.ckpt") == "run_a_1541c446_latest"

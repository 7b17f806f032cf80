"""LeRobot export end to end: sample recordings -> pairing manifest -> dataset -> norm stats."""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dpflow_core import export as lr
from dpflow_core.conversion import ConversionSettings, align_episode
from dpflow_core.errors import ConversionError
from dpflow_core.pairing import load_manifest, pair_recordings, write_manifest
from dpflow_core.recordings.samples import SampleSpec, write_episode, write_task

SPEC = SampleSpec(seconds=2.5, width=160, height=120, gop_size=15)


@pytest.fixture(scope="module")
def manifest_path(tmp_path_factory) -> Path:
    """3 good episodes and one whose VIO covers 30 % of it (aligned frames too few: skipped)."""
    base = tmp_path_factory.mktemp("recordings")
    write_task(base, episodes=3, seconds=SPEC.seconds, seed=5, task="pick_place", spec=SPEC)
    task_dir = base / "pick_place"
    bad = write_episode(task_dir, "pick_place_0003", replace(SPEC, vio_coverage=(0.0, 0.3)), seed=99)
    summary = json.loads((task_dir / "vio_result.json").read_text())
    summary["success_mcap_files"].append(bad.vio_mcap.name)
    (task_dir / "vio_result.json").write_text(json.dumps(summary))
    manifest = pair_recordings(task_dir)
    assert [a.stem for a in manifest.accepted] == [f"pick_place_{k:04d}" for k in range(4)]
    return write_manifest(manifest, base / "manifest.json")


@pytest.fixture(scope="module")
def exported(manifest_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "pick_place_lerobot"
    return out, lr.export_lerobot(manifest_path, out, workers=2)


def test_export_reuses_align_episode_frame_for_frame(manifest_path, exported):
    out, result = exported
    manifest = load_manifest(manifest_path)
    assert result.stems == [f"pick_place_{k:04d}" for k in range(3)]
    assert list(result.skipped) == ["pick_place_0003"] and "low_coverage" in result.skipped["pick_place_0003"]
    assert result.task == "pick_place" and result.image_size == [160, 120]
    aligned = [align_episode(a.vio_mcap, ConversionSettings(image_size=None),
                             stem=a.stem) for a in manifest.accepted[:3]]
    fps = 1 / np.median(np.concatenate([np.diff(a.timestamps_s) for a in aligned]))
    info = json.loads((out / "meta/info.json").read_text())
    assert info["fps"] == pytest.approx(fps, rel=1e-12) and 29.5 < info["fps"] < 30.5
    assert info["total_episodes"] == 3 and info["total_frames"] == sum(len(a) for a in aligned)
    assert info["features"]["observation.images.camera0"]["shape"] == [120, 160, 3]
    tasks = pq.read_table(out / "meta/tasks.parquet").to_pylist()
    assert tasks == [{"task_index": 0, "__index_level_0__": "pick_place"}]
    table = pq.read_table(out / "data/chunk-000/file-000.parquet")
    assert pq.ParquetFile(out / "data/chunk-000/file-000.parquet").metadata.num_row_groups == 3  # one per episode
    episodes = pq.read_table(out / "meta/episodes/chunk-000/file-000.parquet").to_pylist()
    ep_col = table.column("episode_index").to_numpy()
    with av.open(str(out / "videos/observation.images.camera0/chunk-000/file-000.mp4")) as c:
        s = c.streams.video[0]
        decoded = [(float(f.pts * s.time_base), f.to_ndarray(format="rgb24")) for f in c.decode(s)]
    video_t = np.array([t for t, _ in decoded])
    for k, a in enumerate(aligned):
        rows = table.filter(pa.array(ep_col == k))
        state = rows.column("observation.state").combine_chunks().flatten().to_numpy().reshape(-1, 7)
        expected = np.concatenate([a.eef_pos, a.eef_rot_axis_angle, a.gripper_width], axis=1)
        np.testing.assert_array_equal(state, expected)
        action = rows.column("action").combine_chunks().flatten().to_numpy().reshape(-1, 7)
        np.testing.assert_array_equal(action[:-1], expected[1:])
        ep = episodes[k]
        assert ep["dataset_to_index"] - ep["dataset_from_index"] == len(a) == ep["length"]
        inside = (video_t >= ep["videos/observation.images.camera0/from_timestamp"] - 1e-4) & (
            video_t < ep["videos/observation.images.camera0/to_timestamp"] - 1e-4)
        frames = np.stack([f for (_, f), keep in zip(decoded, inside) if keep]).astype(np.float64)
        assert frames.shape == a.rgb.shape
        psnr = 10 * np.log10(255**2 / np.mean((frames - a.rgb) ** 2))
        assert psnr > 30, f"episode {k}: PSNR {psnr:.1f} dB"


def test_provenance_records_inputs_and_alignment(manifest_path, exported):
    out, result = exported
    record = json.loads((out / "meta/dpflow.json").read_text())
    manifest = load_manifest(manifest_path)
    assert record["manifests"] == [str(manifest_path)]
    assert record["fps"] == result.fps and record["action_rule"] == "next_state"
    for k, ep in enumerate(record["episodes"]):
        assert ep["episode_index"] == k and ep["stem"] == manifest.accepted[k].stem
        assert ep["files"]["vio_mcap"]["sha256"] == manifest.accepted[k].files["vio_mcap"].sha256
        assert ep["alignment"]["frames"] == ep["frames"]
    assert set(record["skipped"]) == {"pick_place_0003"}


def test_norm_stats_of_the_export(exported):
    from test_lerobot import assert_stats_close, openpi_reference

    out, result = exported
    assert result.codebase_version == "v3.0"
    stats = lr.compute_openpi_norm_stats(out, action_horizon=10, batch_size=16)
    table = pq.read_table(out / "data/chunk-000/file-000.parquet")
    ep = table.column("episode_index").to_numpy()
    cols = {k: table.column(k).combine_chunks().flatten().to_numpy().reshape(-1, 7) for k in ("observation.state", "action")}
    per_episode = [[cols[k][ep == e] for e in range(result.n_episodes)] for k in cols]
    assert_stats_close({k: v.to_json() for k, v in stats.items()},
                       openpi_reference(*per_episode, horizon=10, batch_size=16))
    assert np.all(stats["state"].q01 <= stats["state"].q99)


def test_changed_input_is_skipped_with_its_hash(manifest_path, tmp_path):
    manifest = json.loads(manifest_path.read_text())
    manifest["accepted"][1]["files"]["vio_mcap"]["sha256"] = "0" * 64
    edited = tmp_path / "manifest.json"
    edited.write_text(json.dumps(manifest))
    result = lr.export_lerobot(edited, tmp_path / "ds", workers=1)
    assert result.stems == ["pick_place_0000", "pick_place_0002"]
    assert "input_changed" in result.skipped["pick_place_0001"] and "0" * 64 in result.skipped["pick_place_0001"]


def test_cli_export_with_delta_actions_and_image_size(manifest_path, tmp_path):
    out = tmp_path / "ds"
    cmd = ["dpflow", "export-lerobot", str(manifest_path), "-o", str(out), "--action-rule", "delta",
           "--image-size", "64,48", "--task-text", "put the cup on the plate", "--workers", "1", "--format", "v2.1"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "LeRobot v2.1, 3 episodes" in proc.stdout and "skipped pick_place_0003: low_coverage" in proc.stderr
    info = json.loads((out / "meta/info.json").read_text())
    assert info["features"]["observation.images.camera0"]["shape"] == [48, 64, 3]
    assert json.loads((out / "meta/tasks.jsonl").read_text())["task"] == "put the cup on the plate"
    table = pq.read_table(out / "data/chunk-000/episode_000000.parquet")
    state = table.column("observation.state").combine_chunks().flatten().to_numpy().reshape(-1, 7)
    action = table.column("action").combine_chunks().flatten().to_numpy().reshape(-1, 7)
    np.testing.assert_allclose(action[:-1, :3], np.diff(state[:, :3], axis=0), atol=1e-6)
    assert not action[-1].any()
    again = subprocess.run(cmd, capture_output=True, text=True)
    assert again.returncode == 2 and "already exists" in again.stderr


def test_bad_options_fail_before_any_work(manifest_path, tmp_path):
    with pytest.raises(ConversionError, match="must be even"):
        lr.export_lerobot(manifest_path, tmp_path / "a", lr.ExportSettings(image_size=(63, 48)))
    with pytest.raises(ConversionError, match="unknown action rule"):
        lr.export_lerobot(manifest_path, tmp_path / "b", lr.ExportSettings(action_rule="velocity"))
    with pytest.raises(ConversionError, match="unknown LeRobot format 'v2.0'"):
        lr.export_lerobot(manifest_path, tmp_path / "c", lr.ExportSettings(codebase_version="v2.0"))
    assert list(tmp_path.iterdir()) == []


def test_reuse_existing_returns_the_same_export_and_refuses_another(manifest_path, exported):
    out, result = exported
    key = lr.export_key(manifest_path)
    assert result.export_key == key and len(key) == 64
    assert lr.export_key(manifest_path, lr.ExportSettings(action_rule="delta")) != key
    assert lr.export_key(manifest_path, lr.ExportSettings(task_text="other task")) != key
    assert lr.export_key(manifest_path, lr.ExportSettings(codebase_version="v2.1")) != key
    again = lr.export_lerobot(manifest_path, out, reuse_existing=True)
    assert again.reused and again.export_key == key
    assert (again.fps, again.stems, again.total_frames, again.image_size) == (
        result.fps, result.stems, result.total_frames, result.image_size)
    with pytest.raises(ConversionError, match="holds another export"):
        lr.export_lerobot(manifest_path, out, lr.ExportSettings(action_rule="delta"), reuse_existing=True)


def test_same_frequency_and_episodes_as_the_npz_conversion(manifest_path, exported, tmp_path):
    from dpflow_core.conversion import ConversionSettings, convert

    _, result = exported
    npz = convert(manifest_path, tmp_path / "dataset.npz", ConversionSettings(image_size=(64, 48)), workers=1)
    assert npz.frequency_hz == pytest.approx(result.fps, rel=1e-12)
    assert npz.n_episodes == result.n_episodes and npz.total_steps == result.total_frames
    assert {r["stem"] for r in npz.rejected} == set(result.skipped)


def test_unreadable_input_is_skipped_with_the_os_condition(manifest_path, tmp_path):
    """A directory where the _vio.mcap was (root reads anything, so no chmod): skipped, no traceback;
    the default gap policy of the export is reject, so no camera hole is ever bridged."""
    import shutil

    manifest = json.loads(manifest_path.read_text())
    src = Path(manifest["accepted"][2]["files"]["vio_mcap"]["path"])
    copy = tmp_path / "task"
    shutil.copytree(src.parent, copy)
    for entry in manifest["accepted"]:
        for f in entry["files"].values():
            f["path"] = str(copy / Path(f["path"]).name)
    manifest["root"] = str(copy)
    (copy / src.name).unlink()
    (copy / src.name).mkdir()
    edited = tmp_path / "manifest.json"
    edited.write_text(json.dumps(manifest))
    result = lr.export_lerobot(edited, tmp_path / "ds", workers=1)
    assert result.stems == ["pick_place_0000", "pick_place_0001"]
    assert "is a directory, not a file" in result.skipped["pick_place_0002"]


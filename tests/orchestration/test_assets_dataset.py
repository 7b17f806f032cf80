"""Dagster: dataset_npz asset (content-addressed, reused when identical) and its blocking checks."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import dagster as dg
import numpy as np
import pytest
from partitioned import materialize as materialize_task
from synthetic_dataset import synthetic_arrays, write_npz

from dpflow_core.recordings import samples
from dpflow_core.conversion import ConversionResult
from dpflow_core.dataset import CHECKS
from dpflow_core.recordings.topics import DAS_DEFAULT
from dpflow_dagster.defs.dataset import dataset_npz, dataset_npz_checks
from dpflow_dagster.partitions import task_partitions

SPEC = samples.SampleSpec(seconds=2.0, width=160, height=120, gop_size=15)


def _entry(path: Path) -> dict:
    return {"path": str(path), "size_bytes": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def _manifest(eps, root, rejected=()) -> dict:
    return {
        "manifest_version": 1, "root": str(root), "task": "pick", "created_at": "2026-01-01T00:00:00+00:00",
        "topics": {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(DAS_DEFAULT).items()},
        "accepted": [{"stem": e.stem, "vio_status": {"status": "success"}, "validation": {},
                      "files": {"raw_mcap": _entry(e.raw_mcap), "vio_mcap": _entry(e.vio_mcap),
                                "vio_json": _entry(e.vio_json)}} for e in eps],
        "rejected": list(rejected),
    }


def _upstream(manifest_path: Path, n_accepted: int):
    @dg.asset(name="paired_episodes", group_name="dataset")
    def paired_episodes() -> dict:
        return {"manifest_path": str(manifest_path), "root": str(manifest_path.parent), "task": "pick",
                "accepted": n_accepted, "rejected": 0}

    return paired_episodes


@pytest.fixture(scope="module")
def episodes(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets") / "pick"
    return root, [samples.write_episode(root, f"pick_{k:04d}", replace(SPEC, seconds=2.0 + 0.2 * k), seed=50 + k)
                  for k in range(2)]


def _run_config(tmp_path: Path) -> dg.RunConfig:
    return dg.RunConfig(ops={"dataset_npz": {"config": {"image_width": 48, "image_height": 32, "workers": 1,
                                                        "output_dir": str(tmp_path / "work")}}})


def test_dataset_npz_materializes_with_passing_checks_and_is_reused(episodes, tmp_path):
    root, eps = episodes
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps(_manifest(eps, root)))
    assets = [_upstream(manifest, 2), dataset_npz, dataset_npz_checks]
    # episodes here are ~60 steps: the UMI default minimum (46) does not flag them
    res = materialize_task(assets, "pick", run_config=_run_config(tmp_path))
    assert res.success
    value = res.output_for_node("dataset_npz")
    path = value.path
    assert path.parent.parent == tmp_path / "work" / "datasets" / "pick" and len(path.parent.name) == 12
    assert value.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert value.image_size == (48, 32) and value.n_episodes == 2
    assert value.frequency_hz == pytest.approx(30.0, rel=0.01)
    assert set(value.to_dict()) - {"rejected", "wall_time_s", "metadata", "reused"} == {"path", "sha256", "size_bytes", "sidecar_path", "norm_stats_path", "frequency_hz",
                          "n_episodes", "total_steps", "image_size"}
    evals = {e.check_name: e for e in res.get_asset_check_evaluations()}
    assert set(evals) == set(CHECKS) and all(e.passed for e in evals.values())
    mat = res.asset_materializations_for_node("dataset_npz")[0]
    md = mat.metadata
    assert md["sha256"].value == value.sha256 and md["reused"].value is False
    table = md["inputs"].value
    for e in eps:
        assert e.stem in table and _entry(e.vio_mcap)["sha256"] in table
    assert md["frames_per_s"].value > 0 and md["episode_length_max"].value >= md["episode_length_min"].value

    again = materialize_task(assets, "pick", run_config=_run_config(tmp_path))
    assert again.success
    assert again.output_for_node("dataset_npz") == value
    md2 = again.asset_materializations_for_node("dataset_npz")[0].metadata
    assert md2["reused"].value is True and "reused the existing identical dataset" in md2["status"].value

    # The asset filled the per-episode cache that `dpflow convert` reads: the CLI aligns nothing anew
    # and writes the same bytes (DPFLOW_CACHE_DIR is this test's own cache, set by conftest).
    assert md["episodes_from_cache"].value == 0 and md["episode_cache_dir"].value == os.environ["DPFLOW_CACHE_DIR"]
    cli = subprocess.run([str(Path(sys.executable).parent / "dpflow"), "convert", str(manifest), "-o",
                          str(tmp_path / "cli.npz"), "--image-size", "48,32", "-j", "1", "--json"],
                         capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    sidecar = json.loads((tmp_path / "cli.json").read_text())
    assert sidecar["cache"]["episodes_reused"] == 2 and sidecar["cache"]["episodes_aligned"] == 0
    assert sidecar["sha256"] == value.sha256


def test_all_rejected_manifest_fails_with_reasons(tmp_path):
    manifest = tmp_path / "manifest.json"
    rejected = [{"stem": "a", "path": "/x/a.mcap", "code": "vio_failed", "reason": "VIO status is 'failed'"}]
    manifest.write_text(json.dumps(_manifest([], tmp_path, rejected)))
    res = materialize_task([_upstream(manifest, 0), dataset_npz], "pick", run_config=_run_config(tmp_path),
                           raise_on_error=False)
    assert not res.success
    failure = next(e for e in res.all_events if e.event_type_value == "STEP_FAILURE")
    text = str(failure.event_specific_data.error)
    assert "no valid episodes: 1 found, 1 rejected: a: VIO status is 'failed'" in text


def _dataset_value(path: Path, n_episodes: int, total_steps: int) -> ConversionResult:
    """The ``dataset_npz`` value of a 32x32 npz written by a test (frequency: the synthetic 30 Hz)."""
    return ConversionResult(
        path=path, sha256=hashlib.sha256(path.read_bytes()).hexdigest(), size_bytes=path.stat().st_size,
        sidecar_path=path.with_suffix(".json"), norm_stats_path=path.with_name("norm_stats.json"),
        frequency_hz=30.0, n_episodes=n_episodes, total_steps=total_steps, image_size=(32, 32),
    )


def test_blocking_check_stops_downstream(tmp_path):
    arrays = synthetic_arrays(n_episodes=1, episode_length=30, image_size=(32, 32))
    arrays["data__robot0_eef_rot_axis_angle"][4] = [3.5, 0.0, 0.0]
    path = write_npz(tmp_path / "dataset.npz", arrays)

    @dg.asset(name="dataset_npz")
    def stub() -> ConversionResult:
        return _dataset_value(path, n_episodes=1, total_steps=30)

    ran = []

    @dg.asset(deps=["dataset_npz"])
    def downstream() -> None:
        ran.append(True)

    res = dg.materialize([stub, dataset_npz_checks, downstream], raise_on_error=False)
    evals = {e.check_name: e for e in res.get_asset_check_evaluations()}
    assert not evals["rotation_norm_le_pi"].passed
    assert evals["rotation_norm_le_pi"].metadata["max_norm_rad"].value == pytest.approx(3.5)
    assert not evals["min_two_episodes"].passed
    assert not evals["short_episodes"].passed and evals["short_episodes"].severity == dg.AssetCheckSeverity.WARN
    assert evals["values_finite"].passed and evals["image_size"].passed
    assert not res.success and ran == []


def test_full_graph_with_pairing(tmp_path):
    from dpflow_dagster.defs import recordings as assets_recordings

    samples.write_task(tmp_path / "rec", episodes=2, seconds=2.0, task="wipe", spec=SPEC)
    run_config = dg.RunConfig(ops={
        "paired_episodes": {"config": {"root": str(tmp_path / "rec" / "wipe"), "output_dir": str(tmp_path / "work")}},
        "dataset_npz": {"config": {"image_width": 40, "image_height": 30, "workers": 2,
                                   "output_dir": str(tmp_path / "work")}},
    })
    res = materialize_task([assets_recordings.paired_episodes, dataset_npz, dataset_npz_checks], "wipe",
                           run_config=run_config)
    assert res.success
    value = res.output_for_node("dataset_npz")
    assert value.n_episodes == 2 and value.path.parent.parent.name == "wipe"
    z = np.load(value.path)
    assert z["data__camera0_rgb"].shape[1:] == (30, 40, 3)


def test_umi_dataset_is_the_npz_in_umis_zarr_layout_and_is_reused_only_when_intact(episodes, tmp_path):
    """umi_dataset writes dataset.zarr.zip beside dataset.npz; read back with zarr's own ZipStore its
    low-dimensional arrays and episode_ends equal the npz's, its SHA-256 is the sidecar's; a second
    materialization reuses it, and a zip changed on disk is written anew, never reused."""
    import zarr
    from imagecodecs.numcodecs import register_codecs

    from dpflow_core.replay_buffer import ReplayBuffer
    from dpflow_dagster.defs.dataset import umi_dataset
    from dpflow_dagster.resources import ProductPathIOManager

    root, eps = episodes
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps(_manifest(eps, root)))
    assets = [_upstream(manifest, 2), dataset_npz, umi_dataset]
    io = {"io_manager": ProductPathIOManager(base_dir=str(tmp_path / "io"))}
    res = materialize_task(assets, "pick", run_config=_run_config(tmp_path), resources=io)
    assert res.success
    npz = res.output_for_node("dataset_npz").path
    value = res.output_for_node("umi_dataset")
    out = Path(value.path)
    assert out == npz.with_name("dataset.zarr.zip")
    assert value.sha256 == hashlib.sha256(out.read_bytes()).hexdigest()
    assert json.loads(out.with_name(out.name + ".json").read_text())["sha256"] == value.sha256
    md = res.asset_materializations_for_node("umi_dataset")[0].metadata
    assert md["path"].value == str(out) and md["reused"].value is False
    assert md["dataset_sha256"].value == res.output_for_node("dataset_npz").sha256

    register_codecs()
    group = zarr.open_group(zarr.storage.ZipStore(out, mode="r"), mode="r")
    buffer = ReplayBuffer(npz)
    np.testing.assert_array_equal(group["meta/episode_ends"][:], buffer.episode_ends)
    for key in ("robot0_eef_pos", "robot0_eef_rot_axis_angle", "robot0_gripper_width"):
        np.testing.assert_array_equal(group[f"data/{key}"][:], np.asarray(buffer[key]))
    assert group["data/camera0_rgb"].shape == buffer["camera0_rgb"].shape

    again = materialize_task(assets, "pick", run_config=_run_config(tmp_path), resources=io)
    assert again.output_for_node("umi_dataset") == value
    assert again.asset_materializations_for_node("umi_dataset")[0].metadata["reused"].value is True

    data = bytearray(out.read_bytes())
    data[len(data) // 2] ^= 0xFF
    out.write_bytes(bytes(data))
    third = materialize_task(assets, "pick", run_config=_run_config(tmp_path), resources=io)
    assert third.asset_materializations_for_node("umi_dataset")[0].metadata["reused"].value is False
    assert hashlib.sha256(out.read_bytes()).hexdigest() == value.sha256  # written anew, deterministically


def test_a_failed_blocking_check_fails_the_run_with_dpflows_reason(tmp_path):
    """The run page shows the run's failure event first: its error is the check, the task and why."""
    arrays = synthetic_arrays(n_episodes=2, episode_length=60, image_size=(32, 32))
    arrays["data__robot0_eef_rot_axis_angle"][4] = [3.5, 0.0, 0.0]
    path = write_npz(tmp_path / "dataset.npz", arrays)

    @dg.asset(name="dataset_npz", partitions_def=task_partitions)
    def stub() -> ConversionResult:
        return _dataset_value(path, n_episodes=2, total_steps=120)

    (tmp_path / "dagster_home").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster_home")) as instance:  # SQLite storage on disk
        res = materialize_task([stub, dataset_npz_checks], "pick_cup", instance=instance, raise_on_error=False)
        assert not res.success
        records = instance.get_records_for_run(res.run_id).records
        events = [r.event_log_entry.dagster_event for r in records if r.event_log_entry.dagster_event]
        run = instance.get_run_by_id(res.run_id)
    [evaluation] = [e.asset_check_evaluation_data for e in events
                    if e.event_type_value == "ASSET_CHECK_EVALUATION" and not e.asset_check_evaluation_data.passed]
    assert evaluation.check_name == "rotation_norm_le_pi" and evaluation.partition == "pick_cup"
    reason = f"blocking check dataset_npz:rotation_norm_le_pi failed for task pick_cup: {evaluation.description}"
    assert "3.5" in evaluation.description  # the check's own figure, from the damaged pose
    [step_failure] = [e for e in events if e.event_type_value == "STEP_FAILURE"]
    assert step_failure.step_failure_data.user_failure_data.description == reason
    assert step_failure.step_failure_data.user_failure_data.metadata["task"].value == "pick_cup"
    [run_failure] = [e for e in events if e.event_type == dg.DagsterEventType.RUN_FAILURE]
    error = run_failure.job_failure_data.error
    assert reason in error.message and "blocking asset check failed" not in error.message
    assert run.status == dg.DagsterRunStatus.FAILURE


def test_dataset_npz_reads_the_manifest_from_disk_once(episodes, tmp_path, monkeypatch):
    """Issue 30: the asset gathered the inputs to name the dataset's folder, then convert read the manifest again."""
    import dpflow_core.pairing.manifest as manifest_module

    reads = []
    original = manifest_module.read_manifest_json
    monkeypatch.setattr(manifest_module, "read_manifest_json", lambda path: reads.append(Path(path)) or original(path))
    root, eps = episodes
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps(_manifest(eps, root)))
    res = materialize_task([_upstream(manifest, 2), dataset_npz], "pick", run_config=_run_config(tmp_path))
    assert res.success and res.output_for_node("dataset_npz").n_episodes == 2
    assert reads == [manifest]

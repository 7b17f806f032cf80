"""The lerobot_dataset and norm_stats assets, materialized for real on sample recordings."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import numpy as np
import pytest

from dpflow_core import export as lr
from dpflow_core.pairing import pair_recordings, write_manifest
from dpflow_core.recordings.samples import SampleSpec, write_task
from dpflow_dagster.defs import lerobot as assets_lerobot
from partitioned import materialize as materialize_task

SPEC = SampleSpec(seconds=2.0, width=96, height=64, gop_size=15)


@pytest.fixture(scope="module")
def paired(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("rec")
    write_task(base, episodes=2, seconds=SPEC.seconds, seed=11, task="wipe_table", spec=SPEC)
    manifest = pair_recordings(base / "wipe_table")
    path = write_manifest(manifest, base / "manifest.json")
    return {"manifest_path": str(path), "root": str(manifest.root), "task": manifest.task,
            "accepted": len(manifest.accepted), "rejected": len(manifest.rejected)}


def _upstream(value: dict) -> dg.AssetsDefinition:
    @dg.asset(name="paired_episodes", group_name="dataset")
    def paired_episodes() -> dict:
        return value

    return paired_episodes


def _run(paired: dict, work: Path, **lerobot_config) -> dg.ExecuteInJobResult:
    return materialize_task(
        [_upstream(paired), assets_lerobot.lerobot_dataset, assets_lerobot.norm_stats],
        "wipe_table",
        run_config={"ops": {"lerobot_dataset": {"config": {"output_dir": str(work), "workers": 1, **lerobot_config}}}},
        raise_on_error=False,
    )


def test_assets_export_then_reuse(paired, tmp_path):
    result = _run(paired, tmp_path, action_rule="delta", task_text="wipe the table")
    assert result.success
    value = result.output_for_node("lerobot_dataset")
    path = value.path
    key = lr.export_key(paired["manifest_path"], lr.ExportSettings(task_text="wipe the table", action_rule="delta"))
    assert path == tmp_path / "lerobot" / "wipe_table" / key[:16]
    assert value.export_key == key and value.codebase_version == "v3.0"
    assert value.n_episodes == 2 and value.image_size == [96, 64] and value.action_rule == "delta"
    info = json.loads((path / "meta/info.json").read_text())
    assert info["total_frames"] == value.total_frames and info["fps"] == value.fps
    stats_value = result.output_for_node("norm_stats")
    assert stats_value.to_dict() == {"path": str(path / "norm_stats.json"), "dataset_path": str(path), "state_dim": 7, "action_dim": 7}
    on_disk = json.loads((path / "norm_stats.json").read_text())["norm_stats"]
    assert on_disk["actions"]["mean"] == lr.compute_openpi_norm_stats(path)["actions"].mean.tolist()
    mat = result.asset_materializations_for_node("lerobot_dataset")[0]
    assert mat.metadata["reused"].value is False and mat.metadata["fps"].value == pytest.approx(value.fps)

    again = _run(paired, tmp_path, action_rule="delta", task_text="wipe the table")
    assert again.success and again.output_for_node("lerobot_dataset") == value
    assert again.asset_materializations_for_node("lerobot_dataset")[0].metadata["reused"].value is True

    other = _run(paired, tmp_path, format="v2.1")  # next_state actions, v2.1: another folder, the first untouched
    assert other.success
    other_path = other.output_for_node("lerobot_dataset").path
    assert other.output_for_node("lerobot_dataset").codebase_version == "v2.1"
    assert json.loads((other_path / "meta/info.json").read_text())["codebase_version"] == "v2.1"
    assert other_path != path and sorted(p.name for p in (tmp_path / "lerobot" / "wipe_table").iterdir()) == sorted(
        [path.name, other_path.name])
    assert np.isfinite(lr.compute_openpi_norm_stats(other_path)["state"].std).all()


def test_norm_stats_asset_fails_fast_on_an_unconverted_folder(tmp_path):
    @dg.asset(name="lerobot_dataset", group_name="dataset")
    def not_converted() -> lr.LeRobotExport:  # a value that names a folder holding no export
        return lr.LeRobotExport(path=tmp_path, fps=30.0, n_episodes=2, total_frames=120,
                                video_keys=["observation.images.camera0"], image_size=[96, 64],
                                action_rule="next_state", task="wipe_table")

    result = materialize_task([not_converted, assets_lerobot.norm_stats], "wipe_table", raise_on_error=False)
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert "meta/info.json not found" in failure.event_specific_data.error.message


def test_bad_image_size_is_a_failure_with_the_reason(paired, tmp_path):
    result = _run(paired, tmp_path, image_size="95,64")
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert "must be even" in str(failure.event_specific_data.error.message)
    assert not (tmp_path / "lerobot").exists()

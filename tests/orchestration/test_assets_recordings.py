"""The paired_episodes asset, its job (string selection) and the recordings Definitions."""

from __future__ import annotations

import json
import re

import dagster as dg
import pytest

from dpflow_core.pairing import load_manifest, pair_recordings
from dpflow_dagster.defs import recordings as assets_recordings
from dpflow_dagster.defs.recordings import defs, paired_episodes
from dpflow_dagster.partitions import recordings_root
from partitioned import add_task
from partitioned import materialize as materialize_task
from recording_fixtures import write_small_episode, write_small_task


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    base = tmp_path_factory.mktemp("asset")
    write_small_task(base, episodes=2, seed=9)
    d = base / "pick_place"
    write_small_episode(d, "broken", seed=10, vio_status="failed")
    return d


def _materialize(config: dict, instance=None, task: str = "pick_place"):
    return materialize_task(
        [paired_episodes],
        task,
        run_config={"ops": {"paired_episodes": {"config": config}}},
        instance=instance,
        raise_on_error=False,
    )


def test_materialize_writes_a_content_addressed_manifest(task_dir, tmp_path):
    result = _materialize({"root": str(task_dir), "output_dir": str(tmp_path)})
    assert result.success
    value = result.output_for_node("paired_episodes")
    expected = pair_recordings(task_dir)
    path = tmp_path / "manifests" / f"pick_place-{expected.content_hash()[:12]}.json"
    assert value.to_dict() == {"manifest_path": str(path), "root": str(task_dir), "task": "pick_place", "accepted": 2, "rejected": 1}
    manifest = load_manifest(path)
    assert manifest.content_hash() == expected.content_hash()

    meta = result.asset_materializations_for_node("paired_episodes")[0].metadata
    assert meta["manifest_path"].value == str(path)
    assert meta["accepted"].value == 2 and meta["rejected"].value == 1
    assert meta["content_hash"].value == expected.content_hash()
    assert meta["rejects"].value.splitlines() == [
        "| stem | code | reason |",
        "|---|---|---|",
        "| broken | failed_status | broken_vio.json says VIO failed (status = 'failed') |",
    ]
    table = meta["accepted_episodes"].value.splitlines()
    sha = manifest.accepted[0].files["vio_mcap"].sha256[:12]
    assert table[2].startswith(f"| pick_place_0000 | `{sha}` |") and len(table) == 4

    # episode quality: the report beside the manifest, the table with inline thumbnails
    report_dir = tmp_path / "reports" / path.stem
    assert meta["report"].value == str(report_dir / "report.html") and (report_dir / "report.html").is_file()
    quality = json.loads((report_dir / "quality.json").read_text())
    assert [e["stem"] for e in quality["episodes"]] == ["pick_place_0000", "pick_place_0001"]
    rows = meta["quality"].value.splitlines()
    assert rows[0].startswith("| episode | duration s |") and rows[0].endswith("| preview |") and len(rows) == 4
    for row, episode in zip(rows[2:], quality["episodes"]):
        assert row.startswith(f"| {episode['stem']} | {episode['duration_s']:.2f} |")
        assert f"![{episode['stem']}](data:image/jpeg;base64," in row
        assert (report_dir / "previews" / f"{episode['stem']}.png").is_file()
    assert meta["total_duration_s"].value == pytest.approx(sum(e["duration_s"] for e in quality["episodes"]))
    assert meta["outliers"].value == sum(e["is_outlier"] for e in quality["episodes"])

    before = path.stat().st_mtime_ns
    again = _materialize({"root": str(task_dir), "output_dir": str(tmp_path)})
    assert again.output_for_node("paired_episodes").manifest_path == str(path)
    assert path.stat().st_mtime_ns == before
    assert [p.name for p in (tmp_path / "manifests").iterdir()] == [path.name]


def test_defaults_come_from_the_environment(task_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("DPFLOW_RECORDINGS_ROOT", str(task_dir))
    monkeypatch.setenv("DPFLOW_WORKDIR", str(tmp_path / "work"))
    result = _materialize({})
    assert result.success
    value = result.output_for_node("paired_episodes")
    assert value.root == str(task_dir)
    assert re.fullmatch(re.escape(str(tmp_path / "work" / "manifests")) + r"/pick_place-[0-9a-f]{12}\.json", value.manifest_path)
    # the usual setting: the output root holding the task folders; the partition picks one
    monkeypatch.setenv("DPFLOW_RECORDINGS_ROOT", str(task_dir.parent))
    again = _materialize({})
    assert again.success and again.output_for_node("paired_episodes") == value
    monkeypatch.delenv("DPFLOW_RECORDINGS_ROOT")
    monkeypatch.delenv("DPFLOW_WORKDIR")
    monkeypatch.chdir(tmp_path)
    assert assets_recordings.default_workdir() == tmp_path / "outputs"
    assert recordings_root() == tmp_path / "outputs" / "recordings"


def test_partition_without_its_task_folder_fails_naming_the_folders(task_dir, tmp_path):
    result = _materialize({"root": str(task_dir.parent), "output_dir": str(tmp_path)}, task="wipe_table")
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE)
    info = failure.step_failure_data.user_failure_data
    assert info.metadata["code"].value == "no_task_folder"
    assert info.description.startswith(f"{task_dir.parent}: no task folder 'wipe_table' here (task folders: pick_place); set DPFLOW_RECORDINGS_ROOT")
    # a task folder given as the root serves its own partition only
    result = _materialize({"root": str(task_dir), "output_dir": str(tmp_path)}, task="wipe_table")
    info = next(e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE).step_failure_data.user_failure_data
    assert info.description == (
        f"{task_dir}: this is the task folder 'pick_place', not the output root holding a task folder 'wipe_table'"
    )
    assert not (tmp_path / "manifests").exists()


def test_quality_and_previews_are_optional(task_dir, tmp_path):
    result = _materialize({"root": str(task_dir), "output_dir": str(tmp_path), "previews": False})
    meta = result.asset_materializations_for_node("paired_episodes")[0].metadata
    rows = meta["quality"].value.splitlines()
    assert len(rows) == 4 and "preview" not in rows[0] and "report" not in meta
    assert not (tmp_path / "reports").exists()
    result = _materialize({"root": str(task_dir), "output_dir": str(tmp_path), "quality": False})
    meta = result.asset_materializations_for_node("paired_episodes")[0].metadata
    assert "quality" not in meta and meta["accepted"].value == 2


def test_bad_root_fails_with_the_reason_as_metadata(tmp_path):
    root = tmp_path / "pick_place"  # the task folder itself, empty
    root.mkdir()
    result = _materialize({"root": str(root), "output_dir": str(tmp_path / "out")})
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE)
    info = failure.step_failure_data.user_failure_data
    assert info.description == f"{root}: no <STEM>.mcap files under {root}"
    assert info.metadata["code"].value == "no_recordings"
    assert not (tmp_path / "out").exists()


def test_recordings_definitions_load_and_the_string_selection_job_resolves(task_dir, tmp_path):
    dg.Definitions.validate_loadable(defs)
    repo = defs.get_repository_def()
    job = repo.get_job("paired_episodes_job")
    assert [n.name for n in job.nodes] == ["paired_episodes"]
    node = repo.asset_graph.get(dg.AssetKey("paired_episodes"))
    assert node.group_name == "dataset" and "mcap" in node.kinds and node.description
    assert node.partitions_def.name == "task" and node.owners == ["team:robot-learning"]
    instance = dg.DagsterInstance.ephemeral()
    add_task(instance, "pick_place")
    result = job.execute_in_process(
        run_config={"ops": {"paired_episodes": {"config": {"root": str(task_dir), "output_dir": str(tmp_path)}}}},
        instance=instance, partition_key="pick_place",
    )
    assert result.success
    manifest = json.loads(open(result.output_for_node("paired_episodes").manifest_path).read())
    assert [a["stem"] for a in manifest["accepted"]] == ["pick_place_0000", "pick_place_0001"]


def test_root_definitions_merge_the_recordings_stage():
    from dpflow_dagster import definitions

    names = {getattr(d, "name", None) for d in definitions.defs.sensors or []}
    assert "recordings_sensor" in names
    assert any(getattr(a, "key", None) == dg.AssetKey("paired_episodes") for a in definitions.defs.assets or [])

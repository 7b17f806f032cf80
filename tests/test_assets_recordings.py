"""The paired_episodes asset, its job (string selection) and the recordings Definitions."""

from __future__ import annotations

import json
import re

import dagster as dg
import pytest

from dpflow_core.pairing import load_manifest, pair_recordings
from dpflow_dagster import assets_recordings
from dpflow_dagster.assets_recordings import defs, paired_episodes
from recording_fixtures import write_small_episode, write_small_task


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    base = tmp_path_factory.mktemp("asset")
    write_small_task(base, episodes=2, seed=9)
    d = base / "pick_place"
    write_small_episode(d, "broken", seed=10, vio_status="failed")
    return d


def _materialize(config: dict, instance=None):
    return dg.materialize(
        [paired_episodes],
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
    assert value == {"manifest_path": str(path), "root": str(task_dir), "task": "pick_place", "accepted": 2, "rejected": 1}
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

    before = path.stat().st_mtime_ns
    again = _materialize({"root": str(task_dir), "output_dir": str(tmp_path)})
    assert again.output_for_node("paired_episodes")["manifest_path"] == str(path)
    assert path.stat().st_mtime_ns == before
    assert [p.name for p in (tmp_path / "manifests").iterdir()] == [path.name]


def test_defaults_come_from_the_environment(task_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("DPFLOW_RECORDINGS_ROOT", str(task_dir))
    monkeypatch.setenv("DPFLOW_WORKDIR", str(tmp_path / "work"))
    result = _materialize({})
    assert result.success
    value = result.output_for_node("paired_episodes")
    assert value["root"] == str(task_dir)
    assert re.fullmatch(re.escape(str(tmp_path / "work" / "manifests")) + r"/pick_place-[0-9a-f]{12}\.json", value["manifest_path"])
    monkeypatch.delenv("DPFLOW_RECORDINGS_ROOT")
    monkeypatch.delenv("DPFLOW_WORKDIR")
    monkeypatch.chdir(tmp_path)
    assert assets_recordings.default_workdir() == tmp_path / "outputs"


def test_bad_root_fails_with_the_reason_as_metadata(tmp_path):
    result = _materialize({"root": str(tmp_path), "output_dir": str(tmp_path / "out")})
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE)
    info = failure.step_failure_data.user_failure_data
    assert info.description == f"{tmp_path}: no <STEM>.mcap files under {tmp_path}"
    assert info.metadata["code"].value == "no_recordings"
    assert not (tmp_path / "out").exists()


def test_recordings_definitions_load_and_the_string_selection_job_resolves(task_dir, tmp_path):
    dg.Definitions.validate_loadable(defs)
    repo = defs.get_repository_def()
    job = repo.get_job("paired_episodes_job")
    assert [n.name for n in job.nodes] == ["paired_episodes"]
    node = repo.asset_graph.get(dg.AssetKey("paired_episodes"))
    assert node.group_name == "dataset" and "mcap" in node.kinds and node.description
    result = job.execute_in_process(
        run_config={"ops": {"paired_episodes": {"config": {"root": str(task_dir), "output_dir": str(tmp_path)}}}}
    )
    assert result.success
    manifest = json.loads(open(result.output_for_node("paired_episodes")["manifest_path"]).read())
    assert [a["stem"] for a in manifest["accepted"]] == ["pick_place_0000", "pick_place_0001"]


def test_root_definitions_merge_the_recordings_stage():
    from dpflow_dagster import definitions

    names = {getattr(d, "name", None) for d in definitions.defs.sensors or []}
    assert "recordings_sensor" in names
    assert any(getattr(a, "key", None) == dg.AssetKey("paired_episodes") for a in definitions.defs.assets or [])

"""Snapshot of the Dagster definitions: an accidental rewiring of the graph fails here.

The snapshot (tests/snapshots/definitions.json) holds, per asset: group, kinds,
owners, code version, dependencies, partitions, automation condition (its label), pools and
asset checks (name, blocking, pool); and the sensors, jobs and resources. The
test recomputes it from ``dpflow_dagster.definitions`` and prints a unified diff
when they differ. After an intended change, rewrite it with

    DPFLOW_UPDATE_SNAPSHOTS=1 .venv/bin/python -m pytest tests/orchestration/test_definitions_snapshot.py

and review the diff of the JSON file before committing it.
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path

import dagster as dg

from dpflow_dagster.definitions import defs

SNAPSHOT = Path(__file__).resolve().parents[1] / "snapshots" / "definitions.json"


def _partitions(partitions_def) -> str | None:
    if partitions_def is None:
        return None
    name = getattr(partitions_def, "name", None)
    return f"{type(partitions_def).__name__}({name})" if name else type(partitions_def).__name__


def _label(condition) -> str | None:
    if condition is None:
        return None
    return condition.get_label() or type(condition).__name__


def definitions_snapshot(definitions: dg.Definitions) -> dict:
    """The graph's shape as plain JSON-ready data (sorted, stable across runs)."""
    graph = definitions.resolve_asset_graph()
    repo = definitions.get_repository_def()
    checks_by_asset: dict[str, list[dict]] = {}
    for check_key in sorted(graph.asset_check_keys, key=lambda k: (k.asset_key.to_user_string(), k.name)):
        spec = graph.get_check_spec(check_key)
        node = graph.get(check_key)
        assets_def = graph.assets_def_for_key(check_key)
        checks_by_asset.setdefault(check_key.asset_key.to_user_string(), []).append({
            "name": check_key.name,
            "blocking": spec.blocking,
            "partitions": _partitions(node.partitions_def),
            "pool": assets_def.op.pool if assets_def.is_executable else None,
        })
    assets = {}
    for key in sorted(graph.get_all_asset_keys(), key=lambda k: k.to_user_string()):
        node = graph.get(key)
        name = key.to_user_string()
        assets[name] = {
            "group": node.group_name,
            "code_version": node.code_version,
            "kinds": sorted(node.kinds),
            "owners": sorted(node.owners),
            "deps": sorted(k.to_user_string() for k in node.parent_keys),
            "partitions": _partitions(node.partitions_def),
            "automation_condition": _label(node.automation_condition),
            "pools": sorted(node.pools or []),
            "described": bool(node.description),
            "checks": checks_by_asset.get(name, []),
        }
    sensors = {}
    for sensor in sorted(repo.sensor_defs, key=lambda s: s.name):
        targets = sorted(t.job_name for t in sensor.targets if getattr(t, "job_name", None))
        selection = sensor.asset_selection
        sensors[sensor.name] = {
            "type": type(sensor).__name__,
            "default_status": sensor.default_status.value,
            "jobs": targets,
            "assets": sorted(k.to_user_string() for k in selection.resolve(graph)) if selection is not None else [],
        }
    jobs = {}
    for job in sorted(repo.get_all_jobs(), key=lambda j: j.name):
        if job.name.startswith("__"):
            continue
        jobs[job.name] = {
            "assets": sorted(k.to_user_string() for k in job.asset_layer.executable_asset_keys),
            "partitions": _partitions(job.partitions_def),
        }
    return {
        "assets": assets,
        "sensors": sensors,
        "jobs": jobs,
        "resources": sorted(repo.get_top_level_resources()),
    }


def test_definitions_match_the_snapshot():
    current = json.dumps(definitions_snapshot(defs), indent=2, sort_keys=True) + "\n"
    if os.environ.get("DPFLOW_UPDATE_SNAPSHOTS"):
        SNAPSHOT.parent.mkdir(exist_ok=True)
        SNAPSHOT.write_text(current)
    expected = SNAPSHOT.read_text()
    diff = "".join(difflib.unified_diff(
        expected.splitlines(keepends=True), current.splitlines(keepends=True),
        fromfile=str(SNAPSHOT), tofile="dpflow_dagster.definitions",
    ))
    assert not diff, (
        "The Dagster definitions differ from the snapshot (rewrite it with DPFLOW_UPDATE_SNAPSHOTS=1 "
        f"if the change is intended):\n{diff}"
    )


def test_the_snapshot_states_the_rules_of_the_graph():
    """What the snapshot must keep saying, whatever else changes: one task partition for the whole graph
    and its checks,
    GPU work never automated and in the gpu_server pool, conversion behind the blocking checks."""
    snap = json.loads(SNAPSHOT.read_text())
    assets = snap["assets"]
    assert {a["partitions"] for a in assets.values()} == {"DynamicPartitionsDefinition(task)"}
    # every check follows its asset's task partition (an unpartitioned one loads every task's value)
    assert {c["partitions"] for a in assets.values() for c in a["checks"]} == {"DynamicPartitionsDefinition(task)"}
    assert all(a["owners"] and a["described"] and a["kinds"] and a["code_version"] for a in assets.values())
    training = {name for name, a in assets.items() if a["group"] == "training"}
    assert training == {"smoke_run", "train_run", "checkpoint", "evaluation", "rollout_evaluation", "no_camera_run",
                        "no_camera_checkpoint"}
    # the no-camera ablation: after the smoke run, rolled out by the closed-loop judge
    assert "smoke_run" in assets["no_camera_run"]["deps"] and "no_camera_checkpoint" in assets["rollout_evaluation"]["deps"]
    assert [c["name"] for c in assets["rollout_evaluation"]["checks"] if c["blocking"]] == ["closed_loop_success"]
    assert {name for name, a in assets.items() if a["group"] == "dataset"} == {
        "paired_episodes", "dataset_npz", "lerobot_dataset", "norm_stats", "remote_dataset", "umi_dataset"}
    # umi_dataset (for a lab's own UMI train.py) is written only when asked for
    for name in training | {"remote_dataset", "paired_episodes", "umi_dataset"}:
        assert assets[name]["automation_condition"] is None, name
    for name in ("dataset_npz", "lerobot_dataset", "norm_stats"):
        assert assets[name]["automation_condition"] == "eager, after blocking checks", name
    assert assets["smoke_run"]["pools"] == assets["train_run"]["pools"] == assets["no_camera_run"]["pools"] == ["gpu_server"]
    assert [c["name"] for c in assets["dataset_npz"]["checks"] if c["blocking"]] == [
        "episode_ends_valid", "image_size", "members_length_T", "min_two_episodes", "rotation_norm_le_pi",
        "short_episodes", "values_finite"]
    assert all(s["default_status"] == "STOPPED" for s in snap["sensors"].values())
    assert snap["jobs"]["paired_episodes_job"]["assets"] == ["paired_episodes"]
    assert snap["jobs"]["dpflow_pipeline"]["assets"] == sorted(set(assets) - {"umi_dataset"})

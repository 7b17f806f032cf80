"""Several tasks (task partitions) in one Dagster instance: every check follows its asset's partition.

Real SQLite instances (``dg.instance_for_test``), real recordings written by the
sample writer at small sizes, the real pairing, conversion, local upload and
checks. What must hold with two and three tasks:

- each check step loads and evaluates the materialized partition only, and its
  result is recorded for that partition (``partition``) and names the task
  (metadata ``task``), whatever order the tasks' steps run in;
- a failing blocking check in one task (its dataset damaged on disk) stops that
  task's upload only;
- re-materializing one task leaves the other tasks' materializations, check
  results and files as they were.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import dagster as dg
import pytest

from dpflow_core.dataset import CHECKS
from dpflow_core.files import sha256_file
from dpflow_dagster.defs.dataset import dataset_npz, dataset_npz_checks
from dpflow_dagster.defs.recordings import paired_episodes
from dpflow_dagster.defs.remote import remote_dataset, remote_dataset_sha256_match
from dpflow_dagster.resources import GpuServerResource, ProductPathIOManager
from partitioned import add_task
from recording_fixtures import SMALL, cut_at_fraction, write_small_task

SPEC = replace(SMALL, seconds=2.0)
TASKS = ("pick_cup", "wipe_table", "stack_blocks")
ASSETS = [paired_episodes, dataset_npz, dataset_npz_checks, remote_dataset, remote_dataset_sha256_match]
#: The dataset part of the graph without the upload (whose preflight imports torch: seconds per run).
DATASET_PART = ["paired_episodes", "dataset_npz"]
REMOTE_CHECK = ("remote_dataset", "remote_dataset_sha256_match")


@pytest.fixture(scope="module")
def recordings(tmp_path_factory) -> Path:
    """A Matrix Studio output root holding three task folders of two small episodes each."""
    root = tmp_path_factory.mktemp("multi") / "matrix_output"
    for k, task in enumerate(TASKS):
        write_small_task(root, episodes=2, seed=20 + k, task=task, spec=SPEC)
    return root


def _run_config(root: Path, work: Path, selection=None, width: int = 40, height: int = 30) -> dg.RunConfig:
    ops = {
        "paired_episodes": {"config": {"root": str(root), "output_dir": str(work), "quality": False}},
        "dataset_npz": {"config": {"image_width": width, "image_height": height, "workers": 1,
                                   "output_dir": str(work)}},
    }
    if isinstance(selection, dg.AssetSelection):
        return dg.RunConfig()
    return dg.RunConfig(ops={k: v for k, v in ops.items() if selection is None or k in selection})


def _resources(work: Path) -> dict:
    return {
        "gpu_server": GpuServerResource(data_root=str(work / "server")),
        "io_manager": ProductPathIOManager(base_dir=str(work / "io")),
    }


def _materialize(instance, task: str, root: Path, work: Path, selection=DATASET_PART, **config) -> dg.ExecuteInJobResult:
    """Materialize ``selection`` (asset names with their checks, an AssetSelection, or None: all of ASSETS)."""
    add_task(instance, task)
    return dg.materialize(
        ASSETS, partition_key=task, instance=instance, selection=selection, resources=_resources(work),
        run_config=_run_config(root, work, selection, **config), raise_on_error=False,
    )


def check_results(instance: dg.DagsterInstance) -> dict[tuple[str | None, str, str], list[tuple[float, bool, dict]]]:
    """(partition, asset, check) -> [(timestamp, passed, metadata)], oldest first, of every check evaluation."""
    out: dict = {}
    for run in instance.get_runs():
        records = instance.get_records_for_run(run.run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION).records
        for r in records:
            ev = r.event_log_entry.dagster_event.event_specific_data
            meta = {k: v.value for k, v in ev.metadata.items()}
            out.setdefault((ev.partition, ev.asset_key.to_user_string(), ev.check_name), []).append(
                (r.event_log_entry.timestamp, ev.passed, meta))
    return {k: sorted(v, key=lambda item: item[0]) for k, v in out.items()}


def materializations(instance: dg.DagsterInstance, asset: str, task: str) -> list[tuple[int, dict]]:
    """(storage id, metadata) of each materialization of ``asset`` for partition ``task``, newest first."""
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[task]), limit=100
    ).records
    return [(r.storage_id, {k: v.value for k, v in r.asset_materialization.metadata.items()}) for r in records]


def _assert_task_checked(instance, task: str, expected_runs: int = 1, remote: bool = False) -> None:
    """Every dataset check (and the upload's) ran ``expected_runs`` times for ``task``, passed, names the task."""
    results = check_results(instance)
    for key in [(task, "dataset_npz", name) for name in CHECKS] + ([(task, *REMOTE_CHECK)] if remote else []):
        assert len(results.get(key, [])) == expected_runs, (key, sorted(results))
        for _, passed, meta in results[key]:
            assert passed and meta["task"] == task, (key, meta)


def test_two_tasks_in_turn_then_one_again_leaves_the_other_untouched(recordings, tmp_path):
    work = tmp_path / "work"
    first, second = TASKS[:2]
    with dg.instance_for_test() as instance:
        for task in (first, second):
            result = _materialize(instance, task, recordings, work)
            assert result.success, task
            # the check step evaluated the run's partition only: one result per check, for this task
            evaluations = result.get_asset_check_evaluations()
            assert sorted(e.check_name for e in evaluations) == sorted(CHECKS)
            assert {e.partition for e in evaluations} == {task}
        for task in (first, second):
            _assert_task_checked(instance, task)
            [(_, meta)] = materializations(instance, "dataset_npz", task)
            # the path shown is the dataset itself, not the IO manager's pickle under work/io
            dataset = Path(meta["path"])
            assert dataset.parent.parent == work / "datasets" / task and dataset.name == "dataset.npz"
            assert meta["sha256"] == sha256_file(dataset)
            [(_, manifest)] = materializations(instance, "paired_episodes", task)
            assert manifest["path"] == manifest["manifest_path"] and Path(manifest["path"]).parent == work / "manifests"
        assert instance.get_materialized_partitions(dg.AssetKey("dataset_npz")) == {first, second}

        before_checks = {k: v for k, v in check_results(instance).items() if k[0] == second}
        before = {a: materializations(instance, a, second) for a in DATASET_PART}
        second_file = before["dataset_npz"][0][1]["path"]
        second_sha = sha256_file(second_file)

        # the first task again, with other options: a new dataset of that task only
        again = _materialize(instance, first, recordings, work, selection=["dataset_npz"], width=32, height=24)
        assert again.success
        assert {e.partition for e in again.get_asset_check_evaluations()} == {first}
        _assert_task_checked(instance, first, expected_runs=2)
        new, old = materializations(instance, "dataset_npz", first)
        assert new[1]["path"] != old[1]["path"] and new[1]["image_size"] == "32x24"
        assert Path(old[1]["path"]).is_file(), "the earlier dataset stays"

        assert {k: v for k, v in check_results(instance).items() if k[0] == second} == before_checks
        assert {a: materializations(instance, a, second) for a in before} == before
        assert sha256_file(second_file) == second_sha


@pytest.mark.slow
def test_three_tasks_with_their_steps_interleaved(recordings, tmp_path):
    """Pair all three, then convert them in another order, one step per run."""
    work = tmp_path / "work"
    steps = [(TASKS[2], "paired_episodes"), (TASKS[0], "paired_episodes"), (TASKS[2], "dataset_npz"),
             (TASKS[1], "paired_episodes"), (TASKS[0], "dataset_npz"), (TASKS[1], "dataset_npz")]
    with dg.instance_for_test() as instance:
        for task, step in steps:
            result = _materialize(instance, task, recordings, work, selection=[step])
            assert result.success, (task, step)
            assert {e.partition for e in result.get_asset_check_evaluations()} <= {task}
        for task in TASKS:
            _assert_task_checked(instance, task)
            [(_, dataset)] = materializations(instance, "dataset_npz", task)
            [(_, manifest)] = materializations(instance, "paired_episodes", task)
            assert manifest["task"] == task and dataset["manifest_path"] == manifest["manifest_path"]
            assert Path(dataset["path"]).parent.parent == work / "datasets" / task
        assert len({materializations(instance, "dataset_npz", t)[0][1]["sha256"] for t in TASKS}) == 3


@pytest.mark.slow
def test_a_failing_check_in_one_task_does_not_block_another(recordings, tmp_path):
    """One task's dataset is damaged on disk after conversion: its checks fail and its upload does not run;
    the other task's checks, upload and upload check run and pass, and each result stays with its task."""
    work = tmp_path / "work"
    bad, good = TASKS[2], TASKS[0]
    with dg.instance_for_test() as instance:
        assert _materialize(instance, bad, recordings, work).success
        [(_, meta)] = materializations(instance, "dataset_npz", bad)
        cut_at_fraction(meta["path"], 0.5)
        checks_then_upload = dg.AssetSelection.checks_for_assets(dataset_npz) | dg.AssetSelection.assets(remote_dataset)
        failed = _materialize(instance, bad, recordings, work, selection=checks_then_upload)
        assert not failed.success
        evals = failed.get_asset_check_evaluations()
        assert {e.partition for e in evals} == {bad} and not any(e.passed for e in evals)
        assert materializations(instance, "remote_dataset", bad) == []

        ok = _materialize(instance, good, recordings, work, selection=None)
        assert ok.success
        _assert_task_checked(instance, good, remote=True)
        [(_, remote)] = materializations(instance, "remote_dataset", good)
        [(_, dataset)] = materializations(instance, "dataset_npz", good)
        assert remote["sha256"] == dataset["sha256"] and f"/{good}/" in remote["remote_path"]
        assert remote["path"] == remote["remote_path"] and sha256_file(remote["path"]) == dataset["sha256"]
        results = check_results(instance)
        assert [p for _, p, _ in results[(bad, "dataset_npz", "members_length_T")]] == [True, False]
        assert [p for _, p, _ in results[(good, "dataset_npz", "members_length_T")]] == [True]
        assert (bad, *REMOTE_CHECK) not in results
        assert instance.get_materialized_partitions(dg.AssetKey("remote_dataset")) == {good}


@pytest.mark.slow
def test_the_sensor_adds_two_task_folders_in_one_tick_and_both_convert(recordings, tmp_path, monkeypatch):
    """An instance with one task converted; two new task folders land: one tick adds both partitions and
    requests both pairings; each task's conversion and checks then run for that task alone."""
    from dpflow_dagster.definitions import defs
    from dpflow_dagster.sensors import recordings_sensor

    root, work = tmp_path / "matrix_output", tmp_path / "work"
    shutil.copytree(recordings / TASKS[0], root / TASKS[0])
    monkeypatch.setenv("DPFLOW_RECORDINGS_ROOT", str(root))
    with dg.instance_for_test() as instance:
        assert _materialize(instance, TASKS[0], root, work, selection=["paired_episodes"]).success

        def tick(cursor):
            context = dg.build_sensor_context(
                instance=instance, instance_ref=instance.get_ref(), cursor=cursor, definitions=defs)
            return recordings_sensor.evaluate_tick(context)

        first = tick(tick(None).cursor)
        assert [r.partition_key for r in first.run_requests] == [TASKS[0]] and not first.dynamic_partitions_requests
        settled = tick(first.cursor)
        assert settled.run_requests == []
        for task in TASKS[1:]:
            shutil.copytree(recordings / task, root / task)
        data = tick(tick(settled.cursor).cursor)
        assert sorted(r.partition_key for r in data.run_requests) == sorted(TASKS[1:])
        assert data.dynamic_partitions_requests == [dg.AddDynamicPartitionsRequest("task", sorted(TASKS[1:]))]

        instance.add_dynamic_partitions("task", list(data.dynamic_partitions_requests[0].partition_keys))
        for request in data.run_requests:
            assert request.run_config["ops"]["paired_episodes"]["config"]["root"] == str(root / request.partition_key)
            result = _materialize(instance, request.partition_key, root, work)
            assert result.success, request.partition_key
        for task in TASKS[1:]:
            _assert_task_checked(instance, task)
        assert instance.get_materialized_partitions(dg.AssetKey("dataset_npz")) == set(TASKS[1:])
        assert instance.get_materialized_partitions(dg.AssetKey("paired_episodes")) == set(TASKS)

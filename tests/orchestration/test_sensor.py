"""The recordings sensor, evaluated with build_sensor_context on a real (temporary) Dagster instance."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import dagster as dg
import pytest

from dpflow_dagster.defs.recordings import defs
from dpflow_dagster.sensors import paired_episodes_job, parse_cursor, recordings_sensor
from recording_fixtures import write_small_episode, write_small_task

T0 = 1_700_000_000.0  # fixed mtimes (s) so the test does not depend on the clock or file system granularity


def _touch(paths, mtime: float) -> None:
    for p in paths:
        os.utime(p, (mtime, mtime))


def _files(d: Path, stem: str) -> list[Path]:
    return [p for p in (d / f"{stem}.mcap", d / f"{stem}_vio.mcap", d / f"{stem}_vio.json") if p.exists()]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """Two finished episodes and a spare one, written once; each test copies them."""
    base = tmp_path_factory.mktemp("sensor_src")
    write_small_task(base, episodes=2, seed=4)
    write_small_episode(base / "spare", "pick_place_0002", seed=5)
    write_small_episode(base / "spare2", "pick_place_0000", seed=6)
    write_small_task(base, episodes=1, seed=7, task="wipe_table")
    write_small_episode(base / "spare3", "wipe_table_0001", seed=8)
    return base


@pytest.fixture
def root(source, tmp_path, monkeypatch):
    d = tmp_path / "pick_place"
    shutil.copytree(source / "pick_place", d)
    for i, stem in enumerate(("pick_place_0000", "pick_place_0001")):
        _touch(_files(d, stem), T0 + i)
    monkeypatch.setenv("DPFLOW_RECORDINGS_ROOT", str(d))
    return d


@pytest.fixture(scope="module")
def instance():
    with dg.instance_for_test() as inst:
        yield inst


def _settled(cursor: str) -> dict[str, float]:
    """Task -> newest requested mtime, asserting that nothing waits any more."""
    states = parse_cursor(cursor)
    assert all((s.pending_n, s.waiting_n, s.watch) == (0, 0, {}) for s in states.values()), states
    return {task: s.max_mtime for task, s in states.items()}


def tick(instance, cursor):
    context = dg.build_sensor_context(instance=instance, cursor=cursor, definitions=defs)
    result = recordings_sensor(context)
    assert isinstance(result, dg.SensorResult)
    return result


def test_run_only_after_two_identical_ticks(root, instance):
    first = tick(instance, None)
    assert not first.run_requests
    assert first.skip_reason.skip_message == (
        "waiting for 2 recording(s) to finish and stay unchanged for one tick: pick_place_0000, pick_place_0001"
    )
    state = parse_cursor(first.cursor)["pick_place"]
    # both seen once: one digest over them, the newest mtime among them, nothing requested yet
    assert (state.max_mtime, state.pending_n, state.pending_upto_ns, state.watch) == (0.0, 2, int((T0 + 1) * 1e9), {})
    assert state.waiting_names == ["pick_place_0000", "pick_place_0001"] and len(state.pending_digest) == 64
    second = tick(instance, first.cursor)
    assert len(second.run_requests) == 1
    request = second.run_requests[0]
    assert request.run_key.startswith("recordings-")
    assert request.run_config == {"ops": {"paired_episodes": {"config": {"root": str(root)}}}}
    assert request.tags["dpflow/new_stems"] == "pick_place_0000,pick_place_0001"
    assert request.partition_key == "pick_place"
    assert second.dynamic_partitions_requests == [dg.AddDynamicPartitionsRequest("task", ["pick_place"])]
    assert _settled(second.cursor) == {"pick_place": T0 + 1}
    job = defs.resolve_job_def("paired_episodes_job")
    assert dg.validate_run_config(job, request.run_config)["ops"]["paired_episodes"]["config"]["root"] == str(root)

    third = tick(instance, second.cursor)
    assert not third.run_requests
    assert third.skip_reason.skip_message == f"no new recordings under {root}"
    assert _settled(third.cursor) == {"pick_place": T0 + 1}
    # the same tick from the same cursor asks for the same run key: Dagster runs it once
    assert tick(instance, first.cursor).run_requests[0].run_key == request.run_key


def test_half_written_recordings_wait(root, instance, source):
    cursor = tick(instance, tick(instance, None).cursor).cursor
    spare = source / "spare"
    stem = "pick_place_0002"
    # the recorder has written the raw file and part of the VIO file; no status yet
    shutil.copyfile(spare / f"{stem}.mcap", root / f"{stem}.mcap")
    data = (spare / f"{stem}_vio.mcap").read_bytes()
    (root / f"{stem}_vio.mcap").write_bytes(data[: len(data) // 2])
    _touch(_files(root, stem), T0 + 10)
    r = tick(instance, cursor)
    state = parse_cursor(r.cursor)["pick_place"]
    assert not r.run_requests and (state.waiting_n, state.waiting_names, state.pending_n) == (1, [stem], 0)
    r = tick(instance, r.cursor)  # unchanged but incomplete: still waiting
    assert not r.run_requests
    # the VIO file grows and a status file says it is still running
    (root / f"{stem}_vio.mcap").write_bytes(data)
    (root / f"{stem}_vio.json").write_text(json.dumps({"status": "running"}))
    _touch(_files(root, stem), T0 + 11)
    r = tick(instance, r.cursor)
    r = tick(instance, r.cursor)
    assert not r.run_requests  # status not final, however long it stays
    # half-written JSON is not final either
    (root / f"{stem}_vio.json").write_text('{"status": "succ')
    _touch(_files(root, stem), T0 + 12)
    r = tick(instance, tick(instance, r.cursor).cursor)
    assert not r.run_requests
    shutil.copyfile(spare / f"{stem}_vio.json", root / f"{stem}_vio.json")
    _touch(_files(root, stem), T0 + 13)
    r = tick(instance, r.cursor)
    assert not r.run_requests  # first sight of the finished state
    # a file that changes between ticks resets the wait
    with open(root / f"{stem}_vio.mcap", "ab") as f:
        f.write(b"\0")
    r = tick(instance, r.cursor)
    assert not r.run_requests
    (root / f"{stem}_vio.mcap").write_bytes(data)
    _touch(_files(root, stem), T0 + 14)
    r = tick(instance, r.cursor)
    assert not r.run_requests
    r = tick(instance, r.cursor)
    assert [q.tags["dpflow/new_stems"] for q in r.run_requests] == [stem]
    assert _settled(r.cursor) == {"pick_place": T0 + 14}


def test_rerecorded_stem_runs_again_unchanged_never(root, instance, source):
    first = tick(instance, tick(instance, None).cursor)
    key1 = first.run_requests[0].run_key
    assert not tick(instance, first.cursor).run_requests
    # re-recorded: new content and a newer mtime for pick_place_0000
    for name in ("pick_place_0000.mcap", "pick_place_0000_vio.mcap", "pick_place_0000_vio.json"):
        shutil.copyfile(source / "spare2" / name, root / name)
    _touch(_files(root, "pick_place_0000"), T0 + 20)
    r = tick(instance, first.cursor)
    assert not r.run_requests
    r = tick(instance, r.cursor)
    assert [q.tags["dpflow/new_stems"] for q in r.run_requests] == ["pick_place_0000"]
    key2 = r.run_requests[0].run_key
    assert key2 != key1
    assert not tick(instance, r.cursor).run_requests
    # only the mtime changes (touched again): content key changes, so it runs again
    _touch(_files(root, "pick_place_0000"), T0 + 30)
    r2 = tick(instance, tick(instance, r.cursor).cursor)
    assert r2.run_requests[0].run_key not in (key1, key2)


def test_failed_recordings_are_final_too(root, instance):
    status = root / "pick_place_0001_vio.json"
    status.write_text(json.dumps({"status": "failed"}))
    _touch([status], T0 + 1)
    r = tick(instance, tick(instance, None).cursor)
    assert r.run_requests[0].tags["dpflow/new_stems"] == "pick_place_0000,pick_place_0001"


def test_missing_root_and_bad_cursor(tmp_path, instance, monkeypatch):
    monkeypatch.setenv("DPFLOW_RECORDINGS_ROOT", str(tmp_path / "absent"))
    r = tick(instance, None)
    assert r.skip_reason.skip_message == f"{tmp_path / 'absent'}: no such folder" and not r.run_requests
    assert parse_cursor("not json") == {}
    assert parse_cursor('{"tasks": {"pick_place": {"max_mtime": "x"}}}') == {}
    assert parse_cursor('{"max_mtime": 5.0, "pending": {}}') == {}  # an older cursor: start afresh


def test_sensor_targets_the_job_and_is_off_by_default():
    assert recordings_sensor.job_name == "paired_episodes_job" == paired_episodes_job.name
    assert recordings_sensor.default_status == dg.DefaultSensorStatus.STOPPED
    assert defs.resolve_sensor_def("recordings_sensor") is not None


def test_output_root_adds_partitions_and_requests_runs_in_the_same_tick(source, tmp_path, monkeypatch):
    """Task folders under the output root: one partition and one run each, added and requested in one tick;
    the runs materialize their partitions on a real instance and conversion follows by its automation."""
    from dpflow_dagster.definitions import defs as root_defs

    out = tmp_path / "output"
    for task in ("pick_place", "wipe_table"):
        shutil.copytree(source / task, out / task)
    (out / "not a task").mkdir()
    (out / ".cache").mkdir()
    monkeypatch.setenv("DPFLOW_RECORDINGS_ROOT", str(out))
    monkeypatch.setenv("DPFLOW_WORKDIR", str(tmp_path / "work"))
    with dg.instance_for_test() as instance:
        first = tick(instance, None)
        assert first.skip_reason.skip_message == (
            "waiting for 3 recording(s) to finish and stay unchanged for one tick: "
            "pick_place/pick_place_0000, pick_place/pick_place_0001, wipe_table/wipe_table_0000"
        )
        # evaluate_tick resolves each request against the partitions, those added in the tick included
        context = dg.build_sensor_context(
            instance=instance, instance_ref=instance.get_ref(), cursor=first.cursor, definitions=defs
        )
        data = recordings_sensor.evaluate_tick(context)
        assert [r.partition_key for r in data.run_requests] == ["pick_place", "wipe_table"]
        assert [r.run_config["ops"]["paired_episodes"]["config"]["root"] for r in data.run_requests] == [
            str(out / "pick_place"), str(out / "wipe_table")]
        assert [r.tags["dpflow/task"] for r in data.run_requests] == ["pick_place", "wipe_table"]
        assert data.dynamic_partitions_requests == [dg.AddDynamicPartitionsRequest("task", ["pick_place", "wipe_table"])]
        assert set(parse_cursor(data.cursor)) == {"pick_place", "wipe_table"}

        # what the daemon does with the result: add the partitions, launch the runs
        instance.add_dynamic_partitions("task", list(data.dynamic_partitions_requests[0].partition_keys))
        # the automation sensor's tick now: the new partitions wait for their paired episodes
        before = dg.evaluate_automation_conditions(defs=root_defs, instance=instance)
        assert before.total_requested == 0
        job = defs.resolve_job_def("paired_episodes_job")
        for request in data.run_requests:
            result = job.execute_in_process(
                run_config=request.run_config, instance=instance, partition_key=request.partition_key, tags=request.tags
            )
            assert result.success
            assert result.output_for_node("paired_episodes").root == str(out / request.partition_key)
        assert instance.get_materialized_partitions(dg.AssetKey("paired_episodes")) == {"pick_place", "wipe_table"}

        # conversion is eager behind blocking checks; the GPU assets are never requested
        evaluation = dg.evaluate_automation_conditions(defs=root_defs, instance=instance, cursor=before.cursor)
        requested = {
            key.to_user_string(): set(evaluation.get_requested_partitions(key))
            for key in root_defs.resolve_asset_graph().get_all_asset_keys()
            if evaluation.get_requested_partitions(key)
        }
        both = {"pick_place", "wipe_table"}
        assert requested == {"dataset_npz": both, "lerobot_dataset": both, "norm_stats": both}

        # a new recording in one task: a run for that partition, which exists now
        shutil.copytree(source / "spare3", out / "wipe_table", dirs_exist_ok=True)
        again = tick(instance, tick(instance, data.cursor).cursor)
        assert [(r.partition_key, r.tags["dpflow/new_stems"]) for r in again.run_requests] == [("wipe_table", "wipe_table_0001")]
        assert not again.dynamic_partitions_requests
        quiet = tick(instance, again.cursor)
        assert quiet.skip_reason.skip_message == (
            f"no new recordings under {out}; folders ignored (not valid task names): 'not a task'"
        )

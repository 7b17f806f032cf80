"""The dataset assets materialized against a real PostgreSQL-backed Dagster instance.

A private PostgreSQL server (tests/pg.py) runs on 127.0.0.1; the instance is
built from ``dagster_home/dagster.postgres.yaml`` with the connection in the
``DAGSTER_PG_*`` environment variables, exactly as a deployment would do.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.instance.config import dagster_instance_config

from dpflow_core.recordings.samples import SampleSpec, write_task
from pg import postgres  # noqa: F401  (the fixture)

REPO = Path(__file__).resolve().parents[2]
PG_YAML = REPO / "dagster_home" / "dagster.postgres.yaml"

#: The dataset assets, upstream first; those present in the definitions are materialized.
DATASET_ASSETS = ("paired_episodes", "dataset_npz")


def test_postgres_yaml_is_a_valid_instance_config_reading_env(tmp_path):
    shutil.copy(PG_YAML, tmp_path / "dagster.yaml")
    config, _ = dagster_instance_config(str(tmp_path))
    db = config["storage"]["postgres"]["postgres_db"]
    assert {k: db[k] for k in ("hostname", "port", "username", "password", "db_name")} == {
        "hostname": {"env": "DAGSTER_PG_HOST"},
        "port": {"env": "DAGSTER_PG_PORT"},
        "username": {"env": "DAGSTER_PG_USERNAME"},
        "password": {"env": "DAGSTER_PG_PASSWORD"},
        "db_name": {"env": "DAGSTER_PG_DB"},
    }
    assert db["scheme"] == "postgresql+psycopg2"
    assert config["run_monitoring"]["enabled"] and config["run_retries"]["enabled"]


@pytest.mark.parametrize("name", ["dagster.yaml", "dagster.postgres.yaml"])
def test_instance_configs_monitor_retry_crashes_only_and_limit_the_gpu_pool(name, tmp_path):
    shutil.copy(REPO / "dagster_home" / name, tmp_path / "dagster.yaml")
    config, _ = dagster_instance_config(str(tmp_path))
    assert config["run_monitoring"]["enabled"] and config["run_monitoring"]["start_timeout_seconds"] > 0
    assert config["run_retries"]["enabled"] and config["run_retries"]["max_retries"] == 1
    assert config["run_retries"]["retry_on_asset_or_op_failure"] is False  # a failed training is never relaunched
    assert config["concurrency"]["pools"]["default_limit"] == 1  # the gpu_server pool: one run per server


@pytest.fixture
def pg_instance(postgres, tmp_path, monkeypatch):  # noqa: F811
    """A DagsterInstance on a fresh database of the private server, built from the YAML."""
    db = postgres.create_database(f"dagster_{uuid.uuid4().hex[:8]}")
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(PG_YAML, home / "dagster.yaml")
    for key, value in postgres.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("DAGSTER_PG_DB", db)
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    instance = dg.DagsterInstance.from_config(str(home))
    try:
        yield instance, db
    finally:
        instance.dispose()


@pytest.mark.postgres
@pytest.mark.slow
def test_dataset_assets_materialize_into_postgres(pg_instance, postgres, tmp_path, monkeypatch):  # noqa: F811
    from dagster_postgres import PostgresEventLogStorage, PostgresRunStorage

    from dpflow_dagster.definitions import defs

    instance, db = pg_instance
    assert isinstance(instance.run_storage, PostgresRunStorage)
    assert isinstance(instance.event_log_storage, PostgresEventLogStorage)

    write_task(tmp_path / "recordings", episodes=2, seconds=2, spec=SampleSpec(width=160, height=120))
    monkeypatch.setenv("DPFLOW_RECORDINGS_ROOT", str(tmp_path / "recordings"))  # the output root; the task is the partition
    monkeypatch.setenv("DPFLOW_WORKDIR", str(tmp_path / "work"))

    all_keys = {k.to_user_string() for k in defs.resolve_asset_graph().get_all_asset_keys()}
    selected = [name for name in DATASET_ASSETS if name in all_keys]
    assert "paired_episodes" in selected, sorted(all_keys)
    job = defs.resolve_implicit_global_asset_job_def()
    instance.add_dynamic_partitions("task", ["pick_place"])
    result = job.execute_in_process(
        instance=instance, asset_selection=[dg.AssetKey(n) for n in selected], partition_key="pick_place"
    )
    assert result.success
    run_id = result.run_id

    # through the instance
    assert instance.get_run_by_id(run_id).status == dg.DagsterRunStatus.SUCCESS
    for name in selected:
        event = instance.get_latest_materialization_event(dg.AssetKey(name))
        assert event is not None and event.run_id == run_id, name
        assert instance.get_materialized_partitions(dg.AssetKey(name)) == {"pick_place"}, name
    paired = instance.get_latest_materialization_event(dg.AssetKey("paired_episodes")).asset_materialization
    assert paired.metadata["accepted"].value == 2
    assert paired.metadata["rejected"].value == 0
    manifest = json.loads(Path(paired.metadata["manifest_path"].value).read_text())
    assert sorted(e["stem"] for e in manifest["accepted"]) == ["pick_place_0000", "pick_place_0001"]

    # a second instance from the same config (as the webserver or daemon would build) sees it
    other = dg.DagsterInstance.from_config(str(Path(instance.root_directory)))
    try:
        assert other.get_run_by_id(run_id).status == dg.DagsterRunStatus.SUCCESS
    finally:
        other.dispose()

    # and the rows are in PostgreSQL itself
    assert postgres.query("SELECT status FROM runs WHERE run_id = %s", (run_id,), db=db) == [("SUCCESS",)]
    rows = postgres.query(
        "SELECT asset_key, partition, count(*) FROM event_logs WHERE run_id = %s "
        "AND dagster_event_type = 'ASSET_MATERIALIZATION' GROUP BY asset_key, partition ORDER BY asset_key",
        (run_id,),
        db=db,
    )
    assert rows == sorted((json.dumps([name]), "pick_place", 1) for name in selected)
    assert postgres.query("SELECT partition FROM dynamic_partitions WHERE partitions_def_name = 'task'", db=db) == [
        ("pick_place",)]
    known = {r[0] for r in postgres.query("SELECT asset_key FROM asset_keys", db=db)}
    assert {json.dumps([name]) for name in selected} <= known

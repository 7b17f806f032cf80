"""The training stage as Dagster assets on the local transport: the definitions, a leaking smoke run
blocked by its check, and re-attaching to a running training.

The whole chain with the built-in trainer (smoke run, resume continuity, training, checkpoint,
evaluation, and the lineage each records) is asserted on the second task of the README's main job,
tests/project/test_demo_e2e.py (:func:`_assert_training_chain_record`): the same assets, trained once for both.
"""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest
from test_runs import FAKE_TRAINER

from conftest import kill_tmux_server, tmux_socket
from dpflow_core.server import sha256_file
from dpflow_dagster.defs import training as at
from dpflow_dagster.resources import GpuServerResource

TMUX_SOCKET = tmux_socket("assets")
TASK = "pick_place"


@pytest.fixture(scope="module", autouse=True)
def _private_tmux_server():
    yield
    kill_tmux_server(TMUX_SOCKET)


def stub_remote_dataset(path: Path, frequency_hz: float):
    """``remote_dataset`` as the remote stage hands it over (here the server is this machine)."""
    value = {
        "remote_path": str(path), "sha256": sha256_file(path), "size_bytes": path.stat().st_size, "host": None,
        "frequency_hz": frequency_hz, "local_path": str(path),
    }

    @dg.asset(name="remote_dataset", group_name="dataset", partitions_def=at.smoke_run.partitions_def)
    def remote_dataset() -> dict:
        return value

    return remote_dataset


def materialize(assets, tmp_path: Path, run_config: dg.RunConfig, raise_on_error: bool = True):
    """``dg.materialize`` with the local GPU server under ``tmp_path`` (one task partition when partitioned)."""
    kwargs = {}
    partitions = at.smoke_run.partitions_def
    if partitions is not None:
        instance = dg.DagsterInstance.ephemeral()
        if isinstance(partitions, dg.DynamicPartitionsDefinition):
            instance.add_dynamic_partitions(partitions.name, [TASK])
        kwargs = dict(instance=instance, partition_key=TASK)
    resources = {"gpu_server": GpuServerResource(data_root=str(tmp_path / "server"), tmux_socket=TMUX_SOCKET)}
    return dg.materialize(assets, resources=resources, run_config=run_config, raise_on_error=raise_on_error, **kwargs)


def checks_by_name(result: dg.ExecuteInJobResult) -> dict:
    return {e.check_name: e for e in result.get_asset_check_evaluations()}


def materializations(result) -> dict:
    return {
        e.asset_key.to_user_string(): e.step_materialization_data.materialization.metadata
        for e in result.get_asset_materialization_events()
    }


def test_definitions():
    keys = {a.key.to_user_string() for a in at.defs.assets}
    assert keys == {"smoke_run", "train_run", "checkpoint", "evaluation"}
    for asset in at.defs.assets:
        assert asset.group_names_by_key[asset.key] == "training"
        assert asset.partitions_def.name == "task" and asset.owners_by_key[asset.key] == ["team:robot-learning"]
        assert asset.automation_conditions_by_key.get(asset.key) is None  # GPU work: never by automation
    assert at.smoke_run.op.pool == at.train_run.op.pool == "gpu_server"
    blocking = {s.key.name: s.blocking for c in at.defs.asset_checks for s in c.check_specs}
    assert blocking == {"released": True, "resume_continuity": False, "natural_exit": True,
                        "sha256_match": True, "beats_baseline": True}
    field = at.TrainRunConfig.model_fields["num_processes"]
    assert field.default == 0 and "one per free GPU" in field.description


@pytest.fixture()
def fake(tmp_path):
    trainer = tmp_path / "fake_train.py"
    trainer.write_text(FAKE_TRAINER)
    dataset = tmp_path / "dataset.npz"
    dataset.write_bytes(b"stand-in dataset")
    return str(trainer), dataset


@pytest.mark.slow
def test_a_leaking_smoke_run_fails_released_and_blocks_training(tmp_path, fake):
    trainer, dataset = fake
    run_config = dg.RunConfig(ops={
        "smoke_run": at.SmokeRunConfig(run_name="smoke-leak", train_command=trainer, extra_overrides=["fake.mode=leave_child"]),
        "train_run": at.TrainRunConfig(run_name="train-b", train_command=trainer, poll_s=0.2),
    })
    result = materialize(
        [stub_remote_dataset(dataset, 30.0), at.smoke_run, at.train_run, at.smoke_run_released], tmp_path, run_config,
        raise_on_error=False,
    )
    released = checks_by_name(result)["released"]
    assert not released.passed
    assert "(sleep 300)" in released.metadata["at_end/leftover_processes"].value
    assert "sleep 300" in released.metadata["at_end/cleanup_terminated"].value
    assert released.metadata["now/leftover_processes"].value == "none"
    assert "train_run" not in materializations(result)  # the blocking check stopped it
    assert not (tmp_path / "server" / "runs" / "train-b").exists()
    # the run fails with dpflow's reason: the check, the task and what the check found
    [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    assert failure.step_failure_data.user_failure_data.description == (
        f"blocking check smoke_run:released failed for task {TASK}: {released.description}")


@pytest.mark.slow
def test_a_second_materialization_reattaches_to_the_running_training(tmp_path, fake):
    trainer, dataset = fake
    assets = [stub_remote_dataset(dataset, 30.0), at.train_run, at.train_run_natural_exit]
    common = dict(run_name="train-c", train_command=trainer, epochs=2, max_train_steps=10,
                  extra_overrides=["fake.step_s=0.3"], poll_s=0.3)
    first = materialize(
        assets, tmp_path, dg.RunConfig(ops={"train_run": at.TrainRunConfig(**common, monitor_timeout_s=1.0)}), raise_on_error=False
    )
    assert not first.success  # the orchestrator gave up following; the run goes on
    second = materialize(assets, tmp_path, dg.RunConfig(ops={"train_run": at.TrainRunConfig(**common)}))
    meta = materializations(second)["train_run"]
    assert meta["attached"].value is True and meta["launch_index"].value == 0
    assert meta["global_step"].value == 19 and meta["exit_code"].value == 0
    assert checks_by_name(second)["natural_exit"].passed
    assert [p.name for p in (tmp_path / "server" / "runs" / "train-c" / "dpflow").iterdir()] == ["launch-0"]

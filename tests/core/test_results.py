"""Typed stage results: to_dict/from_dict round trips, refusal of bad dicts, and values stored by
the previous version (plain dicts) still read, by the core and by a downstream asset."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
from pathlib import Path

import dagster as dg
import numpy as np
import pytest

from dpflow_core.checkpoints import DownloadedCheckpoint
from dpflow_core.conversion import ConversionResult
from dpflow_core.errors import ResultError
from dpflow_core.evaluation import PREDICTORS, EvaluationResult
from dpflow_core.export import LeRobotExport, OpenpiNormStatsFile
from dpflow_core.export.umi import UmiExport
from dpflow_core.pairing import PairedEpisodes
from dpflow_core.runs import ReportedCheck, ResumeCheckSize, SmokeRun, TrainResult, smoke_spec
from dpflow_core.runs.monitor import RankRun
from dpflow_core.server.upload import RemoteDataset
from partitioned import materialize as materialize_task

SHA = "ab" * 32
SPEC = smoke_spec("smoke-a", "/srv/pick/abcd/dataset.npz", 29.97, dataset_sha256=SHA, config_name="demo")


def _metrics(mse: float) -> dict:
    return {"mse": mse, "mse_per_key": {"position": mse, "rotation": mse, "gripper": mse},
            "mse_per_step": [mse, mse], "position_error_m": 0.01, "rotation_error_rad": 0.02,
            "gripper_error_m": 0.003, "gripper_events": 2, "gripper_events_matched": 1, "gripper_events_false": 0,
            "gripper_timing_error_s": 0.1}


def _evaluation() -> EvaluationResult:
    return EvaluationResult(
        checkpoint_path="/c/latest.ckpt", dataset_path="/d/dataset.npz", dataset_sha256=SHA, recorded_dataset_sha256=SHA,
        held_out_episodes=(3, 7), n_episodes=2, train_episodes=6, n_samples=24, horizon=2, step_s=0.1,
        dimension_names=("position.x", "gripper.width"),
        metrics={p: _metrics(m) for p, m in zip(PREDICTORS, (0.01, 0.2, 0.1, 0.05))},
        gripper_threshold_m=0.04, margin=0.2,
        trajectory_plot="/e/t.png", error_plot="/e/e.png", loss_plot=None, out_dir="/e", seconds=3.5,
        notes=("no training log",), checkpoint_sha256="cd" * 32, executed_steps=(1,), latency_s=0.0, n_action_steps=1,
        mean_relative_action=((0.0, 0.0, 0.01, 0.0, 0.0, 0.0, 0.0), (0.0, 0.0, 0.02, 0.0, 0.0, 0.0, 0.0)),
        gate={c: {"policy": 0.01, "best_baseline": "hold", "baseline": 0.1, "required": 0.08, "improvement": 0.9,
                  "passed": True, "policy_ci95": [0.005, 0.02], "improvement_ci95": [0.8, 0.95]}
              for c in ("position_error_m", "rotation_error_rad", "gripper_events")},
    )


def _checkpoint(tmp_path: Path) -> DownloadedCheckpoint:
    local = tmp_path / "latest.ckpt"
    local.write_bytes(b"checkpoint bytes")
    digest = hashlib.sha256(local.read_bytes()).hexdigest()
    return DownloadedCheckpoint(
        run_name="train-a", choice="latest", remote_path="/srv/runs/train-a/checkpoints/latest.ckpt",
        remote_sha256=digest, size_bytes=local.stat().st_size, local_path=str(local), local_sha256=digest,
        local_dir=str(tmp_path), hydra_dir=None, log_path=str(tmp_path / "logs.json.txt"), normalizer_path=None,
        record_path=str(tmp_path / "record.json"), run_finished=True, exit_code=0, dataset_local_path="/d/dataset.npz",
    )


def _results(tmp_path: Path) -> list:
    return [
        PairedEpisodes("/w/manifests/pick-0123456789ab.json", "/rec/pick", "pick", 2, 1),
        ConversionResult(
            path=Path("/w/datasets/pick/0123456789ab/dataset.npz"), sha256=SHA, size_bytes=123_456,
            sidecar_path=Path("/w/datasets/pick/0123456789ab/dataset.json"),
            norm_stats_path=Path("/w/datasets/pick/0123456789ab/norm_stats.json"), frequency_hz=29.97,
            n_episodes=2, total_steps=120, image_size=(224, 224),
            rejected=[{"stem": "b", "stage": "align", "code": "gap", "reason": "a 2 s hole"}], wall_time_s=4.5,
            metadata={"episode_lengths": {"min": 58, "max": 62}}, reused=True,
        ),
        UmiExport("/w/dataset.zarr.zip", "/w/dataset.zarr.zip.json", SHA, 999, 120, 2, (224, 224, 3), 80, 3,
                  "/w/dataset.npz", "ef" * 32),
        LeRobotExport(path=Path("/w/lerobot/pick/0123456789abcdef"), fps=29.97, n_episodes=2, total_frames=120,
                      video_keys=["observation.images.camera0"], image_size=[96, 64], action_rule="delta",
                      task="pick the cup", stems=["pick_0000", "pick_0001"], skipped={"pick_0002": "off rate"},
                      export_key="01" * 32, reused=True, codebase_version="v2.1"),
        OpenpiNormStatsFile("/w/lerobot/pick/x/norm_stats.json", "/w/lerobot/pick/x", 7, 7),
        RemoteDataset("/srv/pick/abcd/dataset.npz", SHA, 123_456, None, 29.97, "/w/dataset.npz"),
        SmokeRun(run_name=SPEC.name, run_dir="/srv/runs/smoke-a", host="gpu01", config_name="demo",
                 train_command=SPEC.train_command, gpu_ids=(0,), dataset_remote_path=SPEC.dataset_path,
                 dataset_sha256=SHA, frequency_hz=29.97, spec=SPEC, resume_check=ResumeCheckSize(2, 3)),
        TrainResult(run_name="train-a", run_dir="/srv/runs/train-a", launch_index=1, host=None, exit_code=0,
                    global_step=23, epoch=2, train_loss=0.125, dataset_sha256=SHA, dataset_local_path=None,
                    in_run_check=ReportedCheck(True, {"epochs": 3, "problems": ""})),
        _checkpoint(tmp_path),
        _evaluation(),
        SmokeRun(run_name=SPEC.name, run_dir="/shared/runs/smoke-a", host="login01", config_name="demo",
                 train_command=SPEC.train_command, dataset_remote_path=SPEC.dataset_path, dataset_sha256=SHA,
                 frequency_hz=29.97, spec=SPEC, resume_check=ResumeCheckSize(2, 2), launch_index=0, scheduler="slurm",
                 slurm_job_id="17", slurm_state="COMPLETED", slurm_exit_code="0:0", dataset_local_path="/w/dataset.npz"),
        TrainResult(run_name="train-s", run_dir="/shared/runs/train-s", launch_index=0, host="login01", exit_code=None,
                    global_step=39, epoch=1, train_loss=None, dataset_sha256=SHA, dataset_local_path="/w/dataset.npz",
                    scheduler="slurm", dataset_remote_path="/shared/pick/dataset.npz", frequency_hz=10.0,
                    slurm_job_id="18", slurm_state="FAILED", slurm_exit_code="1:0"),
        TrainResult(run_name="train-h", run_dir="/srv/runs/train-h", launch_index=0, host="10.0.0.1", exit_code=None,
                    global_step=None, epoch=None, train_loss=None, dataset_sha256=SHA, dataset_local_path=None,
                    scheduler="hosts", dataset_remote_path="/srv/pick/dataset.npz", frequency_hz=10.0,
                    ranks=(RankRun(0, "10.0.0.1", "/srv/runs/train-h", 0, False, False, True),
                           RankRun(1, "10.0.0.2", "/srv/runs/train-h", None, True, True, False))),
    ]


def test_to_dict_is_json_and_from_dict_restores_every_field(tmp_path):
    for result in _results(tmp_path):
        data = result.to_dict()
        text = json.dumps(data, allow_nan=False)  # JSON-safe: paths as strings, tuples as lists
        back = type(result).from_dict(json.loads(text))
        assert back == result, type(result).__name__
        for f in dataclasses.fields(result):  # compare=False fields too (metadata, rejected, reused)
            assert getattr(back, f.name) == getattr(result, f.name), (type(result).__name__, f.name)
        assert type(result).coerce(result) is result and type(result).coerce(data) == result


def test_nested_and_typed_fields_come_back_typed(tmp_path):
    smoke = SmokeRun.from_dict(json.loads(json.dumps(_results(tmp_path)[6].to_dict())))
    assert smoke.spec == SPEC and smoke.spec.kind == "smoke" and smoke.gpu_ids == (0,)
    assert smoke.resume_check == ResumeCheckSize(epochs=2, steps=3)
    conversion = ConversionResult.from_dict(_results(tmp_path)[1].to_dict())
    assert isinstance(conversion.path, Path) and conversion.image_size == (224, 224)
    assert conversion.frames_per_s == pytest.approx(120 / 4.5)
    evaluation = EvaluationResult.from_dict(_evaluation().to_dict())
    assert evaluation.held_out_episodes == (3, 7) and evaluation.gate["position_error_m"]["best_baseline"] == "hold"
    assert evaluation.beats_baseline and evaluation.gate["rotation_error_rad"]["required"] == pytest.approx(0.08)
    assert evaluation.mean_relative_action[1][2] == 0.02 and not dataclasses.replace(evaluation, gate={}).beats_baseline


@pytest.mark.parametrize("index", range(13))
def test_a_dict_missing_a_field_is_refused_naming_it(tmp_path, index):
    result = _results(tmp_path)[index]
    required = [f.name for f in dataclasses.fields(result)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    data = result.to_dict()
    name = required[len(required) // 2]
    del data[name]
    if isinstance(result, DownloadedCheckpoint) and name == "local_path":
        data.pop("path", None)
    with pytest.raises(ResultError) as info:
        type(result).from_dict(data)
    assert f"{type(result).__name__}: field {name!r} is missing" in str(info.value)
    assert info.value.code == "missing_field"


@pytest.mark.parametrize(("cls", "field", "value", "says"), [
    (ConversionResult, "size_bytes", "123456", "ConversionResult.size_bytes must be an integer, got '123456'"),
    (ConversionResult, "n_episodes", True, "ConversionResult.n_episodes must be an integer, got True"),
    (ConversionResult, "image_size", [224], "ConversionResult.image_size must have 2 items, got [224]"),
    (RemoteDataset, "frequency_hz", None, "RemoteDataset.frequency_hz must not be null"),
    (RemoteDataset, "frequency_hz", "30", "RemoteDataset.frequency_hz must be a number, got '30'"),
    (PairedEpisodes, "accepted", 2.0, "PairedEpisodes.accepted must be an integer, got 2.0"),
    (TrainResult, "in_run_check", {"passed": "yes", "metadata": {}}, "ReportedCheck.passed must be true or false"),
    (TrainResult, "ranks", [{"rank": 0, "run_dir": "/r"}], "RankRun: field 'host' is missing"),
    (TrainResult, "slurm_job_id", 18, "TrainResult.slurm_job_id must be a string, got 18"),
    (SmokeRun, "launch_index", "0", "SmokeRun.launch_index must be an integer, got '0'"),
])
def test_a_bad_value_is_refused_naming_the_field(tmp_path, cls, field, value, says):
    result = next(r for r in _results(tmp_path) if type(r) is cls)
    data = {**result.to_dict(), field: value}
    with pytest.raises(ResultError, match="^" + says.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        cls.from_dict(data)


def test_a_value_that_is_not_a_mapping_is_refused(tmp_path):
    with pytest.raises(ResultError, match="PairedEpisodes: expected a mapping, got 'x'"):
        PairedEpisodes.coerce("x")
    with pytest.raises(ResultError, match=r"SmokeRun.resume_check must be a mapping, got 2"):
        SmokeRun.from_dict({**_results(tmp_path)[6].to_dict(), "resume_check": 2})


def test_values_stored_by_the_previous_version_read_as_results(tmp_path):
    """The plain dicts the assets returned before their values were typed (their exact layouts)."""
    paired = PairedEpisodes.coerce({"manifest_path": "/m.json", "root": "/rec/pick", "task": "pick", "accepted": 2, "rejected": 1})
    assert paired == PairedEpisodes("/m.json", "/rec/pick", "pick", 2, 1)
    dataset = ConversionResult.coerce({
        "path": "/d/dataset.npz", "sha256": SHA, "size_bytes": 10, "sidecar_path": "/d/dataset.json",
        "norm_stats_path": "/d/norm_stats.json", "frequency_hz": 30, "n_episodes": 2, "total_steps": 120,
        "image_size": [224, 224],
    })
    assert dataset.path == Path("/d/dataset.npz") and dataset.frequency_hz == 30.0 and dataset.image_size == (224, 224)
    assert (dataset.rejected, dataset.metadata, dataset.reused) == ([], {}, False)
    lerobot = LeRobotExport.coerce({
        "path": "/l", "codebase_version": "v3.0", "fps": 30.0, "n_episodes": 2, "total_frames": 120,
        "video_keys": ["observation.images.camera0"], "image_size": [96, 64], "action_rule": "next_state",
        "task": "pick", "export_key": None,
    })
    assert lerobot.path == Path("/l") and lerobot.stems == [] and lerobot.export_key is None
    smoke = SmokeRun.coerce({
        "run_name": "smoke-a", "run_dir": "/srv/runs/smoke-a", "host": None, "config_name": "demo",
        "train_command": SPEC.train_command, "gpu_ids": [], "dataset_remote_path": SPEC.dataset_path,
        "dataset_sha256": SHA, "frequency_hz": 29.97, "spec": SPEC.to_dict(), "resume_check": {"epochs": 2, "steps": 2},
    })
    assert smoke.spec == SPEC and smoke.resume_check.steps == 2 and smoke.gpu_ids == ()
    train = TrainResult.coerce({
        "run_name": "train-a", "run_dir": "/r", "launch_index": 0, "host": None, "exit_code": None, "global_step": None,
        "epoch": None, "train_loss": None, "dataset_sha256": SHA, "dataset_local_path": "/d/dataset.npz",
        "in_run_check": {"passed": False, "metadata": {"problems": "epoch 2 of 3"}},
    })
    assert train.in_run_check == ReportedCheck(False, {"problems": "epoch 2 of 3"}) and train.exit_code is None
    checkpoint = DownloadedCheckpoint.coerce({
        "run_name": "train-a", "path": "/c/latest.ckpt", "sha256": SHA, "remote_path": "/srv/latest.ckpt",
        "remote_sha256": SHA, "size_bytes": 10, "local_dir": "/c", "log_path": None, "record_path": "/c/record.json",
        "normalizer_path": None, "choice": "latest", "dataset_local_path": "/d/dataset.npz",
    })
    assert (checkpoint.local_path, checkpoint.local_sha256, checkpoint.run_finished) == ("/c/latest.ckpt", SHA, None)
    assert checkpoint.dataset_local_path == "/d/dataset.npz" and checkpoint.already_present is False
    evaluation = EvaluationResult.coerce(_evaluation().to_dict() | {"checkpoint_sha256": "cd" * 32})
    assert evaluation == _evaluation()


def test_an_instance_with_an_old_materialization_runs_the_next_asset(tmp_path):
    """``dataset_npz`` stored by the previous version (a pickled dict) feeds today's ``remote_dataset``."""
    from dpflow_dagster.defs.dataset import dataset_npz
    from dpflow_dagster.defs.recordings import paired_episodes
    from dpflow_dagster.defs.remote import remote_dataset
    from dpflow_dagster.resources import GpuServerResource, ProductPathIOManager

    path = tmp_path / "datasets" / "pick_place" / "0123456789ab" / "dataset.npz"
    path.parent.mkdir(parents=True)
    np.savez(path, data__x=np.arange(6000, dtype=np.float64))  # a real archive: upload checks its CRC-32s
    path.with_suffix(".json").write_text(json.dumps({"task": "pick_place"}))
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    old_value = {
        "path": str(path), "sha256": sha, "size_bytes": path.stat().st_size, "sidecar_path": str(path.with_suffix(".json")),
        "norm_stats_path": str(path.with_name("norm_stats.json")), "frequency_hz": 29.97, "n_episodes": 3,
        "total_steps": 120, "image_size": [224, 224],
    }
    io = tmp_path / "io"
    (io / "dataset_npz").mkdir(parents=True)
    (io / "dataset_npz" / "pick_place").write_bytes(pickle.dumps(old_value))  # ProductPathIOManager's layout
    result = materialize_task(
        [paired_episodes, dataset_npz, remote_dataset], "pick_place", selection=[remote_dataset],
        resources={"io_manager": ProductPathIOManager(base_dir=str(io)),
                   "gpu_server": GpuServerResource(data_root=str(tmp_path / "server"))},
    )
    assert result.success
    value = result.output_for_node("remote_dataset")
    expected = tmp_path / "server" / "pick_place" / sha[:16] / "dataset.npz"
    assert value == RemoteDataset(str(expected), sha, path.stat().st_size, None, 29.97, str(path.resolve()), (str(expected),))
    assert expected.read_bytes() == path.read_bytes()
    with (io / "remote_dataset" / "pick_place").open("rb") as f:
        assert pickle.load(f) == value  # today's value: the typed result


def test_smoke_and_train_values_of_a_slurm_job_or_several_hosts_stored_by_the_previous_version():
    """The dicts ``smoke_run`` and ``train_run`` stored on a Slurm cluster and on several hosts (their layouts)."""
    layout = {"run_dir": "/shared/runs/x", "launch_index": 0, "host": "login01", "dataset_remote_path": SPEC.dataset_path,
              "dataset_sha256": SHA, "frequency_hz": 10, "dataset_local_path": "/w/dataset.npz"}
    smoke = SmokeRun.coerce({**layout, "run_name": "smoke-a", "scheduler": "slurm", "slurm_job_id": "17",
                             "config_name": "demo", "train_command": SPEC.train_command, "spec": SPEC.to_dict(),
                             "resume_check": {"epochs": 2, "steps": 2}})
    assert (smoke.scheduler, smoke.slurm_job_id, smoke.launch_index, smoke.gpu_ids) == ("slurm", "17", 0, ())
    assert (smoke.slurm_state, smoke.dataset_local_path, smoke.frequency_hz) == (None, "/w/dataset.npz", 10.0)
    train = {**layout, "run_name": "train-s", "global_step": 39, "epoch": 1, "train_loss": None, "in_run_check": None}
    slurm = TrainResult.coerce({**train, "scheduler": "slurm", "slurm_job_id": "18", "exit_code": "0:0"})
    assert (slurm.scheduler, slurm.slurm_job_id, slurm.slurm_exit_code, slurm.exit_code) == ("slurm", "18", "0:0", None)
    assert (slurm.global_step, slurm.epoch, slurm.dataset_remote_path, slurm.ranks) == (39, 1, SPEC.dataset_path, ())
    hosts = TrainResult.coerce({**train, "scheduler": "hosts", "slurm_job_id": None, "exit_code": None})
    assert (hosts.scheduler, hosts.slurm_exit_code, hosts.exit_code, hosts.ranks) == ("hosts", None, None, ())
    assert TrainResult.from_dict(slurm.to_dict()) == slurm  # today's form keeps the two exit codes apart
    with pytest.raises(ResultError, match="^TrainResult.launch_index must not be null"):
        TrainResult.coerce({**train, "launch_index": None, "scheduler": "slurm", "exit_code": "0:0"})


def test_the_values_of_a_slurm_job_and_of_several_hosts_from_their_scale_results():
    from dpflow_core.runs.scale import ScaleResult
    from dpflow_core.runs.slurm import SlurmJob
    from dpflow_core.server import SlurmSettings

    train_spec = dataclasses.replace(SPEC, name="train-h", kind="train")
    hosts = ScaleResult("hosts", "train", "train-h", False, (), run_dir="/srv/a/runs/train-h", problems=("rank 1 failed",),
                        hosts={"run_dirs": ["/srv/a/runs/train-h", "/srv/b/runs/train-h"], "exit_codes": [0, 3],
                               "failed_ranks": [1], "stopped_ranks": [], "tokens": ["t0", "t1"], "released": [True, False]},
                        epoch=1, global_step=11, launch_index=0)
    value = hosts.train_result(train_spec, host="a", dataset_sha256=SHA, dataset_local_path=None, hosts=["a", "b"])
    assert value.ranks == (RankRun(0, "a", "/srv/a/runs/train-h", 0, False, False, True),
                           RankRun(1, "b", "/srv/b/runs/train-h", 3, True, False, False))
    assert (value.scheduler, value.run_dir, value.global_step, value.epoch, value.exit_code) == ("hosts", "/srv/a/runs/train-h", 11, 1, None)
    assert (value.dataset_remote_path, value.frequency_hz, value.slurm_job_id) == (SPEC.dataset_path, 29.97, None)
    job = SlurmJob(spec=SPEC, run_dir="/shared/runs/smoke-a", state_dir="/shared/runs/smoke-a/dpflow/launch-1",
                   launch_index=1, job_id="21", token="t", settings=SlurmSettings(), nodes=1, gpus_per_node=0,
                   num_processes=1, command="srun ...", script_path="/s.sh", output_path="/o.txt", submitted_at="")
    slurm = ScaleResult("slurm", "smoke", "smoke-a", True, (), run_dir=job.run_dir, job_id="21", state="COMPLETED",
                        exit_code="0:0", release="released", job=job, launch_index=1)
    smoke = slurm.smoke_run(SPEC, "login01", ResumeCheckSize(2, 2), "/w/dataset.npz")
    assert (smoke.scheduler, smoke.slurm_job_id, smoke.slurm_state, smoke.slurm_exit_code) == ("slurm", "21", "COMPLETED", "0:0")
    assert (smoke.launch_index, smoke.run_dir, smoke.spec, smoke.gpu_ids) == (1, "/shared/runs/smoke-a", SPEC, ())
    assert SmokeRun.from_dict(json.loads(json.dumps(smoke.to_dict()))) == smoke


def test_a_train_run_stored_by_the_previous_version_feeds_checkpoint_and_natural_exit(tmp_path):
    """``train_run`` stored by the previous version (a pickled dict) is read by today's ``checkpoint`` and
    ``natural_exit``; and ``smoke_run`` of a Slurm job by ``resume_continuity``."""
    from test_runs import FAKE_TRAINER

    from dpflow_core.runs import RunSpec, launch_run
    from dpflow_core.server import GpuServer, ServerConfig
    from dpflow_dagster.defs import training as at
    from dpflow_dagster.resources import GpuServerResource, ProductPathIOManager

    remote_dataset = dg.AssetSpec("remote_dataset", partitions_def=at.smoke_run.partitions_def)  # not run here

    trainer, dataset = tmp_path / "fake_train.py", tmp_path / "dataset.npz"
    trainer.write_text(FAKE_TRAINER)
    dataset.write_bytes(b"stand-in dataset")
    spec = RunSpec(name="train-old", kind="train", dataset_path=str(dataset), frequency_hz=30.0, config_name="tiny",
                   epochs=2, max_train_steps=3, train_command=str(trainer))
    with GpuServer(ServerConfig.local(data_root=str(tmp_path / "server"))) as server:
        handle = launch_run(server, spec, method="setsid")
        assert server.wait_detached(handle.detached, 60.0).exit_code == 0
    old_train = {
        "run_name": "train-old", "run_dir": handle.run_dir, "launch_index": 0, "host": None, "exit_code": 0,
        "global_step": 5, "epoch": 1, "train_loss": 0.5, "dataset_sha256": SHA, "dataset_local_path": None,
        "in_run_check": None,
    }
    old_smoke = {
        "run_name": "smoke-a", "run_dir": "/shared/runs/smoke-a", "launch_index": 0, "host": None, "scheduler": "slurm",
        "slurm_job_id": "17", "dataset_remote_path": SPEC.dataset_path, "dataset_sha256": SHA, "frequency_hz": 29.97,
        "dataset_local_path": None, "config_name": "demo", "train_command": SPEC.train_command, "spec": SPEC.to_dict(),
        "resume_check": {"epochs": 2, "steps": 2},
    }
    io = tmp_path / "io"
    for name, old in (("train_run", old_train), ("smoke_run", old_smoke)):
        (io / name).mkdir(parents=True)
        (io / name / "pick_place").write_bytes(pickle.dumps(old))  # ProductPathIOManager's layout
    selection = (dg.AssetSelection.assets(at.checkpoint) | dg.AssetSelection.checks(at.train_run_natural_exit)
                 | dg.AssetSelection.checks(at.smoke_run_resume_continuity))
    result = materialize_task(
        [remote_dataset, at.smoke_run, at.train_run, at.checkpoint, at.train_run_natural_exit, at.smoke_run_resume_continuity],
        "pick_place", selection=selection,
        resources={"io_manager": ProductPathIOManager(base_dir=str(io)),
                   "gpu_server": GpuServerResource(data_root=str(tmp_path / "server"))},
        run_config=dg.RunConfig(ops={"checkpoint": at.CheckpointConfig(output_dir=str(tmp_path / "ckpt"),
                                                                       stable_interval_s=0.1)}),
    )
    assert result.success
    [meta] = [e.step_materialization_data.materialization.metadata for e in result.get_asset_materialization_events()]
    assert meta["train_run/run_name"].value == "train-old" and meta["train_run/run_dir"].value == handle.run_dir
    assert (meta["global_step"].value, meta["epoch"].value, meta["train_loss"].value) == (5, 1, 0.5)
    assert meta["dataset_sha256"].value == SHA and meta["run_finished"].value is True
    value = result.output_for_node("checkpoint")
    assert value.run_name == "train-old" and value.dataset_local_path is None
    checks = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert checks["natural_exit"].passed and checks["natural_exit"].metadata["last_global_step"].value == 5
    assert checks["natural_exit"].metadata["reported_from_run"].value is False
    continuity = checks["resume_continuity"]
    assert not continuity.passed and continuity.severity == dg.AssetCheckSeverity.WARN
    assert continuity.description.startswith("not checked on a Slurm cluster")

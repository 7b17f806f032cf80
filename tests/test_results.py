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
import pytest

from dpflow_core.checkpoints import DownloadedCheckpoint
from dpflow_core.conversion import ConversionResult
from dpflow_core.errors import ResultError
from dpflow_core.evaluation import PREDICTORS, EvaluationResult
from dpflow_core.export import LeRobotExport, OpenpiNormStatsFile
from dpflow_core.export.umi import UmiExport
from dpflow_core.pairing import PairedEpisodes
from dpflow_core.runs import ReportedCheck, ResumeCheckSize, SmokeRun, TrainResult, smoke_spec
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
        mean_action=(0.1, 0.2, 0.3, 0.0, 0.0, 0.0, 0.05), gripper_threshold_m=0.04, margin=0.2,
        trajectory_plot="/e/t.png", error_plot="/e/e.png", loss_plot=None, out_dir="/e", seconds=3.5,
        notes=("no training log",), checkpoint_sha256="cd" * 32,
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
    assert evaluation.held_out_episodes == (3, 7) and evaluation.best_baseline == "hold"
    assert evaluation.beats_baseline and evaluation.required_mse == pytest.approx(0.08)


@pytest.mark.parametrize("index", range(10))
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
])
def test_a_bad_value_is_refused_naming_the_field(tmp_path, cls, field, value, says):
    [result] = [r for r in _results(tmp_path) if type(r) is cls]
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
    path.write_bytes(os.urandom(50_000))
    path.with_suffix(".json").write_text(json.dumps({"task": "pick_place"}))
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    old_value = {
        "path": str(path), "sha256": sha, "size_bytes": 50_000, "sidecar_path": str(path.with_suffix(".json")),
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
    assert value == RemoteDataset(str(expected), sha, 50_000, None, 29.97, str(path.resolve()), (str(expected),))
    assert expected.read_bytes() == path.read_bytes()
    with (io / "remote_dataset" / "pick_place").open("rb") as f:
        assert pickle.load(f) == value  # today's value: the typed result

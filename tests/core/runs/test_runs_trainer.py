"""The built-in trainer under dpflow's runs, on the CPU over the local transport:
a smoke run end to end, the natural-exit check, and the resume-continuity check."""

from __future__ import annotations

import json
import subprocess

import pytest
from synthetic_dataset import write_synthetic_dataset

from dpflow_core.server import GpuServer, ServerConfig
from dpflow_core.runs import (
    check_natural_exit,
    check_resume_continuity,
    compare_logs,
    load_handle,
    read_run_config,
    run_smoke,
    smoke_spec,
    SmokeSettings,
)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "dataset.npz"
    return str(write_synthetic_dataset(path, n_episodes=4, episode_length=40, image_size=(32, 32), frequency_hz=10.0))


@pytest.fixture()
def server(tmp_path):
    # A repository of its own: the shared checkout may get new commits while a test runs,
    # which the continuity check would rightly report.
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=dpflow", "-c", "user.email=dpflow@localhost"]
    subprocess.run(git + ["init", "-q"], check=True)
    (repo / "README").write_text("training repository\n")
    subprocess.run(git + ["add", "README"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "initial"], check=True)
    with GpuServer(ServerConfig.local(data_root=str(tmp_path / "server"), repo_path=str(repo))) as srv:
        yield srv


@pytest.mark.slow
def test_smoke_run_on_cpu_end_to_end(server, dataset):
    spec = smoke_spec("smoke-cpu", dataset, 10.0, SmokeSettings(max_train_steps=3, batch_size=4), config_name="tiny")
    result = run_smoke(server, spec, timeout_s=300)
    assert result.passed, (result.problems, result.output_tail)
    assert result.exit_code == 0 and result.finite_losses == 3 and result.checkpoints == ()
    assert result.release.passed and result.release.gpu_status == "no_gpu"
    assert result.release.metadata()["gpu"] == "CPU run: GPU release not checked" and result.release.verdict == "warn"
    handle = result.handle
    cfg = read_run_config(server, handle.run_dir)
    assert cfg["checkpoint"]["save_last_ckpt"] is False and cfg["checkpoint"]["topk"]["k"] == 0
    assert cfg["logging"]["mode"] == "offline" and cfg["training"]["resume"] is False
    assert cfg["task"]["dataset_frequeny"] == 10.0 and cfg["dataloader"]["batch_size"] == 4
    assert server.exists(f"{handle.run_dir}/wandb"), "W&B files belong in the run directory"
    assert "--cpu --num_processes 1" in handle.command
    record = json.loads(server.read_text(f"{handle.state_dir}/record.json"))
    assert record["repo"]["commit"] and record["exit_code"] == 0 and record["nvidia_smi"]["status"] == "no_gpu"


@pytest.mark.slow
def test_resume_continuity_passes_and_the_full_run_exits_naturally(server, dataset):
    base = smoke_spec("cont", dataset, 10.0, SmokeSettings(batch_size=4), config_name="tiny")
    report = check_resume_continuity(server, base, epochs=2, steps_per_epoch=2)
    assert report.passed, (report.problems, report.mismatches)
    # epoch 1 = global steps 2, 3 plus its summary line
    assert report.resume_step == 2 and report.compared == 3
    assert report.max_loss_rel_diff <= 1e-6 and report.max_lr_rel_diff == 0.0
    assert report.commit

    full = load_handle(server, "cont-resume-full")
    natural = check_natural_exit(server, full)
    assert natural.passed, natural.problems
    assert natural.checkpoint.format == "dpflow-train-checkpoint" and natural.checkpoint.epoch == 2
    assert (natural.batches_per_epoch, natural.last_global_step) == (2, 3)
    # the checkpoint counts what is done, the log from 0: said so, not as a second "epoch 2, global_step 4"
    assert natural.checkpoint.describe().endswith("saved after 2 epoch(s), 4 step(s)")

    # The comparison does see a schedule that does not continue.
    from dpflow_core.logs import parse_log_text

    a = parse_log_text(server.read_text(f"{full.run_dir}/logs.json.txt"))
    b = [dict(r, lr=r["lr"] + 1e-5) if r["global_step"] == 3 else r for r in a]
    compared, _, max_lr, mismatches = compare_logs(a, b, 2)
    assert compared == 3 and max_lr > 1e-3 and any("step 3: lr" in m for m in mismatches)


@pytest.mark.slow
def test_a_trainer_refusing_its_config_is_named_not_the_launcher(server, dataset):
    """The built-in trainer under accelerate's launcher refuses a bad setting with its own ``error:`` line, and the
    launcher's traceback ends with a ``subprocess.CalledProcessError`` below it. The run's problem used to quote
    that last line, a command line of overrides; it now quotes the trainer's reason."""
    spec = smoke_spec("bad-precision", dataset, 10.0,
                      SmokeSettings(max_train_steps=2, batch_size=4, extra_overrides=("training.mixed_precision=bf17",)),
                      config_name="tiny")
    result = run_smoke(server, spec, timeout_s=300)
    assert not result.passed and result.exit_code not in (0, None)
    (problem,) = [p for p in result.problems if p.startswith("exit status")]
    assert "error: training.mixed_precision must be one of" in problem and "got 'bf17'" in problem, problem
    assert "CalledProcessError" not in problem
    assert "subprocess.CalledProcessError" in result.output_tail  # the launcher's line is there, and not quoted

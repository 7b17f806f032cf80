"""`dpflow smoke`, `train`, `checkpoint` and `evaluate`: verdicts and exit statuses (local transport)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from conftest import kill_tmux_server, tmux_socket, train_in_process
from test_runs import FAKE_TRAINER
from typer.testing import CliRunner

from dpflow_core.cli import app
from dpflow_core.runs import SmokeRun, TrainResult

TMUX_SOCKET = tmux_socket("runs-cli")
runner = CliRunner()


@pytest.fixture(scope="module", autouse=True)
def _private_tmux_server():
    yield
    kill_tmux_server(TMUX_SOCKET)


@pytest.fixture()
def env(tmp_path, monkeypatch):
    # The CLI's local transport takes the tmux socket from the default config; keep sessions private.
    from dpflow_core import server as remote

    original = remote.ServerConfig.local.__func__

    def local(cls, **overrides):
        overrides.setdefault("tmux_socket", TMUX_SOCKET)
        return original(cls, **overrides)

    monkeypatch.setattr(remote.ServerConfig, "local", classmethod(local))
    trainer = tmp_path / "fake_train.py"
    trainer.write_text(FAKE_TRAINER)
    dataset = tmp_path / "dataset.npz"
    dataset.write_bytes(b"stand-in dataset")
    return {"trainer": str(trainer), "dataset": str(dataset), "root": str(tmp_path / "server"), "tmp": tmp_path}


def invoke(*args):
    result = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
    return result.exit_code, result.output


@pytest.mark.slow
def test_smoke_prints_the_verdicts_and_fails_on_a_leftover(env):
    common = ["--remote-dir", env["root"], "--train-command", env["trainer"], "--frequency", "30"]
    code, out = invoke("smoke", env["dataset"], "--run-name", "cli-ok", *common)
    assert code == 0, out
    assert "[PASS] smoke run: exit 0, 3 finite train_loss, no checkpoint" in out
    assert "[WARN] released: CPU run: GPU release not checked (no GPU present); no process of the run is left" in out
    code, out = invoke("smoke", env["dataset"], "--run-name", "cli-leak", "--override", "fake.mode=leave_child", *common)
    assert code == 1
    assert "[PASS] smoke run" in out and "[FAIL] released: CPU run: GPU release not checked (no GPU present); leftover processes: pid" in out and "(sleep 300)" in out
    assert "cleanup: terminated ['pid" in out
    code, out = invoke("smoke", env["dataset"], "--run-name", "cli-json", "--json", *common)
    assert code == 0, out
    value = SmokeRun.from_dict(json.loads(out)["smoke_run"])  # what the smoke_run asset hands on
    assert (value.run_name, value.run_dir, value.gpu_ids, value.launch_index) == ("cli-json", f"{env['root']}/runs/cli-json", (), 0)
    assert value.spec.train_command == env["trainer"] and value.frequency_hz == 30.0 and value.scheduler == "single"


@pytest.mark.slow
def test_train_then_checkpoint_then_an_oom_run(env):
    common = ["--remote-dir", env["root"], "--train-command", env["trainer"], "--frequency", "30"]
    code, out = invoke("train", env["dataset"], "--run-name", "cli-train", "--epochs", 2, "--max-train-steps", 3, "--poll", 0.2,
                       "--json", *common)
    assert code == 0, out
    line = next(ln for ln in out.splitlines() if ln.startswith("DPFLOW_JSON "))
    value = TrainResult.from_dict(json.loads(line.split(" ", 1)[1])["train_run"])  # what the train_run asset hands on
    assert (value.run_name, value.launch_index, value.exit_code, value.global_step, value.epoch) == ("cli-train", 0, 0, 5, 1)
    assert value.run_dir == f"{env['root']}/runs/cli-train" and value.dataset_remote_path == env["dataset"]
    assert "launched cli-train\n" in out and "  tmux session:   cli-train\n" in out
    assert f"  run directory:  {env['root']}/runs/cli-train\n" in out
    assert f"  W&B directory:  {env['root']}/runs/cli-train/wandb\n" in out
    assert "[WARN] GPU release: CPU run: GPU release not checked" in out
    assert "[PASS] natural exit: exit 0, last logged epoch 1, global_step 5; " in out
    shown = re.findall(r"^  epoch (\d+) step (\d+) ", out, re.M)
    assert shown and len(shown) == len(set(shown)), shown  # each step's line once (an epoch summary repeated it)
    code, out = invoke("checkpoint", "cli-train", "--remote-dir", env["root"], "-o", env["tmp"] / "ckpts")
    assert code == 0, out
    assert "[PASS] checkpoint sha256" in out and str(env["tmp"] / "ckpts" / "cli-train") in out
    code, out = invoke("train", env["dataset"], "--run-name", "cli-oom", "--override", "fake.mode=oom", "--poll", 0.2, *common)
    assert code == 1
    assert "[FAIL] natural exit: exit status 1" in out
    assert "1. Leftovers first" in out and "6. Mixed precision last" in out


@pytest.mark.slow
def test_train_without_run_name_reattaches_to_the_running_training_of_the_dataset(env):
    from dpflow_core.files import sha256_file

    common = ["--remote-dir", env["root"], "--train-command", env["trainer"], "--frequency", "30"]
    code, out = invoke("train", env["dataset"], "--detach", "--epochs", 2, "--max-train-steps", 4,
                       "--override", "fake.step_s=0.5", *common)
    assert code == 0, out
    [name] = re.findall(r"^launched (train-[0-9a-f]{12}-\d{8}T\d{6}Z)$", out, re.M)
    assert name.startswith(f"train-{sha256_file(env['dataset'])[:12]}-")
    assert f"  tmux session:   {name}\n" in out and f"  W&B directory:  {env['root']}/runs/{name}/wandb\n" in out
    code, out = invoke("train", env["dataset"], "--poll", 0.2, *common)  # no --run-name: the same run, followed
    assert code == 0, out
    assert f"attached to {name}\n" in out and "launched" not in out
    assert "[PASS] natural exit: exit 0, last logged epoch 1, global_step 7; " in out
    assert os.listdir(Path(env["root"]) / "runs") == [name]  # no second run


def test_evaluate_exit_status_follows_the_gate_and_fails_for_an_untrained_policy(tmp_path, tiny_checkpoint):
    # the session's briefly trained checkpoint (read-only: the results go to a folder of this test)
    dataset, results = tiny_checkpoint.dataset, tmp_path / "evaluation"
    code, out = invoke("evaluate", tiny_checkpoint.checkpoint, "--dataset", dataset, "--samples-per-episode", 8, "-o", results)
    # A briefly trained absolute-pose policy need not beat holding the pose: the verdict, the exit
    # status and evaluation.json must agree, with the four figures printed.
    saved = json.loads((results / "evaluation.json").read_text())
    assert code == (0 if saved["beats_baseline"] else 1), out
    pos = saved["gate"]["position_error_m"]
    assert f"[{'PASS' if saved['beats_baseline'] else 'FAIL'}] beats baselines: position_error_m {pos['policy']:.4g} vs required < {pos['required']:.4g}" in out
    assert "| MSE, mixed units (not gated) |" in out and (results / "trajectories.png").is_file()
    assert not (tiny_checkpoint.checkpoint.parent / "evaluation").exists()
    untrained = train_in_process(
        dataset, tmp_path / "untrained", "optimizer.lr=0.0", "policy.noise_scheduler.prediction_type=epsilon",
        "training.num_epochs=1", "training.max_train_steps=1",
    )
    code, out = invoke("evaluate", untrained, "--dataset", dataset, "--samples-per-episode", 8)
    assert code == 1 and "[FAIL] beats baselines" in out

"""The lab's own training repository (issue 14): an upstream-style ``train.py`` over both transports.

The repository is a git checkout whose ``train.py`` is tests/upstream_trainer.py, a stand-in of
ours for upstream Diffusion Policy / UMI's ``train.py``: same command line, same run directory,
workspace checkpoints saved with ``torch.save(..., pickle_module=dill)``. dpflow launches it
with the ``upstream`` template, the checkpoint probe loads its checkpoints with the server's
Python, the natural-exit (completion) check fails when the optimizer state is missing, and the
resume-continuity check passes on a real resume of it and fails when the restore loses state.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import dill
import pytest
import torch
from sshd import sshd_server  # noqa: F401  (fixture)

from conftest import kill_tmux_server, tmux_socket
from dpflow_core.logs import parse_log_text
from dpflow_core.runs import (
    UPSTREAM_TRAIN_COMMAND, RunSpec, check_natural_exit, check_resume_continuity, launch_run, list_checkpoints,
    load_handle, monitor_run, probe_checkpoint, smoke_spec, SmokeSettings,
)
from dpflow_core.server import GpuServer, ServerConfig

TESTS = Path(__file__).resolve().parents[2]  # tests/, beside the helper modules
TMUX_SOCKET = tmux_socket("upstream")
UMI_CONFIG = "train_diffusion_unet_timm_umi_workspace"
TOPK_NAME = re.compile(r"^epoch=\d{4}-train_loss=\d+\.\d{3}\.ckpt$")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _private_tmux_server():
    yield
    kill_tmux_server(TMUX_SOCKET)


@pytest.fixture(scope="module")
def umi_checkout(tmp_path_factory) -> Path:
    """A git checkout standing in for the lab's UMI repository: ``train.py`` at its root."""
    repo = tmp_path_factory.mktemp("universal_manipulation_interface")
    shutil.copyfile(TESTS / "upstream_trainer.py", repo / "train.py")
    git = ["git", "-C", str(repo), "-c", "user.name=lab", "-c", "user.email=lab@localhost"]
    subprocess.run(git + ["init", "-q", "-b", "main"], check=True)
    subprocess.run(git + ["add", "train.py"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "umi"], check=True)
    return repo


def server_config(request, tmp_path: Path, umi_checkout: Path, transport: str) -> ServerConfig:
    """The lab's server over ``transport`` ("local" or "ssh", the test sshd), its repository the UMI checkout.

    Each test runs over one transport: every run pays a trainer launch and a checkpoint probe (torch
    imported in each), and what differs between the transports (commands, files, the probe) is the
    same for every test. Over SSH: the passing resume continuity and one failing restore; locally:
    the complete run, the completion check and the other failing restore.
    """
    values = dict(data_root=str(tmp_path / "server"), python=sys.executable, repo_path=str(umi_checkout),
                  tmux_socket=TMUX_SOCKET)
    if transport == "local":
        return ServerConfig.local(**values)
    # This machine has no GPU: the SSH server's GPU requirement is switched off explicitly.
    return request.getfixturevalue("sshd_server").server_config(**values, expect_gpu=False)


@pytest.fixture()
def dataset(tmp_path) -> str:
    path = tmp_path / "dataset.zarr.zip"
    path.write_bytes(b"stand-in dataset")
    return str(path)


def _spec(name: str, dataset: str, *extra: str) -> RunSpec:
    return RunSpec(
        name=name, kind="train", dataset_path=dataset, frequency_hz=59.94, config_name=UMI_CONFIG, epochs=2,
        max_train_steps=3, train_command="upstream", extra_overrides=tuple(extra),
    )


def test_upstream_train_py_runs_to_a_complete_checkpoint(request, tmp_path, umi_checkout, dataset):
    with GpuServer(server_config(request, tmp_path, umi_checkout, "local")) as server:
        handle = launch_run(server, _spec("umi-ok", dataset))
        assert handle.spec.train_command == UPSTREAM_TRAIN_COMMAND
        assert f"train.py --config-name={UMI_CONFIG} " in handle.command
        for override in (f"task.dataset_path={dataset}", "task.dataset_frequeny=59.94", "training.num_epochs=2",
                         "training.max_train_steps=3", f"hydra.run.dir={handle.run_dir}", "logging.name=umi-ok"):
            assert f" {override}" in handle.command
        result = monitor_run(server, handle, poll_s=0.2, stall_timeout_s=120, timeout_s=300)
        assert result.ok, result.message
        report = check_natural_exit(server, handle)
        assert report.passed, (report.problems, report.output_tail)
        # 2 epochs x 3 batches, counted from the per-batch log lines (upstream writes no summary lines)
        assert (report.batches_per_epoch, report.last_epoch, report.last_global_step) == (3, 1, 5)
        probe = report.checkpoint
        assert probe.format == "upstream-workspace" and probe.loaded_with == "torch.load(pickle_module=dill)"
        assert probe.state_dicts == ("ema_model", "model", "optimizer")
        assert probe.pickles == ("_output_dir", "epoch", "global_step") and probe.entries == ("cfg", "pickles", "state_dicts")
        assert (probe.epoch, probe.global_step) == (1, 6)
        names = list_checkpoints(server, handle.run_dir)
        assert "latest.ckpt" in names and len([n for n in names if TOPK_NAME.match(n)]) == 2

    # independent ground truth: the file itself, loaded here the way upstream does
    with open(f"{handle.checkpoint_dir}/latest.ckpt", "rb") as fh:
        payload = torch.load(fh, map_location="cpu", pickle_module=dill, weights_only=False)
    assert sorted(payload["state_dicts"]) == list(probe.state_dicts)
    assert dill.loads(payload["pickles"]["global_step"]) == probe.global_step
    assert payload["cfg"].training.num_epochs == 2 and payload["cfg"].name == UMI_CONFIG


def test_checkpoint_without_optimizer_state_fails_the_completion_check(request, tmp_path, umi_checkout, dataset):
    with GpuServer(server_config(request, tmp_path, umi_checkout, "local")) as server:
        handle = launch_run(server, _spec("umi-no-optimizer", dataset, "standin.drop=optimizer"))
        assert monitor_run(server, handle, poll_s=0.2, stall_timeout_s=120, timeout_s=300).ok
        report = check_natural_exit(server, handle)
        topk = [n for n in list_checkpoints(server, handle.run_dir) if TOPK_NAME.match(n)]
        assert len(topk) == 2
        assert probe_checkpoint(server, f"{handle.checkpoint_dir}/{topk[0]}").missing == ("optimizer",)
    assert not report.passed
    assert report.exit_code == 0 and report.last_global_step == 5  # the run itself ended well
    [problem] = report.problems
    assert problem.startswith("latest.ckpt: ") and "not loadable: missing entries: optimizer" in problem
    assert "(state_dicts: ema_model, model)" in problem


def test_a_checkpoint_the_servers_python_cannot_load_is_not_complete(tmp_path):
    import zipfile

    with GpuServer(ServerConfig.local(data_root=str(tmp_path / "server"))) as server:
        bad = f"{server.data_root}/not-a-checkpoint.ckpt"
        server.mkdir(server.data_root)
        local = tmp_path / "bad.ckpt"
        with zipfile.ZipFile(local, "w") as z:  # an intact zip (CRCs fine) that holds no checkpoint
            z.writestr("archive/data.pkl", b"not a pickle")
        server.put(local, bad)
        probe = probe_checkpoint(server, bad)
    assert probe.zip_ok and not probe.loadable
    assert probe.error.startswith("cannot be loaded with the server's Python: ")


def _continuity(server, dataset, *extra):
    base = smoke_spec("umi-cont", dataset, 59.94, SmokeSettings(train_command="upstream", batch_size=4,
                                                                 extra_overrides=extra), config_name=UMI_CONFIG)
    return check_resume_continuity(server, base, epochs=2, steps_per_epoch=3, timeout_s=300)


def test_resume_continuity_of_the_upstream_trainer(request, tmp_path, umi_checkout, dataset):
    with GpuServer(server_config(request, tmp_path, umi_checkout, "ssh")) as server:
        report = _continuity(server, dataset)
        full = parse_log_text(server.read_text(f"{load_handle(server, report.full_run).run_dir}/logs.json.txt"))
        cont = parse_log_text(server.read_text(f"{load_handle(server, report.resumed_run).run_dir}/logs.json.txt"))
    assert report.passed, (report.problems, report.mismatches)
    # the first epoch's top-k file held global_step 3 (3 batches done): epoch 1 is steps 3, 4, 5
    assert report.resume_step == 3 and report.compared == 3 and report.commit
    assert report.max_loss_rel_diff == 0.0 and report.max_lr_rel_diff == 0.0  # CPU, same ops: bit for bit
    # independent ground truth: the two logs as the trainer wrote them
    assert [r["global_step"] for r in cont] == [3, 4, 5] and [r["epoch"] for r in cont] == [1, 1, 1]
    assert cont == full[3:]
    assert len({r["lr"] for r in full}) == 6 and len({r["train_loss"] for r in cont}) == 3  # schedule and loss move


@pytest.mark.parametrize("fault, transport", [("standin.restore=model,ema_model", "ssh"),
                                              ("standin.reset_global_step=true", "local")])
def test_resume_continuity_fails_when_the_restore_loses_state(request, tmp_path, umi_checkout, dataset, fault, transport):
    with GpuServer(server_config(request, tmp_path, umi_checkout, transport)) as server:
        report = _continuity(server, dataset, fault)
    assert not report.passed
    text = "; ".join(report.mismatches)
    if fault.startswith("standin.restore"):
        # a fresh AdamW state: the first resumed batch's loss (before its update) agrees, the next ones do not;
        # the schedule follows global_step, which was restored
        assert not report.problems  # both runs ended well; their logs disagree
        assert report.compared == 3 and report.max_lr_rel_diff == 0.0 and report.max_loss_rel_diff > 1e-3
        assert "step 4: train_loss" in text and "step 3:" not in text
    else:
        # global_step restarted at 0: the resumed log holds steps 0-2, the uninterrupted one 3-5
        assert report.mismatches[0] == ("the resumed run logged global_step 0-2, before the checkpoint's "
                                        "global_step 3: its step counter did not continue")
        assert "only uninterrupted [(3, False), (4, False), (5, False)]" in text
        assert report.compared == 0 and report.problems == ("the resumed run logged nothing to compare",)

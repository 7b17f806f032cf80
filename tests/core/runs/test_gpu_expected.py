"""A broken GPU is a failure, not a CPU run (issue 14).

Over SSH (the tests' real sshd) or with ``expect_gpu``, a missing, failing or empty
``nvidia-smi`` (tests/fake_nvidia_smi.py, the real tool's messages and exit statuses)
fails preflight as a problem and refuses smoke and train, naming the command, its exit
status and its output. On the local transport without a GPU, the CPU path runs and says
"CPU run: GPU release not checked" as a WARN. Requested GPU ids that are busy or absent
are refused with what runs on them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_nvidia_smi import DRIVER_FAILURE, H200_APPS, H200_GPUS, NO_DEVICES, write_fake_nvidia_smi
from sshd import sshd_server  # noqa: F401  (fixture)
from test_runs import FAKE_TRAINER
from typer.testing import CliRunner

from conftest import kill_tmux_server, tmux_socket
from dpflow_core.cli import app
from dpflow_core.errors import RunError
from dpflow_core.runs import (
    CPU_CONFIG_NAME, CPU_RUN_NOTE, GPU_CONFIG_NAME, choose_gpus, launch_run, load_handle, resolve_config_name, smoke_spec, SmokeSettings,
)
from dpflow_core.server import GpuInventory, GpuServer, ServerConfig, parse_compute_apps, parse_gpu_query
from dpflow_core.server.preflight import preflight

REPO = Path(__file__).resolve().parents[3]
TMUX_SOCKET = tmux_socket("gpu-expected")
runner = CliRunner()

#: mode -> (exit status the shell reports, text that must be named)
FAILURES = {
    "driver": (9, DRIVER_FAILURE),
    "no_devices": (6, NO_DEVICES),
    "empty": (0, "lists none"),
    "absent": (127, "not found"),
}


@pytest.fixture(scope="module", autouse=True)
def _private_tmux_server():
    yield
    kill_tmux_server(TMUX_SOCKET)


def _smi(tmp_path: Path, mode: str) -> str:
    if mode == "absent":
        return str(tmp_path / "nowhere" / "nvidia-smi")
    return str(write_fake_nvidia_smi(tmp_path / f"smi-{mode}", mode=mode))


@pytest.fixture()
def files(tmp_path):
    trainer = tmp_path / "fake_train.py"
    trainer.write_text(FAKE_TRAINER)
    dataset = tmp_path / "dataset.npz"
    dataset.write_bytes(b"stand-in dataset")
    return str(trainer), str(dataset)


def _assert_names_the_failure(text: str, smi: str, mode: str) -> None:
    exit_code, output = FAILURES[mode]
    assert f"`{smi} --query-gpu=index,uuid,name" in text  # the command
    assert f"status {exit_code}" in text  # its exit status
    assert output in text  # what it printed


# ----------------------------------------------------------------------- SSH transport


@pytest.mark.sshd
@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(FAILURES))
def test_broken_gpu_over_ssh_fails_preflight_and_refuses_smoke_and_train(sshd_server, tmp_path, files, mode):
    trainer, dataset = files
    smi = _smi(tmp_path, mode)
    # The system python3 (no torch) keeps preflight quick; the GPU problem is what is checked here.
    config = sshd_server.server_config(
        data_root=str(tmp_path / "server"), python="python3", nvidia_smi=smi, tmux_socket=TMUX_SOCKET,
    )
    assert config.expect_gpu is None and config.gpu_expected  # SSH: a GPU is expected by default
    with GpuServer(config) as server:
        report = preflight(server)
        assert not report.ok and report.gpu_expected
        [problem] = [p for p in report.problems if p.startswith("gpu:")]
        _assert_names_the_failure(problem, smi, mode)
        assert report.to_metadata()["preflight/ok"] is False

        inventory = server.gpu_inventory()
        assert inventory.exit_code == FAILURES[mode][0] and inventory.command.startswith(smi)
        with pytest.raises(RunError) as auto:
            resolve_config_name("auto", inventory, server)  # never the CPU config over SSH
        assert auto.value.code == "gpu_unavailable" and "local transport" in auto.value.reason
        spec = smoke_spec("smoke-refused", dataset, 30.0, SmokeSettings(train_command=trainer), config_name="tiny")
        with pytest.raises(RunError) as refused:
            launch_run(server, spec)
        assert refused.value.code == "gpu_unavailable"
        _assert_names_the_failure(refused.value.reason, smi, mode)
        assert not server.exists(f"{server.data_root}/runs/smoke-refused")  # nothing was created

    connection = [*sshd_server.cli_args(), "--remote-dir", str(tmp_path / "server"), "--python", "python3",
                  "--nvidia-smi", smi]
    for command in (["smoke", dataset, "--frequency", "30"], ["train", dataset, "--frequency", "30", "--detach"]):
        result = runner.invoke(app, [*command, "--train-command", trainer, *connection])
        assert isinstance(result.exception, RunError), result.output
        assert result.exception.code == "gpu_unavailable"
        _assert_names_the_failure(result.exception.reason, smi, mode)
    assert not (tmp_path / "server" / "runs").exists() or not os.listdir(tmp_path / "server" / "runs")


@pytest.mark.sshd
@pytest.mark.slow
def test_cli_prints_the_refusal_in_one_line_and_exits_2(sshd_server, tmp_path, files):
    trainer, dataset = files
    smi = _smi(tmp_path, "driver")
    run = [sys.executable, "-c", "from dpflow_core.cli import main; main()", "smoke", dataset, "--frequency", "30",
           "--train-command", trainer, *sshd_server.cli_args(), "--remote-dir", str(tmp_path / "server"),
           "--python", sys.executable, "--nvidia-smi", smi]
    out = subprocess.run(run, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, (out.stdout, out.stderr)
    [line] = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert "refusing to start on" in line and f"{sshd_server.host}:{sshd_server.port}" in line
    _assert_names_the_failure(line, smi, "driver")

    # --no-expect-gpu opts out explicitly: preflight then warns instead of failing
    pre = subprocess.run(
        [sys.executable, "-c", "from dpflow_core.cli import main; main()", "preflight", "--json", "--no-expect-gpu",
         *sshd_server.cli_args(), "--remote-dir", str(tmp_path / "server"), "--python", sys.executable,
         "--nvidia-smi", smi],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert pre.returncode == 0, pre.stderr
    data = json.loads(pre.stdout)
    assert data["ok"] and data["gpu_expected"] is False and data["gpus"]["status"] == "error"
    assert any(DRIVER_FAILURE in w for w in data["warnings"])


# --------------------------------------------------------------------- local transport


@pytest.mark.slow
def test_expect_gpu_on_the_local_transport_refuses_too(tmp_path, files):
    trainer, dataset = files
    smi = _smi(tmp_path, "driver")
    config = ServerConfig.local(data_root=str(tmp_path / "server"), nvidia_smi=smi, expect_gpu=True, tmux_socket=TMUX_SOCKET,
                                python="python3")
    with GpuServer(config) as server:
        report = preflight(server)
        assert not report.ok
        [problem] = [p for p in report.problems if p.startswith("gpu:")]
        _assert_names_the_failure(problem, smi, "driver")
        with pytest.raises(RunError) as refused:
            launch_run(server, smoke_spec("smoke-local-refused", dataset, 30.0, SmokeSettings(train_command=trainer)))
    assert refused.value.code == "gpu_unavailable"
    with GpuServer(ServerConfig.local(data_root=str(tmp_path / "server"), nvidia_smi=smi)) as server:
        report = preflight(server)  # not expected locally: a warning that names the failure
        assert report.ok and not report.gpu_expected and any(DRIVER_FAILURE in w for w in report.warnings)
        assert resolve_config_name("auto", server.gpu_inventory(), server) == CPU_CONFIG_NAME


@pytest.mark.slow
def test_local_cpu_run_is_a_warn_saying_gpu_release_not_checked(tmp_path, files, monkeypatch):
    trainer, dataset = files
    from dpflow_core import server as remote

    original = remote.ServerConfig.local.__func__
    monkeypatch.setattr(remote.ServerConfig, "local", classmethod(
        lambda cls, **kw: original(cls, **{"tmux_socket": TMUX_SOCKET, "nvidia_smi": _smi(tmp_path, "absent"), **kw})))
    root = tmp_path / "server"
    result = runner.invoke(app, ["smoke", dataset, "--run-name", "cpu-smoke", "--frequency", "30",
                                 "--train-command", trainer, "--remote-dir", str(root)], catch_exceptions=False)
    assert result.exit_code == 0, result.output  # a WARN does not fail the command
    assert f"[WARN] released: {CPU_RUN_NOTE} (no GPU present); no process of the run is left" in result.output
    assert "[PASS] released" not in result.output
    assert "GPUs:           none (CPU run)" in result.output
    with GpuServer(ServerConfig.local(data_root=str(root))) as server:
        handle = load_handle(server, "cpu-smoke")
        record = json.loads(server.read_text(f"{handle.state_dir}/record.json"))
        release = json.loads(server.read_text(f"{handle.state_dir}/release.json"))
    assert handle.metadata()["gpu_release"] == CPU_RUN_NOTE and record["gpu_release"] == CPU_RUN_NOTE
    assert release["passed"] is True and release["warning"] == CPU_RUN_NOTE
    assert handle.spec.config_name == CPU_CONFIG_NAME and handle.gpu_ids == ()  # 'auto' locally without GPU


# ----------------------------------------------------------------------- GPU choice


def test_requested_gpu_that_is_busy_or_absent_is_refused_with_what_runs_on_it():
    inv = GpuInventory("ok", parse_gpu_query("\n".join(H200_GPUS)), parse_compute_apps("\n".join(H200_APPS)))
    assert choose_gpus(inv, 0, requested=(1,)) == [1]
    with pytest.raises(RunError) as busy:
        choose_gpus(inv, 0, requested=(0, 1))
    assert busy.value.code == "gpu_busy"
    assert busy.value.reason == (
        "requested GPU(s) [0] busy: GPU 0: 20905 MiB used, pid 48213 /opt/conda/envs/dp/bin/python (20480 MiB)"
    )
    with pytest.raises(RunError) as absent:
        choose_gpus(inv, 0, requested=(3,))
    assert absent.value.code == "gpu_absent" and "[3] not listed" in absent.value.reason
    assert "GPU 0: 20905 MiB used, pid 48213" in absent.value.reason and "GPU 1: 1 MiB used, no compute process" in absent.value.reason
    with pytest.raises(RunError) as none:
        choose_gpus(GpuInventory("no_gpu", message="no GPU: nvidia-smi lists none"), 0, requested=(0,))
    assert none.value.code == "gpu_absent" and "lists none" in none.value.reason
    assert resolve_config_name("auto", inv, None) == GPU_CONFIG_NAME


@pytest.mark.slow
def test_requested_gpu_is_checked_against_nvidia_smi_of_this_launch(tmp_path, files):
    trainer, dataset = files
    smi = write_fake_nvidia_smi(tmp_path / "smi")
    config = ServerConfig.local(data_root=str(tmp_path / "server"), nvidia_smi=str(smi), tmux_socket=TMUX_SOCKET)
    spec = smoke_spec("smoke-gpu0", dataset, 30.0, SmokeSettings(train_command=trainer, gpu_ids=(0,)))
    with GpuServer(config) as server:
        with pytest.raises(RunError) as busy:
            launch_run(server, spec)
        assert busy.value.code == "gpu_busy" and "pid 48213" in busy.value.reason
        # GPU 0 is free in the next nvidia-smi answer: the same request is accepted now
        (tmp_path / "smi" / "apps.csv").write_text("")
        (tmp_path / "smi" / "gpus.csv").write_text(H200_GPUS[0].replace("20905", "3") + "\n" + H200_GPUS[1] + "\n")
        handle = launch_run(server, spec)
        server.wait_detached(handle.detached, 60)
    assert handle.gpu_ids == (0,) and "--gpu_ids 0" in handle.command


def test_expect_gpu_defaults_and_settings(monkeypatch):
    from dpflow_core.cli.remote import server_config_from_options
    from dpflow_dagster.resources import gpu_server_from_env

    assert server_config_from_options({"host": "gpu01.lab.example"}).gpu_expected is True  # SSH: on by default
    assert server_config_from_options({"host": "gpu01.lab.example", "expect_gpu": False}).gpu_expected is False
    assert server_config_from_options({}).gpu_expected is False  # local: off by default
    assert server_config_from_options({"expect_gpu": True, "nvidia_smi": "/opt/nv/nvidia-smi"}).nvidia_smi == "/opt/nv/nvidia-smi"
    monkeypatch.delenv("DPFLOW_SERVER_HOST", raising=False)
    monkeypatch.setenv("DPFLOW_SERVER_EXPECT_GPU", "true")  # lab.yaml server.expect_gpu: true
    assert gpu_server_from_env().server_config().gpu_expected is True
    monkeypatch.setenv("DPFLOW_SERVER_EXPECT_GPU", "maybe")
    with pytest.raises(ValueError, match="DPFLOW_SERVER_EXPECT_GPU='maybe'"):
        gpu_server_from_env()

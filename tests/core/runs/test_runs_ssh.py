"""Runs over SSH against a real OpenSSH server on 127.0.0.1: the same code path as locally.

A smoke run that leaves a child behind fails the release check naming it (and a
foreign ``train.py`` process is left alone); a training run survives a dropped
connection and a new connection re-attaches to it instead of launching again;
the checkpoint comes back with matching SHA-256 on both ends.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from sshd import sshd_server  # noqa: F401  (fixture)
from test_runs import FAKE_TRAINER, _alive, _wait_for, fake_spec

from conftest import kill_tmux_server, tmux_socket
from dpflow_core.checkpoints import download_checkpoint, verify_checkpoint
from dpflow_core.server import GpuServer
from dpflow_core.runs import (
    check_natural_exit,
    cleanup_run,
    launch_or_attach,
    monitor_run,
    run_processes,
    run_smoke,
)

TMUX_SOCKET = tmux_socket("runs-ssh")
pytestmark = [pytest.mark.sshd, pytest.mark.slow]


@pytest.fixture(scope="module", autouse=True)
def _private_tmux_server():
    yield
    kill_tmux_server(TMUX_SOCKET)


@pytest.fixture()
def files(tmp_path):
    trainer = tmp_path / "fake_train.py"
    trainer.write_text(FAKE_TRAINER)
    dataset = tmp_path / "dataset.npz"
    dataset.write_bytes(b"stand-in dataset")
    return trainer, str(dataset)


@pytest.fixture()
def config(sshd_server, tmp_path):  # noqa: F811
    # This machine has no GPU: opt out of the GPU requirement of SSH servers explicitly.
    return sshd_server.server_config(data_root=str(tmp_path / "server"), python=sys.executable, tmux_socket=TMUX_SOCKET,
                                     expect_gpu=False)


def test_leftover_child_over_ssh_is_named_and_only_it_is_ended(config, files):
    trainer, dataset = files
    foreign = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(300)", "train.py"], start_new_session=True, stdin=subprocess.DEVNULL
    )
    try:
        with GpuServer(config) as server:
            assert server.transport == "ssh"
            spec = fake_spec("smoke-ssh-leak", dataset, trainer, kind="smoke", mode="leave_child")
            result = run_smoke(server, spec, timeout_s=120, release_wait_s=1.0, cleanup=True)
        assert result.passed and not result.release.passed
        assert len(result.release.leftovers) == 1 and "(sleep 300)" in result.release.leftovers[0]
        leak = result.release.leftover_pids[0]
        assert result.release.cleanup.terminated == result.release.leftovers and result.release.cleanup.remaining == ()
        _wait_for(lambda: not _alive(leak), 10)
        assert foreign.poll() is None
    finally:
        foreign.send_signal(signal.SIGTERM)
        foreign.wait(10)


def test_dropped_connection_then_reattach_then_checkpoint(config, files, tmp_path, caplog):
    trainer, dataset = files
    spec = fake_spec("train-ssh", dataset, trainer, epochs=2, steps=8, step_s=0.5)
    with GpuServer(config) as server:
        handle, attached = launch_or_attach(server, spec)
        assert not attached and handle.detached.tmux_session == "train-ssh"
        _wait_for(lambda: server.size(handle.log_path))
    # The orchestrator's connection is gone; the run goes on in its tmux session.
    with GpuServer(config) as server:
        again, attached = launch_or_attach(server, spec)
        assert attached and again.detached.pid == handle.detached.pid
        assert server.tmux_session_exists("train-ssh")
        dropped = []

        def drop_once(progress, new):  # the SSH connection breaks while the monitor follows the run
            if not dropped:
                server._transport.connection.client.get_transport().close()
                dropped.append(progress.global_step)

        result = monitor_run(server, again, poll_s=0.5, stall_timeout_s=60, timeout_s=120, on_progress=drop_once)
        assert result.ok, result.message
        assert dropped and server._transport.connection.is_connected
        assert "lost the server while monitoring train-ssh" in caplog.text
        assert result.progress.global_step == 15
        report = check_natural_exit(server, again)
        assert report.passed, report.problems
        assert run_processes(server, again) == []
        got = download_checkpoint(server, "train-ssh", dest_root=tmp_path / "ckpts", stable_interval_s=0.2)
    assert got.match and got.local_sha256 == got.remote_sha256
    assert got.log_path and got.hydra_dir  # companions came along
    check = verify_checkpoint(got.local_path, got.remote_sha256, got.size_bytes)
    # A stand-in file is not a dpflow checkpoint: its container and SHA-256 are what can be checked.
    assert check.passed and check.local_sha256 == got.remote_sha256 and "not a dpflow checkpoint" in check.load_error


def test_cleanup_over_ssh_ends_a_running_training(config, files):
    trainer, dataset = files
    spec = fake_spec("train-ssh-stop", dataset, trainer, epochs=1, steps=500, step_s=0.2)
    with GpuServer(config) as server:
        handle, _ = launch_or_attach(server, spec)
        _wait_for(lambda: server.size(handle.log_path))
        procs = run_processes(server, handle)
        assert any(any("fake_train.py" in a for a in p.cmdline) for p in procs)
        report = cleanup_run(server, handle, grace_s=10)
        assert report.terminated and report.remaining == ()
        status = server.wait_detached(handle.detached, 30)
        time.sleep(0.2)
        assert status.finished and status.exit_code == 143
        assert "killed by SIGTERM" in " ".join(check_natural_exit(server, handle).problems)

"""Choosing, downloading and verifying a run's checkpoint (local transport; SSH in test_runs_ssh.py)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import tmux_socket
from test_runs import FAKE_TRAINER, fake_spec

from dpflow_core.checkpoints import (
    choose_checkpoint,
    download_checkpoint,
    metrics_from_name,
    verify_checkpoint,
    wait_until_stable,
)
from dpflow_core.errors import RunError
from dpflow_core.server import GpuServer, ServerConfig, sha256_file
from dpflow_core.runs import launch_run, monitor_run


@pytest.fixture()
def real_checkpoint(tiny_checkpoint) -> Path:
    """A checkpoint written by the built-in trainer (conftest's shared one: 1 epoch x 2 batches)."""
    return tiny_checkpoint.checkpoint


@pytest.fixture()
def server(tmp_path):
    with GpuServer(ServerConfig.local(data_root=str(tmp_path / "server"), tmux_socket=tmux_socket("ckpt"))) as srv:
        yield srv


@pytest.fixture()
def finished_run(server, tmp_path, real_checkpoint):
    trainer = tmp_path / "fake_train.py"
    trainer.write_text(FAKE_TRAINER)
    dataset = tmp_path / "dataset.npz"
    dataset.write_bytes(b"stand-in dataset")
    spec = fake_spec("train-ckpt", str(dataset), trainer, epochs=2, steps=2)
    spec = type(spec)(**{**spec.to_dict(), "extra_overrides": (f"fake.ckpt_from={real_checkpoint}",)})
    handle = launch_run(server, spec, method="setsid")
    assert monitor_run(server, handle, poll_s=0.2, timeout_s=120).ok
    return handle


def test_names_and_choice():
    assert metrics_from_name("epoch=0010-train_loss=0.012.ckpt") == {"epoch": 10.0, "train_loss": 0.012}
    names = ["latest.ckpt", "epoch=0003-train_loss=0.200.ckpt", "epoch=0007-train_loss=0.150.ckpt", "epoch=0009-train_loss=0.150.ckpt"]
    assert choose_checkpoint(names, "latest") == "latest.ckpt"
    assert choose_checkpoint(names, "best") == "epoch=0009-train_loss=0.150.ckpt"  # ties: the later epoch
    with pytest.raises(RunError) as err:
        choose_checkpoint(["latest.ckpt"], "best")
    assert err.value.code == "checkpoint_missing" and "topk" in err.value.reason
    with pytest.raises(RunError):
        choose_checkpoint(["epoch=0001-train_loss=0.1.ckpt"], "latest")


def test_download_with_companions_then_a_truncated_copy_fails_the_check(server, finished_run, tmp_path, real_checkpoint,
                                                                        tiny_checkpoint):
    got = download_checkpoint(server, "train-ckpt", dest_root=tmp_path / "ckpts", stable_interval_s=0.1)
    assert got.match and got.remote_sha256 == sha256_file(real_checkpoint) and got.run_finished and got.exit_code == 0
    folder = Path(got.local_dir)
    assert folder == tmp_path / "ckpts" / "train-ckpt" / got.remote_sha256[:16]
    assert Path(got.local_path).name == "latest.ckpt"
    assert (folder / ".hydra" / "config.yaml").is_file() and (folder / "logs.json.txt").is_file()
    normalizer = json.loads(Path(got.normalizer_path).read_text())["normalizer"]
    assert {"robot0_eef_pos", "action"} <= set(normalizer) and len(normalizer["action"]["mean"]) == 10
    record = json.loads(Path(got.record_path).read_text())
    assert record["exit_code"] == 0 and record["ended_at"] and record["pip_freeze"]
    assert record["checkpoint"]["remote_sha256"] == record["checkpoint"]["local_sha256"] == got.remote_sha256
    assert record["overrides"] and record["command"] == finished_run.command and record["repo"]["commit"]
    # what the policy was trained with: the camera-to-TCP transform, the representation, the dataset's hash
    assert record["trained_with"] == {
        "tx_cam_tcp": np.eye(4).tolist(), "obs_pose_repr": "relative", "action_pose_repr": "relative",
        "dataset_sha256": sha256_file(tiny_checkpoint.dataset),
    }

    check = verify_checkpoint(got.local_path, got.remote_sha256, got.size_bytes, server=server, remote_path=got.remote_path)
    assert check.passed and check.loadable and check.remote_now_sha256 == got.remote_sha256

    again = download_checkpoint(server, "train-ckpt", dest_root=tmp_path / "ckpts", stable_interval_s=0.1)
    assert again.already_present and again.local_path == got.local_path

    with open(got.local_path, "r+b") as f:
        f.truncate(got.size_bytes - 1000)
    check = verify_checkpoint(got.local_path, got.remote_sha256, got.size_bytes)
    assert not check.passed and not check.loadable
    text = " ".join(check.problems)
    assert "SHA-256 differs" in text and "size differs" in text and "not loadable" in text


def test_best_choice_and_a_corrupted_transfer_never_gets_the_final_name(server, finished_run, tmp_path, monkeypatch):
    best = download_checkpoint(server, "train-ckpt", choose="best", dest_root=tmp_path / "ckpts", stable_interval_s=0.1)
    assert Path(best.local_path).name == "epoch=0001-train_loss=0.250.ckpt" and best.match

    real_get = server._transport.get

    def flaky_get(remote, local):
        real_get(remote, local)
        if remote.endswith(".ckpt"):
            with open(local, "r+b") as f:
                f.seek(100)
                f.write(b"\x00" * 16)

    monkeypatch.setattr(server._transport, "get", flaky_get)
    bad = download_checkpoint(server, "train-ckpt", dest_root=tmp_path / "other", stable_interval_s=0.1)
    assert not bad.match and bad.local_sha256 != bad.remote_sha256
    assert ".mismatch-" in Path(bad.local_dir).name
    assert not (tmp_path / "other" / "train-ckpt" / bad.remote_sha256[:16]).exists()
    assert not verify_checkpoint(bad.local_path, bad.remote_sha256, bad.size_bytes).passed


def test_wait_until_stable_waits_for_a_growing_file(server, tmp_path):
    path = tmp_path / "growing.ckpt"
    path.write_bytes(b"x")
    stop = time.monotonic() + 1.0

    def grow():
        while time.monotonic() < stop:
            with open(path, "ab") as f:
                f.write(b"y" * 1000)
            time.sleep(0.05)

    thread = threading.Thread(target=grow)
    thread.start()
    started = time.monotonic()
    size = wait_until_stable(server, str(path), interval_s=0.2, stable_checks=2)
    thread.join()
    assert time.monotonic() - started >= 0.9 and size == path.stat().st_size
    with pytest.raises(RunError) as err:
        wait_until_stable(server, str(tmp_path / "absent.ckpt"), interval_s=0.1)
    assert err.value.code == "checkpoint_missing"

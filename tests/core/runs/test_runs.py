"""Runs on the GPU server over the local transport: launch, release check, cleanup, natural exit,
re-attach, monitoring, OOM advice.

A small stand-in trainer (written to a temp folder) takes the trainer's Hydra-style
overrides, writes ``logs.json.txt`` like the real one, and can misbehave on demand
(``fake.mode=leave_child | nan | stall | oom``); it runs under the real ``accelerate
launch`` in a real detached session, so the process tree is the real one. The
built-in trainer itself runs in ``test_runs_trainer.py``.
"""

from __future__ import annotations

import dataclasses

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import kill_tmux_server, tmux_socket
from dpflow_core.errors import RunError
from dpflow_core.server import GpuServer, ServerConfig, parse_compute_apps, parse_gpu_query
from dpflow_core.runs import (
    RunSpec,
    check_natural_exit,
    check_released,
    choose_gpus,
    cleanup_run,
    describe_exit,
    free_gpus,
    launch_or_attach,
    launch_run,
    load_handle,
    monitor_run,
    oom_advice,
    probe_checkpoint,
    run_processes,
    run_smoke,
    smoke_spec,
    SmokeSettings,
)

FAKE_TRAINER = textwrap.dedent(
    '''
    """Stand-in trainer for dpflow's tests: the built-in trainer's overrides and run directory."""
    import json, os, subprocess, sys, time, zipfile
    args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a and not a.startswith("-"))
    run_dir = args["hydra.run.dir"]
    epochs = int(args.get("training.num_epochs", "1"))
    steps = int(args.get("training.max_train_steps", "2"))
    mode = args.get("fake.mode", "")
    step_s = float(args.get("fake.step_s", "0"))
    os.makedirs(os.path.join(run_dir, ".hydra"), exist_ok=True)
    with open(os.path.join(run_dir, ".hydra", "config.yaml"), "w") as f:
        f.write(f"training:\\n  num_epochs: {epochs}\\n  max_train_steps: {steps}\\n"
                "  gradient_accumulate_every: 1\\ndataloader:\\n  batch_size: 8\\nval_dataloader:\\n  batch_size: 6\\n")
    print(f"training {run_dir} on 1 process(es), {steps} batches per epoch", flush=True)
    if mode == "oom":
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", file=sys.stderr, flush=True)
        sys.exit(1)
    g = 0
    with open(os.path.join(run_dir, "logs.json.txt"), "a") as log:
        for e in range(epochs):
            for b in range(steps):
                loss = float("nan") if mode == "nan" and g >= 1 else 1.0 / (g + 1)
                log.write(json.dumps({"train_loss": loss, "global_step": g, "epoch": e, "lr": 1e-3}) + "\\n")
                log.flush()
                g += 1
                if mode == "stall" and g == 1:
                    time.sleep(600)
                time.sleep(step_s)
            log.write(json.dumps({"train_loss": 0.5, "global_step": g - 1, "epoch": e, "lr": 1e-3, "epoch_summary": True}) + "\\n")
        log.write('{"train_loss": 0.1, "glob')  # a partial line, as while a run writes
    if args.get("checkpoint.save_last_ckpt", "true") != "false":
        d = os.path.join(run_dir, "checkpoints")
        os.makedirs(d, exist_ok=True)
        tmp = os.path.join(d, ".latest.ckpt.tmp-1")
        if "fake.ckpt_from" in args:  # a real checkpoint, also as two top-k files
            import shutil
            for name in ("epoch=0000-train_loss=0.500.ckpt", "epoch=0001-train_loss=0.250.ckpt"):
                shutil.copyfile(args["fake.ckpt_from"], os.path.join(d, name))
            shutil.copyfile(args["fake.ckpt_from"], tmp)
        else:  # the workspace format of upstream Diffusion Policy / UMI (tests/upstream_trainer.py)
            sys.path.insert(0, @TESTS@)
            from upstream_trainer import save_workspace_checkpoint
            save_workspace_checkpoint(tmp, cfg={"training": {"num_epochs": epochs}}, epoch=epochs, global_step=g,
                                      output_dir=run_dir, drop=tuple(d for d in args.get("fake.drop", "").split(",") if d))
        os.replace(tmp, os.path.join(d, "latest.ckpt"))
    if mode == "leave_child":
        subprocess.Popen(["sleep", "300"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    '''
).replace("@TESTS@", repr(str(Path(__file__).resolve().parents[2])))  # tests/, where upstream_trainer.py is


@pytest.fixture(scope="module")
def fake_trainer(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("trainer") / "fake_train.py"
    path.write_text(FAKE_TRAINER)
    return path


TMUX_SOCKET = tmux_socket("runs")


@pytest.fixture(scope="module", autouse=True)
def _private_tmux_server():
    """Training sessions go to a private tmux server, stopped by its socket afterwards."""
    yield
    kill_tmux_server(TMUX_SOCKET)


@pytest.fixture()
def server(tmp_path):
    with GpuServer(ServerConfig.local(data_root=str(tmp_path / "server"), tmux_socket=TMUX_SOCKET)) as srv:
        yield srv


@pytest.fixture()
def dataset(tmp_path) -> str:
    path = tmp_path / "dataset.npz"
    path.write_bytes(b"stand-in dataset")
    return str(path)


def fake_spec(name, dataset, trainer, *, kind="train", epochs=1, steps=2, mode="", step_s=0.0, save=True) -> RunSpec:
    extra = (f"fake.mode={mode}",) if mode else ()
    if step_s:
        extra += (f"fake.step_s={step_s}",)
    if kind == "smoke":
        return smoke_spec(name, dataset, 30.0, SmokeSettings(train_command=str(trainer), epochs=epochs, max_train_steps=steps, extra_overrides=extra))
    return RunSpec(
        name=name, kind="train", dataset_path=dataset, frequency_hz=30.0, config_name="tiny", epochs=epochs,
        max_train_steps=steps, train_command=str(trainer), extra_overrides=extra, save_checkpoints=save,
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _wait_for(predicate, timeout_s: float = 60.0, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError("condition not met in time")


# ----------------------------------------------------------------------------- units


def test_free_gpus_and_choice_from_nvidia_smi_csv():
    from fake_nvidia_smi import H200_APPS, H200_GPUS

    from dpflow_core.server import GpuInventory

    inv = GpuInventory("ok", parse_gpu_query("\n".join(H200_GPUS)), parse_compute_apps("\n".join(H200_APPS)))
    assert free_gpus(inv) == [1]  # GPU 0 runs pid 48213 with 20 GiB
    assert choose_gpus(inv, 0) == [1]
    assert choose_gpus(inv, 1) == [1]
    with pytest.raises(RunError) as err:
        choose_gpus(inv, 2)
    assert err.value.code == "no_free_gpu" and "48213" in err.value.reason
    assert choose_gpus(GpuInventory("no_gpu"), 0) == []


def test_smoke_overrides_and_command(server, dataset, fake_trainer):
    from dpflow_core.runs import build_command, render_train_command

    spec = smoke_spec("s1", dataset, 29.97, config_name="tiny")
    overrides = spec.overrides("/runs/s1")
    for expected in ("logging.mode=offline", "training.resume=false", "checkpoint.save_last_ckpt=false",
                     "checkpoint.topk.k=0", "task.dataset_frequeny=29.97", "hydra.run.dir=/runs/s1",
                     "training.max_train_steps=3", "dataloader.batch_size=4", "dataloader.num_workers=0"):
        assert expected in overrides
    # An upstream-style train.py always gets resume=true: UMI's workspace keeps the optimizer out of
    # its checkpoints otherwise, and it resumes only from an existing latest.ckpt.
    upstream = RunSpec(**{**spec.to_dict(), "kind": "train", "train_command": "upstream"})
    assert not upstream.builtin_trainer and "training.resume=true" in upstream.overrides("/runs/s1")
    assert "training.resume=false" not in upstream.overrides("/runs/s1")
    cmd, _, n = build_command(server, spec, "/runs/s1", [])
    assert n == 1 and "-m accelerate.commands.launch --cpu --num_processes 1" in cmd
    assert "-m dpflow_core.train --config-name=tiny" in cmd and cmd.endswith("checkpoint.topk.k=0")
    cmd, _, n = build_command(server, RunSpec(**{**spec.to_dict(), "kind": "train", "num_processes": 0}), "/r", [2, 3])
    assert n == 2 and "--num_processes 2 --gpu_ids 2,3" in cmd and "--multi_gpu" in cmd and "--cpu" not in cmd
    # A user's own train.py: placeholders are quoted, overrides placed where asked.
    text = render_train_command(
        "train.py --config-name=umi {overrides} data={dataset} n={num_processes} g={gpu_ids}",
        run_dir="/r d", dataset="/data/my set.npz", overrides=["a=1", "b=x y"], num_processes=2, gpu_ids=[0, 1], config_name="c",
    )
    assert text == "train.py --config-name=umi a=1 'b=x y' data='/data/my set.npz' n=2 g=0,1"
    assert render_train_command("train.py", run_dir="/r", dataset="/d", overrides=["a=1"], num_processes=1, gpu_ids=[],
                                config_name="c") == "train.py a=1"
    with pytest.raises(RunError, match="unknown placeholder"):
        render_train_command("train.py {checkpoint}", run_dir="/r", dataset="/d", overrides=[], num_processes=1, gpu_ids=[], config_name="c")


def test_oom_advice_follows_the_manual_order(server, dataset, fake_trainer):
    handle = launch_run(server, fake_spec("oom1", dataset, fake_trainer, mode="oom"), record=False)
    server.wait_detached(handle.detached, 60)
    report = check_natural_exit(server, handle)
    assert not report.passed and report.exit_code == 1
    steps = report.oom_advice
    assert len(steps) == 6
    assert [s.split(".")[0] for s in steps] == ["1", "2", "3", "4", "5", "6"]
    assert "Leftovers" in steps[0] and "dataloader.batch_size=4 (now 8)" in steps[1]
    assert "val_dataloader.batch_size=3 (now 6)" in steps[2] and "gradient_accumulate_every=2" in steps[3]
    assert "image-size" in steps[4] and "mixed_precision" in steps[5]
    assert oom_advice(handle) and describe_exit(143) == "exit status 143 (killed by SIGTERM)"


# -------------------------------------------------------------------- smoke + release


@pytest.mark.slow
def test_smoke_run_passes_and_is_released(server, dataset, fake_trainer):
    spec = fake_spec("smoke-ok", dataset, fake_trainer, kind="smoke")
    result = run_smoke(server, spec, timeout_s=120)
    assert result.passed, result.problems
    assert result.exit_code == 0 and result.finite_losses == 2 and result.checkpoints == ()
    assert result.release.passed and result.release.leftovers == ()
    assert result.release.gpu_status == "no_gpu" and result.release.metadata()["gpu"] == "CPU run: GPU release not checked"
    assert result.release.verdict == "warn" and result.release.metadata()["verdict"] == "warn"
    handle = load_handle(server, "smoke-ok")
    assert handle.detached.method == "setsid" and handle.detached.leader.pgid == handle.detached.pid
    record = json.loads(server.read_text(f"{handle.state_dir}/record.json"))
    assert record["exit_code"] == 0 and record["ended_at"] and record["dataset"]["frequency_hz"] == 30.0
    assert record["overrides"] == list(handle.overrides) and record["pip_freeze"]
    with pytest.raises(RunError) as err:  # a new run refuses an existing directory
        launch_run(server, spec)
    assert err.value.code == "run_exists"


@pytest.mark.slow
def test_leftover_child_fails_release_and_foreign_train_py_is_never_signalled(server, dataset, fake_trainer):
    foreign = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(300)", "train.py", "--config-name=tiny"],
        start_new_session=True, stdin=subprocess.DEVNULL,
    )
    try:
        spec = fake_spec("smoke-leak", dataset, fake_trainer, kind="smoke", mode="leave_child")
        result = run_smoke(server, spec, timeout_s=120, release_wait_s=1.0, cleanup=False)
        assert result.passed  # the smoke run itself exited 0 with a finite loss
        release = result.release
        assert not release.passed
        assert len(release.leftovers) == 1 and "(sleep 300)" in release.leftovers[0]
        leak = release.leftover_pids[0]
        assert f"pid {leak}" in release.message and _alive(leak)
        assert foreign.pid not in release.leftover_pids

        handle = load_handle(server, "smoke-leak")
        cleaned = cleanup_run(server, handle, grace_s=5)
        assert cleaned.terminated == (release.leftovers[0],) and cleaned.killed == () and cleaned.remaining == ()
        _wait_for(lambda: not _alive(leak), 10)
        assert foreign.poll() is None and _alive(foreign.pid)
        assert check_released(server, handle, wait_s=0).passed
    finally:
        foreign.send_signal(signal.SIGTERM)
        foreign.wait(10)


def test_release_check_reads_gpu_memory_from_nvidia_smi(tmp_path, dataset, fake_trainer):
    from fake_nvidia_smi import H200_APPS, H200_GPUS, write_fake_nvidia_smi

    smi = write_fake_nvidia_smi(tmp_path / "smi", H200_GPUS, H200_APPS)
    config = ServerConfig.local(data_root=str(tmp_path / "server"), nvidia_smi=str(smi), tmux_socket=TMUX_SOCKET)
    with GpuServer(config) as server:
        spec = fake_spec("smoke-gpu", dataset, fake_trainer, kind="smoke")
        result = run_smoke(server, spec, timeout_s=120, release_wait_s=0.5)
        handle = result.handle
        assert handle.gpu_ids == (1,) and handle.gpu_memory_before_mib == {1: 1}
        assert "--gpu_ids 1" in handle.command and "--cpu" not in handle.command
        assert result.release.passed and result.release.gpus[0] == {"index": 1, "before_mib": 1, "after_mib": 1, "released": True}

        held = (H200_GPUS[0], H200_GPUS[1].replace(", 1, 0", ", 5123, 0"))
        apps = H200_APPS + ("50001, GPU-0c2e9d4b-7a61-4f0e-8d2b-3e4f5a6b7c8d, 5120, python",)
        write_fake_nvidia_smi(tmp_path / "smi", held, apps)
        report = check_released(server, handle, wait_s=0)
        assert not report.passed and report.leftovers == ()
        assert "GPU 1 NOT released (1 -> 5123 MiB)" in report.message
        assert "pid 50001 python 5120 MiB on GPU 1" in report.message


# ---------------------------------------------------------------- training lifecycle


def test_sigterm_fails_natural_exit_and_reattach_never_launches_twice(server, dataset, fake_trainer):
    spec = fake_spec("train-term", dataset, fake_trainer, epochs=2, steps=200, step_s=0.2)
    handle, attached = launch_or_attach(server, spec)
    assert not attached and handle.detached.method == "tmux" and handle.detached.tmux_session == "train-term"
    _wait_for(lambda: server.size(handle.log_path))
    again, attached = launch_or_attach(server, spec)  # a second materialization
    assert attached and again.detached.pid == handle.detached.pid and again.token == handle.token
    assert len(load_handle(server, "train-term").detached.command) and server.listdir(f"{handle.run_dir}/dpflow") == ["launch-0"]
    trainer = _wait_for(lambda: [p for p in run_processes(server, handle) if any("fake_train.py" in a for a in p.cmdline)])
    assert server.signal_process(trainer[0], "TERM")
    status = server.wait_detached(handle.detached, 60)
    assert status.finished and status.exit_code != 0
    report = check_natural_exit(server, handle)
    assert not report.passed and not report.running
    evidence = " ".join(report.problems)
    assert "exit status" in evidence and ("SIGTERM" in evidence or "-15" in evidence)
    assert "last logged epoch is 0, the config asked for 2" in evidence
    assert "latest.ckpt" in evidence and "missing" in evidence
    cleanup_run(server, handle, grace_s=5)


def test_a_run_name_of_another_dataset_is_refused_not_attached(server, dataset, fake_trainer, tmp_path):
    """The same --run-name on a second dataset (a new user reusing a README command for a second task) is
    refused, naming both datasets: attaching would hand the first dataset's run and checkpoint back as the
    second's. The same name on the same dataset still attaches."""
    spec = fake_spec("try", dataset, fake_trainer, epochs=1, steps=2)
    handle = launch_run(server, spec, record=False)
    server.wait_detached(handle.detached, 60)
    again, attached = launch_or_attach(server, spec)
    assert attached and again.token == handle.token
    other = tmp_path / "other.npz"
    other.write_bytes(b"another stand-in dataset")
    with pytest.raises(RunError) as err:
        launch_or_attach(server, fake_spec("try", str(other), fake_trainer, epochs=1, steps=2))
    assert err.value.code == "run_name_in_use"
    assert f"run 'try' was launched on {dataset}, not {other}" in str(err.value)
    hashed = dataclasses.replace(spec, dataset_sha256="ab" * 32)
    with pytest.raises(RunError, match="sha256|a run name belongs to one dataset"):
        launch_or_attach(server, dataclasses.replace(hashed, dataset_path=str(other)))
    cleanup_run(server, handle, grace_s=5)


def test_natural_exit_passes_then_a_truncated_checkpoint_fails(server, dataset, fake_trainer):
    spec = fake_spec("train-ok", dataset, fake_trainer, epochs=2, steps=3)
    handle = launch_run(server, spec, record=False)
    result = monitor_run(server, handle, poll_s=0.2, stall_timeout_s=60, timeout_s=120)
    assert result.ok and result.progress.global_step == 5 and result.progress.epoch == 1
    report = check_natural_exit(server, handle)
    assert report.passed, report.problems
    assert (report.expected_epochs, report.last_epoch, report.batches_per_epoch) == (2, 1, 3)
    assert (report.expected_global_step, report.last_global_step) == (5, 5)
    ckpt = f"{handle.checkpoint_dir}/latest.ckpt"
    size = server.size(ckpt)
    with open(ckpt, "r+b") as f:
        f.truncate(size // 2)
    assert not probe_checkpoint(server, ckpt).loadable
    report = check_natural_exit(server, handle)
    assert not report.passed and any("latest.ckpt" in p and "not loadable" in p for p in report.problems)


def test_monitor_stops_a_run_with_nan_loss(server, dataset, fake_trainer):
    handle = launch_run(server, fake_spec("train-nan", dataset, fake_trainer, steps=400, mode="nan", step_s=0.1), record=False)
    result = monitor_run(server, handle, poll_s=0.3, stall_timeout_s=60, timeout_s=120)
    assert result.status == "nan" and result.stopped is not None and result.stopped.terminated
    assert result.progress.nonfinite["global_step"] == 1
    assert run_processes(server, handle) == []


def test_monitor_detects_a_stall(server, dataset, fake_trainer):
    handle = launch_run(server, fake_spec("train-stall", dataset, fake_trainer, mode="stall"), record=False)
    result = monitor_run(server, handle, poll_s=0.3, stall_timeout_s=2.0, timeout_s=120)
    assert result.status == "stalled" and "global_step 0" in result.message
    assert result.stopped is not None and run_processes(server, handle) == []

"""Dagster Pipes over SSH (real sshd on 127.0.0.1): the built-in trainer's reports reach the asset while it
trains, a connection killed mid-run (the sshd child serving it, by PID) loses and duplicates nothing and
launches nothing twice; a trainer without Pipes still reports, from logs.json.txt.

Ground truth: the messages file and ``logs.json.txt`` the trainer wrote on disk (this machine is the
server), the wrapper's exit file time, and the launch folders.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import dagster as dg
import pytest
from conftest import kill_tmux_server, tmux_socket
from sshd import sshd_server  # noqa: F401  (fixture)
from synthetic_dataset import write_synthetic_dataset
from test_assets_training import TASK, checks_by_name, materializations, stub_remote_dataset

from dpflow_dagster.defs import training as at
from dpflow_dagster.resources import GpuServerResource

TMUX_SOCKET = tmux_socket("pipes")
EVERY_N = 2


@pytest.fixture(scope="module", autouse=True)
def _private_tmux_server():
    yield
    kill_tmux_server(TMUX_SOCKET)


def _resource(sshd, tmp_path: Path) -> GpuServerResource:
    return GpuServerResource(
        host=sshd.host, port=sshd.port, user=sshd.user, key_file=str(sshd.key_path), known_hosts=str(sshd.known_hosts),
        data_root=str(tmp_path / "server"), python=sys.executable, tmux_socket=TMUX_SOCKET, expect_gpu=False,
    )


def _materialize(tmp_path: Path, sshd, train_config: at.TrainRunConfig):
    dataset = write_synthetic_dataset(tmp_path / "dataset.npz", n_episodes=4, episode_length=40, image_size=(32, 32))
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(at.train_run.partitions_def.name, [TASK])
    result = dg.materialize(
        [stub_remote_dataset(dataset, 10.0), at.train_run, at.train_run_natural_exit], instance=instance,
        partition_key=TASK, resources={"gpu_server": _resource(sshd, tmp_path)},
        run_config=dg.RunConfig(ops={"train_run": train_config}),
    )
    return result, instance


def _sshd_children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _step_observations(result, instance) -> list[tuple[float, dict]]:
    """(time stored in the event log, figures) of each step report of the run, in event-log order."""
    out = []
    for entry in instance.all_logs(result.run_id, of_type=dg.DagsterEventType.ASSET_OBSERVATION):
        meta = entry.dagster_event.event_specific_data.asset_observation.metadata
        if "source" in meta:
            out.append((entry.timestamp, {k: v.value for k, v in meta.items()}))
    return out


@pytest.mark.sshd
@pytest.mark.slow
def test_pipes_reports_arrive_live_and_survive_a_killed_connection(sshd_server, tmp_path):  # noqa: F811
    run_dir = tmp_path / "server" / "runs" / "train-pipes"
    killed: dict = {}

    def kill_the_connection_at_the_first_step_report():
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            files = list((run_dir / "dpflow").glob("pipes-*.jsonl")) if (run_dir / "dpflow").is_dir() else []
            if files and '"kind": "step"' in files[0].read_text():
                exit_files = list(run_dir.glob("dpflow/launch-0/*.exit"))
                children = _sshd_children(sshd_server.pid)
                for child in children:  # the per-connection sshd processes of our own test server
                    os.kill(child, signal.SIGKILL)
                killed.update(children=children, run_alive=not exit_files, at=time.time())
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=kill_the_connection_at_the_first_step_report, daemon=True)
    watcher.start()
    result, instance = _materialize(tmp_path, sshd_server, at.TrainRunConfig(
        run_name="train-pipes", config_name="tiny", epochs=2, max_train_steps=5, batch_size=8, num_workers=0,
        poll_s=0.2, report_every_n_steps=EVERY_N, logging_mode="disabled",
    ))
    watcher.join(5)
    assert result.success
    assert killed.get("children") and killed["run_alive"], killed  # the connection died while the run went on

    meta = {k: v.value for k, v in materializations(result)["train_run"].items()}
    assert meta["reports"] == "dagster-pipes" and meta["exit_code"] == 0 and meta["attached"] is False
    # the trainer's materialization: its latest.ckpt SHA-256 is the data version
    latest = run_dir / "checkpoints" / "latest.ckpt"
    assert meta["latest_ckpt_sha256"] == hashlib.sha256(latest.read_bytes()).hexdigest()
    [mat] = [e for e in result.get_asset_materialization_events() if e.asset_key == dg.AssetKey("train_run")]
    assert mat.step_materialization_data.materialization.tags["dagster/data_version"] == meta["latest_ckpt_sha256"]

    # every message of the file handled once: step reports equal the file's, in order, none twice
    [messages_file] = (run_dir / "dpflow").glob("pipes-*.jsonl")
    messages = [json.loads(line) for line in messages_file.read_text().splitlines()]
    assert meta["pipes_messages"] == len(messages)
    assert messages[0]["method"] == "opened" and messages[-1]["method"] == "closed"
    steps_in_file = [m["params"]["payload"]["global_step"] for m in messages
                     if m["method"] == "report_custom_message" and m["params"]["payload"]["kind"] == "step"]
    observed = _step_observations(result, instance)
    assert [o["global_step"] for _, o in observed] == steps_in_file
    # ground truth from logs.json.txt: every N-th step and each epoch's summary
    records = [json.loads(line) for line in (run_dir / "logs.json.txt").read_text().splitlines()]
    expected = [r["global_step"] for r in records if r.get("epoch_summary") or (r["global_step"] + 1) % EVERY_N == 0]
    assert steps_in_file == expected and len(set(zip(steps_in_file, range(len(expected))))) == len(expected)
    assert all({"train_loss", "lr", "epoch", "total_steps"} <= set(o) for _, o in observed)
    assert observed[-1][1]["total_steps"] == records[-1]["global_step"] + 1 == 10 and "eta_s" in observed[-1][1] and "steps_per_s" in observed[-1][1]
    # live: step reports were in the event log before the process ended
    exit_time = next(run_dir.glob("dpflow/launch-0/*.exit")).stat().st_mtime
    assert observed[0][0] < exit_time
    # one launch only
    assert sorted(p.name for p in (run_dir / "dpflow").iterdir() if p.is_dir()) == ["launch-0"]
    # the check carries the trainer's own verdict beside the exit status
    check = checks_by_name(result)["natural_exit"]
    assert check.passed and check.metadata["reported_from_run"].value is True
    assert check.metadata["in_run/epoch"].value == 2
    saves = [m for m in messages if m["method"] == "report_custom_message" and m["params"]["payload"]["kind"] == "checkpoint"]
    assert meta["checkpoints_saved"] == len(saves) >= 1 and any(s["params"]["payload"]["name"] == "latest.ckpt" for s in saves)


@pytest.mark.sshd
@pytest.mark.slow
def test_without_pipes_the_same_reports_come_from_logs_json(sshd_server, tmp_path):  # noqa: F811
    result, instance = _materialize(tmp_path, sshd_server, at.TrainRunConfig(
        run_name="train-logs", config_name="tiny", epochs=2, max_train_steps=3, batch_size=8, num_workers=0,
        poll_s=0.2, report_every_n_steps=EVERY_N, pipes=False, logging_mode="disabled",
    ))
    assert result.success
    run_dir = tmp_path / "server" / "runs" / "train-logs"
    meta = materializations(result)["train_run"]
    assert meta["reports"].value == "logs.json.txt" and "pipes_messages" not in meta
    assert not list((run_dir / "dpflow").glob("pipes-*.jsonl"))
    records = [json.loads(line) for line in (run_dir / "logs.json.txt").read_text().splitlines()]
    expected = [r["global_step"] for r in records if r.get("epoch_summary") or (r["global_step"] + 1) % EVERY_N == 0]
    observed = [o for _, o in _step_observations(result, instance)]
    assert [o["global_step"] for o in observed] == expected
    assert {o["source"] for o in observed} == {"logs.json.txt"}
    check = checks_by_name(result)["natural_exit"]
    assert check.passed and check.metadata["reported_from_run"].value is False


@pytest.mark.sshd
@pytest.mark.slow
def test_smoke_run_reports_through_the_same_pipes_reader(sshd_server, tmp_path):  # noqa: F811
    dataset = write_synthetic_dataset(tmp_path / "dataset.npz", n_episodes=4, episode_length=40, image_size=(32, 32))
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(at.smoke_run.partitions_def.name, [TASK])
    result = dg.materialize(
        [stub_remote_dataset(dataset, 10.0), at.smoke_run], instance=instance, partition_key=TASK,
        resources={"gpu_server": _resource(sshd_server, tmp_path)},
        run_config=dg.RunConfig(ops={"smoke_run": at.SmokeRunConfig(
            run_name="smoke-pipes", config_name="tiny", epochs=1, max_train_steps=3, batch_size=4)}),
    )
    assert result.success
    meta = {k: v.value for k, v in materializations(result)["smoke_run"].items()}
    [messages_file] = (tmp_path / "server" / "runs" / "smoke-pipes" / "dpflow").glob("pipes-*.jsonl")
    messages = [json.loads(line) for line in messages_file.read_text().splitlines()]
    assert meta["reports"] == "dagster-pipes" and meta["pipes_messages"] == len(messages)
    steps = [m["params"]["payload"]["global_step"] for m in messages
             if m["method"] == "report_custom_message" and m["params"]["payload"]["kind"] == "step"]
    # every step is reported (N = 1), the epoch summary repeats the last one
    assert steps == [0, 1, 2, 2]
    assert [o["global_step"] for _, o in _step_observations(result, instance)] == steps

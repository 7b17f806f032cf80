"""The trainer as users run it: Hydra command line, run directory, W&B offline,
exact resume after a kill, atomic checkpoints, and two accelerate processes."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dpflow_core.errors import RunError
from dpflow_core.files import sha256_file
from dpflow_core.replay_buffer import ReplayBuffer
from dpflow_core.train import checkpoint as ckpt
from dpflow_core.train.app import CONFIG_DIR
from dpflow_core.inference import load_policy
from dpflow_core.train.batches import SequenceDataset
from dpflow_core.train.logs import read_json_log
from dpflow_core.train.workspace import train
from tests.synthetic_dataset import write_synthetic_dataset

STEP_KEYS = {"train_loss", "global_step", "epoch", "lr", "data_time_s"}
TOPK_NAME = re.compile(r"^epoch=\d{4}-train_loss=\d+\.\d{3}\.ckpt$")

# Runs the trainer and SIGKILLs the process right after it logs a given step.
KILL_AFTER_LOG = """
import json, os, signal, sys
from dpflow_core.train import app, workspace
kill_at = int(os.environ["DPFLOW_TEST_KILL_AT_STEP"])
log = workspace.Workspace._log
def _log(self, record):
    log(self, record)
    if record["global_step"] == kill_at and "epoch_summary" not in record:
        loaded = sorted(m for m in sys.modules if m.split(".")[0] == "wandb")
        with open(os.environ["DPFLOW_TEST_MODULES"], "w") as f:
            json.dump(loaded, f)
        os.kill(os.getpid(), signal.SIGKILL)
workspace.Workspace._log = _log
app.main()
"""


@pytest.fixture
def one_thread():
    """One torch thread: on a small, shared machine two spinning threads are much slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "dataset.npz"
    return write_synthetic_dataset(path, n_episodes=4, episode_length=40, image_size=(32, 32))


@pytest.fixture
def env(tmp_path):
    e = dict(os.environ)
    # one thread per process: the machine is small and shared; also the same in every run
    e.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TQDM_DISABLE="1", WANDB_DIR=str(tmp_path / "wandb_dir"))
    return e


def _train(args, env, module=True, timeout=300, check=True):
    head = [sys.executable, "-m", "dpflow_core.train"] if module else [sys.executable, "-c", KILL_AFTER_LOG]
    proc = subprocess.run(head + list(args), env=env, capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _tiny(dataset, run_dir, *extra):
    return ["--config-name=tiny", f"task.dataset_path={dataset}", f"hydra.run.dir={run_dir}", *extra]


def _compose(dataset, *overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR)):
        return compose("tiny", overrides=[f"task.dataset_path={dataset}", *overrides])


def _steps(records):
    return [r for r in records if "epoch_summary" not in r]


def _assert_same_state(a: dict, b: dict, keys=("model", "policy")) -> None:
    for key in keys:
        assert a[key].keys() == b[key].keys()
        for name in a[key]:
            assert torch.equal(a[key][name], b[key][name]), f"{key}.{name} differs"


@pytest.mark.slow
def test_resume_after_kill_matches_straight_run_bit_for_bit(tmp_path, dataset, env):
    # 3 epochs x 4 batches; latest.ckpt also every 6 steps, i.e. in the middle of epoch 1.
    common = [
        "logging.mode=disabled",
        "training.num_epochs=3",
        "training.max_train_steps=4",
        "checkpoint.every_n_steps=6",
        "checkpoint.topk.k=2",
    ]
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    # the uninterrupted run in this process (one trainer start-up fewer); the killed and the resumed one
    # are processes of their own, as users run them: the logs and states must still agree bit for bit
    train(_compose(dataset, *common), straight)

    modules = tmp_path / "modules.json"
    kill_env = env | {"DPFLOW_TEST_KILL_AT_STEP": "7", "DPFLOW_TEST_MODULES": str(modules)}
    killed = _train(_tiny(dataset, broken, *common), kill_env, module=False, check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert json.loads(modules.read_text()) == []  # logging.mode=disabled never imports wandb
    at_kill = ckpt.load_checkpoint(broken / "checkpoints" / "latest.ckpt")
    assert (at_kill["epoch"], at_kill["batch_in_epoch"], at_kill["global_step"]) == (1, 2, 6)
    assert [r["global_step"] for r in _steps(read_json_log(broken / "logs.json.txt"))] == list(range(8))

    resumed = _train(_tiny(dataset, broken, *common, "training.resume=true"), env)
    assert "resumed from" in resumed.stdout and "dropped 2 log lines" in resumed.stdout

    log_a, log_b = read_json_log(straight / "logs.json.txt"), read_json_log(broken / "logs.json.txt")
    assert [r["global_step"] for r in _steps(log_a)] == list(range(12))
    untimed = [[{k: v for k, v in r.items() if k != "data_time_s"} for r in log] for log in (log_a, log_b)]
    assert untimed[0] == untimed[1]  # every loss, learning rate, validation loss and action MSE, exactly
    assert len(log_a) == 12 + 3 and len({r["lr"] for r in _steps(log_a)}) > 3

    a = ckpt.load_checkpoint(straight / "checkpoints" / "latest.ckpt")
    b = ckpt.load_checkpoint(broken / "checkpoints" / "latest.ckpt")
    assert a["global_step"] == b["global_step"] == 12 and a["epoch"] == b["epoch"] == 3
    _assert_same_state(a, b)
    assert a["ema"] == b["ema"] and a["ema"]["optimization_step"] == 12
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    for k, st in a["optimizer"]["state"].items():
        for name, value in st.items():
            assert torch.equal(value, b["optimizer"]["state"][k][name]), f"optimizer state {k}.{name}"
    assert a["lr_scheduler"] == b["lr_scheduler"]
    assert torch.equal(a["rank_states"][0]["rng"]["torch"], b["rank_states"][0]["rng"]["torch"])
    names_a = sorted(p.name for p in (straight / "checkpoints").iterdir())
    assert names_a == sorted(p.name for p in (broken / "checkpoints").iterdir())
    assert len(names_a) == 3 and all(TOPK_NAME.match(n) for n in names_a if n != "latest.ckpt")


@pytest.mark.slow
def test_offline_wandb_logs_run_directory_and_resume_guards(tmp_path, dataset, env, one_thread):
    run = tmp_path / "run"
    started = time.monotonic()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dpflow_core.train",
            *_tiny(dataset, run, "logging.mode=offline", "training.num_epochs=2", "training.max_train_steps=3"),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    elapsed = time.monotonic() - started

    wandb_runs = list((tmp_path / "wandb_dir" / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 1 and list(wandb_runs[0].glob("run-*.wandb")), elapsed

    records = read_json_log(run / "logs.json.txt")
    lines = (run / "logs.json.txt").read_text().splitlines()
    assert len(lines) == len(records) == 2 * 3 + 2
    steps = _steps(records)
    assert [set(r) for r in steps] == [STEP_KEYS] * 6
    assert [r["global_step"] for r in steps] == list(range(6)) and [r["epoch"] for r in steps] == [0, 0, 0, 1, 1, 1]
    summaries = [r for r in records if r.get("epoch_summary")]
    assert [s["epoch"] for s in summaries] == [0, 1] and [s["global_step"] for s in summaries] == [2, 5]
    for s in summaries:
        assert {"val_loss", "train_action_mse_error", "val_action_mse_error"} <= set(s)
        assert s["val_loss"] > 0 and s["train_action_mse_error"] > 0
    # a trailing partial line (a run being written) is skipped by the reader
    with open(run / "logs.json.txt", "a") as f:
        f.write('{"train_loss": 0.1, "glo')
    assert read_json_log(run / "logs.json.txt") == records

    overrides = (run / ".hydra" / "overrides.yaml").read_text()
    assert "training.max_train_steps=3" in overrides and (run / ".hydra" / "config.yaml").is_file()
    latest = ckpt.load_checkpoint(run / "checkpoints" / "latest.ckpt")
    assert latest["wandb_id"] and wandb_runs[0].name.endswith(latest["wandb_id"])
    assert ckpt.missing_checkpoint_entries(latest) == []

    # evaluation rebuilds the EMA policy and cuts samples exactly as training did
    policy = load_policy(run / "checkpoints" / "latest.ckpt")
    cfg, spec = policy.cfg, policy.spec
    # tiny: no latency, so no shift (tests/core/train/test_representation.py covers the shifts)
    assert cfg.training.max_train_steps == 3 and spec.obs_latency_steps["robot0_eef_pos"] == 0.0
    assert spec.obs_pose_repr == spec.action_pose_repr == "relative"
    assert latest["dataset"]["sha256"] == sha256_file(dataset) and latest["tx_cam_tcp"] == np.eye(4).tolist()
    for name, value in policy.network.state_dict().items():
        assert torch.equal(value, latest["policy"][name])
    assert any(not torch.equal(latest["policy"][k], latest["model"][k]) for k in latest["model"])
    buffer = ReplayBuffer(dataset)
    samples = SequenceDataset(buffer, spec, np.ones(buffer.n_episodes, bool))
    out = policy.network.predict_action(samples.collate([0, 5, 9])["obs"])
    assert out["action_pred"].shape == (3, 8, 10) and out["action"].shape == (3, 4, 10)
    absolute = policy.predict_samples(buffer, samples.index[[0, 5, 9]])
    assert absolute.shape == (3, 8, 7) and np.isfinite(absolute).all()

    # (in this process, to spare two start-ups) the same directory without
    # training.resume=true is refused; a checkpoint lacking an entry fails loudly on resume
    with pytest.raises(RunError, match="already holds a run"):
        train(_compose(dataset, "logging.mode=disabled"), run)
    del latest["optimizer"]
    torch.save(latest, run / "checkpoints" / "latest.ckpt")
    with pytest.raises(RunError, match="missing: optimizer"):
        train(_compose(dataset, "logging.mode=disabled", "training.resume=true"), run)
    with pytest.raises(RunError, match="no checkpoint to resume from"):
        train(_compose(dataset, "logging.mode=disabled", "training.resume=true"), tmp_path / "empty")
    assert records == read_json_log(run / "logs.json.txt")  # nothing was written by the refused runs


def test_misspelled_and_added_keys_fail_before_any_work(tmp_path, dataset, env):
    for bad, words in [
        ("training.num_epoch=3", ["num_epoch"]),
        ("task.dataset_frequency=30", ["dataset_frequency"]),  # the real key is dataset_frequeny
        ("dataloader.batchsize=8", ["batchsize"]),
        ("+training.foo=1", ["+training.foo=1", "not allowed"]),
    ]:
        run = tmp_path / bad.replace("=", "_").replace("+", "")
        proc = _train(_tiny(dataset, run, bad, "logging.mode=disabled"), env, check=False, timeout=120)
        assert proc.returncode != 0, bad
        for word in words:
            assert word in proc.stderr, proc.stderr[-2000:]
        assert not run.exists()


KILL_DURING_SAVE = """
import io, sys, time, torch
from pathlib import Path
from dpflow_core.train import checkpoint
real_save = torch.save
def half_written_then_hang(obj, f):
    buf = io.BytesIO()
    real_save(obj, buf)
    data = buf.getvalue()
    f.write(data[: len(data) // 2])
    f.flush()
    Path(sys.argv[2]).write_text("half written")
    time.sleep(600)
torch.save = half_written_then_hang
checkpoint.atomic_save({"format": "new", "weights": torch.ones(1000)}, sys.argv[1])
"""


def test_kill_during_save_leaves_previous_latest_intact(tmp_path, env):
    latest = tmp_path / "checkpoints" / "latest.ckpt"
    ckpt.atomic_save({"format": "old", "weights": torch.zeros(1000)}, latest)
    before = latest.read_bytes()
    flag = tmp_path / "flag"
    proc = subprocess.Popen([sys.executable, "-c", KILL_DURING_SAVE, str(latest), str(flag)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not flag.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the saving process ended early"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert latest.read_bytes() == before
    assert torch.load(latest, weights_only=True)["format"] == "old"
    leftovers = [p for p in latest.parent.iterdir() if p != latest]
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".latest.ckpt.tmp-") and leftovers[0].stat().st_size > 0
    assert ckpt.remove_stale_temp_files(latest.parent) == leftovers and list(latest.parent.iterdir()) == [latest]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_accelerate_processes_train_save_and_resume(tmp_path, dataset, env):
    run = tmp_path / "run"

    def launch(*extra):
        cmd = [
            sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_ip", "127.0.0.1", "--main_process_port", str(_free_port()),
            "-m", "dpflow_core.train", *_tiny(dataset, run, "logging.mode=disabled", "training.max_train_steps=3", *extra),
        ]  # fmt: skip
        proc = subprocess.run(
            cmd, env=env | {"ACCELERATE_USE_CPU": "true"}, capture_output=True, text=True, timeout=400
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
        return proc

    launch("training.num_epochs=2")
    first = ckpt.load_checkpoint(run / "checkpoints" / "latest.ckpt")
    assert first["num_processes"] == 2 and len(first["rank_states"]) == 2
    # each process drew its own noise: their RNG states differ
    assert not torch.equal(first["rank_states"][0]["rng"]["torch"], first["rank_states"][1]["rng"]["torch"])
    assert first["sampler"]["num_replicas"] == 2 and (first["epoch"], first["global_step"]) == (2, 6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no second run directory
    assert (run / ".hydra" / "config.yaml").is_file()

    second = launch("training.num_epochs=3", "training.resume=true")
    assert "resumed from" in second.stdout + second.stderr
    last = ckpt.load_checkpoint(run / "checkpoints" / "latest.ckpt")
    assert (last["epoch"], last["global_step"]) == (3, 9)
    steps = _steps(read_json_log(run / "logs.json.txt"))
    assert [r["global_step"] for r in steps] == list(range(9))
    assert [r["epoch"] for r in steps] == [0] * 3 + [1] * 3 + [2] * 3
    # the weights moved on after the resume
    assert any(not torch.equal(first["model"][k], last["model"][k]) for k in first["model"])


def test_default_config_is_the_224_to2_horizon16_setup(tmp_path, dataset, one_thread):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from dpflow_core.errors import DatasetError
    from dpflow_core.train.data import ObsActionSpec
    from dpflow_core.train.policy import build_policy

    with initialize_config_dir(config_dir=str(CONFIG_DIR)):
        cfg = compose("train_diffusion_unet_image", overrides=[f"task.dataset_path={dataset}"])
    assert list(cfg.task.image_size) == [224, 224] and cfg.n_obs_steps == 2 and cfg.horizon == 16
    assert cfg.task.dataset_frequeny is None and cfg.training.mixed_precision == "no" and cfg.logging.mode == "offline"
    # the 32x32 test dataset does not match the default's 224x224
    with pytest.raises(DatasetError, match=r"task.image_size=\[224, 224\]"):
        train(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()

    meta = {
        "rgb": {"camera0_rgb": [224, 224, 3]},
        "lowdim": {"robot0_eef_pos": 3, "robot0_eef_rot_axis_angle": 6, "robot0_gripper_width": 1},
        "action_dim": 10,
    }
    stats = {
        k: {s: np.zeros(d, np.float32) + (1.0 if s in ("max", "std") else 0.0) for s in ("min", "max", "mean", "std")}
        for k, d in [*meta["lowdim"].items(), ("action", 10)]
    }
    policy = build_policy(
        OmegaConf.to_container(cfg.policy), ObsActionSpec(n_obs_steps=2, horizon=16), cfg.n_action_steps, meta, stats
    )
    obs = {"camera0_rgb": torch.randint(0, 256, (2, 2, 224, 224, 3), dtype=torch.uint8)}
    obs |= {k: torch.rand(2, 2, d) for k, d in meta["lowdim"].items()}
    loss = policy({"obs": obs, "action": torch.rand(2, 16, 10)})
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert policy.obs_encoder.crop_hw["camera0_rgb"] == (213, 213) and policy.obs_encoder.output_dim == 2 * (512 + 10)


def test_episodes_too_short_for_the_horizon_are_a_clear_error(tmp_path, one_thread):
    from dpflow_core.errors import DatasetError

    short = write_synthetic_dataset(tmp_path / "short.npz", n_episodes=3, episode_length=7)
    # tiny: horizon 8, no down-sampling -> at least 8 frames per episode
    with pytest.raises(DatasetError, match="no training sample.*shorter than 8 frames"):
        train(_compose(short, "logging.mode=disabled"), tmp_path / "run")
    one = write_synthetic_dataset(tmp_path / "one.npz", n_episodes=1, episode_length=20)
    with pytest.raises(DatasetError, match="at least 2 episodes"):
        train(_compose(one, "logging.mode=disabled"), tmp_path / "run")
    assert not (tmp_path / "run").exists()

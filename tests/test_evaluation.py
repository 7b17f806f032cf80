"""Offline evaluation on held-out episodes: metrics, the constant baseline, plots, refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from synthetic_dataset import write_synthetic_dataset

from dpflow_core.errors import DatasetError, RunError
from dpflow_core.evaluation import evaluate_checkpoint, held_out_split, read_loss_curve

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def train_in_process(dataset: Path, run_dir: Path, *overrides: str) -> Path:
    """Train the built-in trainer's demo config in this process; return ``latest.ckpt``."""
    from hydra import compose, initialize_config_dir

    from dpflow_core.train.app import CONFIG_DIR
    from dpflow_core.train.workspace import train

    with initialize_config_dir(config_dir=str(CONFIG_DIR)):
        cfg = compose("demo", overrides=[f"task.dataset_path={dataset}", "logging.mode=disabled", *overrides])
    train(cfg, run_dir)
    return run_dir / "checkpoints" / "latest.ckpt"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "dataset.npz"
    return write_synthetic_dataset(path, n_episodes=8, episode_length=40, image_size=(32, 32), frequency_hz=10.0)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, dataset) -> Path:
    """A checkpoint that learned something: 3 epochs x 8 batches of the demo config."""
    run_dir = tmp_path_factory.mktemp("run") / "trained"
    return train_in_process(dataset, run_dir, "training.num_epochs=3", "training.max_train_steps=8", "dataloader.batch_size=16")


def test_metrics_baseline_and_plots(trained, dataset, tmp_path):
    from dpflow_core.replay_buffer import ReplayBuffer
    from dpflow_core.train.data import split_episodes

    log = trained.parent.parent / "logs.json.txt"
    result = evaluate_checkpoint(trained, dataset, tmp_path / "eval", log_path=log, max_samples_per_episode=12)

    train_mask, val_mask = split_episodes(8, 0.25, 42)  # the demo config's task.val_ratio and split_seed
    assert result.held_out_episodes == tuple(np.flatnonzero(val_mask)) and result.train_episodes == 6
    assert result.n_samples == 12 * len(result.held_out_episodes) and result.horizon == 8
    assert result.dimension_names == (
        "position.x", "position.y", "position.z", "rotation.rx", "rotation.ry", "rotation.rz", "gripper.width",
    )

    # The baseline is the mean action over the training episodes' steps, computed here from the raw arrays.
    buf = ReplayBuffer(dataset)
    steps = np.concatenate([np.arange(buf.episode_slice(e).start, buf.episode_slice(e).stop) for e in np.flatnonzero(train_mask)])
    raw = np.concatenate([buf[k][steps] for k in ("robot0_eef_pos", "robot0_eef_rot_axis_angle", "robot0_gripper_width")], axis=1)
    assert np.allclose(result.baseline_action, raw.astype(np.float64).mean(axis=0), atol=1e-7)

    # Overall and per-group MSE are means of the per-dimension ones.
    assert result.policy_mse == pytest.approx(np.mean(result.policy_mse_per_dim))
    assert result.baseline_mse == pytest.approx(np.mean(result.baseline_mse_per_dim))
    assert result.policy_mse_per_group["position"] == pytest.approx(np.mean(result.policy_mse_per_dim[:3]))
    assert result.baseline_mse_per_group["gripper"] == pytest.approx(result.baseline_mse_per_dim[6])
    assert result.beats_baseline and result.policy_mse < result.baseline_mse, result.markdown_table()
    assert 0 < result.improvement < 1

    for plot in (result.trajectory_plot, result.loss_plot):
        data = Path(plot).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000
    curve = read_loss_curve(log)
    # 6 training episodes x (40 - 7) anchors = 198 samples: 13 batches of 16, capped at 8 per epoch.
    assert len(curve["train_loss"]) == 3 * 8 and len(curve["epoch_train_loss"]) == 3 and len(curve["val_loss"]) == 3
    assert (tmp_path / "eval" / "evaluation.json").is_file()
    with pytest.raises(RunError) as err:  # results are never overwritten unless asked
        evaluate_checkpoint(trained, dataset, tmp_path / "eval")
    assert err.value.code == "exists"


def test_a_policy_that_learned_nothing_does_not_beat_the_baseline(tmp_path, dataset):
    # Untrained weights (lr 0) predicting noise (epsilon), as the GPU config does. (An untrained
    # sample-predicting net outputs about the middle of the normaliser's range, which on a few short
    # synthetic episodes can land closer to the held-out ones than the training mean does.)
    untrained = train_in_process(
        dataset, tmp_path / "untrained", "optimizer.lr=0.0", "policy.noise_scheduler.prediction_type=epsilon",
        "training.num_epochs=1", "training.max_train_steps=1",
    )
    result = evaluate_checkpoint(untrained, dataset, tmp_path / "eval", max_samples_per_episode=12)
    assert not result.beats_baseline and result.policy_mse > result.baseline_mse


def test_refuses_another_dataset_and_a_run_without_held_out_episodes(trained, tmp_path):
    from omegaconf import OmegaConf

    other = write_synthetic_dataset(tmp_path / "other.npz", n_episodes=4, episode_length=45, image_size=(32, 32))
    with pytest.raises(DatasetError) as err:
        evaluate_checkpoint(trained, other, tmp_path / "eval")
    assert err.value.code == "dataset_mismatch" and "n_episodes=8" in err.value.reason
    with pytest.raises(RunError) as err:
        held_out_split(OmegaConf.create({"task": {"val_ratio": 0.0, "split_seed": 1}}), 4)
    assert err.value.code == "no_held_out_episodes"

"""Sample timing on a dataset whose keys are known functions of time, and a tiny policy that
learns relative actions and predicts the right absolute poses through dpflow_core.inference."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy.spatial.transform import Rotation

from dpflow_core import pose as P
from dpflow_core.inference import Policy
from dpflow_core.replay_buffer import ReplayBuffer
from dpflow_core.train import data as D
from dpflow_core.train.batches import SequenceDataset
from dpflow_core.train.policy import build_policy
from tests.synthetic_dataset import write_npz

FREQ = 10.0
STEPS = 120


def _buffer(path, poses: list[np.ndarray], grip: list[np.ndarray], frames: list[np.ndarray]) -> ReplayBuffer:
    """A replay buffer from per-episode poses ``(T, 6)``, widths ``(T,)`` and frames ``(T, 8, 8, 3)``."""
    lengths = [len(p) for p in poses]
    pose = np.concatenate(poses)
    arrays = {
        "data__camera0_rgb": np.concatenate(frames),
        "data__robot0_eef_pos": pose[:, :3].astype(np.float32),
        "data__robot0_eef_rot_axis_angle": pose[:, 3:].astype(np.float32),
        "data__robot0_gripper_width": np.concatenate(grip)[:, None].astype(np.float32),
        "data__robot0_demo_start_pose": np.concatenate([np.repeat(p[:1], len(p), 0) for p in poses]).astype(np.float32),
        "data__robot0_demo_end_pose": np.concatenate([np.repeat(p[-1:], len(p), 0) for p in poses]).astype(np.float32),
        "data__timestamp": np.concatenate([np.arange(n) / FREQ for n in lengths]),
        "meta__episode_ends": np.cumsum(lengths).astype(np.int64),
        "meta__info_json": np.frombuffer(
            json.dumps({"frequency_hz": FREQ, "n_episodes": len(lengths), "image_size": [8, 8]}).encode(), np.uint8
        ).copy(),
    }
    return ReplayBuffer(write_npz(path, arrays))


@pytest.fixture(scope="module")
def clock(tmp_path_factory) -> ReplayBuffer:
    """One 40-step episode: x = t, y = 2t (m), a rotation of 0.3 rad/s about z, width 0.01 + 0.02 t; frame value = step."""
    t = np.arange(40) / FREQ
    pose = np.stack([t, 2 * t, np.zeros_like(t), np.zeros_like(t), np.zeros_like(t), 0.3 * t], axis=1)
    frames = np.broadcast_to(np.arange(40, dtype=np.uint8)[:, None, None, None], (40, 8, 8, 3)).copy()
    return _buffer(tmp_path_factory.mktemp("clock") / "clock.npz", [pose], [0.01 + 0.02 * t], [frames])


def test_each_sample_key_reads_the_time_of_the_table(clock):
    # camera 0.1 s late, robot 0.02 s, gripper 0.05 s: the pose is read (0.1 - 0.02) x 10 = 0.8 steps
    # after each camera frame, the width 0.5 steps after it; actions start at the camera's time
    lat = D.latency_steps(D.DEFAULT_LOWDIM_KEYS, 0.1, 0.02, 0.05, FREQ)
    assert lat == pytest.approx({"robot0_eef_pos": 0.8, "robot0_eef_rot_axis_angle": 0.8, "robot0_gripper_width": 0.5})
    spec = D.ObsActionSpec(
        n_obs_steps=3, horizon=4, obs_down_sample_steps=2, action_down_sample_steps=3,
        obs_latency_steps=lat, obs_pose_repr="abs", action_pose_repr="abs",
    )
    ds = SequenceDataset(clock, spec, np.ones(1, bool))
    anchor = 20
    s = ds.samples([int(np.flatnonzero(ds.index[:, 0] == anchor)[0])])
    cam_steps = anchor - np.array([4, 2, 0])
    np.testing.assert_array_equal(s["obs"]["camera0_rgb"][0, :, 0, 0, 0], cam_steps)
    t_pose = (cam_steps + 0.8) / FREQ
    np.testing.assert_allclose(s["obs"]["robot0_eef_pos"][0], np.stack([t_pose, 2 * t_pose, 0 * t_pose], 1), atol=1e-6)
    rot = P.rot6d_to_rotvec(s["obs"]["robot0_eef_rot_axis_angle"][0])
    np.testing.assert_allclose(rot[:, 2], 0.3 * t_pose, atol=1e-6)
    np.testing.assert_allclose(s["obs"]["robot0_gripper_width"][0, :, 0], 0.01 + 0.02 * (cam_steps + 0.5) / FREQ, atol=1e-6)
    t_act = (anchor + 3 * np.arange(4)) / FREQ
    np.testing.assert_allclose(s["action"][0, :, :3], np.stack([t_act, 2 * t_act, 0 * t_act], 1), atol=1e-6)
    np.testing.assert_allclose(s["action"][0, :, 9], 0.01 + 0.02 * t_act, atol=1e-6)
    # at the episode end the shifted times are clipped to the last step (edge padding)
    last = ds.samples([len(ds) - 1])
    assert ds.index[-1, 0] == 40 - 1 - 9
    np.testing.assert_allclose(last["obs"]["robot0_eef_pos"][0, -1, 0], (30 + 0.8) / FREQ, atol=1e-6)
    # dataset_frequeny 0: no shift at all
    flat = D.ObsActionSpec(
        n_obs_steps=3, horizon=4, obs_down_sample_steps=2, obs_pose_repr="abs", action_pose_repr="abs",
        obs_latency_steps=D.latency_steps(D.DEFAULT_LOWDIM_KEYS, 0.1, 0.02, 0.05, 0.0),
    )
    s0 = SequenceDataset(clock, flat, np.ones(1, bool)).samples([anchor])
    np.testing.assert_allclose(s0["obs"]["robot0_eef_pos"][0, :, 0], cam_steps / FREQ, atol=1e-6)
    # relative: the latest observed pose is the origin, earlier ones lie behind it
    rel = D.ObsActionSpec(n_obs_steps=3, horizon=4, obs_down_sample_steps=2, obs_latency_steps=lat)
    sr = SequenceDataset(clock, rel, np.ones(1, bool)).samples([anchor])
    np.testing.assert_allclose(sr["obs"]["robot0_eef_pos"][0, -1], 0.0, atol=1e-6)
    np.testing.assert_allclose(sr["obs"]["robot0_eef_rot_axis_angle"][0, -1], [1, 0, 0, 0, 1, 0], atol=1e-6)
    back = Rotation.from_rotvec([0, 0, -0.3 * t_pose[-1]]).apply([-0.4, -0.8, 0.0])  # 4 steps back, in the current frame
    np.testing.assert_allclose(sr["obs"]["robot0_eef_pos"][0, 0], back, atol=1e-6)


def _screw_episodes(n: int, length: int, seed: int):
    """Episodes from random world poses, each repeating one body-frame step: (0.5 to 1.5) x (1 cm along x,
    0.05 rad about z), so the policy must read the speed from the observed motion."""
    rng = np.random.default_rng(seed)
    poses = []
    for speed in np.linspace(0.5, 1.5, n)[rng.permutation(n)]:
        step = P.pos_rot_to_mat(np.array([0.01, 0.0, 0.0]) * speed, np.array([0.0, 0.0, 0.05]) * speed)
        mat = P.pos_rot_to_mat(rng.uniform(-1, 1, 3), Rotation.random(random_state=rng).as_rotvec())
        track = [mat]
        for _ in range(length - 1):
            track.append(track[-1] @ step)
        poses.append(P.mat_to_pose(np.stack(track)))
    return poses


@pytest.fixture
def one_thread():
    """One torch thread: on a small, shared machine two spinning threads are much slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_tiny_relative_policy_predicts_the_right_absolute_poses_in_new_world_frames(tmp_path, one_thread):
    torch.manual_seed(0)
    poses = _screw_episodes(6, 24, seed=1)
    grip = [np.full(24, 0.05) for _ in poses]
    frames = [np.zeros((24, 8, 8, 3), np.uint8) for _ in poses]
    buffer = _buffer(tmp_path / "screw.npz", poses, grip, frames)
    tx = P.tx_from_config({"translation": [0.0, 0.0, 0.1], "rotation": [0.0, 0.3, 0.0]})
    spec = D.ObsActionSpec(
        rgb_keys=(), n_obs_steps=2, horizon=4, rot6d_norm="range", tx_cam_tcp=P.as_tuple(tx)
    )
    train_mask = np.array([True, True, True, True, True, False])
    ds = SequenceDataset(buffer, spec, train_mask)
    cfg = {
        "obs_encoder": {
            "_target_": "dpflow_core.train.policy.ObsEncoder",
            "rgb_model": {"_target_": "dpflow_core.train.vision.ResNet18GN", "base_width": 8, "feature_dim": 8},
            "crop_ratio": 1.0,
        },
        "unet": {"down_dims": [16, 32], "kernel_size": 3, "n_groups": 4, "diffusion_step_embed_dim": 8},
        "noise_scheduler": {
            "num_train_timesteps": 10, "beta_start": 1e-4, "beta_end": 0.02, "beta_schedule": "squaredcos_cap_v2",
            "clip_sample": True, "prediction_type": "sample",
        },
        "num_inference_steps": 4,
    }
    net = build_policy(cfg, spec, 2, D.shape_meta(buffer, spec), D.normalizer_stats(buffer, spec, train_mask))
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    batch = ds.collate(range(len(ds)))
    with torch.no_grad():
        first = float(net(batch))
    for _ in range(STEPS):
        loss = net(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first
    policy = Policy(net.eval(), spec, None, FREQ, {}, tmp_path / "none.ckpt")

    # the held-out episode starts in a world frame never seen in training
    held = poses[5]
    t = 12
    obs = {
        "robot0_eef_pos": held[t - 1 : t + 1, :3],
        "robot0_eef_rot_axis_angle": held[t - 1 : t + 1, 3:],
        "robot0_gripper_width": np.full((2, 1), 0.05),
        "timestamp": np.array([t - 1, t]) / FREQ,
    }
    gen = torch.Generator().manual_seed(0)
    out = policy.predict_action(obs, generator=gen, frame="dataset")
    truth = P.pose_to_mat(held[t : t + 4])
    assert out["action"].shape == (4, 7) and out["robot0_eef_pos"].shape == (4, 3)
    np.testing.assert_allclose(out["timestamp"], (t + np.arange(4)) / FREQ)
    pos_err = np.linalg.norm(out["robot0_eef_pos"] - truth[:, :3, 3], axis=1)
    rot_err = (Rotation.from_rotvec(out["robot0_eef_rot_axis_angle"]).inv() * Rotation.from_matrix(truth[:, :3, :3])).magnitude()
    # the horizon moves 3 cm and 0.15 rad; "hold" would be off by up to that much
    assert pos_err.max() < 0.004, pos_err
    assert rot_err.max() < 0.02, rot_err
    np.testing.assert_allclose(out["robot0_gripper_width"][:, 0], 0.05, atol=2e-3)
    # the TCP frame is the camera pose times tx_cam_tcp
    tcp = policy.predict_action(obs, generator=torch.Generator().manual_seed(0), frame="tcp")
    np.testing.assert_allclose(P.pose_to_mat(tcp["action"][:, :6]), P.pose_to_mat(out["action"][:, :6]) @ tx, atol=1e-6)
    # the batch function for evaluation: absolute predictions for dataset anchors, dataset frame
    rows = D.sequence_index(buffer.episode_ends, ~train_mask, spec)
    pred = policy.predict_samples(buffer, rows)
    rec = D.recorded_actions(buffer, spec, rows)
    assert pred.shape == rec.shape == (len(rows), 4, 7)
    # the episode's first anchor shows no motion yet (edge padding): its speed cannot be known
    moving = rows[:, 0] > rows[:, 1]
    err = np.linalg.norm(pred[moving, :, :3] - rec[moving, :, :3], axis=-1)
    hold = np.linalg.norm(rec[moving, :, :3] - rec[moving, :1, :3], axis=-1)
    assert err.mean() < 0.002 and err.max() < 0.008, (err.mean(), err.max())
    assert hold.max() > 0.02  # holding the current pose would be far off
    with pytest.raises(ValueError, match="n_obs_steps=2"):
        policy.predict_action({k: v[:1] for k, v in obs.items()})


def test_predict_command_replays_an_episode_and_never_overwrites_its_plot(tmp_path, one_thread, tiny_checkpoint):
    from typer.testing import CliRunner

    from dpflow_core.cli import app

    dataset, ckpt = tiny_checkpoint
    plot = tmp_path / "episode1.png"
    args = ["predict", str(ckpt), str(dataset), "--episode", "1", "-o", str(plot)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    # episode 1 has 40 frames, horizon 8: anchors 0..32
    assert np.diff(ReplayBuffer(dataset).episode_ends[:2]).tolist() == [40]
    assert "episode 1: 33 anchors" in result.output and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = CliRunner().invoke(app, args)
    assert again.exit_code != 0 and "exists already" in str(again.exception)


def test_every_shipped_config_holds_out_at_least_two_episodes_or_ten_percent():
    from hydra import compose, initialize_config_dir

    from dpflow_core.train.app import CONFIG_DIR

    names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    assert {"demo", "tiny", "train_diffusion_unet_image"} <= set(names)
    with initialize_config_dir(config_dir=str(CONFIG_DIR)):
        for name in names:
            task = compose(name, overrides=["task.dataset_path=x.npz"]).task
            assert task.pose_repr.obs_pose_repr == task.pose_repr.action_pose_repr == "relative", name
            for n_episodes in (6, 40, 200):
                _, val = D.split_episodes(n_episodes, float(task.val_ratio), int(task.split_seed), int(task.val_min_episodes))
                assert val.sum() >= min(2, n_episodes - 1) and val.sum() >= 0.1 * n_episodes - 0.5, (name, n_episodes)


def test_rotation_wrt_start_is_relative_to_the_episode_first_pose(clock):
    spec = D.ObsActionSpec(n_obs_steps=2, horizon=4, lowdim_keys=D.DEFAULT_LOWDIM_KEYS + (D.ROT_WRT_START_KEY,))
    s = SequenceDataset(clock, spec, np.ones(1, bool)).samples([20])
    # the clock episode starts with zero rotation, so w.r.t. the start is the rotation itself: 0.3 rad/s about z
    rot = P.rot6d_to_rotvec(s["obs"][D.ROT_WRT_START_KEY][0])
    np.testing.assert_allclose(rot, [[0, 0, 0.3 * 1.9], [0, 0, 0.3 * 2.0]], atol=1e-6)

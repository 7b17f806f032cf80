"""Trainer building blocks: sample cutting, batch order, normaliser, networks, checkpoint files."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dpflow_core.errors import DatasetError, RunError
from dpflow_core.replay_buffer import ReplayBuffer
from dpflow_core.train import checkpoint as ckpt
from dpflow_core.train.batches import SequenceDataset
from dpflow_core.train.data import (
    ObsActionSpec,
    latency_steps,
    normalizer_modes,
    normalizer_stats,
    sequence_index,
    shape_meta,
    split_episodes,
)
from dpflow_core.train.normalizer import LinearNormalizer
from dpflow_core.train.policy import build_policy
from dpflow_core.train.sampler import EpochBatchSampler
from dpflow_core.train.unet import ConditionalUnet1D
from tests.synthetic_dataset import write_synthetic_dataset

TINY_POLICY = {
    "obs_encoder": {
        "_target_": "dpflow_core.train.policy.ObsEncoder",
        "rgb_model": {"_target_": "dpflow_core.train.vision.ResNet18GN", "base_width": 8, "feature_dim": 16},
        "crop_ratio": 0.875,
    },
    "unet": {"down_dims": [16, 32], "kernel_size": 3, "n_groups": 8, "diffusion_step_embed_dim": 16},
    "noise_scheduler": {
        "num_train_timesteps": 10,
        "beta_start": 1e-4,
        "beta_end": 0.02,
        "beta_schedule": "squaredcos_cap_v2",
        "clip_sample": True,
        "prediction_type": "epsilon",
    },
    "num_inference_steps": 3,
}


@pytest.fixture
def one_thread():
    """One torch thread: on a small, shared machine two spinning threads are much slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def buffer(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds") / "dataset.npz"
    return ReplayBuffer(write_synthetic_dataset(path, n_episodes=3, episode_length=[12, 6, 10], image_size=(32, 32)))


def test_sequence_index_respects_episode_bounds_and_horizon(buffer):
    spec = ObsActionSpec(horizon=4, action_down_sample_steps=2)
    # (4 - 1) * 2 + 1 = 7 frames needed: episode 1 (6 frames) gives nothing.
    assert spec.min_episode_length == 7
    idx = sequence_index(buffer.episode_ends, np.ones(3, bool), spec)
    assert idx[:, 0].tolist() == list(range(0, 6)) + list(range(18, 22))
    assert set(map(tuple, idx[:, 1:].tolist())) == {(0, 12), (18, 28)}
    padded = sequence_index(
        buffer.episode_ends, np.array([False, True, False]), ObsActionSpec(horizon=4, action_padding=True)
    )
    assert padded[:, 0].tolist() == list(range(12, 18))


def test_samples_pad_at_edges_and_read_lowdim_after_the_camera(buffer):
    spec = ObsActionSpec(
        n_obs_steps=3,
        horizon=4,
        obs_down_sample_steps=2,
        action_down_sample_steps=1,
        obs_latency_steps={"robot0_eef_pos": 1.0, "robot0_eef_rot_axis_angle": 1.0},
        obs_pose_repr="abs",
        action_pose_repr="abs",
        action_padding=True,
    )
    ds = SequenceDataset(buffer, spec, np.array([True, False, False]))
    pos = np.asarray(buffer["robot0_eef_pos"])
    rgb = np.asarray(buffer["camera0_rgb"])
    first = ds[0]  # anchor 0: history is the first frame repeated; the pose one step later
    np.testing.assert_allclose(first["obs"]["robot0_eef_pos"].numpy(), pos[[0, 0, 1]], atol=1e-7)
    np.testing.assert_allclose(first["action"][:, :3].numpy(), pos[[0, 1, 2, 3]], atol=1e-7)
    s = ds[5]  # anchor 5: camera at 1, 3, 5; the pose one step after each: 2, 4, 6
    np.testing.assert_allclose(s["obs"]["robot0_eef_pos"].numpy(), pos[[2, 4, 6]], atol=1e-7)
    np.testing.assert_array_equal(s["obs"]["camera0_rgb"].numpy(), rgb[[1, 3, 5]])
    assert s["obs"]["camera0_rgb"].dtype == torch.uint8
    assert s["obs"]["robot0_eef_rot_axis_angle"].shape == (3, 6)  # rot6d
    last = ds[11]  # anchor 11, the episode's last frame: actions repeat it, the shifted pose is clipped
    np.testing.assert_allclose(last["action"][:, :3].numpy(), pos[[11, 11, 11, 11]], atol=1e-7)
    np.testing.assert_allclose(last["obs"]["robot0_eef_pos"][-1].numpy(), pos[11], atol=1e-7)
    grip = np.asarray(buffer["robot0_gripper_width"])
    np.testing.assert_array_equal(last["action"][:, 9].numpy(), grip[[11, 11, 11, 11], 0])
    assert last["action"].shape == (4, 10)


def test_latency_steps_and_split():
    keys = ("robot0_eef_pos", "robot0_gripper_width")
    lat = latency_steps(keys, 0.125, 0.0001, 0.02, 30.0)
    assert lat == pytest.approx({"robot0_eef_pos": 0.1249 * 30, "robot0_gripper_width": 0.105 * 30})
    assert latency_steps(keys, 0.125, 0.0001, 0.02, 0.0) == {"robot0_eef_pos": 0.0, "robot0_gripper_width": 0.0}
    with pytest.raises(ValueError, match="robot_obs_latency"):
        latency_steps(keys, 0.1, -1.0, 0.0, 30.0)
    assert split_episodes(6, 0.1, seed=3, min_val_episodes=2)[1].sum() == 2
    assert split_episodes(30, 0.1, seed=3, min_val_episodes=2)[1].sum() == 3
    train, val = split_episodes(20, 0.1, seed=3)
    assert val.sum() == 2 and not (train & val).any() and (train | val).all()
    assert (split_episodes(20, 0.1, seed=3)[1] == val).all()
    assert split_episodes(5, 0.0, 0)[1].sum() == 0
    assert split_episodes(2, 0.9, 0)[1].sum() == 1
    with pytest.raises(ValueError, match="at least 2 episodes"):
        split_episodes(1, 0.1, 0)


def test_batch_order_depends_on_seed_and_epoch_only_and_resumes_mid_epoch():
    s = EpochBatchSampler(50, 8, shuffle=True, seed=7)
    s.set_epoch(2)
    full = list(s)
    assert len(full) == 7 and sorted(sum(full, [])) == list(range(50))
    again = EpochBatchSampler(50, 8, shuffle=True, seed=7)
    again.set_epoch(2, start_batch=3)
    assert list(again) == full[3:] and len(again) == 4
    other = EpochBatchSampler(50, 8, shuffle=True, seed=7)
    other.set_epoch(3)
    assert list(other) != full
    capped = EpochBatchSampler(50, 8, shuffle=True, seed=7, max_batches=2)
    capped.set_epoch(2)
    assert list(capped) == full[:2]
    assert s.batch(2, 4) == full[4]


def test_shards_are_equal_sized_and_cover_the_epoch():
    shards = [EpochBatchSampler(11, 2, shuffle=True, seed=1, num_replicas=2, rank=r) for r in range(2)]
    for sh in shards:
        sh.set_epoch(0)
    a, b = (sum(list(sh), []) for sh in shards)
    assert len(a) == len(b) == 6
    assert set(a) | set(b) == set(range(11))
    assert shards[0].batches_per_epoch() == shards[1].batches_per_epoch() == 3
    assert shards[0].order_differences(shards[1].state_dict()) == []
    st = shards[0].state_dict() | {"num_replicas": 4}
    assert any("num_replicas" in d for d in shards[0].order_differences(st))


def test_normalizer_fits_the_representation_ranges_positions_and_passes_rot6d(buffer):
    spec = ObsActionSpec(horizon=4, obs_pose_repr="abs", action_pose_repr="abs")
    stats = normalizer_stats(buffer, spec)
    assert set(stats) == {"robot0_eef_pos", "robot0_eef_rot_axis_angle", "robot0_gripper_width", "action"}
    # every sample's actions: episodes 0 and 2 (episode 1 is too short for H=4) minus their last 3 steps as anchors
    rows = sequence_index(buffer.episode_ends, np.ones(3, bool), spec)
    pos = np.asarray(buffer["robot0_eef_pos"], dtype=np.float64)
    used = np.unique(np.clip(rows[:, :1] + np.arange(4), rows[:, 1:2], rows[:, 2:3] - 1))
    np.testing.assert_allclose(stats["action"]["min"][:3], pos[used].min(0), rtol=1e-6)
    np.testing.assert_allclose(stats["action"]["max"][:3], pos[used].max(0), rtol=1e-6)
    assert stats["action"]["min"].shape == (10,) and stats["robot0_eef_rot_axis_angle"]["min"].shape == (6,)
    norm = LinearNormalizer(stats, normalizer_modes(spec, {"robot0_eef_pos": 3, "robot0_eef_rot_axis_angle": 6,
                                                           "robot0_gripper_width": 1}))
    ds = SequenceDataset(buffer, spec, np.ones(3, bool))
    act = ds.collate(range(len(ds)))["action"].reshape(-1, 10)
    y = norm.normalize("action", act)
    assert torch.allclose(y.min(0).values[:3], torch.tensor(-1.0), atol=1e-5)
    assert torch.allclose(y.max(0).values[:3], torch.tensor(1.0), atol=1e-5)
    assert torch.equal(y[:, 3:9], act[:, 3:9])  # rot6d passes through
    assert torch.allclose(norm.unnormalize("action", y), act, atol=1e-6)
    gauss = LinearNormalizer(stats, {"action": ["gaussian"] * 3 + ["identity"] * 7})
    g = gauss.normalize("action", act)
    np.testing.assert_allclose(g[:, :3].mean(0).numpy(), 0.0, atol=1e-4)
    np.testing.assert_allclose(g[:, :3].std(0, unbiased=False).numpy(), 1.0, atol=1e-4)
    with pytest.raises(ValueError, match="modes"):
        LinearNormalizer(stats, {"action": ["range"] * 3})
    # fitted on some episodes only: the statistics are those of exactly their samples
    mask = np.array([False, False, True])
    start, end = int(buffer.episode_ends[1]), int(buffer.episode_ends[2])
    sub = normalizer_stats(buffer, spec, mask)
    np.testing.assert_allclose(sub["action"]["max"][:3], pos[start:end].max(0), rtol=1e-6)
    rebuilt = LinearNormalizer(norm.stats())
    rebuilt.load_state_dict(norm.state_dict())
    assert torch.equal(rebuilt.normalize("action", act), y)


def test_unet_shapes_and_horizon_check(one_thread):
    net = ConditionalUnet1D(7, 10, diffusion_step_embed_dim=16, down_dims=[16, 32, 64], kernel_size=3, n_groups=8)
    out = net(torch.randn(2, 8, 7), torch.tensor([0, 5]), torch.randn(2, 10))
    assert out.shape == (2, 8, 7)
    assert net(torch.randn(2, 8, 7), 3, torch.randn(2, 10)).shape == (2, 8, 7)
    with pytest.raises(ValueError, match="divisible by 4"):
        net(torch.randn(2, 6, 7), 3, torch.randn(2, 10))


def test_policy_learns_and_predicts_in_dataset_units(buffer, one_thread):
    torch.manual_seed(0)
    spec = ObsActionSpec(n_obs_steps=2, horizon=4)
    ds = SequenceDataset(buffer, spec, np.array([True, False, True]))
    policy = build_policy(TINY_POLICY, spec, 2, shape_meta(buffer, spec), normalizer_stats(buffer, spec))
    batch = ds.collate(range(len(ds)))
    opt = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    first = float(policy(batch).detach())
    for _ in range(30):
        loss = policy(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(policy(batch).detach()) < first
    policy.eval()
    out = policy.predict_action(batch["obs"])
    assert out["action_pred"].shape == (len(ds), 4, 10) and out["action"].shape == (len(ds), 2, 10)
    # clipped samples unnormalise inside the dataset's range; rot6d (passed through) inside [-1, 1]
    ranged = [0, 1, 2, 9]
    lo = policy.normalizer.stats()["action"]["min"][ranged] - 1e-4
    hi = policy.normalizer.stats()["action"]["max"][ranged] + 1e-4
    pred = out["action_pred"]
    assert ((pred[..., ranged] >= lo) & (pred[..., ranged] <= hi)).all()
    assert (pred[..., 3:9].abs() <= 1.0).all()


def test_atomic_save_replaces_and_cleans_up(tmp_path):
    path = tmp_path / "latest.ckpt"
    ckpt.atomic_save({"a": torch.arange(3)}, path)
    ckpt.atomic_save({"a": torch.arange(4)}, path)
    assert torch.equal(torch.load(path, weights_only=True)["a"], torch.arange(4))
    assert [p.name for p in tmp_path.iterdir()] == ["latest.ckpt"]
    copy = ckpt.atomic_copy(path, tmp_path / "epoch=0001-train_loss=0.100.ckpt")
    ckpt.atomic_save({"a": torch.arange(5)}, path)  # a new inode: the top-k file keeps its content
    assert torch.equal(torch.load(copy, weights_only=True)["a"], torch.arange(4))
    stale = tmp_path / ".latest.ckpt.tmp-999999"
    stale.write_bytes(b"partial")
    assert ckpt.remove_stale_temp_files(tmp_path) == [stale] and not stale.exists()


def test_topk_keeps_best_and_evicts_worst(tmp_path):
    tk = ckpt.TopKCheckpoints(tmp_path, "train_loss", "min", 2, "epoch={epoch:04d}-train_loss={train_loss:.3f}.ckpt")
    assert tk.propose({"epoch": 0, "train_loss": 0.5}) == ("epoch=0000-train_loss=0.500.ckpt", [])
    assert tk.propose({"epoch": 1, "train_loss": 0.3}) == ("epoch=0001-train_loss=0.300.ckpt", [])
    assert tk.propose({"epoch": 2, "train_loss": 0.9}) == (None, [])
    assert tk.propose({"epoch": 3, "train_loss": 0.1}) == (
        "epoch=0003-train_loss=0.100.ckpt",
        ["epoch=0000-train_loss=0.500.ckpt"],
    )
    assert tk.propose({"epoch": 4, "val_loss": 0.0}) == (None, [])
    assert set(tk.index) == {"epoch=0001-train_loss=0.300.ckpt", "epoch=0003-train_loss=0.100.ckpt"}
    (tmp_path / "epoch=0003-train_loss=0.100.ckpt").write_bytes(b"x")
    assert tk.reconcile() == ["epoch=0001-train_loss=0.300.ckpt"]
    zero = ckpt.TopKCheckpoints(tmp_path, "train_loss", "min", 0, "x.ckpt")
    assert zero.propose({"epoch": 0, "train_loss": 0.1}) == (None, [])


def test_missing_entries_and_foreign_files(tmp_path):
    assert "rank_states" in ckpt.required_checkpoint_entries()
    payload = {name: 0 for name in ckpt.REQUIRED_ENTRIES} | {"format": ckpt.FORMAT, "format_version": 1}
    payload |= {"cfg": "training:\n  mixed_precision: fp16\n  use_ema: true\n", "num_processes": 1}
    payload |= {"ema": None, "grad_scaler": {"used": True, "state": None}}
    payload |= {"rank_states": [{"rng": {"python": 0, "numpy": 0, "torch": 0}, "epoch_losses": []}]}
    missing = ckpt.missing_checkpoint_entries(payload)
    assert {"ema", "grad_scaler.state", "rank_states[0].rng.cuda"} <= set(missing)
    payload["grad_scaler"] = {"used": False, "state": None}
    assert "grad_scaler.state" not in ckpt.missing_checkpoint_entries(payload)
    del payload["optimizer"]
    assert ckpt.missing_checkpoint_entries(payload) == ["optimizer"]
    ckpt.atomic_save(payload, tmp_path / "incomplete.ckpt")
    with pytest.raises(RunError, match="missing: optimizer"):
        ckpt.load_checkpoint(tmp_path / "incomplete.ckpt")
    torch.save({"state_dict": {}}, tmp_path / "foreign.ckpt")
    with pytest.raises(RunError, match="not a dpflow trainer checkpoint"):
        ckpt.load_checkpoint(tmp_path / "foreign.ckpt")
    (tmp_path / "trunc.ckpt").write_bytes((tmp_path / "incomplete.ckpt").read_bytes()[:100])
    with pytest.raises(RunError, match="unreadable"):
        ckpt.load_checkpoint(tmp_path / "trunc.ckpt")


def test_rng_state_round_trip():
    import random

    state = ckpt.capture_rng_state()
    a = (random.random(), np.random.rand(), torch.rand(2))
    ckpt.restore_rng_state(state)
    b = (random.random(), np.random.rand(), torch.rand(2))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def test_dataset_frequency_scales_latency_and_zero_warns_loudly(buffer, caplog):
    from dpflow_core.train.data import resolve_frequency

    assert resolve_frequency(None, buffer) == 10.0  # measured, from the metadata
    with caplog.at_level("WARNING"):
        assert resolve_frequency(0, buffer) == 0.0
    assert "compensation is OFF" in caplog.text and "task.dataset_frequeny=10" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert resolve_frequency(30, buffer) == 30.0
    assert "differs from the 10 Hz measured" in caplog.text
    with pytest.raises(DatasetError, match="dataset_frequeny"):
        resolve_frequency(-1, buffer)


def test_pretrained_obs_encoder_trains_at_a_tenth_of_the_lr_in_the_umi_config(buffer, tmp_path):
    from diffusers.optimization import get_scheduler
    from hydra import compose, initialize_config_dir

    from dpflow_core.train.app import CONFIG_DIR
    from dpflow_core.train.policy import optimizer_param_groups
    from dpflow_core.train.workspace import obs_encoder_lr_scale

    weights = "policy.obs_encoder.rgb_model.pretrained_path=/weights/open_clip_pytorch_model.bin"
    with initialize_config_dir(config_dir=str(CONFIG_DIR)):
        umi = [compose("train_diffusion_unet_timm_umi", overrides=["task.dataset_path=x.npz", *extra])
               for extra in ([weights], [], [weights, "optimizer.pretrained_obs_encoder_lr_scale=0.5"])]
        image = compose("train_diffusion_unet_image", overrides=["task.dataset_path=x.npz", weights])
    # UMI: 0.1x for a pretrained encoder, the full rate for a random one; configurable; 1 elsewhere
    assert [obs_encoder_lr_scale(c) for c in umi] == [0.1, 1.0, 0.5]
    assert obs_encoder_lr_scale(image) == 1.0 and umi[0].optimizer.lr == 3.0e-4

    spec = ObsActionSpec(n_obs_steps=2, horizon=4)
    policy = build_policy(TINY_POLICY, spec, 2, shape_meta(buffer, spec), normalizer_stats(buffer, spec))
    groups = optimizer_param_groups(policy, 3.0e-4, 0.1)
    assert [g["name"] for g in groups] == ["model", "obs_encoder"]
    encoder = {id(p) for p in policy.obs_encoder.parameters()}
    assert {id(p) for p in groups[1]["params"]} == encoder and encoder
    assert not encoder & {id(p) for p in groups[0]["params"]}
    assert len(groups[0]["params"]) + len(groups[1]["params"]) == len(list(policy.parameters()))
    optimizer = torch.optim.AdamW(groups, lr=3.0e-4)
    schedule = get_scheduler("cosine", optimizer=optimizer, num_warmup_steps=2, num_training_steps=10)
    for _ in range(4):
        optimizer.step()
        schedule.step()
    model_lr, encoder_lr = schedule.get_last_lr()
    assert 0 < model_lr < 3.0e-4 and encoder_lr == pytest.approx(0.1 * model_lr, rel=1e-12)
    assert [g["initial_lr"] for g in optimizer.param_groups] == [3.0e-4, pytest.approx(3.0e-5, rel=1e-12)]

    lowdim_spec = ObsActionSpec(n_obs_steps=2, horizon=4, rgb_keys=())  # the demo config's kind
    no_camera = build_policy(TINY_POLICY, lowdim_spec, 2, shape_meta(buffer, lowdim_spec), normalizer_stats(buffer, lowdim_spec))
    [only] = optimizer_param_groups(no_camera, 1e-3, 0.1)
    # the demo config's case: one group, every parameter in the order AdamW(policy.parameters()) had them
    assert only["name"] == "model" and [id(p) for p in only["params"]] == [id(p) for p in no_camera.parameters()]
    with pytest.raises(ValueError, match="obs_encoder_lr_scale must be a finite number >= 0, got -0.1"):
        optimizer_param_groups(policy, 1e-3, -0.1)
    with pytest.raises(ValueError, match="optimizer.lr must be a finite number >= 0, got nan"):
        optimizer_param_groups(policy, float("nan"))
    frozen = optimizer_param_groups(policy, 0.0)  # lr 0: an untrained reference policy (the evaluation tests')
    assert [g["lr"] for g in frozen] == [0.0, 0.0]


def test_loader_batches_equal_per_sample_collation(buffer):
    """Whole batches from worker processes hold exactly what per-sample ``dataset[i]`` plus
    ``default_collate`` gives, frames read straight from the replay buffer."""
    from torch.utils.data import DataLoader, default_collate

    from dpflow_core.train.batches import gather_frames, pass_batch
    from dpflow_core.train.data import obs_positions

    spec = ObsActionSpec(horizon=4, n_obs_steps=2, obs_down_sample_steps=2, obs_latency_steps={"robot0_gripper_width": 0.5})
    ds = SequenceDataset(buffer, spec, np.ones(3, bool))
    # batches of 2: each worker fills more batches than its 4 reused buffers, checked as they arrive
    sampler = EpochBatchSampler(len(ds), 2, seed=7)
    loader = DataLoader(ds, batch_sampler=sampler, num_workers=2, collate_fn=pass_batch)
    assert len(sampler) == -(-len(ds) // 2) > 2 * ds.worker_buffers
    n = 0
    for indices, batch in zip(sampler, loader):
        n += 1
        expected = default_collate([ds[i] for i in indices])
        assert list(batch["obs"]) == list(expected["obs"])
        for key, value in expected["obs"].items():
            assert batch["obs"][key].dtype == value.dtype and torch.equal(batch["obs"][key], value), key
        assert torch.equal(batch["action"], expected["action"])
        steps = obs_positions(spec, "camera0_rgb", ds.index[indices]).astype(np.int64)
        assert np.array_equal(batch["obs"]["camera0_rgb"].numpy(), np.asarray(buffer["camera0_rgb"])[steps])
    assert n == len(sampler)
    with pytest.raises(ValueError, match="C-contiguous uint8 array of shape"):
        gather_frames(buffer["camera0_rgb"], np.zeros((2, 2), np.int64), np.zeros((2, 2, 32, 32, 3), np.float32))

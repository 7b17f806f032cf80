"""Training throughput: the two-level minibatch (K noise samples per encoded observation) is
the same estimator as one noise sample per observation, K=1 is the original loss bit for bit,
and the speed settings are read, checked and applied by the trainer."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dpflow_core.errors import RunError
from dpflow_core.replay_buffer import ReplayBuffer
from dpflow_core.train.batches import SequenceDataset
from dpflow_core.train.data import ObsActionSpec, normalizer_stats, shape_meta
from dpflow_core.train.logs import read_json_log
from dpflow_core.train.policy import build_policy
from dpflow_core.train.workspace import throughput_settings, train
from tests.synthetic_dataset import write_synthetic_dataset
from tests.core.train.test_train_run import _compose
from tests.core.train.test_train_units import TINY_POLICY

#: |z| above this rejects "same expectation". For n >= 80 independent draws per estimator the
#: difference of two means is close to normal (CLT; the per-draw statistics are bounded, smooth
#: functions of Gaussian noise), so one statistic exceeds 4 by chance with probability 6e-5,
#: and any of the 5 below with under 3e-4; a real bias of a few standard errors shows.
Z_LIMIT = 4.0


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def buffer(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds") / "dataset.npz"
    return ReplayBuffer(write_synthetic_dataset(path, n_episodes=3, episode_length=[12, 8, 10], image_size=(32, 32)))


def _policy(buffer, k=1, prediction_type="epsilon", **encoder):
    spec = ObsActionSpec(n_obs_steps=2, horizon=4)
    cfg = copy.deepcopy(TINY_POLICY)
    cfg["obs_encoder"].update(encoder)
    cfg["noise_scheduler"]["prediction_type"] = prediction_type
    torch.manual_seed(0)
    policy = build_policy(cfg, spec, 2, shape_meta(buffer, spec), normalizer_stats(buffer, spec), noise_samples_per_obs=k)
    return policy, SequenceDataset(buffer, spec, np.array([True, True, True]))


def _flat_grad(policy) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in policy.parameters() if p.grad is not None])


def test_k1_is_the_original_loss_bit_for_bit(buffer, one_thread):
    policy, ds = _policy(buffer)
    policy.train()  # random crops: the encoder draws from the global generator before the noise
    batch = ds.collate(range(6))
    torch.manual_seed(7)
    loss = policy.compute_loss(batch)
    # Diffusion Policy's loss written out (the code before the two-level minibatch), same draws
    torch.manual_seed(7)
    cond = policy.obs_encoder(batch["obs"], policy.normalizer)
    action = policy.normalizer.normalize("action", batch["action"].float())
    noise = torch.randn(action.shape)
    steps = torch.randint(0, policy.noise_scheduler.config.num_train_timesteps, (action.shape[0],)).long()
    pred = policy.model(policy.noise_scheduler.add_noise(action, noise, steps), steps, cond)
    assert torch.equal(loss, F.mse_loss(pred, noise))


def test_k_samples_equal_k_copies_of_each_observation(buffer, one_thread):
    """K>1 on B observations is K=1 on the B x K batch with each observation repeated K times
    in a row (the same draws, in the same order): losses and gradients agree to rounding."""
    k = 4
    shared, ds = _policy(buffer, k=k, crop_ratio=1.0)  # no random crop: the copies encode alike
    copies, _ = _policy(buffer, k=1, crop_ratio=1.0)
    copies.load_state_dict(shared.state_dict())
    batch = ds.collate(range(5))
    repeated = {
        "obs": {key: v.repeat_interleave(k, dim=0) for key, v in batch["obs"].items()},
        "action": batch["action"].repeat_interleave(k, dim=0),
    }
    torch.manual_seed(3)
    a = shared.compute_loss(batch)
    a.backward()
    torch.manual_seed(3)
    b = copies.compute_loss(repeated)
    b.backward()
    assert math.isclose(float(a.detach()), float(b.detach()), rel_tol=1e-5)
    assert torch.allclose(_flat_grad(shared), _flat_grad(copies), rtol=1e-4, atol=1e-6)


def _draws(policy, batch, n, seed, directions, loss_fn=None):
    """Per draw: the loss and the gradient projected on ``directions``, ``(n, 1 + len(directions))``."""
    loss_fn = loss_fn or policy.compute_loss
    torch.manual_seed(seed)
    out = []
    for _ in range(n):
        policy.zero_grad(set_to_none=True)
        loss = loss_fn(batch)
        loss.backward()
        out.append(torch.cat([loss.detach().reshape(1), directions @ _flat_grad(policy)]))
    return torch.stack(out).double()


def _z(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two-sample z statistic of the means, per column."""
    se = (a.var(0) / a.shape[0] + b.var(0) / b.shape[0]).sqrt()
    return (a.mean(0) - b.mean(0)) / se


def test_k_samples_have_the_expected_loss_and_mean_gradient_of_one_sample(buffer, one_thread):
    """Over many draws of augmentation, noise and steps, K=4 (crops shared by the 4 samples of an
    observation) and K=1 give the same mean loss and mean gradient (4 random projections). The
    model predicts the clean sample and is trained a little first, so that its loss depends on the
    observation: the same statistics then resolve the bug K invites, features paired with another
    observation's actions (``repeat`` where ``repeat_interleave`` belongs)."""
    one, ds = _policy(buffer, k=1, prediction_type="sample")
    batch = ds.collate(range(0, 18, 3))
    opt = torch.optim.AdamW(one.parameters(), lr=3e-3)
    one.train()
    torch.manual_seed(0)
    for _ in range(40):
        opt.zero_grad()
        one.compute_loss(batch).backward()
        opt.step()
    four, _ = _policy(buffer, k=4, prediction_type="sample")
    four.load_state_dict(one.state_dict())
    four.train()
    n_params = sum(p.numel() for p in one.parameters())
    directions = torch.randn(4, n_params, generator=torch.Generator().manual_seed(11))
    a = _draws(one, batch, 80, seed=100, directions=directions)
    b = _draws(four, batch, 80, seed=200, directions=directions)
    z = _z(a, b)
    assert z.abs().max() < Z_LIMIT, z
    # the K=4 estimator is the less noisy one (4x the denoising samples per draw)
    assert float(b[:, 0].var()) < float(a[:, 0].var())

    def mispaired(batch):
        cond = four.obs_encoder(batch["obs"], four.normalizer).repeat(4, 1)
        action = four.normalizer.normalize("action", batch["action"].float()).repeat_interleave(4, dim=0)
        noise = torch.randn(action.shape)
        steps = torch.randint(0, four.noise_scheduler.config.num_train_timesteps, (action.shape[0],))
        return F.mse_loss(four.model(four.noise_scheduler.add_noise(action, noise, steps), steps, cond), action)

    c = _draws(four, batch, 80, seed=300, directions=directions, loss_fn=mispaired)
    assert _z(a, c).abs().max() > 2 * Z_LIMIT, _z(a, c)


def test_speed_settings_are_checked_with_the_key_named(tmp_path):
    cfg = _compose(tmp_path / "absent.npz", "training.noise_samples_per_obs=0")
    with pytest.raises(RunError, match="training.noise_samples_per_obs must be a positive integer"):
        throughput_settings(cfg)
    cfg = _compose(tmp_path / "absent.npz", "training.torch_threads=two")
    with pytest.raises(RunError, match="training.torch_threads"):
        throughput_settings(cfg)
    cfg = _compose(tmp_path / "absent.npz", "training.allow_tf32=1")
    with pytest.raises(RunError, match="training.allow_tf32 must be true or false"):
        throughput_settings(cfg)
    defaults = throughput_settings(_compose(tmp_path / "absent.npz"))
    assert defaults == {"noise_samples_per_obs": 1, "torch_threads": 1, "allow_tf32": False}


class _Crash(Exception):
    pass


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_resume_with_k_noise_samples_continues_bit_for_bit(tmp_path, one_thread, monkeypatch, precision):
    """A K=3 run that dies after its mid-epoch checkpoint and is resumed logs the same losses and
    learning rates and ends with the same weights as one that ran straight; every step line
    carries the time the step waited for its batch. The same under bf16 autocast on the CPU (run after a
    float32 training in the same process, which accelerate's one state used to refuse)."""
    from dpflow_core.train import workspace

    data = write_synthetic_dataset(tmp_path / "dataset.npz", n_episodes=4, episode_length=30, image_size=(32, 32))
    common = [
        "logging.mode=disabled",
        "training.num_epochs=2",
        "training.max_train_steps=3",
        "training.sample_every=2",
        "training.noise_samples_per_obs=3",
        "training.torch_threads=1",
        "checkpoint.every_n_steps=2",
        "checkpoint.topk.k=0",
        f"training.mixed_precision={precision}",
    ]
    train(_compose(data, *common), tmp_path / "straight")

    log = workspace.Workspace._log

    def crash_at_step_4(self, record):
        log(self, record)
        if record["global_step"] == 4 and "epoch_summary" not in record:
            raise _Crash

    monkeypatch.setattr(workspace.Workspace, "_log", crash_at_step_4)
    with pytest.raises(_Crash):
        train(_compose(data, *common), tmp_path / "broken")
    monkeypatch.setattr(workspace.Workspace, "_log", log)
    train(_compose(data, *common, "training.resume=true"), tmp_path / "broken")

    a, b = (read_json_log(tmp_path / run / "logs.json.txt") for run in ("straight", "broken"))
    steps = [r for r in a if "epoch_summary" not in r]
    assert [r["global_step"] for r in steps] == list(range(6))
    assert all(0 <= r["data_time_s"] < 60 for r in steps)

    def untimed(records):
        return [{k: v for k, v in r.items() if k != "data_time_s"} for r in records]

    assert untimed(a) == untimed(b)
    sa = torch.load(tmp_path / "straight/checkpoints/latest.ckpt", weights_only=False)
    sb = torch.load(tmp_path / "broken/checkpoints/latest.ckpt", weights_only=False)
    assert sa["global_step"] == sb["global_step"] == 6
    for name, value in sa["model"].items():
        assert torch.equal(value, sb["model"][name]), name


def test_bf16_autocast_trains_in_bf16_close_to_float32(tmp_path, one_thread, caplog):
    """``training.mixed_precision=bf16`` on the CPU really computes in bfloat16: from the same seed and batches,
    its losses differ from float32's (bf16 keeps 8 mantissa bits, so an equal loss would mean no autocast) but
    stay within 5 % of them over the first steps; ``auto`` resolves to what the machine computes natively."""
    from dpflow_core.train.config import mixed_precision_of, native_bf16

    data = write_synthetic_dataset(tmp_path / "dataset.npz", n_episodes=4, episode_length=30, image_size=(32, 32))
    common = ["logging.mode=disabled", "training.num_epochs=1", "training.max_train_steps=4",
              "training.torch_threads=1", "checkpoint.topk.k=0"]
    losses = {}
    for i, precision in enumerate(("no", "bf16", "no")):
        run = tmp_path / f"{i}_{precision}"
        train(_compose(data, *common, f"training.mixed_precision={precision}"), run)
        losses.setdefault(precision, []).append(
            [r["train_loss"] for r in read_json_log(run / "logs.json.txt") if "epoch_summary" not in r])
    (fp32, again), (bf16,) = losses["no"], losses["bf16"]
    assert fp32 == again  # the float32 run after the bf16 one is float32 again
    assert all(a != b for a, b in zip(fp32, bf16))
    assert np.allclose(bf16, fp32, rtol=0.05)
    cfg = _compose(data, "training.mixed_precision=auto")
    assert mixed_precision_of(cfg, "cpu") == ("bf16" if native_bf16("cpu") else "no")
    with caplog.at_level("INFO", logger="dpflow.train"):
        train(_compose(data, *common, "training.mixed_precision=auto"), tmp_path / "auto")
    logged = caplog.text  # what the run's train.log gets
    expected = "bf16 (training.mixed_precision: auto: this CPU has" if native_bf16("cpu") else \
        "no (training.mixed_precision: auto: this CPU has no bf16 instructions)"
    assert f"mixed precision: {expected}" in logged, logged
    with pytest.raises(RunError, match="mixed_precision"):
        mixed_precision_of(_compose(data, "training.mixed_precision=fp8"))


def test_native_bf16_reads_the_cpu_flags():
    """bf16 autocast only where the CPU has bfloat16 instructions (else oneDNN emulates them, slower than
    float32); the machine's own answer agrees with lscpu's flags where lscpu exists."""
    import shutil
    import subprocess

    from dpflow_core.train.config import native_bf16

    assert native_bf16("cpu", {"avx2", "avx512f", "avx512_bf16"})
    assert native_bf16("cpu", {"amx_bf16", "amx_tile"}) and native_bf16("cpu", {"asimd", "bf16"})
    assert not native_bf16("cpu", {"avx2", "avx512f", "avx512bw"}) and not native_bf16("cpu", set())
    if shutil.which("lscpu"):
        flags = set(subprocess.run(["lscpu"], capture_output=True, text=True).stdout.split())
        assert native_bf16("cpu") == bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})

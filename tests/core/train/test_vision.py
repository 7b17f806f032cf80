"""Observation encoders from the config: the torch-only ViT loading timm / CLIP
weights by key name, UMI's augmentation (training only), and UMI's timm
workspace config through the real trainer entry point."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hydra.errors import InstantiationException
from safetensors.torch import save_file
from torch import nn

from dpflow_core.errors import WeightsError
from dpflow_core.train.app import CONFIG_DIR
from dpflow_core.train.policy import ObsEncoder, build_obs_encoder
from dpflow_core.train.vision import ImageAugment, ResNet18GN
from dpflow_core.train.vit import CLIP_MEAN, CLIP_STD, QuickGELU, ViTEncoder, clip_to_timm
from tests.synthetic_dataset import write_synthetic_dataset

# A tiny ViT in the CLIP layout: 32x32 images, 8x8 patches (a 4x4 grid), width 32, 2 blocks.
D, DEPTH, HEADS, PATCH, GRID = 32, 2, 2, 8, 4
TINY_VIT = dict(image_hw=(32, 32), trunk=dict(patch_size=PATCH, embed_dim=D, depth=DEPTH, num_heads=HEADS))


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def timm_clip_state_dict(seed: int = 0, grid: int = GRID, head: int = 16) -> dict[str, torch.Tensor]:
    """A state dict with the key names and shapes of timm's ``vit_base_patch16_clip_224``
    (written out here from timm's naming, not taken from our module), at a tiny size."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    sd = {
        "cls_token": r(1, 1, D),
        "pos_embed": r(1, 1 + grid * grid, D),
        "patch_embed.proj.weight": r(D, 3, PATCH, PATCH),  # CLIP: no patch bias
        "norm_pre.weight": r(D),
        "norm_pre.bias": r(D),
        "norm.weight": r(D),
        "norm.bias": r(D),
        "head.weight": r(head, D),  # CLIP's image projection, as timm stores it
        "head.bias": torch.zeros(head),
    }
    for i in range(DEPTH):
        b = f"blocks.{i}."
        sd |= {
            b + "norm1.weight": r(D), b + "norm1.bias": r(D),
            b + "attn.qkv.weight": r(3 * D, D) / D**0.5, b + "attn.qkv.bias": r(3 * D),
            b + "attn.proj.weight": r(D, D) / D**0.5, b + "attn.proj.bias": r(D),
            b + "norm2.weight": r(D), b + "norm2.bias": r(D),
            b + "mlp.fc1.weight": r(4 * D, D) / D**0.5, b + "mlp.fc1.bias": r(4 * D),
            b + "mlp.fc2.weight": r(D, 4 * D) / (4 * D) ** 0.5, b + "mlp.fc2.bias": r(D),
        }  # fmt: skip
    return sd


def reference_tokens(sd: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """CLIP's image tower computed with torch's own TransformerEncoderLayer (pre-norm),
    an implementation independent of ours, from the same timm-named weights."""
    tokens = torch.nn.functional.conv2d(x, sd["patch_embed.proj.weight"], stride=PATCH).flatten(2).transpose(1, 2)
    tokens = torch.cat([sd["cls_token"].expand(x.shape[0], -1, -1), tokens], 1) + sd["pos_embed"]
    tokens = torch.nn.functional.layer_norm(tokens, (D,), sd["norm_pre.weight"], sd["norm_pre.bias"], 1e-5)
    for i in range(DEPTH):
        layer = nn.TransformerEncoderLayer(
            D, HEADS, 4 * D, dropout=0.0, activation=QuickGELU(), layer_norm_eps=1e-5, batch_first=True, norm_first=True
        )
        b = f"blocks.{i}."
        with torch.no_grad():
            layer.self_attn.in_proj_weight.copy_(sd[b + "attn.qkv.weight"])
            layer.self_attn.in_proj_bias.copy_(sd[b + "attn.qkv.bias"])
            layer.self_attn.out_proj.weight.copy_(sd[b + "attn.proj.weight"])
            layer.self_attn.out_proj.bias.copy_(sd[b + "attn.proj.bias"])
            for ours, theirs in [("norm1", "norm1"), ("norm2", "norm2"), ("mlp.fc1", "linear1"), ("mlp.fc2", "linear2")]:
                getattr(layer, theirs).weight.copy_(sd[b + ours + ".weight"])
                getattr(layer, theirs).bias.copy_(sd[b + ours + ".bias"])
        tokens = layer.eval()(tokens)
    return torch.nn.functional.layer_norm(tokens, (D,), sd["norm.weight"], sd["norm.bias"], 1e-5)


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_vit_loads_timm_weights_strictly_by_key_name(tmp_path, suffix, one_thread):
    sd = timm_clip_state_dict()
    path = tmp_path / f"vit{suffix}"
    save_file(sd, str(path)) if suffix == ".safetensors" else torch.save(sd, path)

    enc = ViTEncoder(**TINY_VIT, pretrained_path=str(path)).eval()
    trunk = enc.trunk.state_dict()
    # every weight of the file landed under its own name, and nothing else is in the trunk
    assert set(trunk) == set(sd) - {"head.weight", "head.bias"}
    for name, value in trunk.items():
        assert torch.equal(value, sd[name]), name

    x = torch.rand(3, 3, 32, 32)
    with torch.no_grad():
        ref = reference_tokens(sd, x)
        assert torch.allclose(enc.trunk(x), ref, atol=1e-4)
        assert torch.allclose(enc(x), ref[:, 0], atol=1e-4)  # pool: cls
    # without a file: random init, different weights, same shapes
    fresh = ViTEncoder(**TINY_VIT).trunk.state_dict()
    assert {k: v.shape for k, v in fresh.items()} == {k: v.shape for k, v in trunk.items()}
    assert not torch.equal(fresh["blocks.0.attn.qkv.weight"], sd["blocks.0.attn.qkv.weight"])


def test_wrong_missing_or_misshapen_keys_are_refused_by_name(tmp_path):
    cases = {
        "typo": (lambda sd: sd.update({"blocks.0.attn.qkv_typo.weight": sd.pop("blocks.0.attn.qkv.weight")}),
                 ["'blocks.0.attn.qkv_typo.weight'", "unexpected", "'blocks.0.attn.qkv.weight'", "missing"]),
        "missing": (lambda sd: sd.pop("norm.weight"), ["missing key(s) 'norm.weight'"]),
        "shape": (lambda sd: sd.update({"blocks.1.mlp.fc1.bias": torch.zeros(7)}),
                  ["blocks.1.mlp.fc1.bias has shape [7], the model's is [128]"]),
        "patch_bias": (lambda sd: sd.update({"patch_embed.proj.bias": torch.zeros(D)}),
                       ["unexpected key(s) 'patch_embed.proj.bias'"]),
    }  # fmt: skip
    for name, (spoil, words) in cases.items():
        sd = timm_clip_state_dict()
        spoil(sd)
        path = tmp_path / f"{name}.pth"
        torch.save(sd, path)
        with pytest.raises(WeightsError) as info:
            ViTEncoder(**TINY_VIT, pretrained_path=str(path))
        assert str(path) in str(info.value), name
        for word in words:
            assert word in str(info.value), (name, str(info.value))
    with pytest.raises(WeightsError, match="does not exist"):
        ViTEncoder(**TINY_VIT, pretrained_path=str(tmp_path / "absent.safetensors"))
    (tmp_path / "not_weights.pth").write_bytes(b"not a torch file")
    with pytest.raises(WeightsError, match="cannot read weights"):
        ViTEncoder(**TINY_VIT, pretrained_path=str(tmp_path / "not_weights.pth"))


def test_openai_clip_format_is_renamed_to_timm_names(tmp_path):
    timm_sd = timm_clip_state_dict(seed=3)
    # the same weights under OpenAI CLIP / open_clip names, with a text tower beside them
    clip = {
        "visual.class_embedding": timm_sd["cls_token"].reshape(D),
        "visual.positional_embedding": timm_sd["pos_embed"][0],
        "visual.conv1.weight": timm_sd["patch_embed.proj.weight"],
        "visual.ln_pre.weight": timm_sd["norm_pre.weight"], "visual.ln_pre.bias": timm_sd["norm_pre.bias"],
        "visual.ln_post.weight": timm_sd["norm.weight"], "visual.ln_post.bias": timm_sd["norm.bias"],
        "visual.proj": timm_sd["head.weight"].t().contiguous(),
        "token_embedding.weight": torch.zeros(10, D),
        "transformer.resblocks.0.attn.in_proj_weight": torch.zeros(3 * D, D),  # the text tower's
        "logit_scale": torch.tensor(4.6),
    }  # fmt: skip
    for i in range(DEPTH):
        t, c = f"blocks.{i}.", f"visual.transformer.resblocks.{i}."
        for ours, theirs in [("norm1", "ln_1"), ("norm2", "ln_2"), ("attn.proj", "attn.out_proj"),
                             ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj")]:  # fmt: skip
            for p in ("weight", "bias"):
                clip[f"{c}{theirs}.{p}"] = timm_sd[f"{t}{ours}.{p}"]
        clip[c + "attn.in_proj_weight"] = timm_sd[t + "attn.qkv.weight"]
        clip[c + "attn.in_proj_bias"] = timm_sd[t + "attn.qkv.bias"]

    renamed = clip_to_timm(clip)
    assert set(renamed) == set(timm_sd) - {"head.bias"}
    path = tmp_path / "open_clip_pytorch_model.bin"
    torch.save(clip, path)
    trunk = ViTEncoder(**TINY_VIT, pretrained_path=str(path)).trunk.state_dict()
    for name, value in trunk.items():
        assert torch.equal(value, timm_sd[name]), name


def test_position_embedding_of_another_grid_is_resampled(tmp_path):
    sd = timm_clip_state_dict(grid=2)  # weights for 16x16 images (a 2x2 grid)
    sd["pos_embed"][0, 1:] = torch.tensor([0.25, -1.0, 3.0])[torch.arange(D) % 3]  # the same at every patch
    path = tmp_path / "small.pth"
    torch.save(sd, path)
    trunk = ViTEncoder(**TINY_VIT, pretrained_path=str(path)).trunk  # 32x32 images: a 4x4 grid
    pos = trunk.pos_embed.detach()
    assert pos.shape == (1, 1 + GRID * GRID, D)
    assert torch.equal(pos[0, 0], sd["pos_embed"][0, 0])  # the class token's entry is kept
    assert torch.allclose(pos[0, 1:], sd["pos_embed"][0, 1:2].expand(GRID * GRID, D), atol=1e-6)


def test_attention_and_mean_pooling_and_projection():
    x = torch.rand(2, 3, 32, 32)
    for pool in ("attention", "mean"):
        enc = ViTEncoder(**TINY_VIT, pool=pool, feature_dim=10).eval()
        with torch.no_grad():
            out = enc(x)
            tokens = enc.trunk(x)
        assert out.shape == (2, 10) and enc.feature_dim == 10
        if pool == "mean":
            assert torch.allclose(out, enc.proj(tokens[:, 1:].mean(1)), atol=1e-6)
    assert sum(p.numel() for p in ViTEncoder(**TINY_VIT, pool="attention").attn_pool.parameters()) > 0
    with pytest.raises(ValueError, match="pool must be"):
        ViTEncoder(**TINY_VIT, pool="max")
    with pytest.raises(ValueError, match="not a multiple of patch_size=8"):
        ViTEncoder(image_hw=(30, 32), trunk=dict(patch_size=8, embed_dim=D, depth=1, num_heads=2))


def test_resnet_pretrained_path_loads_its_own_state_dict(tmp_path):
    torch.manual_seed(0)
    src = ResNet18GN(base_width=8, feature_dim=16)
    torch.save(src.state_dict(), tmp_path / "resnet.pt")
    torch.manual_seed(1)
    loaded = ResNet18GN(base_width=8, feature_dim=16, pretrained_path=str(tmp_path / "resnet.pt"))
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, src.state_dict()[name]), name
    with pytest.raises(WeightsError, match=r"unexpected key\(s\) 'proj.bias', 'proj.weight'"):
        ResNet18GN(base_width=8, feature_dim=None, pretrained_path=str(tmp_path / "resnet.pt"))


UMI_JITTER = {"brightness": 0.3, "contrast": 0.4, "saturation": 0.5, "hue": 0.08}


def test_augmentation_is_random_while_training_and_deterministic_in_eval():
    torch.manual_seed(0)
    x = torch.rand(4, 3, 32, 32) * 0.8 + 0.1
    aug = ImageAugment((32, 32), crop_ratio=0.75, resize=True, color_jitter=UMI_JITTER)
    aug.eval()
    a, b = aug(x), aug(x)
    assert torch.equal(a, b)
    # eval: the centre 24x24 crop, resized back to 32x32, no colour change
    centre = torch.nn.functional.interpolate(x[:, :, 4:28, 4:28], size=(32, 32), mode="bilinear", antialias=True)
    assert torch.allclose(a, centre, atol=1e-6)
    aug.train()
    c, d = aug(x), aug(x)
    assert c.shape == d.shape == (4, 3, 32, 32) and not torch.allclose(c, d, atol=1e-3)
    assert float(c.min()) >= 0.0 and float(c.max()) <= 1.0

    # no resize: the crop's own size, as Diffusion Policy's ResNet path; random windows in training
    plain = ImageAugment((32, 32), crop_ratio=0.875)
    assert plain.output_hw == (28, 28) and plain.eval()(x).shape == (4, 3, 28, 28)
    assert torch.equal(plain(x), x[:, :, 2:30, 2:30])
    windows = plain.train()(x.repeat(8, 1, 1, 1))
    assert len({tuple(w.flatten()[:5].tolist()) for w in windows}) > 1

    # brightness alone (torchvision's meaning): each image scaled by one factor in [0.7, 1.3]
    bright = ImageAugment((32, 32), color_jitter={"brightness": 0.3}).train()
    same = (torch.rand(1, 3, 32, 32) * 0.5 + 0.1).repeat(6, 1, 1, 1)
    factors = (bright(same) / same).flatten(1)
    assert torch.allclose(factors, factors[:, :1].expand_as(factors), atol=1e-4)
    assert float(factors.min()) >= 0.7 - 1e-4 and float(factors.max()) <= 1.3 + 1e-4
    assert len({round(float(f), 4) for f in factors[:, 0]}) > 1  # drawn per image

    with pytest.raises(ValueError, match="crop_ratio must be in"):
        ImageAugment((32, 32), crop_ratio=1.2)


def _umi_encoder_cfg(**rgb):
    return {
        "_target_": "dpflow_core.train.policy.ObsEncoder",
        "rgb_model": {"_target_": "dpflow_core.train.vit.ViTEncoder", **{k: v for k, v in TINY_VIT.items() if k != "image_hw"}, **rgb},
        "crop_ratio": 0.95,
        "resize_after_crop": True,
        "color_jitter": UMI_JITTER,
        "image_mean": list(CLIP_MEAN),
        "image_std": list(CLIP_STD),
    }  # fmt: skip


class _Identity:
    def normalize(self, key, x):
        return x


def test_obs_encoder_from_config_eval_agrees_training_differs(tmp_path, one_thread):
    meta = {"rgb": {"camera0_rgb": [32, 32, 3], "camera1_rgb": [32, 32, 3]}, "lowdim": {"robot0_gripper_width": 1}}
    torch.save(timm_clip_state_dict(), tmp_path / "vit.pth")
    enc = build_obs_encoder(_umi_encoder_cfg(pretrained_path=str(tmp_path / "vit.pth")), meta, n_obs_steps=2)
    assert isinstance(enc, ObsEncoder) and enc.output_dim == 2 * (2 * D + 1)
    # one model per camera, each loaded from the file; a 0.95 crop resized back to the 32x32 the ViT takes
    for key in meta["rgb"]:
        assert enc.augment[key].output_hw == (32, 32) and enc.crop_hw[key] == (30, 30)
        assert torch.equal(enc.encoders[key].trunk.cls_token, timm_clip_state_dict()["cls_token"])
    assert enc.encoders["camera0_rgb"] is not enc.encoders["camera1_rgb"]

    obs = {k: torch.randint(0, 256, (3, 2, 32, 32, 3), dtype=torch.uint8) for k in meta["rgb"]}
    obs["robot0_gripper_width"] = torch.rand(3, 2, 1)
    with torch.no_grad():
        enc.eval()
        e1, e2 = enc(obs, _Identity()), enc(obs, _Identity())
        enc.train()
        t1, t2 = enc(obs, _Identity()), enc(obs, _Identity())
    assert e1.shape == (3, 2 * (2 * D + 1)) and torch.equal(e1, e2)
    assert not torch.allclose(t1, t2, atol=1e-4)

    # loading a checkpoint later does not need the pretrained file
    (tmp_path / "vit.pth").unlink()
    again = build_obs_encoder(_umi_encoder_cfg(pretrained_path=str(tmp_path / "vit.pth")), meta, 2, load_pretrained=False)
    assert set(again.state_dict()) == set(enc.state_dict())
    with pytest.raises(WeightsError, match="does not exist"):
        build_obs_encoder(_umi_encoder_cfg(pretrained_path=str(tmp_path / "vit.pth")), meta, 2)
    with pytest.raises(ValueError, match="needs a _target_"):
        build_obs_encoder({"rgb_model": {}}, meta, 2)
    outside = _umi_encoder_cfg() | {"rgb_model": {"_target_": "os.system", "command": "true"}}
    with pytest.raises(InstantiationException, match="os.system"):
        build_obs_encoder(outside, meta, 2)
    with pytest.raises(ValueError, match="image_mean and image_std need 3 values"):
        build_obs_encoder(_umi_encoder_cfg() | {"image_std": [0.5, 0.5]}, meta, 2)
    with pytest.raises(ValueError, match="rgb_model needs a _target_"):
        build_obs_encoder({"_target_": "dpflow_core.train.policy.ObsEncoder", "rgb_model": {"base_width": 8}}, meta, 2)


@pytest.mark.slow  # a trainer process: about 10 s idle, more on a loaded machine
def test_timm_umi_config_trains_through_the_trainer_entry_point(tmp_path):
    from omegaconf import OmegaConf

    from dpflow_core.train import checkpoint as ckpt
    from dpflow_core.train.checkpoint import load_network
    from dpflow_core.replay_buffer import ReplayBuffer
    from dpflow_core.train.batches import SequenceDataset

    dataset = write_synthetic_dataset(tmp_path / "dataset.npz", n_episodes=4, episode_length=60, image_size=(32, 32))
    weights = tmp_path / "model.safetensors"
    save_file(timm_clip_state_dict(seed=5), str(weights))
    run = tmp_path / "run"
    enc = "policy.obs_encoder.rgb_model."
    args = [
        "--config-name=train_diffusion_unet_timm_umi", f"task.dataset_path={dataset}", f"hydra.run.dir={run}",
        "task.tx_cam_tcp=identity",
        "task.image_size=null", "task.val_ratio=0.25", "logging.mode=disabled",
        f"{enc}trunk.patch_size={PATCH}", f"{enc}trunk.embed_dim={D}", f"{enc}trunk.depth={DEPTH}",
        f"{enc}trunk.num_heads={HEADS}",
        f"{enc}pretrained_path={weights}",
        "policy.unet.down_dims=[16,32]", "policy.unet.kernel_size=3", "policy.unet.diffusion_step_embed_dim=16",
        "policy.num_inference_steps=2", "training.num_epochs=1", "training.max_train_steps=2",
        "training.max_val_steps=1", "training.lr_warmup_steps=1", "training.sample_every=1",
        "dataloader.batch_size=4", "dataloader.num_workers=0", "dataloader.persistent_workers=false",
        "dataloader.pin_memory=false", "val_dataloader.batch_size=4", "val_dataloader.num_workers=0",
        "val_dataloader.persistent_workers=false", "val_dataloader.pin_memory=false", "checkpoint.topk.k=0",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TQDM_DISABLE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "dpflow_core.train", *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    latest = ckpt.load_checkpoint(run / "checkpoints" / "latest.ckpt")
    assert latest["global_step"] == 2
    cfg = OmegaConf.create(latest["cfg"])
    assert cfg.policy.obs_encoder.rgb_model._target_ == "dpflow_core.train.vit.ViTEncoder"
    assert cfg.policy.noise_scheduler.num_train_timesteps == 50 and cfg.optimizer.lr == 3.0e-4
    # UMI's param groups: the pretrained ViT (and the rest of the encoder) at 0.1x the U-Net's lr
    groups = {g["name"]: g for g in latest["optimizer"]["param_groups"]}
    assert sorted(groups) == ["model", "obs_encoder"]
    assert groups["model"]["initial_lr"] == 3.0e-4 and groups["obs_encoder"]["initial_lr"] == pytest.approx(3.0e-5)
    n_encoder = sum(1 for k in latest["model"] if k.startswith("obs_encoder.") and "trunk" in k)
    assert len(groups["obs_encoder"]["params"]) >= n_encoder > 0
    # the ViT started from the file: after 2 AdamW steps at lr <= 3e-4 each weight is within ~2 lr of it,
    # while a random start differs by far more
    src = timm_clip_state_dict(seed=5)
    for name in ("cls_token", "blocks.1.mlp.fc2.weight", "norm.bias"):
        trained = latest["model"][f"obs_encoder.encoders.camera0_rgb.trunk.{name}"]
        assert float((trained - src[name]).abs().max()) < 2e-3, name
    assert float((ViTEncoder(**TINY_VIT).trunk.norm.bias.detach() - src["norm.bias"]).abs().max()) > 0.1

    # the checkpoint loads where the pretrained file is gone, and evaluates deterministically
    weights.unlink()
    policy, _, spec = load_network(run / "checkpoints" / "latest.ckpt")
    buffer = ReplayBuffer(dataset)
    obs = SequenceDataset(buffer, spec, np.ones(buffer.n_episodes, bool)).collate([0, 3])["obs"]
    with torch.no_grad():
        f1 = policy.obs_encoder(obs, policy.normalizer)
        f2 = policy.obs_encoder(obs, policy.normalizer)
    assert torch.equal(f1, f2) and f1.shape == (2, 2 * (D + 10))  # low-dim: pos 3, rot6d 6, gripper 1
    out = policy.predict_action(obs, generator=torch.Generator().manual_seed(0))
    assert out["action"].shape == (2, 8, 10) and out["action_pred"].shape == (2, 16, 10)


def test_every_shipped_config_composes_and_names_its_encoder():
    from hydra import compose, initialize_config_dir

    from dpflow_core.train.app import CONFIG_NAMES

    shipped = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    assert sorted(CONFIG_NAMES) == shipped
    readme = (CONFIG_DIR.parents[2] / "README.md").read_text()
    with initialize_config_dir(config_dir=str(CONFIG_DIR)):
        for name in shipped:
            cfg = compose(name, overrides=["task.dataset_path=x.npz"])
            target = cfg.policy.obs_encoder.rgb_model._target_.rsplit(".", 1)[1]
            row = [line for line in readme.splitlines() if line.startswith(f"| `{name}` |")]
            assert len(row) == 1 and f"`{target}`" in row[0], (name, target)


def test_timm_umi_encoder_is_vit_b16_clip_sized(one_thread):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONFIG_DIR)):
        cfg = compose("train_diffusion_unet_timm_umi", overrides=["task.dataset_path=x.npz"])
    meta = {"rgb": {"camera0_rgb": [224, 224, 3]}, "lowdim": {"robot0_gripper_width": 1}}
    enc = build_obs_encoder(OmegaConf.to_container(cfg.policy.obs_encoder), meta, n_obs_steps=2)
    vit = enc.encoders["camera0_rgb"]
    # timm's model card for vit_base_patch16_clip_224.openai: 86.2 M parameters, which include the
    # 768 -> 512 image projection (393,728) that UMI's num_classes=0 drops
    assert sum(p.numel() for p in vit.trunk.parameters()) + 768 * 512 + 512 == 86_193_152
    assert vit.trunk.grid == (14, 14) and enc.augment["camera0_rgb"].crop_hw == (213, 213)
    assert enc.output_dim == 2 * (768 + 1)


def test_keypoint_encoder_finds_where_a_bright_spot_is():
    """Spatial soft-argmax: with the convolutions bypassed, each keypoint is the normalised (x, y) of the
    brightest place of its heat map, whatever the image size."""
    import torch
    from torch import nn

    from dpflow_core.train.vision import KeypointEncoder

    enc = KeypointEncoder(channels=16, keypoints=2, feature_dim=4)
    enc.features = nn.Identity()
    enc.heatmaps = nn.Conv2d(3, 2, 1, bias=False)
    enc.proj = nn.Identity()
    with torch.no_grad():
        enc.heatmaps.weight.zero_()
        enc.heatmaps.weight[0, 0] = 60.0  # keypoint 0 follows the red channel, keypoint 1 the green one
        enc.heatmaps.weight[1, 1] = 60.0
    for h, w, red, green in ((16, 16, (3, 12), (10, 2)), (9, 21, (8, 0), (0, 20))):
        x = torch.zeros(1, 3, h, w)
        x[0, 0, red[0], red[1]] = 1.0
        x[0, 1, green[0], green[1]] = 1.0
        kx0, kx1, ky0, ky1 = enc(x)[0].tolist()
        norm = lambda i, n: -1 + 2 * i / (n - 1)  # noqa: E731
        assert (kx0, ky0) == pytest.approx((norm(red[1], w), norm(red[0], h)), abs=1e-3)
        assert (kx1, ky1) == pytest.approx((norm(green[1], w), norm(green[0], h)), abs=1e-3)

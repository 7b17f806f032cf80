"""Diffusion Policy over images and low-dimensional state (Chi et al., RSS 2023).

Training (:meth:`DiffusionUnetImagePolicy.forward` = ``compute_loss``): the
normalised action sequence is noised at a random DDPM step and the
:class:`~dpflow_core.train.unet.ConditionalUnet1D` predicts the noise (or the
clean sample), conditioned on the encoded observation history. Inference
(:meth:`predict_action`): DDIM denoising from Gaussian noise in a few steps.
Both schedulers come from ``diffusers`` and share one set of betas.

Two-level minibatch (``noise_samples_per_obs`` = K): each observation is
encoded once and K noise draws and diffusion steps are trained against it, so
the observation encoder (the expensive part of a camera policy) runs once per
K denoising samples: the two-level minibatch of Mini-Diffuser (arXiv
2505.09430). The loss is the mean over all B x K samples; its expectation
over noise and steps equals that of one noise sample per observation (only
its variance differs: the K samples of one observation share its draw from
the data). K=1 is the original Diffusion Policy loss, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import DDIMScheduler, DDPMScheduler
from torch import nn

from dpflow_core.train.data import ObsActionSpec, normalizer_modes
from dpflow_core.train.normalizer import LinearNormalizer
from dpflow_core.train.unet import ConditionalUnet1D
from dpflow_core.train.vision import ImageAugment


#: Where ``_target_`` of the encoder config may point (Hydra's execution whitelist):
#: the config names a class, it cannot run arbitrary code.
ENCODER_TARGETS = ("dpflow_core.train.*",)


class ObsEncoder(nn.Module):
    """Observation history -> one feature vector per sample.

    Each image key has its own image model, built from ``rgb_model`` (a Hydra
    config with ``_target_``, e.g. :class:`~dpflow_core.train.vision.ResNet18GN`
    or :class:`~dpflow_core.train.vit.ViTEncoder`, instantiated once per key
    with ``image_hw`` set to the size it receives). Frames go through
    :class:`~dpflow_core.train.vision.ImageAugment` (random crop and colour
    jitter while training, centre crop otherwise), are normalised with
    ``image_mean`` / ``image_std`` and encoded one by one. Low-dimensional keys
    are normalised (by the policy's normaliser, passed to ``forward``) and
    concatenated. Output: ``(B, To * (n_rgb * F + sum D))`` float.

    Args:
        shape_meta: ``{"rgb": {key: [H, W, 3]}, "lowdim": {key: D}, ...}``.
        n_obs_steps: To.
        rgb_model: Hydra config of the per-camera model (``_target_`` and its kwargs).
        crop_ratio, resize_after_crop, color_jitter: of :class:`~dpflow_core.train.vision.ImageAugment`.
        image_mean, image_std: per RGB channel, applied to pixels in [0, 1]
            (0.5, 0.5: the [-1, 1] range; CLIP's statistics for CLIP weights).

    Raises:
        ValueError: ``rgb_model`` without ``_target_``, a bad crop ratio, mean or std.
    """

    def __init__(
        self,
        shape_meta: Mapping[str, Any],
        n_obs_steps: int,
        rgb_model: Mapping[str, Any],
        crop_ratio: float = 1.0,
        resize_after_crop: bool = False,
        color_jitter: Mapping[str, float] | None = None,
        image_mean: Sequence[float] = (0.5, 0.5, 0.5),
        image_std: Sequence[float] = (0.5, 0.5, 0.5),
    ):
        super().__init__()
        from hydra.utils import instantiate

        if not isinstance(rgb_model, Mapping) or "_target_" not in rgb_model:
            raise ValueError(
                "policy.obs_encoder.rgb_model needs a _target_ (e.g. dpflow_core.train.vision.ResNet18GN), "
                f"got {rgb_model!r}"
            )
        if len(image_mean) != 3 or len(image_std) != 3 or min(image_std) <= 0:
            raise ValueError(
                f"image_mean and image_std need 3 values (R, G, B), std > 0; got {list(image_mean)}, {list(image_std)}"
            )
        self.rgb_keys = tuple(shape_meta["rgb"])
        self.lowdim_keys = tuple(shape_meta["lowdim"])
        self.n_obs_steps = n_obs_steps
        self.augment = nn.ModuleDict(
            {
                k: ImageAugment((h, w), crop_ratio, resize_after_crop, color_jitter)
                for k, (h, w, _) in shape_meta["rgb"].items()
            }
        )
        self.crop_hw = {k: a.crop_hw for k, a in self.augment.items()}
        self.encoders = nn.ModuleDict(
            {
                k: instantiate(
                    dict(rgb_model), image_hw=self.augment[k].output_hw, _execution_whitelist_=list(ENCODER_TARGETS)
                )
                for k in self.rgb_keys
            }
        )
        self.register_buffer("image_mean", torch.tensor(list(image_mean), dtype=torch.float32).view(1, 3, 1, 1), False)
        self.register_buffer("image_std", torch.tensor(list(image_std), dtype=torch.float32).view(1, 3, 1, 1), False)
        per_step = sum(e.feature_dim for e in self.encoders.values()) + sum(shape_meta["lowdim"].values())
        self.output_dim = per_step * n_obs_steps

    def forward(self, obs: Mapping[str, torch.Tensor], normalizer: LinearNormalizer) -> torch.Tensor:
        feats = []
        batch = None
        for key in self.rgb_keys:
            x = obs[key]  # (B, To, H, W, 3) uint8
            b, to = x.shape[:2]
            batch = b
            x = x.reshape(b * to, *x.shape[2:]).permute(0, 3, 1, 2).float() / 255.0
            x = (self.augment[key](x) - self.image_mean) / self.image_std
            feats.append(self.encoders[key](x).reshape(b, to, -1))
        for key in self.lowdim_keys:
            x = obs[key].float()
            batch = x.shape[0]
            feats.append(normalizer.normalize(key, x))
        out = torch.cat(feats, dim=-1)
        if out.shape[1] != self.n_obs_steps:
            raise ValueError(
                f"observations hold {out.shape[1]} steps, the policy expects n_obs_steps={self.n_obs_steps}"
            )
        return out.reshape(batch, -1)


def build_obs_encoder(
    cfg: Mapping[str, Any], shape_meta: Mapping[str, Any], n_obs_steps: int, load_pretrained: bool = True
) -> nn.Module:
    """Instantiate ``policy.obs_encoder`` (``_target_``: :class:`ObsEncoder` or a compatible class).

    ``load_pretrained=False`` sets the image model's ``pretrained_path`` to None:
    a checkpoint being loaded brings its own weights, so the pretrained file
    need not exist where the policy is loaded.

    Raises:
        ValueError: the section has no ``_target_``.
        hydra.errors.InstantiationException: a ``_target_`` outside
            :data:`ENCODER_TARGETS`, or bad arguments for it.
    """
    from hydra.utils import instantiate

    cfg = dict(cfg)
    if "_target_" not in cfg:
        raise ValueError(
            "policy.obs_encoder needs a _target_ (e.g. dpflow_core.train.policy.ObsEncoder); "
            f"got the keys {sorted(cfg)}"
        )
    rgb_model = cfg.get("rgb_model")
    if not load_pretrained and isinstance(rgb_model, Mapping) and "pretrained_path" in rgb_model:
        cfg["rgb_model"] = {**rgb_model, "pretrained_path": None}
    return instantiate(
        cfg,
        shape_meta=shape_meta,
        n_obs_steps=n_obs_steps,
        _recursive_=False,
        _convert_="all",
        _execution_whitelist_=list(ENCODER_TARGETS),
    )


class DiffusionUnetImagePolicy(nn.Module):
    """Diffusion Policy with an image encoder from the config (ResNet-18-GN by default) and a FiLM 1-D U-Net.

    Args:
        shape_meta: ``{"rgb": {key: [H, W, 3]}, "lowdim": {key: D}, "action_dim": Da}``
            (see :func:`dpflow_core.train.data.shape_meta`).
        normalizer: the :class:`LinearNormalizer` of every low-dimensional field and ``"action"`` (its
            statistics and per-dimension modes, :func:`~dpflow_core.train.data.normalizer_modes`).
        horizon: H, actions predicted per call.
        n_obs_steps: To, observation frames per call.
        n_action_steps: how many of the H actions ``predict_action`` returns as ``"action"``.
        obs_encoder: the observation encoder (:class:`ObsEncoder`, built by :func:`build_obs_encoder`
            from its Hydra config for ``n_obs_steps`` frames; its ``output_dim`` conditions the U-Net).
        unet: kwargs of :class:`ConditionalUnet1D` (``down_dims``, ``kernel_size``, ``n_groups``,
            ``diffusion_step_embed_dim``).
        noise_scheduler: kwargs of ``diffusers.DDPMScheduler`` (``num_train_timesteps``,
            ``beta_start``, ``beta_end``, ``beta_schedule``, ``clip_sample``, ``prediction_type``).
        num_inference_steps: DDIM steps in ``predict_action``.
        noise_samples_per_obs: K, noise samples and diffusion steps drawn per encoded
            observation in :meth:`compute_loss` (1: Diffusion Policy's loss).

    Raises:
        ValueError: ``n_action_steps`` outside [1, horizon], ``noise_samples_per_obs`` not an
            integer >= 1, or a prediction type other than ``epsilon`` / ``sample``.
    """

    def __init__(
        self,
        shape_meta: Mapping[str, Any],
        normalizer: LinearNormalizer,
        horizon: int,
        n_obs_steps: int,
        n_action_steps: int,
        obs_encoder: ObsEncoder,
        unet: Mapping[str, Any],
        noise_scheduler: Mapping[str, Any],
        num_inference_steps: int = 16,
        noise_samples_per_obs: int = 1,
    ):
        super().__init__()
        if not 1 <= n_action_steps <= horizon:
            raise ValueError(f"n_action_steps must be in [1, horizon={horizon}], got {n_action_steps}")
        k = noise_samples_per_obs
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"policy.noise_samples_per_obs must be an integer >= 1, got {noise_samples_per_obs!r}")
        self.noise_samples_per_obs = noise_samples_per_obs
        self.horizon = int(horizon)
        self.n_obs_steps = int(n_obs_steps)
        self.n_action_steps = int(n_action_steps)
        self.action_dim = int(shape_meta["action_dim"])
        self.num_inference_steps = int(num_inference_steps)
        self.normalizer = normalizer
        self.obs_encoder = obs_encoder
        self.model = ConditionalUnet1D(self.action_dim, self.obs_encoder.output_dim, **dict(unet))
        sched = dict(noise_scheduler)
        self.noise_scheduler = DDPMScheduler(**sched)
        self.prediction_type = self.noise_scheduler.config.prediction_type
        if self.prediction_type not in ("epsilon", "sample"):
            raise ValueError(f"prediction_type must be 'epsilon' or 'sample', got {self.prediction_type!r}")
        sched.pop("variance_type", None)
        self.inference_scheduler = DDIMScheduler(**sched)

    def forward(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """The training loss (scalar): MSE of the predicted noise (or sample).

        ``batch``: ``{"obs": {...}, "action": (B, H, Da)}`` as produced by
        :class:`~dpflow_core.train.batches.SequenceDataset`.
        """
        return self.compute_loss(batch)

    def compute_loss(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """The mean denoising loss over B observations x K noise samples (K: ``noise_samples_per_obs``).

        Each observation's features (and its action sequence) are repeated K times in a row
        (``repeat_interleave``), then B x K noise tensors ``(B*K, H, Da)`` and steps ``(B*K,)`` are
        drawn from torch's global generator, in that order, as with K=1.
        """
        cond = self.obs_encoder(batch["obs"], self.normalizer)
        action = self.normalizer.normalize("action", batch["action"].float())
        k = self.noise_samples_per_obs
        if k > 1:
            cond = cond.repeat_interleave(k, dim=0)
            action = action.repeat_interleave(k, dim=0)
        noise = torch.randn(action.shape, device=action.device)
        steps = torch.randint(
            0, self.noise_scheduler.config.num_train_timesteps, (action.shape[0],), device=action.device
        ).long()
        noisy = self.noise_scheduler.add_noise(action, noise, steps)
        pred = self.model(noisy, steps, cond)
        target = noise if self.prediction_type == "epsilon" else action
        return F.mse_loss(pred.float(), target)

    @torch.no_grad()
    def predict_action(
        self, obs: Mapping[str, torch.Tensor], generator: torch.Generator | Sequence[torch.Generator | None] | None = None
    ) -> dict[str, torch.Tensor]:
        """Sample actions for a batch of observation histories.

        Args:
            obs: ``{rgb_key: (B, To, H, W, 3) uint8, lowdim_key: (B, To, D) float}`` in
                dataset units, the layout of ``SequenceDataset`` samples.
            generator: optional generator for the initial noise; or B of them (None: the
                global one), one per observation, each drawing that observation's noise
                as it would for it alone (so a batch of requests equals each on its own).

        Returns:
            ``{"action_pred": (B, H, Da), "action": (B, n_action_steps, Da)}`` float32,
            unnormalised but still in the network's representation (relative
            poses, rot6d; :func:`dpflow_core.train.data.decode_action` makes them
            absolute, :class:`dpflow_core.inference.Policy` does all of it);
            ``action_pred[:, 0]`` is the action at the latest camera frame's
            time, later entries follow every ``action_down_sample_steps`` steps.
        """
        cond = self.obs_encoder(obs, self.normalizer)
        b = cond.shape[0]
        sched = self.inference_scheduler
        sched.set_timesteps(self.num_inference_steps)
        if isinstance(generator, Sequence):
            if len(generator) != b:
                raise ValueError(f"{len(generator)} generators for a batch of {b} observations")
            x = torch.cat([torch.randn((1, self.horizon, self.action_dim), device=cond.device, generator=g)
                           for g in generator])
        else:
            x = torch.randn((b, self.horizon, self.action_dim), device=cond.device, generator=generator)
        for t in sched.timesteps:
            out = self.model(x, t.to(cond.device), cond)
            x = sched.step(out, t, x).prev_sample
        action_pred = self.normalizer.unnormalize("action", x.float())
        return {"action_pred": action_pred, "action": action_pred[:, : self.n_action_steps]}


def build_policy(
    policy_cfg: Mapping[str, Any],
    spec: ObsActionSpec,
    n_action_steps: int,
    shape_meta: Mapping[str, Any],
    normalizer_stats: Mapping[str, Mapping[str, Any]],
    load_pretrained: bool = True,
    noise_samples_per_obs: int = 1,
) -> DiffusionUnetImagePolicy:
    """Build the policy from the ``policy`` section of the trainer config.

    ``load_pretrained=False`` (when a checkpoint's weights follow) does not read
    the image model's ``pretrained_path``. ``noise_samples_per_obs``: K of the
    training loss (``training.noise_samples_per_obs``); inference does not use it.
    """
    return DiffusionUnetImagePolicy(
        shape_meta=shape_meta,
        normalizer=LinearNormalizer(normalizer_stats, normalizer_modes(spec, shape_meta["lowdim"])),
        horizon=spec.horizon,
        n_obs_steps=spec.n_obs_steps,
        n_action_steps=n_action_steps,
        obs_encoder=build_obs_encoder(policy_cfg["obs_encoder"], shape_meta, spec.n_obs_steps, load_pretrained),
        unet=policy_cfg["unet"],
        noise_scheduler=policy_cfg["noise_scheduler"],
        num_inference_steps=policy_cfg["num_inference_steps"],
        noise_samples_per_obs=noise_samples_per_obs,
    )


def optimizer_param_groups(
    policy: DiffusionUnetImagePolicy, lr: float, obs_encoder_lr_scale: float = 1.0
) -> list[dict[str, Any]]:
    """The optimizer's parameter groups: the observation encoder at ``lr * obs_encoder_lr_scale``.

    Group ``"model"`` holds every trainable parameter outside ``policy.obs_encoder`` (the
    U-Net) at ``lr``; group ``"obs_encoder"`` the encoder's trainable parameters at
    ``lr * obs_encoder_lr_scale``, left out when the encoder has none (a low-dimensional-only
    policy). UMI's timm workspace (Chi et al., RSS 2024) trains a pretrained encoder at 0.1x
    the learning rate this way. The learning-rate schedule scales both groups alike, and
    ``"model"`` comes first, so the logged ``lr`` (group 0) is the U-Net's.

    Raises:
        ValueError: ``lr`` or ``obs_encoder_lr_scale`` is negative or not a finite number
            (0 is allowed: the weights stay at their initial values, e.g. an untrained reference
            policy or a frozen encoder).
    """
    for name, value in (("optimizer.lr", lr), ("obs_encoder_lr_scale", obs_encoder_lr_scale)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    encoder = [p for p in policy.obs_encoder.parameters() if p.requires_grad]
    inside = {id(p) for p in encoder}
    rest = [p for p in policy.parameters() if p.requires_grad and id(p) not in inside]
    groups = [{"name": "model", "params": rest, "lr": float(lr)}]
    if encoder:
        groups.append({"name": "obs_encoder", "params": encoder, "lr": float(lr) * float(obs_encoder_lr_scale)})
    return groups

"""Image model and augmentation of the observation encoder.

The per-camera model is built from the ``policy.obs_encoder.rgb_model``
section of the trainer config (``_target_``, ``hydra.utils.instantiate``):

- :class:`ResNet18GN` (here): the layout of He et al. (Deep Residual Learning,
  CVPR 2016), 18-layer variant, with every BatchNorm a GroupNorm as in
  Diffusion Policy (Chi et al., RSS 2023). The default, and what runs on a CPU.
- :class:`KeypointEncoder` (here): four convolutions and spatial soft-argmax keypoints, for the
  64 x 64 wrist camera of the simulated world (the ``sim`` config).
- :class:`~dpflow_core.train.vit.ViTEncoder`: ViT-B/16 in the CLIP layout, as
  UMI's timm encoder (Chi et al., RSS 2024), loading timm / CLIP weights by key name.

Both take ``(N, 3, H, W)`` float images already normalised by the observation
encoder and return ``(N, feature_dim)``. ``pretrained_path`` loads weights from a
local file; without it the weights start random. Nothing is ever downloaded.

:class:`ImageAugment` holds the augmentation of UMI's timm encoder: a random
crop (then a resize back to the input size, for models of a fixed input size)
and colour jitter (``kornia.augmentation.ColorJitter``, torchvision's
semantics) while training; centre crop and no jitter in eval mode, so
evaluation is deterministic.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dpflow_core.train.weights import load_weights_by_name, read_state_dict


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(max(1, channels // 16), channels)


def init_weights(module: nn.Module, pretrained_path: str | None) -> None:
    """Kaiming (fan-out, ReLU) initialisation of every convolution, then a strict load of ``pretrained_path``
    (the module's own parameter names) when given.

    Raises:
        WeightsError: ``pretrained_path`` missing or not matching ``module``.
    """
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
    if pretrained_path is not None:
        load_weights_by_name(module, read_state_dict(pretrained_path), pretrained_path)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (projected when shape changes)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.norm1 = _norm(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.norm2 = _norm(out_channels)
        self.act = nn.ReLU(inplace=True)
        self.shortcut = (
            nn.Identity()
            if stride == 1 and in_channels == out_channels
            else nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), _norm(out_channels))
        )

    def forward(self, x):
        y = self.act(self.norm1(self.conv1(x)))
        y = self.norm2(self.conv2(y))
        return self.act(y + self.shortcut(x))


class ResNet18GN(nn.Module):
    """ResNet-18-style encoder with GroupNorm (``channels // 16`` groups).

    As in Diffusion Policy, GroupNorm replaces BatchNorm: batch statistics and
    their running averages interact badly with the EMA of the weights and with
    small per-process batches.

    Args:
        base_width: channels of the first stage (64 in ResNet-18).
        feature_dim: size of the output feature; None keeps the pooled
            ``8 * base_width`` features, otherwise a linear layer projects them.
        image_hw: the input's ``(H, W)``, passed by the observation encoder to
            every image model; unused here, global pooling takes any size.
        pretrained_path: a state dict of this module (its own parameter names),
            loaded strictly; None: random (Kaiming) initialisation.

    Input ``(N, 3, H, W)`` float (about [-1, 1]); output ``(N, feature_dim)`` float.

    Raises:
        WeightsError: ``pretrained_path`` missing or not matching this module.
    """

    def __init__(
        self,
        base_width: int = 64,
        feature_dim: int | None = None,
        image_hw: Sequence[int] | None = None,
        pretrained_path: str | None = None,
    ):
        super().__init__()
        w = int(base_width)
        self.stem = nn.Sequential(
            nn.Conv2d(3, w, 7, stride=2, padding=3, bias=False),
            _norm(w),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        stages = []
        in_ch = w
        for i, out_ch in enumerate((w, 2 * w, 4 * w, 8 * w)):
            stride = 1 if i == 0 else 2
            stages.append(nn.Sequential(BasicBlock(in_ch, out_ch, stride), BasicBlock(out_ch, out_ch)))
            in_ch = out_ch
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.proj = nn.Identity() if feature_dim is None else nn.Linear(in_ch, int(feature_dim))
        self.feature_dim = in_ch if feature_dim is None else int(feature_dim)
        init_weights(self, pretrained_path)

    def forward(self, x):
        x = self.stages(self.stem(x))
        return self.proj(self.pool(x).flatten(1))


class KeypointEncoder(nn.Module):
    """A small convolutional encoder with spatial soft-argmax keypoints, for low-resolution cameras.

    Four 3x3 convolutions (GroupNorm, ReLU; strides 2, 1, 2, 1) keep a ``H/4 x W/4`` feature map, where
    ResNet-18's five halvings leave 2 x 2 cells of a 64 x 64 frame; a 1 x 1 convolution gives
    ``keypoints`` heat maps, and each heat map's softmax-weighted mean position (x, y in [-1, 1]) is a
    keypoint (spatial soft-argmax: Levine et al., End-to-End Training of Deep Visuomotor Policies, JMLR
    2016; the pooling of robomimic's and Diffusion Policy's CNN encoders). Positions are what a
    grasping policy must read off the image, and global average pooling discards them.

    Args:
        channels: width of the first two convolutions (the last two have twice as many).
        keypoints: heat maps, so ``2 * keypoints`` coordinates.
        feature_dim: output size (a linear layer over the coordinates).
        image_hw: the input's ``(H, W)`` (from the observation encoder; any size works).
        pretrained_path: a state dict of this module (strict), or None.

    Input ``(N, 3, H, W)`` float; output ``(N, feature_dim)`` float.
    """

    def __init__(
        self,
        channels: int = 32,
        keypoints: int = 32,
        feature_dim: int = 64,
        image_hw: Sequence[int] | None = None,
        pretrained_path: str | None = None,
    ):
        super().__init__()
        c = int(channels)

        def block(cin: int, cout: int, stride: int) -> list[nn.Module]:
            return [nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), _norm(cout), nn.ReLU(inplace=True)]

        self.features = nn.Sequential(*block(3, c, 2), *block(c, c, 1), *block(c, 2 * c, 2), *block(2 * c, 2 * c, 1))
        self.heatmaps = nn.Conv2d(2 * c, int(keypoints), 1)
        self.proj = nn.Linear(2 * int(keypoints), int(feature_dim))
        self.feature_dim = int(feature_dim)
        init_weights(self, pretrained_path)

    def forward(self, x):
        maps = self.heatmaps(self.features(x))  # (N, K, h, w)
        n, k, h, w = maps.shape
        attention = torch.softmax(maps.flatten(2), dim=-1).view(n, k, h, w)
        ys = torch.linspace(-1.0, 1.0, h, device=x.device, dtype=maps.dtype)
        xs = torch.linspace(-1.0, 1.0, w, device=x.device, dtype=maps.dtype)
        kx = (attention.sum(2) * xs).sum(-1)
        ky = (attention.sum(3) * ys).sum(-1)
        return self.proj(torch.cat([kx, ky], dim=-1))


def crop(images: torch.Tensor, crop_hw: Sequence[int], random: bool) -> torch.Tensor:
    """Crop ``(N, C, H, W)`` to ``crop_hw``: a random window per image, or the centre."""
    n, c, h, w = images.shape
    ch, cw = crop_hw
    if (ch, cw) == (h, w):
        return images
    if not random:
        top, left = (h - ch) // 2, (w - cw) // 2
        return images[:, :, top : top + ch, left : left + cw]
    top = torch.randint(0, h - ch + 1, (n,), device=images.device)
    left = torch.randint(0, w - cw + 1, (n,), device=images.device)
    rows = (top[:, None] + torch.arange(ch, device=images.device))[:, None, :, None].expand(n, c, ch, w)
    out = images.gather(2, rows)
    cols = (left[:, None] + torch.arange(cw, device=images.device))[:, None, None, :].expand(n, c, ch, cw)
    return out.gather(3, cols)


class ImageAugment(nn.Module):
    """Random crop and colour jitter while training; centre crop in eval mode.

    Args:
        image_hw: the input's ``(H, W)``.
        crop_ratio: side of the crop as a share of the image's, in (0, 1]
            (UMI: 0.95).
        resize: after cropping, resize back to ``image_hw`` (bilinear,
            antialiased), as UMI's encoder does (``RandomCrop`` then ``Resize``);
            False keeps the cropped size (Diffusion Policy's ResNet).
        color_jitter: None, or ``{brightness, contrast, saturation, hue}`` with
            the meaning of ``torchvision.transforms.ColorJitter`` (UMI: 0.3, 0.4,
            0.5, 0.08), applied by ``kornia.augmentation.ColorJitter`` with
            factors drawn per image, training only.

    ``forward``: ``(N, 3, H, W)`` float RGB in [0, 1] -> ``(N, 3, *output_hw)``,
    in [0, 1]. Randomness comes from torch's global generator (saved in checkpoints).

    Raises:
        ValueError: ``crop_ratio`` outside (0, 1].
    """

    def __init__(
        self,
        image_hw: Sequence[int],
        crop_ratio: float = 1.0,
        resize: bool = False,
        color_jitter: Mapping[str, float] | None = None,
    ):
        super().__init__()
        if not 0 < crop_ratio <= 1:
            raise ValueError(f"crop_ratio must be in (0, 1], got {crop_ratio}")
        h, w = (int(s) for s in image_hw)
        self.image_hw = (h, w)
        self.crop_hw = (max(1, int(round(h * crop_ratio))), max(1, int(round(w * crop_ratio))))
        self.resize = bool(resize)
        self.output_hw = self.image_hw if self.resize else self.crop_hw
        self.jitter = None
        if color_jitter:
            from kornia.augmentation import ColorJitter

            self.jitter = ColorJitter(**{k: float(v) for k, v in dict(color_jitter).items()}, p=1.0)

    def forward(self, x):
        x = crop(x, self.crop_hw, random=self.training)
        if self.resize and tuple(x.shape[-2:]) != self.image_hw:
            x = F.interpolate(x, size=self.image_hw, mode="bilinear", align_corners=False, antialias=True)
        if self.training and self.jitter is not None:
            x = self.jitter(x)
        return x

"""Image encoder: a ResNet-18-shaped CNN with GroupNorm, trained from scratch.

Layout of He et al. (Deep Residual Learning, CVPR 2016), 18-layer variant: a
7x7/2 stem with 3x3/2 max-pooling, four stages of two basic blocks with
widths ``w, 2w, 4w, 8w``, global average pooling. As in Diffusion Policy, every
BatchNorm is a GroupNorm (``channels // 16`` groups): batch statistics and
their running averages interact badly with the EMA of the weights and with
small per-process batches. Nothing is downloaded; weights start random.
"""

from __future__ import annotations

from torch import nn


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(max(1, channels // 16), channels)


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
    """ResNet-18-style encoder with GroupNorm.

    Args:
        base_width: channels of the first stage (64 in ResNet-18).
        feature_dim: size of the output feature; None keeps the pooled
            ``8 * base_width`` features, otherwise a linear layer projects them.

    Input ``(N, 3, H, W)`` float (about [-1, 1]); output ``(N, feature_dim)``.
    Any H, W of at least 32 pixels works (global pooling).
    """

    def __init__(self, base_width: int = 64, feature_dim: int | None = None):
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
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = self.stages(self.stem(x))
        return self.proj(self.pool(x).flatten(1))

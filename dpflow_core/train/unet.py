"""1-D temporal U-Net over an action sequence, conditioned by FiLM.

The network of Diffusion Policy (Chi et al., RSS 2023, section III-B,
"CNN-based diffusion policy"): convolutions run along time over the
``(horizon, action_dim)`` sequence; every residual block is modulated by a
per-channel scale and bias (FiLM, Perez et al., AAAI 2018) computed from the
diffusion-step embedding concatenated with the observation features.
Resolution halves at each level but the last and is restored on the way up,
with skip connections at matching resolutions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn


class StepEmbedding(nn.Module):
    """Sinusoidal embedding of the diffusion step (Vaswani et al. 2017): ``(B,)`` -> ``(B, dim)``."""

    def __init__(self, dim: int):
        super().__init__()
        if dim % 2 or dim < 4:
            raise ValueError(f"step embedding size must be even and >= 4, got {dim}")
        self.dim = dim

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.dim // 2
        freqs = torch.exp(torch.arange(half, device=t.device, dtype=torch.float32) * (-math.log(10000.0) / (half - 1)))
        angles = t.float()[:, None] * freqs[None, :]
        return torch.cat([angles.sin(), angles.cos()], dim=-1)


class ConvNormAct(nn.Sequential):
    """Conv1d (same length) -> GroupNorm -> Mish."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, n_groups: int):
        super().__init__(
            nn.Conv1d(in_channels, out_channels, kernel_size, padding=kernel_size // 2),
            nn.GroupNorm(n_groups, out_channels),
            nn.Mish(),
        )


class FiLMResidualBlock(nn.Module):
    """Two conv blocks; between them the features are scaled and shifted from the condition.

    ``x``: ``(B, C_in, T)``; ``cond``: ``(B, cond_dim)``; output ``(B, C_out, T)``.
    """

    def __init__(self, in_channels: int, out_channels: int, cond_dim: int, kernel_size: int, n_groups: int):
        super().__init__()
        self.block1 = ConvNormAct(in_channels, out_channels, kernel_size, n_groups)
        self.block2 = ConvNormAct(out_channels, out_channels, kernel_size, n_groups)
        self.film = nn.Sequential(nn.Mish(), nn.Linear(cond_dim, 2 * out_channels))
        self.skip = nn.Conv1d(in_channels, out_channels, 1) if in_channels != out_channels else nn.Identity()
        self.out_channels = out_channels

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        h = self.block1(x)
        scale, bias = self.film(cond).unsqueeze(-1).chunk(2, dim=1)
        h = self.block2(scale * h + bias)
        return h + self.skip(x)


class ConditionalUnet1D(nn.Module):
    """Noise (or sample) predictor for a sequence of actions.

    Args:
        input_dim: action dimension Da.
        global_cond_dim: size of the flattened observation features.
        diffusion_step_embed_dim: size of the step embedding.
        down_dims: channels per level; ``len(down_dims) - 1`` halvings, so the
            horizon must be divisible by ``2 ** (len(down_dims) - 1)``.
        kernel_size: temporal kernel size (odd).
        n_groups: GroupNorm groups (must divide every entry of ``down_dims``).

    ``forward(sample (B, H, Da), timestep (B,) int or a scalar, global_cond (B, G))``
    returns ``(B, H, Da)``.
    """

    def __init__(
        self,
        input_dim: int,
        global_cond_dim: int,
        diffusion_step_embed_dim: int = 128,
        down_dims: Sequence[int] = (256, 512, 1024),
        kernel_size: int = 5,
        n_groups: int = 8,
    ):
        super().__init__()
        dims = [int(d) for d in down_dims]
        if not dims or any(d % n_groups for d in dims):
            raise ValueError(f"down_dims {dims} must be non-empty and divisible by n_groups={n_groups}")
        if kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd, got {kernel_size}")
        self.n_halvings = len(dims) - 1
        dsed = int(diffusion_step_embed_dim)
        self.step_encoder = nn.Sequential(
            StepEmbedding(dsed), nn.Linear(dsed, 4 * dsed), nn.Mish(), nn.Linear(4 * dsed, dsed)
        )
        cond_dim = dsed + int(global_cond_dim)

        def block(cin: int, cout: int) -> FiLMResidualBlock:
            return FiLMResidualBlock(cin, cout, cond_dim, kernel_size, n_groups)

        self.down = nn.ModuleList()
        cin = input_dim
        for level, cout in enumerate(dims):
            last = level == len(dims) - 1
            self.down.append(
                nn.ModuleList(
                    [block(cin, cout), block(cout, cout), nn.Identity() if last else nn.Conv1d(cout, cout, 3, 2, 1)]
                )
            )
            cin = cout
        self.mid = nn.ModuleList([block(dims[-1], dims[-1]), block(dims[-1], dims[-1])])
        self.up = nn.ModuleList()
        for level in range(len(dims) - 1, 0, -1):
            self.up.append(
                nn.ModuleList(
                    [
                        block(2 * dims[level], dims[level - 1]),
                        block(dims[level - 1], dims[level - 1]),
                        nn.ConvTranspose1d(dims[level - 1], dims[level - 1], 4, 2, 1),
                    ]
                )
            )
        self.head = nn.Sequential(
            ConvNormAct(dims[0], dims[0], kernel_size, n_groups), nn.Conv1d(dims[0], input_dim, 1)
        )

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor | int, global_cond: torch.Tensor) -> torch.Tensor:
        horizon = sample.shape[1]
        if horizon % (2**self.n_halvings):
            raise ValueError(f"horizon {horizon} must be divisible by {2 ** self.n_halvings} for this U-Net")
        t = torch.as_tensor(timestep, device=sample.device)
        if t.ndim == 0:
            t = t.expand(sample.shape[0])
        cond = torch.cat([self.step_encoder(t), global_cond], dim=-1)
        x = sample.transpose(1, 2)
        skips = []
        for level, (b1, b2, downsample) in enumerate(self.down):
            x = b2(b1(x, cond), cond)
            if level > 0:
                skips.append(x)
            x = downsample(x)
        for b in self.mid:
            x = b(x, cond)
        for b1, b2, upsample in self.up:
            x = torch.cat([x, skips.pop()], dim=1)
            x = upsample(b2(b1(x, cond), cond))
        return self.head(x).transpose(1, 2)

"""Vision Transformer image encoder in the CLIP layout, torch only.

:class:`ViTEncoder` is a Vision Transformer (Dosovitskiy et al., ICLR 2021) in
the CLIP layout (Radford et al., ICML 2021): ViT-B/16 with a LayerNorm before
the blocks, QuickGELU, and no bias on the patch projection, as UMI's
``vit_base_patch16_clip_224.openai`` encoder (Chi et al., RSS 2024). Its trunk's
parameter names are timm's ``VisionTransformer`` names, so timm state dicts
load by key name; OpenAI CLIP / open_clip state dicts (``visual.*``) are
renamed to them first (:func:`clip_to_timm`). timm itself cannot be used here:
it imports torchvision, which does not import beside the CPU torch wheel.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dpflow_core.train.weights import load_weights_by_name, read_state_dict

#: Pixel mean and standard deviation of CLIP's image preprocessing (Radford et al. 2021), RGB in [0, 1].
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class QuickGELU(nn.Module):
    """``x * sigmoid(1.702 x)``: the GELU approximation OpenAI's CLIP was trained with."""

    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


class PatchEmbed(nn.Module):
    """Non-overlapping ``patch_size`` patches -> tokens (timm name ``patch_embed.proj``)."""

    def __init__(self, patch_size: int, embed_dim: int, bias: bool):
        super().__init__()
        self.proj = nn.Conv2d(3, embed_dim, patch_size, stride=patch_size, bias=bias)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)  # (N, L, D)


class Attention(nn.Module):
    """Multi-head self-attention with one fused ``qkv`` projection (timm names ``qkv``, ``proj``)."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed_dim={dim} is not divisible by num_heads={num_heads}")
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        n, length, d = x.shape
        q, k, v = self.qkv(x).reshape(n, length, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(n, length, d))


class Mlp(nn.Module):
    """Two linear layers with an activation between (timm names ``fc1``, ``fc2``)."""

    def __init__(self, dim: int, hidden: int, act: nn.Module):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = act
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block (timm names ``norm1``, ``attn``, ``norm2``, ``mlp``)."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, act: nn.Module, eps: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def _activation(name: str) -> nn.Module:
    if name == "quick_gelu":
        return QuickGELU()
    if name == "gelu":
        return nn.GELU()
    raise ValueError(f"act must be 'quick_gelu' (OpenAI CLIP) or 'gelu', got {name!r}")


class VisionTransformer(nn.Module):
    """The ViT trunk, with timm's ``VisionTransformer`` parameter names.

    Names (``D = embed_dim``, ``L = 1 + (H/p) * (W/p)`` tokens): ``cls_token``
    ``(1, 1, D)``, ``pos_embed`` ``(1, L, D)``, ``patch_embed.proj.weight``
    ``(D, 3, p, p)`` (and ``.bias`` unless ``pre_norm``), ``norm_pre.*`` (when
    ``pre_norm``), ``blocks.{i}.{norm1, attn.qkv, attn.proj, norm2, mlp.fc1,
    mlp.fc2}.{weight, bias}``, ``norm.*``. timm's classifier ``head`` is left out
    (UMI builds the model with ``num_classes=0``).

    Args:
        image_hw: input ``(H, W)``, each a multiple of ``patch_size``.
        patch_size, embed_dim, depth, num_heads, mlp_ratio: ViT-B/16 by default.
        pre_norm: a LayerNorm on the tokens before the blocks (CLIP's ``ln_pre``).
        act: ``"quick_gelu"`` (OpenAI CLIP) or ``"gelu"``.
        norm_eps: LayerNorm epsilon (1e-5 in CLIP, 1e-6 in timm's ImageNet ViTs).

    ``forward``: ``(N, 3, H, W)`` float -> ``(N, L, D)`` float tokens after the
    final LayerNorm, the class token first.
    """

    def __init__(
        self,
        image_hw: Sequence[int] = (224, 224),
        patch_size: int = 16,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        pre_norm: bool = True,
        act: str = "quick_gelu",
        norm_eps: float = 1e-5,
    ):
        super().__init__()
        h, w = (int(s) for s in image_hw)
        if h % patch_size or w % patch_size:
            raise ValueError(f"image size {h}x{w} is not a multiple of patch_size={patch_size}")
        self.grid = (h // patch_size, w // patch_size)
        self.embed_dim, self.num_heads = int(embed_dim), int(num_heads)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + self.grid[0] * self.grid[1], embed_dim))
        self.patch_embed = PatchEmbed(patch_size, embed_dim, bias=not pre_norm)
        self.norm_pre = nn.LayerNorm(embed_dim, eps=norm_eps) if pre_norm else nn.Identity()
        self.blocks = nn.Sequential(
            *(Block(embed_dim, num_heads, mlp_ratio, _activation(act), norm_eps) for _ in range(depth))
        )
        self.norm = nn.LayerNorm(embed_dim, eps=norm_eps)
        # timm's ViT initialisation: truncated normal 0.02 for embeddings and linear weights
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        tokens = self.patch_embed(x)
        tokens = torch.cat([self.cls_token.expand(tokens.shape[0], -1, -1), tokens], dim=1) + self.pos_embed
        return self.norm(self.blocks(self.norm_pre(tokens)))

    def load_pretrained(self, path: str | Path) -> int:
        """Load timm- or CLIP-format weights from a local file, strictly by name.

        A file with ``visual.*`` keys (OpenAI CLIP / open_clip) is renamed with
        :func:`clip_to_timm`; timm's ``head.*`` (classifier or CLIP projection) is
        dropped. A position embedding of another grid is resampled bicubically
        (:func:`resample_pos_embed`). Returns the number of tensors loaded.

        Raises:
            WeightsError: the file is unreadable, or a name is missing, unexpected
                or of another shape (each named).
        """
        sd = read_state_dict(path)
        if any(k.startswith("visual.") for k in sd):
            sd = clip_to_timm(sd)
        sd = {k: v for k, v in sd.items() if not k.startswith("head.")}
        return load_weights_by_name(self, sd, path, resize={"pos_embed": resample_pos_embed})


_CLIP_RENAMES = (
    (r"^conv1\.", "patch_embed.proj."),
    (r"^ln_pre\.", "norm_pre."),
    (r"^ln_post\.", "norm."),
    (r"^transformer\.resblocks\.(\d+)\.ln_1\.", r"blocks.\1.norm1."),
    (r"^transformer\.resblocks\.(\d+)\.ln_2\.", r"blocks.\1.norm2."),
    (r"^transformer\.resblocks\.(\d+)\.attn\.in_proj_(weight|bias)$", r"blocks.\1.attn.qkv.\2"),
    (r"^transformer\.resblocks\.(\d+)\.attn\.out_proj\.", r"blocks.\1.attn.proj."),
    (r"^transformer\.resblocks\.(\d+)\.mlp\.c_fc\.", r"blocks.\1.mlp.fc1."),
    (r"^transformer\.resblocks\.(\d+)\.mlp\.c_proj\.", r"blocks.\1.mlp.fc2."),
)


def clip_to_timm(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename an OpenAI CLIP / open_clip image tower (``visual.*``) to timm's ViT names.

    ``visual.class_embedding`` ``(D,)`` becomes ``cls_token`` ``(1, 1, D)``,
    ``visual.positional_embedding`` ``(L, D)`` becomes ``pos_embed`` ``(1, L, D)``,
    ``visual.proj`` (the image-text projection) becomes ``head.weight``
    (transposed, as timm stores it); the text tower and ``logit_scale`` are left
    out. Names not listed keep their tail and are refused by the strict load.
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if not key.startswith("visual."):
            continue
        name = key[len("visual.") :]
        if name == "class_embedding":
            out["cls_token"] = value.reshape(1, 1, -1)
        elif name == "positional_embedding":
            out["pos_embed"] = value.unsqueeze(0)
        elif name == "proj":
            out["head.weight"] = value.t()
        else:
            for pattern, repl in _CLIP_RENAMES:
                name = re.sub(pattern, repl, name)
            out[name] = value
    return out


def resample_pos_embed(pos_embed: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Resample a ``(1, 1 + h*w, D)`` position embedding to ``shape`` ``(1, 1 + H*W, D)``.

    The class token's entry is kept; the patch grid is interpolated
    bicubically, as timm does for other image sizes. Both grids must be square
    (``h = w``, ``H = W``) and of the same ``D``; otherwise the tensor comes back
    unchanged, and the strict load reports the shape mismatch.
    """
    n_src, n_dst = pos_embed.shape[1] - 1, int(shape[1]) - 1
    s, t = math.isqrt(n_src), math.isqrt(n_dst)
    if s * s != n_src or t * t != n_dst or pos_embed.shape[2] != shape[2]:
        return pos_embed  # the caller reports the shape mismatch
    grid = pos_embed[:, 1:].reshape(1, s, s, -1).permute(0, 3, 1, 2)
    grid = F.interpolate(grid.float(), size=(t, t), mode="bicubic", align_corners=False)
    grid = grid.permute(0, 2, 3, 1).reshape(1, t * t, -1).to(pos_embed.dtype)
    return torch.cat([pos_embed[:, :1], grid], dim=1)


class AttentionPool(nn.Module):
    """Attention pooling of tokens: the mean token attends to all of them.

    The pooling of CLIP's ResNet image towers (Radford et al. 2021), which UMI's
    encoder names ``attention_pool_2d``: a learned position embedding is added
    to ``[mean, tokens]``, and multi-head attention with the mean as the only
    query gives one ``(N, D)`` vector. Input ``(N, L, D)``.
    """

    def __init__(self, n_tokens: int, dim: int, num_heads: int):
        super().__init__()
        self.positional_embedding = nn.Parameter(torch.randn(n_tokens + 1, dim) / dim**0.5)
        self.attn = nn.MultiheadAttention(dim, num_heads, batch_first=True)

    def forward(self, tokens):
        x = torch.cat([tokens.mean(dim=1, keepdim=True), tokens], dim=1) + self.positional_embedding
        out, _ = self.attn(x[:, :1], x, x, need_weights=False)
        return out[:, 0]


class ViTEncoder(nn.Module):
    """A :class:`VisionTransformer` trunk and a pooling of its tokens into one feature.

    Args:
        image_hw: the input's ``(H, W)``, passed by the observation encoder.
        trunk: the trunk's shape, keyword arguments of :class:`VisionTransformer` (``patch_size``,
            ``embed_dim``, ``depth``, ``num_heads``, ``mlp_ratio``, ``pre_norm``, ``act``, ``norm_eps``); what
            is left out keeps ViT-B/16 in the CLIP layout. One mapping, the ``trunk:`` block of the config.
        pool: ``"cls"``, the class token (what UMI's encoder uses for a ViT: it
            ignores its ``feature_aggregation`` setting there); ``"attention"``,
            :class:`AttentionPool` over the patch tokens; ``"mean"``, their mean.
        feature_dim: None keeps ``embed_dim`` features, otherwise a linear layer
            projects them.
        pretrained_path: timm- or CLIP-format weights of the trunk, loaded from
            this local file (:meth:`VisionTransformer.load_pretrained`); None:
            random initialisation. The pooling and projection start random either way.

    Input ``(N, 3, H, W)`` float, normalised with the weights' pixel statistics
    (CLIP's for CLIP weights, :data:`CLIP_MEAN`, :data:`CLIP_STD`); output
    ``(N, feature_dim)`` float.

    Raises:
        ValueError: a bad ``pool``, ``act`` or an image size not a multiple of the patch.
        WeightsError: ``pretrained_path`` missing or not fitting the trunk.
    """

    def __init__(
        self,
        image_hw: Sequence[int] = (224, 224),
        trunk: Mapping[str, Any] | None = None,
        pool: str = "cls",
        feature_dim: int | None = None,
        pretrained_path: str | None = None,
    ):
        super().__init__()
        if pool not in ("cls", "attention", "mean"):
            raise ValueError(f"pool must be 'cls', 'attention' or 'mean', got {pool!r}")
        self.trunk = VisionTransformer(image_hw, **dict(trunk or {}))
        embed_dim, num_heads = self.trunk.embed_dim, self.trunk.num_heads
        if pretrained_path is not None:
            self.trunk.load_pretrained(pretrained_path)
        self.pool = pool
        n_patches = self.trunk.grid[0] * self.trunk.grid[1]
        self.attn_pool = AttentionPool(n_patches, embed_dim, num_heads) if pool == "attention" else None
        self.proj = nn.Identity() if feature_dim is None else nn.Linear(embed_dim, int(feature_dim))
        self.feature_dim = int(embed_dim) if feature_dim is None else int(feature_dim)

    def forward(self, x):
        tokens = self.trunk(x)
        if self.pool == "cls":
            feat = tokens[:, 0]
        elif self.pool == "mean":
            feat = tokens[:, 1:].mean(dim=1)
        else:
            feat = self.attn_pool(tokens[:, 1:])
        return self.proj(feat)

"""Per-field affine normalisation of low-dimensional observations and actions.

Each dimension of a field has a mode (UMI's per-field normaliser):

- ``range`` (default): mapped to [-1, 1] from its minimum and maximum over the
  dataset (the "limits" mode of Diffusion Policy, which suits the clipped
  sample range of the DDPM/DDIM schedulers): the midpoint goes to 0 and the
  range to 2. A range below ``range_eps`` (e.g. a gripper that never moved)
  counts as ``range_eps``, so a constant signal maps to 0 and any sample in
  [-1, 1] maps back to within ``range_eps / 2`` of it;
- ``gaussian``: ``(x - mean) / std`` (std below ``range_eps`` counts as ``range_eps``);
- ``identity``: passed through (rot6d, whose entries already lie in [-1, 1]).

Images are not normalised here: the policy maps uint8 pixels to [-1, 1].
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import nn

STAT_NAMES = ("min", "max", "mean", "std")
MODES = ("range", "gaussian", "identity")


class LinearNormalizer(nn.Module):
    """``normalize(field, x) = x * scale + offset`` per field, inverted by ``unnormalize``.

    Built from statistics (``{field: {"min", "max", "mean", "std"}}``, each a
    ``(D,)`` array) so that a policy can be rebuilt from a checkpoint without the
    dataset. Scales, offsets and statistics are buffers: they follow ``.to()`` and
    are part of ``state_dict()`` but are never trained.

    Args:
        stats: the statistics per field.
        modes: per field, one mode per dimension (see the module docstring); a
            missing field is ``range`` in every dimension.
        range_eps: ranges (and standard deviations) below this are treated as constant.

    Raises:
        ValueError: when a field lacks a statistic, its arrays disagree in shape,
            or its modes are unknown or not one per dimension.
    """

    def __init__(
        self,
        stats: Mapping[str, Mapping[str, np.ndarray | torch.Tensor]],
        modes: Mapping[str, Sequence[str]] | None = None,
        range_eps: float = 1e-4,
    ):
        super().__init__()
        self.fields = tuple(stats)
        self.range_eps = float(range_eps)
        for name, st in stats.items():
            missing = [s for s in STAT_NAMES if s not in st]
            if missing:
                raise ValueError(f"normaliser field {name!r} lacks {missing}")
            t = {s: torch.as_tensor(np.asarray(st[s]), dtype=torch.float32).reshape(-1) for s in STAT_NAMES}
            if len({v.shape for v in t.values()}) != 1:
                raise ValueError(f"normaliser field {name!r}: statistics differ in shape")
            lo, hi = t["min"], t["max"]
            mode = list((modes or {}).get(name) or ["range"] * lo.numel())
            if len(mode) != lo.numel() or set(mode) - set(MODES):
                raise ValueError(f"normaliser field {name!r}: modes {mode} must be {lo.numel()} of {MODES}")
            scale = 2.0 / torch.clamp(hi - lo, min=self.range_eps)
            offset = -scale * (hi + lo) / 2
            gauss = torch.tensor([m == "gaussian" for m in mode])
            ident = torch.tensor([m == "identity" for m in mode])
            g_scale = 1.0 / torch.clamp(t["std"], min=self.range_eps)
            scale = torch.where(gauss, g_scale, scale)
            offset = torch.where(gauss, -t["mean"] * g_scale, offset)
            scale = torch.where(ident, torch.ones_like(scale), scale)
            offset = torch.where(ident, torch.zeros_like(offset), offset)
            self.register_buffer(f"{name}__scale", scale)
            self.register_buffer(f"{name}__offset", offset)
            for s in STAT_NAMES:
                self.register_buffer(f"{name}__{s}", t[s])

    def _params(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        if name not in self.fields:
            raise KeyError(f"normaliser has no field {name!r} (has {list(self.fields)})")
        return getattr(self, f"{name}__scale"), getattr(self, f"{name}__offset")

    def normalize(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Map ``x`` (``(..., D)``, dataset units) of field ``name`` to about [-1, 1]."""
        scale, offset = self._params(name)
        return x * scale + offset

    def unnormalize(self, name: str, y: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`normalize`: back to dataset units (m, rad, ...)."""
        scale, offset = self._params(name)
        return (y - offset) / scale

    def stats(self) -> dict[str, dict[str, torch.Tensor]]:
        """The statistics this normaliser was built from (CPU tensors; for checkpoints)."""
        return {
            name: {s: getattr(self, f"{name}__{s}").detach().cpu().clone() for s in STAT_NAMES} for name in self.fields
        }

"""Pretrained weights from a local file, loaded strictly by parameter name.

Used by the image encoders (:mod:`dpflow_core.train.vision`,
:mod:`dpflow_core.train.vit`): a ``.safetensors`` or ``torch.save`` file is read
without running code, and every name must fit the model, or the error names
the file and the keys. Nothing is ever downloaded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from dpflow_core.errors import WeightsError

def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a state dict (a mapping of names to tensors) from a local file.

    Args:
        path: a ``.safetensors`` file, or a ``torch.save`` file (``.pt``, ``.pth``,
            ``.bin``, ``.ckpt``) holding the state dict itself or
            ``{"state_dict": ...}``. Read with ``weights_only=True``: no code runs.

    Returns:
        ``{name: tensor}`` on the CPU.

    Raises:
        WeightsError: the file is missing, unreadable, or holds something else.
    """
    path = Path(path)
    if not path.is_file():
        raise WeightsError("pretrained weights file does not exist", path=path, code="weights_missing")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            obj = load_file(str(path), device="cpu")
        else:
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any reader failure is reported with the file
        raise WeightsError(f"cannot read weights: {type(exc).__name__}: {exc}", path=path) from exc
    if isinstance(obj, Mapping) and isinstance(obj.get("state_dict"), Mapping):
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise WeightsError("not a state dict (a mapping of parameter names to tensors)", path=path)
    return dict(obj)


def load_weights_by_name(
    module: nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    source: str | Path,
    resize: Mapping[str, object] | None = None,
) -> int:
    """Copy ``state_dict`` into ``module`` strictly, by parameter name.

    Every name of ``module.state_dict()`` must be present with the same shape,
    and no other name may be: the error names the file and the first offending
    keys. ``resize`` maps a key to a function ``(tensor, wanted_shape) ->
    tensor`` applied when that key's shape differs (position embeddings).

    Returns:
        the number of tensors loaded.

    Raises:
        WeightsError: names missing, unexpected, or of another shape.
    """
    own = module.state_dict()
    sd = dict(state_dict)
    unexpected = sorted(set(sd) - set(own))
    missing = sorted(set(own) - set(sd))
    problems = []
    if unexpected:
        problems.append(f"unexpected key(s) {_few(unexpected)}")
    if missing:
        problems.append(f"missing key(s) {_few(missing)}")
    for name in sorted(set(sd) & set(own)):
        want = tuple(own[name].shape)
        if tuple(sd[name].shape) != want and resize and name in resize:
            sd[name] = resize[name](sd[name], want)
        if tuple(sd[name].shape) != want:
            problems.append(f"{name} has shape {list(sd[name].shape)}, the model's is {list(want)}")
    if problems:
        raise WeightsError(
            f"weights do not fit {type(module).__name__}: " + "; ".join(problems), path=source, code="weights_mismatch"
        )
    module.load_state_dict(sd, strict=True)
    return len(sd)


def _few(names: Sequence[str], n: int = 5) -> str:
    shown = ", ".join(repr(x) for x in names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")

"""Trainer checkpoints: what they hold, atomic writes, top-k, and loading a policy.

A checkpoint is one ``torch.save`` file (a dict of tensors and plain Python
values, loadable with ``torch.load(weights_only=True)``). It holds everything
needed to continue training exactly where it stopped and everything needed to
rebuild the policy without the dataset:

==================  ===========================================================
entry               content
==================  ===========================================================
format              ``"dpflow-train-checkpoint"``; ``format_version`` its version
cfg                 the resolved trainer config (YAML text)
shape_meta          image shapes, low-dimensional sizes, action dimension
spec                observation/action keys, horizons, strides, latency steps, pose
                    representation, ``tx_cam_tcp``, normaliser mode
normalizer          statistics of every low-dimensional field and the action
dataset             path, episodes, steps, frequency and SHA-256 of the training dataset
tx_cam_tcp          the 4 x 4 camera-to-TCP transform applied to every pose
model               trained weights (``state_dict`` of the policy)
ema                 EMA settings and update count (None when EMA is off); the
                    averaged weights themselves are the ``policy`` entry
policy              weights for evaluation: the EMA weights (``model``'s without EMA)
optimizer           optimizer state
lr_scheduler        learning-rate scheduler state
grad_scaler         ``{"used": bool, "state": dict | None}``: whether accelerate ran a
                    grad scaler (fp16 on a GPU) and its state
epoch               completed epochs
batch_in_epoch      batches already run of epoch ``epoch`` (> 0 for mid-epoch saves)
global_step         batches run since the start of training
sampler             data-order settings (:class:`~dpflow_core.train.sampler.EpochBatchSampler`)
topk                the top-k index (file name -> monitored value)
num_processes       how many processes trained
rank_states         per process: RNG states (python, numpy, torch, cuda) and the
                    losses of the epoch so far
wandb_id            the W&B run id (None without W&B)
==================  ===========================================================

Files are written to a hidden temporary name in the same folder, flushed,
fsynced and renamed over the final name, so a crash or kill during a save
leaves the previous file intact and never a half-written one under a final name.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpflow_core.errors import RunError
from dpflow_core.files import atomic_output, atomic_path

FORMAT = "dpflow-train-checkpoint"
FORMAT_VERSION = 1
LATEST_NAME = "latest.ckpt"
#: How a temporary name of :func:`dpflow_core.files.temp_path_for` starts and what it holds
#: (``.<name>.tmp-<pid>-<random>``): what :func:`remove_stale_temp_files` removes.
TEMP_PREFIX = "."
TEMP_MARK = ".tmp-"

#: Entries every checkpoint must hold, with what they are for.
REQUIRED_ENTRIES: dict[str, str] = {
    "format": "file format marker",
    "format_version": "file format version",
    "cfg": "resolved trainer config",
    "shape_meta": "shapes the policy was built for",
    "spec": "observation/action definition and latency steps",
    "normalizer": "normaliser statistics",
    "dataset": "training dataset identity",
    "tx_cam_tcp": "camera-to-TCP transform",
    "model": "trained weights",
    "ema": "EMA settings and update count",
    "policy": "evaluation (EMA) weights",
    "optimizer": "optimizer state",
    "lr_scheduler": "learning-rate scheduler state",
    "grad_scaler": "grad scaler state",
    "epoch": "completed epochs",
    "batch_in_epoch": "position inside the current epoch",
    "global_step": "batches run so far",
    "sampler": "data-order state",
    "topk": "top-k index",
    "num_processes": "process count",
    "rank_states": "per-process RNG states and epoch losses",
    "wandb_id": "W&B run id",
}
#: RNG states each entry of ``rank_states`` must hold.
RNG_ENTRIES = ("python", "numpy", "torch", "cuda")


def required_checkpoint_entries() -> dict[str, str]:
    """Names of the entries a complete checkpoint holds, each with a short description.

    Besides these, :func:`missing_checkpoint_entries` requires ``ema`` unless EMA was
    off, the grad scaler's state when the run used one, and every process's RNG states.
    """
    return dict(REQUIRED_ENTRIES)


def missing_checkpoint_entries(payload: Mapping[str, Any]) -> list[str]:
    """What a loaded checkpoint lacks to resume training exactly (empty when complete).

    Returns dotted names such as ``"optimizer"``, ``"grad_scaler"`` or
    ``"rank_states[1].rng.cuda"``.
    """
    missing = [name for name in REQUIRED_ENTRIES if name not in payload]
    if missing:
        return missing
    if payload["format"] != FORMAT:
        return [f"format (is {payload['format']!r})"]
    cfg_text = payload["cfg"]
    use_ema = None
    if isinstance(cfg_text, str):
        from omegaconf import OmegaConf

        use_ema = OmegaConf.select(OmegaConf.create(cfg_text), "training.use_ema", default=True)
    for name in (
        "model",
        "policy",
        "optimizer",
        "lr_scheduler",
        "normalizer",
        "shape_meta",
        "spec",
        "sampler",
        "topk",
        "cfg",
    ):
        if payload[name] is None:
            missing.append(name)
    if use_ema and payload["ema"] is None:
        missing.append("ema")
    scaler = payload["grad_scaler"]
    if not isinstance(scaler, Mapping) or "used" not in scaler:
        missing.append("grad_scaler")
    elif scaler["used"] and scaler.get("state") is None:
        missing.append("grad_scaler.state")
    states = payload["rank_states"]
    if not isinstance(states, list) or len(states) != payload["num_processes"]:
        missing.append("rank_states (one per process)")
    else:
        for i, st in enumerate(states):
            rng = st.get("rng") if isinstance(st, Mapping) else None
            if not isinstance(rng, Mapping):
                missing.append(f"rank_states[{i}].rng")
                continue
            missing.extend(f"rank_states[{i}].rng.{k}" for k in RNG_ENTRIES if k not in rng)
            if "epoch_losses" not in st:
                missing.append(f"rank_states[{i}].epoch_losses")
    return missing


# RNG states -------------------------------------------------------------------------


def capture_rng_state() -> dict[str, Any]:
    """RNG states of python ``random``, numpy's global generator, torch CPU and the current CUDA device."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
        # one process drives one device: only its own generator (touching the others
        # would start a CUDA context on every visible GPU in every process)
        "cuda": [torch.cuda.get_rng_state()] if torch.cuda.is_available() and torch.cuda.is_initialized() else [],
    }


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`.

    The CUDA state goes to the current device; without CUDA it is ignored.
    """
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    npst = state["numpy"]
    np.random.set_state(
        (npst["kind"], npst["keys"].numpy().astype(np.uint32), npst["pos"], npst["has_gauss"], npst["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda[0])


# Atomic files ------------------------------------------------------------------------


def atomic_save(payload: Mapping[str, Any], path: str | Path) -> Path:
    """Write ``payload`` with ``torch.save`` to ``path`` through :func:`dpflow_core.files.atomic_output`
    (hidden temporary name in the same folder, fsync of file and folder, rename).

    Raises:
        RunError: when the file cannot be written (the temporary file is removed).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_output(path, "wb") as f:
            torch.save(dict(payload), f)
    except (OSError, RuntimeError, pickle.PicklingError) as exc:
        raise RunError(f"cannot write checkpoint: {exc}", path=path) from exc
    return path


def atomic_copy(src: Path, dst: Path) -> Path:
    """Give ``dst`` the content of ``src`` through :func:`dpflow_core.files.atomic_path`: a hard link
    at the temporary name when possible (no second copy of the bytes on disk), else a copy."""
    with atomic_path(dst) as tmp:
        tmp.unlink()  # the helper created it empty; the link needs the name free
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
    return dst


def remove_stale_temp_files(directory: str | Path) -> list[Path]:
    """Delete temporary checkpoint files left by a killed process; returns what was removed."""
    directory = Path(directory)
    removed = []
    if directory.is_dir():
        for p in directory.iterdir():
            if p.name.startswith(TEMP_PREFIX) and TEMP_MARK in p.name and p.is_file():
                p.unlink(missing_ok=True)
                removed.append(p)
    return removed


def load_checkpoint(path: str | Path, require_complete: bool = True) -> dict[str, Any]:
    """Load a checkpoint on the CPU (``weights_only=True``: no code runs from the file).

    Args:
        path: the ``.ckpt`` file.
        require_complete: also fail when an entry needed to resume is missing.

    Raises:
        RunError: when the file is missing, unreadable, not a dpflow checkpoint,
            or (``require_complete``) incomplete; the reason names what is missing.
    """
    path = Path(path)
    if not path.is_file():
        raise RunError("checkpoint does not exist", path=path, code="checkpoint_missing")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for truncated or foreign files
        raise RunError(
            f"unreadable checkpoint ({type(exc).__name__}: {exc})", path=path, code="checkpoint_unreadable"
        ) from exc
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise RunError(f"not a dpflow trainer checkpoint (no format={FORMAT!r})", path=path, code="checkpoint_foreign")
    if payload.get("format_version") != FORMAT_VERSION:
        raise RunError(
            f"checkpoint format version {payload.get('format_version')!r}; this dpflow reads {FORMAT_VERSION}",
            path=path,
            code="checkpoint_version",
        )
    if require_complete:
        missing = missing_checkpoint_entries(payload)
        if missing:
            raise RunError(
                "incomplete checkpoint, cannot resume exactly; missing: " + ", ".join(missing),
                path=path,
                code="checkpoint_incomplete",
            )
    return payload


# Top-k ------------------------------------------------------------------------------


class TopKCheckpoints:
    """The k best checkpoints by a monitored metric, named by ``format_str``.

    Args:
        directory: the ``checkpoints/`` folder.
        monitor_key: metric to rank by (e.g. ``"train_loss"``; note that top-k on
            training loss ranks fit to the training data, not generalisation).
        mode: ``"min"`` or ``"max"``.
        k: how many to keep; 0 keeps none.
        format_str: file name pattern, formatted with the epoch's metrics and
            ``epoch`` (e.g. ``"epoch={epoch:04d}-train_loss={train_loss:.3f}.ckpt"``).
    """

    def __init__(self, directory: str | Path, monitor_key: str, mode: str, k: int, format_str: str):
        if mode not in ("min", "max"):
            raise ValueError(f"top-k mode must be 'min' or 'max', got {mode!r}")
        if k < 0:
            raise ValueError(f"top-k k must be >= 0, got {k}")
        self.directory = Path(directory)
        self.monitor_key = monitor_key
        self.mode = mode
        self.k = int(k)
        self.format_str = format_str
        self.index: dict[str, float] = {}

    def propose(self, metrics: Mapping[str, Any]) -> tuple[str | None, list[str]]:
        """Decide whether this epoch's checkpoint enters the top-k, updating the index.

        Returns:
            (file name to write or None, file names to delete after writing).
        """
        if self.k == 0 or self.monitor_key not in metrics:
            return None, []
        value = float(metrics[self.monitor_key])
        if not np.isfinite(value):
            return None, []
        name = self.format_str.format(**metrics)
        if Path(name).name != name or not name:
            raise ValueError(f"top-k format_str produced {name!r}, not a plain file name")
        candidates = dict(self.index)
        candidates[name] = value
        ranked = sorted(candidates.items(), key=lambda kv: kv[1], reverse=self.mode == "max")
        keep = dict(ranked[: self.k])
        if name not in keep:
            return None, []
        evicted = [n for n in self.index if n not in keep]
        self.index = keep
        return name, evicted

    def reconcile(self) -> list[str]:
        """Drop index entries whose file is gone (a crash between index update and link)."""
        gone = [n for n in self.index if not (self.directory / n).is_file()]
        for n in gone:
            del self.index[n]
        return gone

    def state_dict(self) -> dict[str, Any]:
        return {"monitor_key": self.monitor_key, "mode": self.mode, "k": self.k, "index": dict(self.index)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        same = state.get("monitor_key") == self.monitor_key and state.get("mode") == self.mode
        self.index = {str(k): float(v) for k, v in state.get("index", {}).items()} if same else {}
        if len(self.index) > self.k:
            ranked = sorted(self.index.items(), key=lambda kv: kv[1], reverse=self.mode == "max")
            self.index = dict(ranked[: self.k])


# Network for inference -----------------------------------------------------------------


def load_network(path: str | Path, device: str | torch.device = "cpu", use_ema: bool = True):
    """Rebuild the trained network module from a checkpoint.

    This is the raw module, in the network's representation (normalised
    relative poses, rot6d); a robot or an evaluation wants
    :func:`dpflow_core.inference.load_policy`, which wraps it.

    Args:
        path: a checkpoint written by the trainer (``latest.ckpt`` or a top-k file).
        device: where to put the policy.
        use_ema: load the EMA weights (entry ``policy``, what evaluation uses); False
            loads the raw trained weights (entry ``model``).

    Returns:
        ``(policy, cfg, spec)``: the :class:`~dpflow_core.train.policy.DiffusionUnetImagePolicy`
        in eval mode, the resolved config (``omegaconf.DictConfig``) and the
        :class:`~dpflow_core.train.data.ObsActionSpec` it was trained with (with the
        latency steps used in training), so evaluation can cut samples the same way.

    Raises:
        RunError: when the file is missing, unreadable or lacks the weights, config,
            shapes or normaliser.
    """
    from omegaconf import OmegaConf

    from dpflow_core.train.policy import build_policy

    payload = load_checkpoint(path, require_complete=False)
    for name in ("cfg", "shape_meta", "spec", "normalizer", "policy" if use_ema else "model"):
        if payload.get(name) is None:
            raise RunError(
                f"checkpoint lacks {name!r}, cannot rebuild the policy", path=path, code="checkpoint_incomplete"
            )
    cfg = OmegaConf.create(payload["cfg"])
    spec = spec_from_payload(payload)
    policy = build_policy(
        OmegaConf.to_container(cfg.policy, resolve=True),
        spec,
        int(cfg.n_action_steps),
        payload["shape_meta"],
        payload["normalizer"],
        load_pretrained=False,  # the checkpoint holds the weights; the pretrained file may not be here
    )
    policy.load_state_dict(payload["policy" if use_ema else "model"])
    return policy.to(device).eval(), cfg, spec


def spec_from_payload(payload: Mapping[str, Any]):
    """The :class:`~dpflow_core.train.data.ObsActionSpec` a checkpoint was trained with."""
    from dpflow_core.train.data import ObsActionSpec

    s = payload["spec"]
    return ObsActionSpec(
        rgb_keys=tuple(s["rgb_keys"]),
        lowdim_keys=tuple(s["lowdim_keys"]),
        action_keys=tuple(s["action_keys"]),
        n_obs_steps=int(s["n_obs_steps"]),
        horizon=int(s["horizon"]),
        obs_down_sample_steps=int(s["obs_down_sample_steps"]),
        action_down_sample_steps=int(s["action_down_sample_steps"]),
        obs_latency_steps={k: float(v) for k, v in s["obs_latency_steps"].items()},
        obs_pose_repr=str(s["obs_pose_repr"]),
        action_pose_repr=str(s["action_pose_repr"]),
        tx_cam_tcp=tuple(tuple(float(v) for v in row) for row in s["tx_cam_tcp"]),
        lowdim_norm=str(s["lowdim_norm"]),
        rot6d_norm=str(s.get("rot6d_norm", "identity")),
        action_padding=bool(s["action_padding"]),
    )


def spec_to_payload(spec) -> dict[str, Any]:
    """Plain-value form of an ObsActionSpec for the checkpoint's ``spec`` entry."""
    return {
        "rgb_keys": list(spec.rgb_keys),
        "lowdim_keys": list(spec.lowdim_keys),
        "action_keys": list(spec.action_keys),
        "n_obs_steps": spec.n_obs_steps,
        "horizon": spec.horizon,
        "obs_down_sample_steps": spec.obs_down_sample_steps,
        "action_down_sample_steps": spec.action_down_sample_steps,
        "obs_latency_steps": {k: float(v) for k, v in spec.obs_latency_steps.items()},
        "obs_pose_repr": spec.obs_pose_repr,
        "action_pose_repr": spec.action_pose_repr,
        "tx_cam_tcp": [list(row) for row in spec.tx_cam_tcp],
        "lowdim_norm": spec.lowdim_norm,
        "rot6d_norm": spec.rot6d_norm,
        "action_padding": spec.action_padding,
    }

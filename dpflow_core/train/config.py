"""The trainer config, read and checked before anything is built.

The built-in trainer is configured by a composed Hydra config (``dpflow_core/train/conf``).
This module turns its sections into what the training loop (:mod:`dpflow_core.train.workspace`)
builds from: :func:`check_config` refuses a config the trainer cannot run (or could only run
into a useless policy) with a :class:`~dpflow_core.errors.RunError` naming the keys;
:func:`spec_from_config` gives the :class:`~dpflow_core.train.data.ObsActionSpec` (spacings
in seconds turned into steps at the dataset's rate, DESIGN rule 15); :func:`throughput_settings`
and :func:`mixed_precision_of` the speed settings; :func:`obs_encoder_lr_scale` the encoder's
learning-rate factor.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from dpflow_core import pose
from dpflow_core.errors import RunError
from dpflow_core.offsets import obs_latencies_s
from dpflow_core.train.data import DEFAULT_ACTION_KEYS, ObsActionSpec, latency_steps

log = logging.getLogger("dpflow.train")

LOGGING_MODES = ("offline", "online", "disabled")
MIXED_PRECISION = ("no", "fp16", "bf16", "auto")
#: CPU instruction-set flags (``/proc/cpuinfo``) with native bfloat16 arithmetic: x86 AVX512-BF16 and AMX, ARM BF16.
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def obs_encoder_lr_scale(cfg: DictConfig) -> float:
    """The observation encoder's learning-rate factor: ``optimizer.pretrained_obs_encoder_lr_scale``
    when the image model starts from a file (``policy.obs_encoder.rgb_model.pretrained_path``), else 1.

    As UMI's timm workspace, which trains a pretrained encoder at 0.1x (its config) and a
    randomly initialised one at the full rate. Missing key: 1 (configs written before it).
    """
    rgb_model = cfg.policy.obs_encoder.get("rgb_model") or {}
    if rgb_model.get("pretrained_path") is None:
        return 1.0
    return float(cfg.optimizer.get("pretrained_obs_encoder_lr_scale", 1.0))


def down_sample_steps(task: DictConfig, which: str, frequency_hz: float) -> int:
    """Steps between observation frames (``which="obs"``) or actions (``"action"``).

    ``task.<which>_dt_s`` (seconds, DESIGN rule 15) when set: ``round(dt x frequency)``, at least 1, so
    one config means the same spacing on 30 Hz and 60 Hz data; a rounding that misses ``dt`` by more than
    10 % is logged. Otherwise ``task.<which>_down_sample_steps`` (steps, the UMI configs' keys).

    Raises:
        ValueError: a spacing that is not positive, or seconds without a usable frequency.
    """
    dt = OmegaConf.select(task, f"{which}_dt_s")
    if dt is None:
        return int(task[f"{which}_down_sample_steps"])
    dt = float(dt)
    if not dt > 0:
        raise ValueError(f"task.{which}_dt_s must be > 0 seconds, got {dt}")
    if not frequency_hz or frequency_hz <= 0:
        raise ValueError(f"task.{which}_dt_s={dt} s needs the dataset's frequency, got {frequency_hz!r}")
    steps = max(1, round(dt * frequency_hz))
    if abs(steps / frequency_hz - dt) > 0.1 * dt:
        log.warning("task.%s_dt_s=%.4g s is %d steps at %.3f Hz (%.4g s)", which, dt, steps, frequency_hz,
                    steps / frequency_hz)
    return steps


def spec_from_config(cfg: DictConfig, frequency_hz: float, metadata: Mapping | None = None) -> ObsActionSpec:
    """The observation/action spec of a trainer config, latencies scaled by ``frequency_hz``.

    Reads ``task.camera_obs_latency`` / ``robot_obs_latency`` / ``gripper_obs_latency``
    (s; with ``task.latency: measured`` less the camera offset the dataset ``metadata`` measured,
    :func:`dpflow_core.offsets.obs_latencies_s`), ``task.pose_repr``, ``task.tx_cam_tcp`` (null or ``identity``: the camera pose is the
    TCP; a 4 x 4 list; ``{translation, rotation}``) and ``task.lowdim_norm``.

    Raises:
        ValueError: for a bad representation, transform or latency.
    """
    task = cfg.task
    lowdim = tuple(task.lowdim_keys)
    lat = latency_steps(
        tuple(dict.fromkeys(lowdim + DEFAULT_ACTION_KEYS)),
        *obs_latencies_s(task, metadata),
        frequency_hz,
    )
    tx = task.tx_cam_tcp
    if isinstance(tx, str):
        if tx != "identity":  # "required" is refused earlier, by check_config
            raise ValueError(f"task.tx_cam_tcp must be identity, a 4x4 list or {{translation, rotation}}, got {tx!r}")
        tx = None
    tx = OmegaConf.to_container(tx, resolve=True) if tx is not None else None
    return ObsActionSpec(
        rgb_keys=tuple(task.rgb_keys),
        lowdim_keys=lowdim,
        action_keys=tuple(task.action_keys),
        n_obs_steps=int(cfg.n_obs_steps),
        horizon=int(cfg.horizon),
        obs_down_sample_steps=down_sample_steps(task, "obs", frequency_hz),
        action_down_sample_steps=down_sample_steps(task, "action", frequency_hz),
        obs_latency_steps=lat,
        obs_pose_repr=str(task.pose_repr.obs_pose_repr),
        action_pose_repr=str(task.pose_repr.action_pose_repr),
        tx_cam_tcp=pose.as_tuple(pose.tx_from_config(tx)),
        lowdim_norm=str(task.lowdim_norm),
        rot6d_norm=str(task.rot6d_norm),
        action_padding=bool(task.action_padding),
    )


def mixed_precision_of(cfg: DictConfig, device: str | None = None) -> str:
    """``training.mixed_precision`` as accelerate spells it (YAML may turn ``no`` into False).

    ``auto`` resolves on the machine that trains (``device``: ``"cpu"`` or ``"cuda"``; default the one accelerate
    will pick: CUDA when available and ``ACCELERATE_USE_CPU`` is not set): ``"bf16"`` where the hardware computes
    bfloat16 natively (:func:`native_bf16`), else ``"no"``. bf16 autocast, never fp16: it needs no grad scaler.
    Measured on this project's 2-core AVX512-BF16 machine in docs/benchmarks.md ("bf16 autocast on the CPU").

    Raises:
        RunError: a value outside :data:`MIXED_PRECISION`.
    """
    value = cfg.training.mixed_precision
    value = "no" if value in (False, None) else str(value)
    if value not in MIXED_PRECISION:
        raise RunError(f"training.mixed_precision must be one of {MIXED_PRECISION}, got {value!r}")
    if value == "auto":
        if device is None:
            use_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
            device = "cuda" if torch.cuda.is_available() and not use_cpu else "cpu"
        value = "bf16" if native_bf16(device) else "no"
    return value


def bf16_reason(device: str) -> str:
    """Why ``auto`` chose as it did on ``device``, for the run's log: the CPU flag that computes bf16, the GPU's
    name, or the lack of either."""
    if device.startswith("cuda"):
        return (f"{torch.cuda.get_device_name()} computes bf16" if native_bf16(device)
                else "this GPU has no native bf16")
    flags = _cpu_flags() & BF16_CPU_FLAGS
    return f"this CPU has {', '.join(sorted(flags))}" if flags else "this CPU has no bf16 instructions"


def _cpu_flags() -> set[str]:
    """The instruction-set flags of ``/proc/cpuinfo`` (x86 ``flags``, ARM ``Features``); empty where unreadable."""
    try:
        text = open("/proc/cpuinfo", encoding="ascii", errors="replace").read()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.split(":")[0].strip() in ("flags", "Features")
            for flag in line.split(":", 1)[1].split()}


def native_bf16(device: str, cpu_flags: set[str] | None = None) -> bool:
    """Whether ``device`` (``"cpu"`` or ``"cuda"``) computes bfloat16 natively, so that bf16 autocast pays.

    CUDA: ``torch.cuda.is_bf16_supported()`` (Ampere and newer). CPU: the instruction-set flags of
    ``/proc/cpuinfo`` (``cpu_flags`` for a test): ``avx512_bf16`` or ``amx_bf16`` on x86 (AMD Zen 4, Intel
    Cooper Lake and newer), ``bf16`` on ARM. Without them oneDNN emulates bf16, slower than float32; a machine
    without ``/proc/cpuinfo`` (not Linux) counts as without.
    """
    if device.startswith("cuda"):
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if cpu_flags is None:
        cpu_flags = _cpu_flags()
    return bool(cpu_flags & BF16_CPU_FLAGS)


def check_config(cfg: DictConfig) -> None:
    """Refuse a config the trainer cannot run, or could only run into a useless policy (RunError naming the keys)."""
    if OmegaConf.is_missing(cfg.task, "dataset_path") or not cfg.task.dataset_path:
        raise RunError("task.dataset_path is required (the dataset.npz to train on)")
    if OmegaConf.select(cfg, "task.tx_cam_tcp") == "required":
        # the UMI config says so: its gripper's TCP is 0.1-0.2 m from the camera
        raise RunError(
            "task.tx_cam_tcp is required by this config: give the pose of the TCP in the camera frame "
            "(task.tx_cam_tcp='{translation: [x, y, z], rotation: [rx, ry, rz]}' in m and rad, or a 4x4 list), "
            "or task.tx_cam_tcp=identity to train on the camera pose itself"
        )
    scheduler = OmegaConf.select(cfg, "policy.noise_scheduler", default=None) or {}
    if str(cfg.task.lowdim_norm) == "gaussian" and bool(scheduler.get("clip_sample", False)):
        limit = float(scheduler.get("clip_sample_range", 1.0) or 1.0)
        raise RunError(
            f"task.lowdim_norm=gaussian with policy.noise_scheduler.clip_sample=true: sampling clips every normalised "
            f"action to [-{limit:g}, {limit:g}], and a gaussian normaliser puts every target beyond {limit:g} standard "
            f"deviation(s) outside it (about a third of a normal distribution, 24-63 % of targets measured in issue 25), "
            f"which the policy can then never predict; use task.lowdim_norm=range, or "
            f"policy.noise_scheduler.clip_sample=false"
        )
    mode = str(cfg.logging.mode)
    if mode not in LOGGING_MODES:
        raise RunError(f"logging.mode must be one of {LOGGING_MODES}, got {mode!r}")
    mixed_precision_of(cfg)
    positive = {
        "training.num_epochs": cfg.training.num_epochs,
        "training.gradient_accumulate_every": cfg.training.gradient_accumulate_every,
        "training.val_every": cfg.training.val_every,
        "training.sample_every": cfg.training.sample_every,
        "training.checkpoint_every": cfg.training.checkpoint_every,
        "dataloader.batch_size": cfg.dataloader.batch_size,
        "val_dataloader.batch_size": cfg.val_dataloader.batch_size,
    }
    for name in ("training.max_train_steps", "training.max_val_steps", "checkpoint.every_n_steps"):
        value = OmegaConf.select(cfg, name)
        if value is not None:
            positive[name] = value
    for name, value in positive.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise RunError(f"{name} must be a positive integer, got {value!r}")
    scale = OmegaConf.select(cfg, "optimizer.pretrained_obs_encoder_lr_scale", default=1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise RunError(f"optimizer.pretrained_obs_encoder_lr_scale must be a finite number > 0, got {scale!r}")
    for name in (
        "dataloader.num_workers",
        "val_dataloader.num_workers",
        "checkpoint.topk.k",
        "training.lr_warmup_steps",
    ):
        value = OmegaConf.select(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise RunError(f"{name} must be an integer >= 0, got {value!r}")


def throughput_settings(cfg: DictConfig) -> dict[str, Any]:
    """The trainer's speed settings, checked: ``noise_samples_per_obs``, ``torch_threads``, ``allow_tf32``.

    Read from the ``training`` section; a config written before a key gets the old behaviour
    (1 noise sample per observation, torch's own thread count, no TF32):

    - ``training.noise_samples_per_obs`` (int >= 1): K, noise samples and diffusion steps
      trained per encoded observation (see :mod:`dpflow_core.train.policy`); the number of
      denoising samples per step is ``dataloader.batch_size`` x K.
    - ``training.torch_threads`` (int >= 1 or null): torch's intra-op threads in each process
      (``torch.set_num_threads``); null leaves torch's default (one per core).
    - ``training.allow_tf32`` (bool): TF32 matmuls and cuDNN convolutions on CUDA (Ampere and
      newer; about 10 mantissa bits instead of 23); ignored on the CPU.

    Raises:
        RunError: a value of the wrong type or range, naming the key.
    """
    k = OmegaConf.select(cfg, "training.noise_samples_per_obs", default=1)
    threads = OmegaConf.select(cfg, "training.torch_threads", default=None)
    tf32 = OmegaConf.select(cfg, "training.allow_tf32", default=False)
    for name, value in (("noise_samples_per_obs", k), ("torch_threads", threads)):
        if value is None and name == "torch_threads":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise RunError(f"training.{name} must be a positive integer, got {value!r}")
    if not isinstance(tf32, bool):
        raise RunError(f"training.allow_tf32 must be true or false, got {tf32!r}")
    return {"noise_samples_per_obs": k, "torch_threads": threads, "allow_tf32": tf32}


def apply_threads(threads: int | None) -> int:
    """Set torch's intra-op thread count (None: unchanged); returns the count before.

    One thread per process is the measured choice on a shared 2-core machine
    (docs/benchmarks.md): two OpenMP threads spin-wait for each other when another
    process holds a core, and a step then took up to 40x longer than on one thread.
    """
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(int(threads))
    return before

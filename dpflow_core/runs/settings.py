"""The settings of a smoke run and of a training run, declared once (DESIGN rule 16).

:class:`SmokeSettings` and :class:`TrainSettings` hold what a person chooses about a run (name, trainer
config, sizes, GPUs, time limits), with their defaults, units and validation. The ``dpflow smoke|train``
and ``dpflow scale smoke|train`` commands and the ``smoke_run`` / ``train_run`` assets only map their
options onto them; :mod:`dpflow_core.runs.recipe` turns them into a :class:`~dpflow_core.runs.spec.RunSpec`
and runs it.

The mapping is declared here, once, in each field's metadata (:func:`front_ends`):

* ``option``: the command-line flag of ``dpflow smoke`` / ``dpflow train``;
* ``config``: the field of the asset's Dagster config;
* ``scale``: False when ``dpflow scale`` leaves it out (GPU ids and process counts: the cluster's
  scheduler or the lab.yaml choose them);
* ``unset``: the Dagster config value that means None (Dagster configs hold no None: ``0`` or ``-1``);
* ``help``: the CLI help and the Dagster description (:mod:`dpflow_core.settings`).

A test reads this metadata and fails when a field lacks its option or its config field.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from dpflow_core.errors import RunError
from dpflow_core.names import validate_name
from dpflow_core.runs.spec import DEFAULT_TRAIN_COMMAND, TRAIN_COMMAND_PRESETS
from dpflow_core.settings import front_ends  # noqa: F401 (re-exported for the front ends)
from dpflow_core.settings import setting as shared_setting

_CONFIG_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
TRAIN_COMMAND_HELP = (
    "Train command template (default: the built-in trainer). Placeholders: {run_dir}, {dataset}, "
    "{overrides}, {num_processes}, {gpu_ids}, {config_name}; the overrides are appended when not placed. "
    "'upstream' is 'train.py --config-name={config_name}' (a Diffusion Policy / UMI checkout as the server's repo; "
    "give the config name, e.g. train_diffusion_unet_timm_umi_workspace). A template starting with "
    "'accelerate' is the whole command."
)
#: Seconds a training run on a Slurm cluster or several hosts is followed when no timeout is given.
SCALED_TRAIN_TIMEOUT_S = 86400.0


def setting(default: Any, option: str, config: str, help: str = "", *, scale: bool = True, unset: Any = None,
            **extra: Any) -> Any:
    """A run settings field (:func:`dpflow_core.settings.setting`) with ``scale`` and ``unset`` (module doc)."""
    return shared_setting(default, option, config, help, scale=scale, unset=unset, **extra)


def gpu_ids_of(value: Any) -> tuple[int, ...]:
    """GPU indices from None, one index, ``"0,1"`` or a sequence of indices.

    Raises:
        RunError: ``bad_config`` for text that is not comma-separated integers.
    """
    if value is None or value == "":
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, str):
        try:
            return tuple(int(part) for part in value.split(",") if part.strip())
        except ValueError:
            raise RunError(f"gpu ids {value!r}: expected comma-separated GPU indices like 0,1", code="bad_config") from None
    return tuple(int(i) for i in value)


def _positive(name: str, value: Any, *, minimum: float = 1) -> None:
    if value is not None and (not isinstance(value, (int, float)) or not math.isfinite(value) or value < minimum):
        raise RunError(f"{name} must be a number >= {minimum:g}, got {value!r}", code="bad_config")


@dataclass(frozen=True)
class RunSettings:
    """What both run kinds take.

    Attributes:
        run_name: the run's name; empty: ``<kind>-<sha256[:12]>-<UTC time>`` (a training run of one server
            first re-attaches to this dataset's running ``train-<sha256[:12]>-*`` run).
        config_name: the trainer's ``--config-name``; ``auto``: :data:`~dpflow_core.runs.spec.GPU_CONFIG_NAME`
            with GPUs, :data:`~dpflow_core.runs.spec.CPU_CONFIG_NAME` without (a cluster: by ``slurm.gpus_per_node``).
        gpu_ids: GPU indices to use (empty: free ones from nvidia-smi now); a busy or absent one is refused.
        train_command: the train command template (:func:`~dpflow_core.runs.command.render_train_command`)
            or a preset name (``builtin``, ``upstream``).
        extra_overrides: further Hydra overrides, appended last.
    """

    run_name: str = setting("", "--run-name", "run_name", "Run name (default: <kind>-<sha256[:12]>-<UTC time>; a "
                            "training of one server first re-attaches to this dataset's running train-<sha256[:12]>-* run).")
    config_name: str = setting("auto", "--config-name", "config_name", "Trainer config ('auto': "
                               "train_diffusion_unet_image with GPUs, demo without; on a cluster by slurm.gpus_per_node).")
    gpu_ids: tuple[int, ...] = setting((), "--gpu-ids", "gpu_ids", "GPUs to use, e.g. 0,1 (default: free ones from "
                                       "nvidia-smi now); busy or absent ones are refused, and any on a Slurm cluster.",
                                       scale=False)
    train_command: str = setting(DEFAULT_TRAIN_COMMAND, "--train-command", "train_command", TRAIN_COMMAND_HELP)
    extra_overrides: tuple[str, ...] = setting((), "--override", "extra_overrides",
                                               "Extra Hydra override, appended last (repeatable).", repeat=True)

    def __post_init__(self):
        def set_(name: str, value: Any) -> None:  # frozen: each value is normalised once, here
            object.__setattr__(self, name, value)

        set_("run_name", self.run_name or "")
        if self.run_name:
            validate_name(self.run_name, "run name")
        set_("config_name", self.config_name or "auto")
        if not _CONFIG_NAME.match(self.config_name):
            raise RunError(f"invalid config name {self.config_name!r}", code="bad_config")
        set_("gpu_ids", gpu_ids_of(self.gpu_ids))
        if any(i < 0 for i in self.gpu_ids) or len(set(self.gpu_ids)) != len(self.gpu_ids):
            raise RunError(f"gpu_ids must be distinct indices >= 0, got {list(self.gpu_ids)!r}", code="bad_config")
        train_command = self.train_command or DEFAULT_TRAIN_COMMAND
        set_("train_command", TRAIN_COMMAND_PRESETS.get(train_command, train_command))
        set_("extra_overrides", tuple(self.extra_overrides or ()))

    @classmethod
    def from_options(cls, values: Mapping[str, Any]):
        """The settings from a command's parameters, named as the ``option`` flags (``--gpu-ids`` -> ``gpu_ids``);
        a parameter left out takes the default."""
        names = {f: m["option"].lstrip("-").replace("-", "_") for f, m in front_ends(cls).items()}
        return cls(**{f: values[p] for f, p in names.items() if p in values and values[p] is not None})

    @classmethod
    def from_config(cls, config: Any):
        """The settings from an asset's Dagster config (its ``config`` fields; an ``unset`` value is None)."""
        out = {}
        for name, meta in front_ends(cls).items():
            value = getattr(config, meta["config"])
            out[name] = None if meta["unset"] is not None and value == meta["unset"] else value
        return cls(**out)


@dataclass(frozen=True)
class SmokeSettings(RunSettings):
    """A smoke run (rule 6): one GPU (or the CPU), offline, no resume, few steps, small batch, no checkpoints.

    Attributes:
        gpu_ids: at most one GPU index (flag ``--gpu-id``).
        epochs: ``training.num_epochs`` (>= 1).
        max_train_steps: ``training.max_train_steps``, batches per epoch (>= 1; also caps validation).
        batch_size: ``dataloader.batch_size`` per process (>= 1).
        num_workers: ``dataloader.num_workers`` (>= 0).
        timeout_s: seconds before the smoke run is ended.
        resume_check_epochs, resume_check_steps: the resume-continuity check's runs: epochs (>= 2) of
            this many batches (>= 1) each.
    """

    gpu_ids: tuple[int, ...] = setting((), "--gpu-id", "gpu_ids", "The GPU to use (default: a free one from "
                                       "nvidia-smi now); refused when busy or absent.", scale=False,
                                       cli=(Optional[int], None))
    epochs: int = setting(1, "--epochs", "epochs", "training.num_epochs.")
    max_train_steps: int = setting(3, "--max-train-steps", "max_train_steps", "training.max_train_steps (batches per epoch).")
    batch_size: int = setting(4, "--batch-size", "batch_size", "dataloader.batch_size (per process).")
    num_workers: int = setting(0, "--num-workers", "num_workers", "dataloader.num_workers.")
    timeout_s: float = setting(900.0, "--timeout", "timeout_s", "Seconds before the smoke run is ended.")
    resume_check_epochs: int = setting(2, "--resume-check-epochs", "resume_check_epochs",
                                       "Epochs of the resume-continuity check's runs (at least 2).")
    resume_check_steps: int = setting(2, "--resume-check-steps", "resume_check_steps",
                                      "Batches per epoch of the resume-continuity check's runs.")

    def __post_init__(self):
        super().__post_init__()
        if len(self.gpu_ids) > 1:
            raise RunError(f"a smoke run uses one GPU, got gpu_ids {list(self.gpu_ids)!r}", code="bad_config")
        for name in ("epochs", "max_train_steps", "batch_size", "resume_check_steps"):
            _positive(name, getattr(self, name))
        _positive("num_workers", self.num_workers, minimum=0)
        _positive("resume_check_epochs", self.resume_check_epochs, minimum=2)
        _positive("timeout_s", self.timeout_s, minimum=1e-3)


@dataclass(frozen=True)
class TrainSettings(RunSettings):
    """A training run (rule 8). None keeps the trainer config's value.

    Attributes:
        epochs: ``training.num_epochs`` (>= 1 or None).
        max_train_steps: ``training.max_train_steps``, batches per epoch (>= 1 or None).
        batch_size: ``dataloader.batch_size`` per process (>= 1 or None).
        num_workers: ``dataloader.num_workers`` (>= 0 or None).
        num_processes: processes/GPUs on one server; 0: one per free GPU (1 on the CPU).
        resume: continue ``run_name`` (required) from its verified ``latest.ckpt``.
        logging_mode: ``logging.mode``: ``offline``, ``online`` or ``disabled``.
        poll_s: seconds between polls of ``logs.json.txt`` (one server).
        stall_timeout_s: seconds without a new log line after the first step that count as a stall (one server).
        timeout_s: seconds before following stops; None: until the run ends on one server (re-attach later),
            :data:`SCALED_TRAIN_TIMEOUT_S` on a cluster or several hosts, where the run is then ended.
    """

    epochs: int | None = setting(None, "--epochs", "epochs", "training.num_epochs (default: the config's).", unset=0)
    max_train_steps: int | None = setting(None, "--max-train-steps", "max_train_steps",
                                          "training.max_train_steps, batches per epoch (default: the config's).", unset=0)
    batch_size: int | None = setting(None, "--batch-size", "batch_size",
                                     "dataloader.batch_size per process (default: the config's).", unset=0)
    num_workers: int | None = setting(None, "--num-workers", "num_workers",
                                      "dataloader.num_workers (default: the config's).", unset=-1)
    num_processes: int = setting(0, "--num-processes", "num_processes",
                                 "Processes/GPUs on one server (0: one per free GPU; 1 on the CPU).", scale=False)
    resume: bool = setting(False, "--resume", "resume", "Continue the run (--run-name) from its verified latest.ckpt.")
    logging_mode: str = setting("offline", "--logging-mode", "logging_mode", "logging.mode: offline | online | disabled.")
    poll_s: float = setting(5.0, "--poll", "poll_s", "Seconds between polls of logs.json.txt.", scale=False)
    stall_timeout_s: float = setting(900.0, "--stall-timeout", "stall_timeout_s", "Seconds without a new log line "
                                     "(after the first step) that count as a stall.", scale=False)
    timeout_s: float | None = setting(None, "--timeout", "monitor_timeout_s", "Seconds before following stops "
                                      "(default: until the run ends on one server, which keeps running; 86400 on a "
                                      "cluster or hosts, where the run is then ended).", unset=0.0)

    def __post_init__(self):
        super().__post_init__()
        for name in ("epochs", "max_train_steps", "batch_size"):
            _positive(name, getattr(self, name))
        _positive("num_workers", self.num_workers, minimum=0)
        _positive("num_processes", self.num_processes, minimum=0)
        for name in ("poll_s", "stall_timeout_s", "timeout_s"):
            _positive(name, getattr(self, name), minimum=1e-3)
        if self.logging_mode not in ("offline", "online", "disabled"):
            raise RunError(f"logging mode must be offline, online or disabled, got {self.logging_mode!r}", code="bad_config")
        if self.resume and not self.run_name:
            raise RunError("resume needs the run_name (--run-name) of the run to continue", code="bad_config")


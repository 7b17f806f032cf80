"""Run spec and naming: what to train, where the run lives, and the trainer's config name.

Takes a dataset (path and SHA-256 on the server) and the trainer's options; gives a validated
:class:`RunSpec`, the run directory ``<data_root>/runs/<name>/`` and the dataset's frequency (Hz)
read from its metadata.
"""

from __future__ import annotations

import dataclasses
import json
import math
import posixpath
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Literal, Mapping, Sequence

from dpflow_core.errors import DatasetError, RunError
from dpflow_core.logs import is_finite_number
from dpflow_core.names import validate_name
from dpflow_core.server import GpuInventory, GpuServer


RUNS_DIR = "runs"
STATE_DIR = "dpflow"
LOG_NAME = "logs.json.txt"
CHECKPOINT_DIR = "checkpoints"
LATEST_CKPT = "latest.ckpt"
OUTPUT_LOG = "output.log"
HANDLE_NAME = "handle.json"
RECORD_NAME = "record.json"
RELEASE_NAME = "release.json"
TOKEN_ENV = "DPFLOW_RUN_TOKEN"
#: The built-in trainer. ``{config_name}`` and the other placeholders are filled by
#: :func:`render_train_command`; the overrides are appended when not placed.
DEFAULT_TRAIN_COMMAND = "-m dpflow_core.train --config-name={config_name}"
#: An upstream-style repository (Diffusion Policy / UMI checkout on the server, ``repo_path``):
#: its ``train.py`` with a workspace config, run from the repository under ``accelerate launch``,
#: with the procedure's overrides (``task.dataset_path``, ``task.dataset_frequeny``,
#: ``hydra.run.dir``, ``logging.*``, ``training.*``, ``checkpoint.*``) appended.
UPSTREAM_TRAIN_COMMAND = "train.py --config-name={config_name}"
#: Names accepted in place of a template (``--train-command upstream``).
TRAIN_COMMAND_PRESETS = {"builtin": DEFAULT_TRAIN_COMMAND, "upstream": UPSTREAM_TRAIN_COMMAND}
#: Placeholders a train command template may use.
TEMPLATE_FIELDS = ("run_dir", "dataset", "overrides", "num_processes", "gpu_ids", "config_name")
#: Config of the built-in trainer on a GPU server, and on a machine without GPU.
GPU_CONFIG_NAME = "train_diffusion_unet_image"
CPU_CONFIG_NAME = "demo"
#: What a run without GPU says in place of the GPU release check (a WARN, never a plain pass).
CPU_RUN_NOTE = "CPU run: GPU release not checked"
_HYDRA_SAFE = re.compile(r"^[A-Za-z0-9_./~:@+-]*$")


def is_builtin_trainer(train_command: str) -> bool:
    """True when the train command template runs the built-in trainer (``-m dpflow_core.train``)."""
    words = TRAIN_COMMAND_PRESETS.get(train_command, train_command).split()
    return any(a == "-m" and b == "dpflow_core.train" for a, b in zip(words, words[1:]))


def utc_now() -> str:
    """Current UTC time as ISO 8601 with seconds (``2025-01-31T12:00:00+00:00``)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# --------------------------------------------------------------------------- identity


def default_run_name(dataset_sha256: str, kind: str, now: datetime | None = None) -> str:
    """``<kind>-<sha256[:12]>-<UTC YYYYmmddTHHMMSSZ>``: unique per dataset and second."""
    now = now or datetime.now(timezone.utc)
    return validate_name(f"{kind}-{(dataset_sha256 or 'nodata')[:12]}-{now:%Y%m%dT%H%M%SZ}", "run name")


def runs_root(server: GpuServer) -> str:
    """``<data_root>/runs`` on the server (absolute)."""
    return posixpath.join(server.data_root, RUNS_DIR)


def run_dir_for(server: GpuServer, name: str) -> str:
    """The run directory of run ``name`` (absolute; the name is validated)."""
    return posixpath.join(runs_root(server), validate_name(name, "run name"))


def hydra_value(value: Any) -> str:
    """A value as a Hydra override accepts it (quoted when it holds special characters)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    text = str(value)
    if _HYDRA_SAFE.match(text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


@dataclass(frozen=True)
class RunSpec:
    """What to run: the name, the data, the trainer and the overrides dpflow sets.

    Attributes:
        name: the run name (validated).
        kind: ``"smoke"`` (few steps, no checkpoints, offline) or ``"train"``.
        dataset_path: the dataset.npz on the server.
        dataset_sha256: its SHA-256 (recorded; checked on the server before launch when set).
        frequency_hz: the dataset's measured frequency (``task.dataset_frequeny``), Hz.
        config_name: the trainer's ``--config-name``.
        epochs: ``training.num_epochs`` (None: the config's).
        max_train_steps: ``training.max_train_steps``, batches per epoch (None: the config's).
        max_val_steps: ``training.max_val_steps``, validation batches (None: the config's).
        batch_size, num_workers: ``dataloader.*`` and ``val_dataloader.*`` (None: the config's).
        num_processes: processes/GPUs; 0 = one per free GPU (1 without GPU).
        gpu_ids: explicit GPU indices (empty: chosen from the free GPUs of this launch's
            nvidia-smi); a listed id that is busy or absent then is refused.
        train_command: the train command template (see :func:`render_train_command`), or a name
            of :data:`TRAIN_COMMAND_PRESETS` (``builtin``, ``upstream``), replaced by its template.
        resume: continue from ``<run_dir>/checkpoints/latest.ckpt`` (verified first).
        logging_mode: ``logging.mode`` (smoke runs are always ``offline``).
        extra_overrides: further Hydra overrides, appended last.
        save_checkpoints: keep ``checkpoint.*`` as configured (False: no latest, no top-k).
    """

    name: str
    kind: Literal["smoke", "train"]
    dataset_path: str
    frequency_hz: float
    dataset_sha256: str | None = None
    config_name: str = GPU_CONFIG_NAME
    epochs: int | None = None
    max_train_steps: int | None = None
    max_val_steps: int | None = None
    batch_size: int | None = None
    num_workers: int | None = None
    num_processes: int = 0
    gpu_ids: tuple[int, ...] = ()
    train_command: str = DEFAULT_TRAIN_COMMAND
    resume: bool = False
    logging_mode: str = "offline"
    extra_overrides: tuple[str, ...] = ()
    save_checkpoints: bool = True

    def __post_init__(self):
        validate_name(self.name, "run name")
        if self.train_command in TRAIN_COMMAND_PRESETS:
            object.__setattr__(self, "train_command", TRAIN_COMMAND_PRESETS[self.train_command])
        if self.kind not in ("smoke", "train"):
            raise RunError(f"run kind must be 'smoke' or 'train', got {self.kind!r}", code="bad_config")
        if not math.isfinite(float(self.frequency_hz)) or float(self.frequency_hz) <= 0:
            raise DatasetError(
                f"dataset frequency must be a positive number of Hz (from the dataset's metadata), got {self.frequency_hz!r}",
                path=self.dataset_path,
                code="bad_frequency",
            )
        for key in ("epochs", "max_train_steps", "max_val_steps", "batch_size"):
            value = getattr(self, key)
            if value is not None and int(value) < 1:
                raise RunError(f"{key} must be >= 1 or unset, got {value!r}", code="bad_config")
        if self.num_workers is not None and int(self.num_workers) < 0:
            raise RunError(f"num_workers must be >= 0, got {self.num_workers!r}", code="bad_config")
        if int(self.num_processes) < 0:
            raise RunError(f"num_processes must be >= 0, got {self.num_processes!r}", code="bad_config")
        if self.logging_mode not in ("offline", "online", "disabled"):
            raise RunError(f"logging mode must be offline, online or disabled, got {self.logging_mode!r}", code="bad_config")
        if any(int(i) < 0 for i in self.gpu_ids) or len(set(self.gpu_ids)) != len(self.gpu_ids):
            raise RunError(f"gpu_ids must be distinct indices >= 0, got {list(self.gpu_ids)!r}", code="bad_config")
        if self.kind == "smoke" and len(self.gpu_ids) > 1:
            raise RunError(f"a smoke run uses one GPU, got gpu_ids {list(self.gpu_ids)!r}", code="bad_config")
        if self.kind == "smoke" and self.resume:
            raise RunError("a smoke run never resumes", code="bad_config")
        if not re.match(r"^[A-Za-z0-9_.-]+$", self.config_name):
            raise RunError(f"invalid config name {self.config_name!r}", code="bad_config")

    @property
    def builtin_trainer(self) -> bool:
        """Whether the train command is dpflow's own trainer (``-m dpflow_core.train``)."""
        return "dpflow_core.train" in self.train_command

    def overrides(self, run_dir: str) -> list[str]:
        """The Hydra overrides dpflow passes (the trainer's ``train.py``-compatible keys).

        ``training.resume`` is ``true`` for every run of an upstream-style trainer: Diffusion
        Policy / UMI workspaces resume only when ``<hydra.run.dir>/checkpoints/latest.ckpt``
        exists (never the case in a new run directory), and UMI's workspace leaves the optimizer
        state out of its checkpoints when ``training.resume`` is false, which would make every
        checkpoint unable to resume. The built-in trainer refuses ``resume=true`` without a
        checkpoint, so it gets ``self.resume``.
        """
        out = [
            f"task.dataset_path={hydra_value(self.dataset_path)}",
            f"task.dataset_frequeny={float(self.frequency_hz):.10g}",
            f"hydra.run.dir={hydra_value(run_dir)}",
            f"logging.mode={'offline' if self.kind == 'smoke' else self.logging_mode}",
            f"logging.name={self.name}",
            f"training.resume={hydra_value(bool(self.resume) or not self.builtin_trainer)}",
        ]
        if self.epochs is not None:
            out.append(f"training.num_epochs={int(self.epochs)}")
        if self.max_train_steps is not None:
            out.append(f"training.max_train_steps={int(self.max_train_steps)}")
        if self.max_val_steps is not None:
            out.append(f"training.max_val_steps={int(self.max_val_steps)}")
        if self.batch_size is not None:
            out += [f"dataloader.batch_size={int(self.batch_size)}", f"val_dataloader.batch_size={int(self.batch_size)}"]
        if self.num_workers is not None:
            out += [f"dataloader.num_workers={int(self.num_workers)}", f"val_dataloader.num_workers={int(self.num_workers)}"]
        if self.kind == "smoke" or not self.save_checkpoints:
            out += ["checkpoint.save_last_ckpt=false", "checkpoint.topk.k=0"]
        return out + list(self.extra_overrides)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable form."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RunSpec":
        """Inverse of :meth:`to_dict`."""
        values = dict(data)
        values["extra_overrides"] = tuple(values.get("extra_overrides", ()))
        values["gpu_ids"] = tuple(int(i) for i in values.get("gpu_ids", ()))
        return cls(**values)


def dataset_frequency(server: GpuServer, dataset_path: str, timeout_s: float = 120.0) -> float:
    """The measured frequency (Hz) recorded in the dataset, read on the server.

    A ``dataset.npz``: its ``meta__info_json`` member; a UMI ``dataset.zarr.zip`` (``dpflow
    export-umi``, a zip holding a zarr format 2 root ``.zgroup``): its root ``.zattrs``.

    Raises:
        DatasetError: when the file is missing or its metadata has no positive ``frequency_hz``.
    """
    script = (
        "import json, sys, zipfile, numpy as np\n"
        "p = sys.argv[1]\n"
        "z = zipfile.ZipFile(p) if zipfile.is_zipfile(p) else None\n"
        "if z is not None and '.zgroup' in z.namelist():\n"
        "    attrs = json.loads(z.read('.zattrs')) if '.zattrs' in z.namelist() else {}\n"
        "    print('DPFLOW_FREQ', json.dumps(attrs.get('frequency_hz')), 'zarr')\n"
        "    sys.exit(0)\n"
        "a = np.load(p)['meta__info_json']\n"
        "t = a.tobytes().decode() if a.dtype == np.uint8 else (str(a.reshape(-1)[0]) if a.dtype.kind == 'U' else b''.join(a.reshape(-1).tolist()).decode())\n"
        "print('DPFLOW_FREQ', json.dumps(json.loads(t).get('frequency_hz')), 'npz')\n"
    )
    path = server.abspath(dataset_path)
    if server.size(path) is None:
        raise DatasetError("dataset not found on the server", path=path, code="not_found")
    result = server.run(server.python_command(["-c", script, path]), timeout_s=timeout_s)
    line = next((ln for ln in result.stdout.splitlines() if ln.startswith("DPFLOW_FREQ ")), None)
    if not result.ok or line is None:
        raise DatasetError(f"cannot read the dataset metadata: {(result.stderr or result.stdout).strip()[-400:]}", path=path)
    _, text, kind = line.split(" ", 2)
    value = json.loads(text)
    if not is_finite_number(value) or value <= 0:
        where = "the zarr root's .zattrs (write it with dpflow export-umi)" if kind == "zarr" else "meta__info_json"
        raise DatasetError(f"{where} has no positive frequency_hz (got {value!r})", path=path, code="bad_frequency")
    return float(value)


# ---------------------------------------------------------------------- launching


def run_environment(run_dir: str, token: str, spec: RunSpec) -> dict[str, str]:
    """The environment variables a launched run gets on top of the server's (name -> value).

    The run's name and ``token`` (:data:`TOKEN_ENV`, by which cleanup finds its processes), W&B's
    folder ``run_dir`` (offline for a smoke run or ``logging_mode="offline"``), unbuffered Python
    output, Hydra's full errors and PyTorch's expandable CUDA segments. Recorded in ``record.json``
    without the token.
    """
    env = {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "WANDB_DIR": run_dir,
        "DPFLOW_RUN_NAME": spec.name,
        TOKEN_ENV: token,
        "PYTHONUNBUFFERED": "1",
        "HYDRA_FULL_ERROR": "1",
    }
    if spec.kind == "smoke" or spec.logging_mode == "offline":
        env["WANDB_MODE"] = "offline"
    return env


def resolve_config_name(config_name: str, inventory: GpuInventory, server: GpuServer | None = None) -> str:
    """The trainer config to run: ``config_name`` itself unless it is ``auto``.

    ``auto`` -> :data:`GPU_CONFIG_NAME` when nvidia-smi lists GPUs; :data:`CPU_CONFIG_NAME` only on
    the local transport of a server that need not have a GPU (``server`` None counts as such).

    Raises:
        RunError: ``gpu_unavailable`` for ``auto`` on a server without a usable GPU that is
            reached over SSH or must have one, naming what nvidia-smi said.
    """
    if config_name and config_name != "auto":
        return config_name
    if inventory.has_gpus:
        return GPU_CONFIG_NAME
    if server is None or (server.transport == "local" and not server.config.gpu_expected):
        return CPU_CONFIG_NAME
    why = inventory.message or "nvidia-smi lists no GPU"
    raise RunError(
        f"config 'auto' picks the CPU config only on the local transport without GPUs; "
        f"{server.config.describe()} has no usable GPU ({why}): fix the GPU, or name a config explicitly",
        code="gpu_unavailable",
    )

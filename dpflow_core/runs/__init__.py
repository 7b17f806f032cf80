"""Runs on the GPU server: identity, launch, monitoring, and the checks of rules 1 and 5-12.

Run identity (rule 1). A run has one validated name (:func:`dpflow_core.names.validate_name`);
everything else derives from it:

    <data_root>/runs/<name>/                 run directory = Hydra output dir (``hydra.run.dir``)
    <data_root>/runs/<name>/wandb/           W&B files (``WANDB_DIR`` = the run directory)
    <data_root>/runs/<name>/dpflow/launch-<k>/   dpflow's state of launch k: wrapper, PID,
                                             exit status, process output, launch record
    tmux session                             ``<name>`` (``.`` -> ``_``)

A new run refuses an existing directory (the directory is created with a
plain ``mkdir``, which fails when it exists, so two launches cannot both own
it); resume is an explicit choice that first verifies ``latest.ckpt`` is
complete. GPU ids come from the current ``nvidia-smi`` (GPUs without compute
processes), never from an earlier run; the dataset frequency from the
dataset's metadata.

Command. ``accelerate launch --num_processes N --gpu_ids ... --num_machines 1
--dynamo_backend no <train command> <overrides>`` run through the server's
configured Python (``python -m accelerate.commands.launch``, so the launcher is
the one of the training environment). The train command is a template
(:data:`DEFAULT_TRAIN_COMMAND`, the built-in trainer, by default); see
:func:`render_train_command`. Without a GPU the same launcher runs one CPU
process (``--cpu --num_processes 1``): one code path on every machine.

Which processes are the run's. The launch exports a random token
(``DPFLOW_RUN_TOKEN``) that every descendant inherits; a process is this
run's when its ``/proc/<pid>/environ`` holds that exact token, or when it is
in the run's process group or session while the group leader (the wrapper
recorded at launch, identified by PID, start time and command line) is still
alive. Process groups alone are not enough: torch's elastic launcher starts
every multi-GPU worker in a session of its own. A command line that merely
mentions ``train.py`` proves nothing and is never used. Cleanup sends TERM to
each proven process (identity re-read just before the signal), waits, and
sends KILL only to those still alive and still proven; never a broad pkill.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import posixpath
import re
import shlex
import string
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Literal, Mapping, Sequence

from dpflow_core.errors import DatasetError, RemoteError, RunError
from dpflow_core.logs import LogProgress, LogTailer, is_finite_number, parse_log_text
from dpflow_core.names import validate_name
from dpflow_core.preflight import repo_state
from dpflow_core.remote import DetachedProcess, GpuInventory, GpuServer, ProcessInfo

log = logging.getLogger(__name__)

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
#: Placeholders a train command template may use.
TEMPLATE_FIELDS = ("run_dir", "dataset", "overrides", "num_processes", "gpu_ids", "config_name")
#: Config of the built-in trainer on a GPU server, and on a machine without GPU.
GPU_CONFIG_NAME = "train_diffusion_unet_image"
CPU_CONFIG_NAME = "demo"
#: A GPU counts as free when it has no compute process and at most this much memory in use.
FREE_GPU_MAX_USED_MIB = 1024
#: Memory a GPU may still show above its pre-run level and count as released.
GPU_RELEASE_TOLERANCE_MIB = 128

_OOM_PATTERN = re.compile(r"CUDA out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED")
_BATCHES_PATTERN = re.compile(r"(\d+) batches per epoch")
_HYDRA_SAFE = re.compile(r"^[A-Za-z0-9_./~:@+-]*$")
_SIGNAL_NAMES = {1: "SIGHUP", 2: "SIGINT", 6: "SIGABRT", 9: "SIGKILL", 11: "SIGSEGV", 15: "SIGTERM"}


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
        train_command: the train command template (see :func:`render_train_command`).
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
    train_command: str = DEFAULT_TRAIN_COMMAND
    resume: bool = False
    logging_mode: str = "offline"
    extra_overrides: tuple[str, ...] = ()
    save_checkpoints: bool = True

    def __post_init__(self):
        validate_name(self.name, "run name")
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
        if self.kind == "smoke" and self.resume:
            raise RunError("a smoke run never resumes", code="bad_config")
        if not re.match(r"^[A-Za-z0-9_.-]+$", self.config_name):
            raise RunError(f"invalid config name {self.config_name!r}", code="bad_config")

    def overrides(self, run_dir: str) -> list[str]:
        """The Hydra overrides dpflow passes (the trainer's ``train.py``-compatible keys)."""
        out = [
            f"task.dataset_path={hydra_value(self.dataset_path)}",
            f"task.dataset_frequeny={float(self.frequency_hz):.10g}",
            f"hydra.run.dir={hydra_value(run_dir)}",
            f"logging.mode={'offline' if self.kind == 'smoke' else self.logging_mode}",
            f"logging.name={self.name}",
            f"training.resume={hydra_value(bool(self.resume))}",
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
        return cls(**values)


def smoke_spec(
    name: str,
    dataset_path: str,
    frequency_hz: float,
    *,
    dataset_sha256: str | None = None,
    config_name: str = GPU_CONFIG_NAME,
    epochs: int = 1,
    max_train_steps: int = 3,
    batch_size: int = 4,
    num_workers: int = 0,
    train_command: str = DEFAULT_TRAIN_COMMAND,
    extra_overrides: Sequence[str] = (),
) -> RunSpec:
    """A smoke run (rule 6): one GPU, offline logging, no resume, few steps, small batch, no checkpoints."""
    return RunSpec(
        name=name, kind="smoke", dataset_path=dataset_path, frequency_hz=frequency_hz, dataset_sha256=dataset_sha256,
        config_name=config_name, epochs=epochs, max_train_steps=max_train_steps, max_val_steps=max_train_steps,
        batch_size=batch_size, num_workers=num_workers, num_processes=1, train_command=train_command, resume=False,
        logging_mode="offline", extra_overrides=tuple(extra_overrides), save_checkpoints=False,
    )


def dataset_frequency(server: GpuServer, dataset_path: str, timeout_s: float = 120.0) -> float:
    """The measured frequency (Hz) recorded in the dataset's ``meta__info_json`` member, read on the server.

    Raises:
        DatasetError: when the file is missing or its metadata has no positive ``frequency_hz``.
    """
    script = (
        "import json, sys, numpy as np\n"
        "a = np.load(sys.argv[1])['meta__info_json']\n"
        "t = a.tobytes().decode() if a.dtype == np.uint8 else (str(a.reshape(-1)[0]) if a.dtype.kind == 'U' else b''.join(a.reshape(-1).tolist()).decode())\n"
        "print('DPFLOW_FREQ', json.dumps(json.loads(t).get('frequency_hz')))\n"
    )
    path = server.abspath(dataset_path)
    if server.size(path) is None:
        raise DatasetError("dataset not found on the server", path=path, code="not_found")
    result = server.run(server.python_command(["-c", script, path]), timeout_s=timeout_s)
    line = next((ln for ln in result.stdout.splitlines() if ln.startswith("DPFLOW_FREQ ")), None)
    if not result.ok or line is None:
        raise DatasetError(f"cannot read the dataset metadata: {(result.stderr or result.stdout).strip()[-400:]}", path=path)
    value = json.loads(line.split(" ", 1)[1])
    if not is_finite_number(value) or value <= 0:
        raise DatasetError(f"meta__info_json has no positive frequency_hz (got {value!r})", path=path, code="bad_frequency")
    return float(value)


# ---------------------------------------------------------------------------- GPUs


def free_gpus(inventory: GpuInventory, max_used_mib: int = FREE_GPU_MAX_USED_MIB) -> list[int]:
    """Indices of GPUs with no compute process and at most ``max_used_mib`` MiB in use (from nvidia-smi)."""
    if inventory.status != "ok":
        return []
    out = []
    for gpu in inventory.gpus:
        if inventory.processes_on(gpu.uuid):
            continue
        if gpu.memory_used_mib is not None and gpu.memory_used_mib > max_used_mib:
            continue
        out.append(gpu.index)
    return out


def choose_gpus(inventory: GpuInventory, num_processes: int) -> list[int]:
    """GPU ids for a run from the current inventory: ``num_processes`` free GPUs (0 = all free ones).

    Returns [] when the server has no GPU (the run then uses one CPU process).

    Raises:
        RunError: ``no_free_gpu`` when GPUs exist but too few are free (naming what runs on them).
    """
    if inventory.status != "ok":
        return []
    free = free_gpus(inventory)
    want = len(free) if num_processes == 0 else int(num_processes)
    if want == 0 or len(free) < want:
        busy = "; ".join(
            f"GPU {g.index}: {g.memory_used_mib} MiB used, processes "
            + (", ".join(f"{p.pid} {p.process_name}" for p in inventory.processes_on(g.uuid)) or "none")
            for g in inventory.gpus if g.index not in free
        )
        raise RunError(
            f"{len(free)} free GPU(s) of {len(inventory.gpus)}, {want or 'at least 1'} needed ({busy})",
            code="no_free_gpu",
        )
    return free[:want]


def gpu_memory(inventory: GpuInventory, indices: Sequence[int]) -> dict[int, int | None]:
    """Memory in use (MiB) of the given GPUs."""
    by_index = {g.index: g for g in inventory.gpus}
    return {i: (by_index[i].memory_used_mib if i in by_index else None) for i in indices}


# ------------------------------------------------------------------------- command


def _main_process_port(name: str) -> int:
    """A rendezvous port derived from the run name (29500-30499), so parallel runs do not collide."""
    return 29500 + int(hashlib.sha256(name.encode()).hexdigest(), 16) % 1000


def launcher_args(num_processes: int, gpu_ids: Sequence[int], run_name: str) -> list[str]:
    """``accelerate launch`` options for N processes on the given GPUs (CPU: one process)."""
    if not gpu_ids:
        return ["--cpu", "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    args = ["--num_processes", str(int(num_processes)), "--gpu_ids", ",".join(str(int(g)) for g in gpu_ids),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    if int(num_processes) > 1:
        args += ["--multi_gpu", "--main_process_port", str(_main_process_port(run_name))]
    return args


def render_train_command(
    template: str,
    *,
    run_dir: str,
    dataset: str,
    overrides: Sequence[str],
    num_processes: int,
    gpu_ids: Sequence[int],
    config_name: str,
) -> str:
    """Fill a train command template; the result is a shell fragment.

    Placeholders: ``{run_dir}``, ``{dataset}``, ``{overrides}`` (all overrides, each
    shell-quoted), ``{num_processes}``, ``{gpu_ids}`` (comma-separated, empty on CPU),
    ``{config_name}``. Values are shell-quoted. When the template does not place
    ``{overrides}`` they are appended. Literal braces are written ``{{`` and ``}}``.

    Raises:
        RunError: for an unknown placeholder or a malformed template.
    """
    fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    unknown = sorted({f for f in fields if f not in TEMPLATE_FIELDS})
    if unknown:
        raise RunError(
            f"unknown placeholder(s) {unknown} in train command {template!r}; allowed: {list(TEMPLATE_FIELDS)}",
            code="bad_template",
        )
    quoted = " ".join(shlex.quote(o) for o in overrides)
    values = {
        "run_dir": shlex.quote(run_dir),
        "dataset": shlex.quote(dataset),
        "overrides": quoted,
        "num_processes": str(int(num_processes)),
        "gpu_ids": shlex.quote(",".join(str(g) for g in gpu_ids)) if gpu_ids else "''",
        "config_name": shlex.quote(config_name),
    }
    try:
        text = template.format(**values)
    except (ValueError, IndexError, KeyError) as exc:
        raise RunError(f"malformed train command template {template!r}: {exc}", code="bad_template") from exc
    if "overrides" not in fields and quoted:
        text = f"{text} {quoted}"
    return text


def is_full_command(template: str) -> bool:
    """True when the template launches by itself (its first word is ``accelerate``)."""
    words = template.split()
    return bool(words) and posixpath.basename(words[0]) == "accelerate"


def build_command(server: GpuServer, spec: RunSpec, run_dir: str, gpu_ids: Sequence[int]) -> tuple[str, list[str], int]:
    """The shell command of a run, its overrides, and the process count.

    ``<activate> && <python> -m accelerate.commands.launch <launcher_args> <train command>``;
    a template starting with ``accelerate`` is the whole command (its placeholders give
    the process count and GPU ids).
    """
    num_processes = len(gpu_ids) if gpu_ids else 1
    overrides = spec.overrides(run_dir)
    train = render_train_command(
        spec.train_command, run_dir=run_dir, dataset=spec.dataset_path, overrides=overrides,
        num_processes=num_processes, gpu_ids=gpu_ids, config_name=spec.config_name,
    )
    if is_full_command(spec.train_command):
        line = train
    else:
        python = " ".join(shlex.quote(w) for w in shlex.split(server.config.python))
        launch = " ".join(shlex.quote(a) for a in ["-m", "accelerate.commands.launch", *launcher_args(num_processes, gpu_ids, spec.name)])
        line = f"{python} {launch} {train}"
    if server.config.activate:
        line = f"{server.config.activate} && {line}"
    return line, overrides, num_processes


# --------------------------------------------------------------------- launch state


@dataclass(frozen=True)
class RunHandle:
    """A launched run, as recorded on the server in ``<state_dir>/handle.json``.

    Attributes:
        spec: what was launched.
        run_dir, state_dir: the run directory and this launch's state folder.
        launch_index: 0 for the first launch, k for the k-th resume.
        token: the value of ``DPFLOW_RUN_TOKEN`` every process of the run inherits.
        gpu_ids: GPUs the run uses (empty: CPU).
        gpu_memory_before_mib: memory in use on those GPUs just before the launch.
        gpu_status: ``ok``, ``no_gpu`` or ``error`` (nvidia-smi at launch).
        num_processes: processes launched.
        command: the full shell command.
        overrides: the Hydra overrides dpflow set.
        started_at: UTC ISO time of the launch.
        detached: the wrapper record (PID, process group, start time, command line, state files).
    """

    spec: RunSpec
    run_dir: str
    state_dir: str
    launch_index: int
    token: str
    gpu_ids: tuple[int, ...]
    gpu_memory_before_mib: dict[int, int | None]
    gpu_status: str
    num_processes: int
    command: str
    overrides: tuple[str, ...]
    started_at: str
    detached: DetachedProcess

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def log_path(self) -> str:
        """``logs.json.txt`` of the run."""
        return posixpath.join(self.run_dir, LOG_NAME)

    @property
    def output_path(self) -> str:
        """The process's stdout and stderr."""
        return self.detached.log_path

    @property
    def checkpoint_dir(self) -> str:
        return posixpath.join(self.run_dir, CHECKPOINT_DIR)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["spec"] = self.spec.to_dict()
        data["detached"] = self.detached.to_dict()
        data["gpu_memory_before_mib"] = {str(k): v for k, v in self.gpu_memory_before_mib.items()}
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RunHandle":
        values = dict(data)
        values["spec"] = RunSpec.from_dict(values["spec"])
        values["detached"] = DetachedProcess.from_dict(values["detached"])
        values["gpu_ids"] = tuple(values["gpu_ids"])
        values["overrides"] = tuple(values["overrides"])
        values["gpu_memory_before_mib"] = {int(k): v for k, v in values["gpu_memory_before_mib"].items()}
        return cls(**values)

    def metadata(self) -> dict[str, Any]:
        """Flat values for asset metadata."""
        return {
            "run_name": self.name,
            "run_dir": self.run_dir,
            "launch_index": self.launch_index,
            "pid": self.detached.pid,
            "pgid": self.detached.leader.pgid,
            "method": self.detached.method,
            "tmux_session": self.detached.tmux_session or "",
            "gpu_ids": ",".join(map(str, self.gpu_ids)) or "cpu",
            "gpu_status": self.gpu_status,
            "num_processes": self.num_processes,
            "command": self.command,
            "started_at": self.started_at,
        }


def _state_dir(run_dir: str, index: int) -> str:
    return posixpath.join(run_dir, STATE_DIR, f"launch-{index}")


def launch_indices(server: GpuServer, run_dir: str) -> list[int]:
    """Indices of the launches recorded in a run directory (sorted)."""
    out = []
    for entry in server.listdir(posixpath.join(run_dir, STATE_DIR)):
        m = re.fullmatch(r"launch-(\d+)", entry)
        if m:
            out.append(int(m.group(1)))
    return sorted(out)


def load_handle(server: GpuServer, name: str, launch_index: int | None = None) -> RunHandle:
    """The record of run ``name``'s latest launch (or of ``launch_index``).

    Raises:
        RunError: ``run_not_found`` when the run was never launched on this server.
    """
    run_dir = run_dir_for(server, name)
    indices = launch_indices(server, run_dir)
    if launch_index is None:
        for index in reversed(indices):
            path = posixpath.join(_state_dir(run_dir, index), HANDLE_NAME)
            if server.size(path):
                launch_index = index
                break
    if launch_index is None:
        raise RunError(f"run {name!r} was never launched on this server", path=run_dir, code="run_not_found")
    path = posixpath.join(_state_dir(run_dir, launch_index), HANDLE_NAME)
    try:
        return RunHandle.from_dict(json.loads(server.read_text(path)))
    except RemoteError as exc:
        raise RunError(f"run {name!r} has no launch record {launch_index}", path=path, code="run_not_found") from exc


def _mkdir_exclusive(server: GpuServer, path: str) -> bool:
    """Create ``path`` (parents first); False when it exists already (atomic on POSIX)."""
    server.mkdir(posixpath.dirname(path))
    return server.run(["mkdir", "--", path]).ok


# ---------------------------------------------------------------- checkpoint probe

_CKPT_PROBE = r"""
import json, sys, zipfile
p = sys.argv[1]
out = {"path": p}
try:
    with zipfile.ZipFile(p) as z:
        bad = z.testzip()
    out["zip_ok"] = bad is None
    if bad is not None:
        out["error"] = "member %s fails its CRC" % bad
except Exception as exc:
    out["zip_ok"] = False
    out["error"] = "%s: %s" % (type(exc).__name__, exc)
if out["zip_ok"]:
    try:
        import torch
        payload = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:
        payload = None
        out["format"] = "foreign"
        out["note"] = "not loadable with weights_only=True (%s); zip integrity verified only" % type(exc).__name__
    if isinstance(payload, dict):
        out["format"] = str(payload.get("format", "foreign"))
        for k in ("epoch", "global_step", "batch_in_epoch", "num_processes"):
            v = payload.get(k)
            if isinstance(v, int):
                out[k] = v
        if payload.get("format") == "dpflow-train-checkpoint":
            try:
                from dpflow_core.train.checkpoint import missing_checkpoint_entries
                out["missing"] = missing_checkpoint_entries(payload)
            except ImportError:
                out["missing"] = [k for k in ("model", "ema", "optimizer", "lr_scheduler", "epoch", "global_step", "rank_states") if k not in payload]
print("DPFLOW_CKPT " + json.dumps(out))
"""


@dataclass(frozen=True)
class CheckpointProbe:
    """Whether a checkpoint file on the server is complete and loadable.

    Attributes:
        path: the file.
        exists: the file is there.
        size_bytes: its size.
        zip_ok: the torch zip container reads and every member passes its CRC.
        format: ``dpflow-train-checkpoint``, or ``foreign`` (another trainer's file,
            checked for container integrity only).
        epoch, global_step: what a dpflow checkpoint says it holds.
        missing: entries a dpflow checkpoint lacks to resume exactly.
        error: why it is not loadable.
    """

    path: str
    exists: bool
    size_bytes: int | None = None
    zip_ok: bool = False
    format: str | None = None
    epoch: int | None = None
    global_step: int | None = None
    missing: tuple[str, ...] = ()
    error: str | None = None
    note: str | None = None

    @property
    def loadable(self) -> bool:
        """True when the file exists, its container is intact and nothing needed is missing."""
        return self.exists and self.zip_ok and not self.missing and self.error is None

    def describe(self) -> str:
        if not self.exists:
            return f"{self.path}: missing"
        if not self.loadable:
            why = self.error or ("missing entries: " + ", ".join(self.missing))
            return f"{self.path} ({self.size_bytes} bytes): not loadable: {why}"
        return f"{self.path} ({self.size_bytes} bytes): loadable, format {self.format}, epoch {self.epoch}, global_step {self.global_step}"


def probe_checkpoint(server: GpuServer, path: str, timeout_s: float = 600.0) -> CheckpointProbe:
    """Check a checkpoint on the server with its own Python: zip CRCs, ``torch.load(weights_only=True)``,
    and for dpflow checkpoints the entries needed to resume (no code from the file runs)."""
    full = server.abspath(path)
    size = server.size(full)
    if size is None:
        return CheckpointProbe(full, False)
    result = server.run(server.python_command(["-c", _CKPT_PROBE, full]), timeout_s=timeout_s)
    line = next((ln for ln in result.stdout.splitlines() if ln.startswith("DPFLOW_CKPT ")), None)
    if line is None:
        why = (result.stderr or result.stdout).strip()[-400:]
        return CheckpointProbe(full, True, size, error=f"probe failed (exit {result.exit_code}): {why}")
    data = json.loads(line.split(" ", 1)[1])
    return CheckpointProbe(
        path=full, exists=True, size_bytes=size, zip_ok=bool(data.get("zip_ok")), format=data.get("format"),
        epoch=data.get("epoch"), global_step=data.get("global_step"), missing=tuple(data.get("missing", ())),
        error=data.get("error"), note=data.get("note"),
    )


# ------------------------------------------------------------------------ records


def _pip_freeze(server: GpuServer) -> list[str] | str:
    result = server.run(server.python_command(["-m", "pip", "freeze", "--all"]), timeout_s=180)
    if not result.ok:
        return f"pip freeze failed (exit {result.exit_code}): {(result.stderr or result.stdout).strip()[-300:]}"
    return [line for line in result.stdout.splitlines() if line.strip()]


def reproducibility_record(server: GpuServer, handle: RunHandle, inventory: GpuInventory) -> dict[str, Any]:
    """The run's reproducibility record at launch (rule 12).

    Repository branch, commit and dirty files (``git`` in the server's ``repo_path``),
    dataset path and SHA-256, the GPU inventory (``nvidia-smi``), installed packages
    (``pip freeze`` of the training interpreter), the full command and overrides,
    the launch time. :func:`finalize_record` adds the end time and exit status.
    """

    repo = repo_state(server, server.config.repo_path)
    host = server.run("uname -n").stdout.strip()
    return {
        "run_name": handle.name,
        "kind": handle.spec.kind,
        "server": server.config.describe(),
        "hostname": host,
        "run_dir": handle.run_dir,
        "launch_index": handle.launch_index,
        "repo": dataclasses.asdict(repo),
        "dataset": {"path": handle.spec.dataset_path, "sha256": handle.spec.dataset_sha256, "frequency_hz": handle.spec.frequency_hz},
        "gpu_ids": list(handle.gpu_ids),
        "nvidia_smi": inventory.to_dict(),
        "pip_freeze": _pip_freeze(server),
        "python": server.config.python,
        "command": handle.command,
        "train_command_template": handle.spec.train_command,
        "overrides": list(handle.overrides),
        "environment": {k: v for k, v in _run_env(handle.run_dir, handle.token, handle.spec).items() if k != TOKEN_ENV},
        "started_at": handle.started_at,
        "ended_at": None,
        "exit_code": None,
    }


def finalize_record(server: GpuServer, handle: RunHandle) -> dict[str, Any]:
    """Add the end time (the exit-status file's mtime) and exit status to the run's record; return it."""
    path = posixpath.join(handle.state_dir, RECORD_NAME)
    record = json.loads(server.read_text(path))
    status = server.detached_status(handle.detached)
    if status.exit_code is not None and record.get("exit_code") is None:
        mtime = server.run(["stat", "-c", "%Y", "--", handle.detached.exit_path])
        ended = (
            datetime.fromtimestamp(int(mtime.stdout.strip()), timezone.utc).isoformat(timespec="seconds")
            if mtime.ok and mtime.stdout.strip().isdigit() else utc_now()
        )
        record.update(exit_code=status.exit_code, ended_at=ended)
        server.write_text(path, json.dumps(record, indent=2) + "\n")
    return record


# ---------------------------------------------------------------------- launching


def _run_env(run_dir: str, token: str, spec: RunSpec) -> dict[str, str]:
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


def _verify_dataset(server: GpuServer, spec: RunSpec) -> None:
    path = server.abspath(spec.dataset_path)
    if server.size(path) is None:
        raise DatasetError("dataset not found on the server", path=path, code="not_found")


def launch_run(
    server: GpuServer,
    spec: RunSpec,
    *,
    method: Literal["auto", "tmux", "setsid"] = "auto",
    record: bool = True,
    inventory: GpuInventory | None = None,
) -> RunHandle:
    """Start a run detached on the server (new run, or an explicit resume).

    A new run creates its run directory exclusively (an existing one is refused);
    a resume requires the directory, no live process of an earlier launch, and a
    complete ``latest.ckpt`` (:func:`probe_checkpoint`). GPUs are chosen from
    ``nvidia-smi`` now (:func:`choose_gpus`; a smoke run takes one). The handle and
    the reproducibility record are written to ``<run_dir>/dpflow/launch-<k>/``.

    Raises:
        RunError: ``run_exists``, ``checkpoint_incomplete``, ``already_running``,
            ``no_free_gpu``, ``bad_template``; DatasetError when the dataset is missing.
    """
    run_dir = run_dir_for(server, spec.name)
    _verify_dataset(server, spec)
    if spec.resume:
        if not server.exists(run_dir):
            raise RunError("resume requested but the run directory does not exist", path=run_dir, code="run_not_found")
        probe = probe_checkpoint(server, posixpath.join(run_dir, CHECKPOINT_DIR, LATEST_CKPT))
        if not probe.loadable:
            raise RunError(f"cannot resume: {probe.describe()}", path=probe.path, code="checkpoint_incomplete")
        indices = launch_indices(server, run_dir)
        if indices:
            try:
                previous = load_handle(server, spec.name, indices[-1])
            except RunError:
                previous = None
            if previous is not None:
                alive = run_processes(server, previous)
                if alive:
                    raise RunError(
                        f"run {spec.name!r} still has processes from launch {previous.launch_index}: "
                        + ", ".join(describe_process(p) for p in alive),
                        path=run_dir, code="already_running",
                    )
        index = (indices[-1] + 1) if indices else 0
        state_dir = _state_dir(run_dir, index)
        if not _mkdir_exclusive(server, state_dir):
            raise RunError("another launch of this run is being prepared", path=state_dir, code="already_running")
    else:
        if not _mkdir_exclusive(server, run_dir):
            raise RunError(
                "the run directory exists already: choose a new run name, or resume explicitly",
                path=run_dir, code="run_exists",
            )
        index = 0
        state_dir = _state_dir(run_dir, index)
        server.mkdir(state_dir)

    inventory = inventory if inventory is not None else server.gpu_inventory()
    gpu_ids = choose_gpus(inventory, 1 if spec.kind == "smoke" else spec.num_processes)
    command, overrides, num_processes = build_command(server, spec, run_dir, gpu_ids)
    token = f"{spec.name}.{uuid.uuid4().hex[:16]}"
    env = _run_env(run_dir, token, spec)
    cwd = server.config.repo_path or run_dir
    before = gpu_memory(inventory, gpu_ids)
    started_at = utc_now()
    detached = server.start_detached(
        spec.name, command, state_dir=state_dir, cwd=cwd, env=env,
        log_path=posixpath.join(state_dir, OUTPUT_LOG), method=method,
    )
    handle = RunHandle(
        spec=spec, run_dir=run_dir, state_dir=state_dir, launch_index=index, token=token, gpu_ids=tuple(gpu_ids),
        gpu_memory_before_mib=before, gpu_status=inventory.status, num_processes=num_processes, command=command,
        overrides=tuple(overrides), started_at=started_at, detached=detached,
    )
    server.write_text(posixpath.join(state_dir, HANDLE_NAME), json.dumps(handle.to_dict(), indent=2) + "\n")
    if record:
        rec = reproducibility_record(server, handle, inventory)
        server.write_text(posixpath.join(state_dir, RECORD_NAME), json.dumps(rec, indent=2) + "\n")
    log.info("launched %s (%s, pid %d) in %s: %s", spec.name, detached.method, detached.pid, run_dir, command)
    return handle


def launch_or_attach(server: GpuServer, spec: RunSpec, **kwargs) -> tuple[RunHandle, bool]:
    """Attach to run ``spec.name`` when it was launched already, else launch it.

    A re-materialization (after the orchestrator died or the SSH connection
    dropped) finds the launch record and follows the running session instead of
    starting a second one. With ``spec.resume`` a finished earlier launch is
    resumed; a running one is attached to.

    Returns:
        (handle, attached): ``attached`` is True when nothing was launched.
    """
    run_dir = run_dir_for(server, spec.name)
    if server.exists(run_dir):
        try:
            handle = load_handle(server, spec.name)
        except RunError:
            handle = None
        if handle is not None:
            status = server.detached_status(handle.detached)
            running = not status.finished and not status.vanished
            if running or not spec.resume:
                return handle, True
    return launch_run(server, spec, **kwargs), False


# ---------------------------------------------------------------------- processes


def describe_process(p: ProcessInfo) -> str:
    """``pid 123 (python -m ...)``: PID and command line (or short name) of a process."""
    cmd = " ".join(p.cmdline)[:160] if p.cmdline else p.comm
    return f"pid {p.pid} ({cmd})"


def token_pids(server: GpuServer, token: str) -> set[int]:
    """PIDs whose environment holds ``DPFLOW_RUN_TOKEN=<token>`` exactly (own processes only are readable)."""
    pattern = shlex.quote(f"{TOKEN_ENV}={token}")
    result = server.run(f"grep -l -z -x -F -e {pattern} /proc/[0-9]*/environ 2>/dev/null; true")
    out = set()
    for line in result.stdout.splitlines():
        m = re.fullmatch(r"/proc/(\d+)/environ", line.strip())
        if m:
            out.add(int(m.group(1)))
    return out


def run_processes(server: GpuServer, handle: RunHandle) -> list[ProcessInfo]:
    """Live processes proven to be this run's (see the module docstring), with command lines.

    A process qualifies when its environment holds the run's token, or when it
    shares the run's process group or session while the wrapper (PID, start time,
    command line recorded at launch) is alive. Processes started before the
    wrapper never qualify.
    """
    leader = handle.detached.leader
    current = server.process_info(leader.pid)
    leader_alive = current is not None and current.alive and current.same_process(leader)
    candidates = set(token_pids(server, handle.token))
    if leader_alive:
        candidates |= {p.pid for p in server.list_processes() if p.alive and (p.pgid == leader.pgid or p.sid == leader.sid)}
    out = []
    for pid in sorted(candidates):
        info = server.process_info(pid)
        if info is None or not info.alive:
            continue
        if leader.start_ticks and info.start_ticks < leader.start_ticks:
            continue
        out.append(info)
    return out


@dataclass(frozen=True)
class CleanupReport:
    """What :func:`cleanup_run` signalled.

    Attributes:
        terminated: processes sent TERM (``describe_process`` strings).
        killed: processes sent KILL because TERM did not end them.
        remaining: processes of the run still alive afterwards.
    """

    terminated: tuple[str, ...] = ()
    killed: tuple[str, ...] = ()
    remaining: tuple[str, ...] = ()


def cleanup_run(server: GpuServer, handle: RunHandle, *, grace_s: float = 10.0, poll_s: float = 0.25) -> CleanupReport:
    """End this run's processes only: TERM each proven one, wait, KILL those TERM did not end.

    Every signal goes through :meth:`GpuServer.signal_process`, which re-reads the
    PID's start time and command line and refuses a process that is not the one
    found; before KILL, membership is proven again.
    """
    targets = run_processes(server, handle)
    terminated = [describe_process(p) for p in targets if server.signal_process(p, "TERM")]
    deadline = time.monotonic() + grace_s
    left = targets
    while left and time.monotonic() < deadline:
        time.sleep(poll_s)
        proven = {p.pid: p for p in run_processes(server, handle)}
        left = [p for p in targets if p.pid in proven and proven[p.pid].same_process(p)]
    killed = []
    if left:
        proven = {p.pid: p for p in run_processes(server, handle)}
        for p in left:
            if p.pid in proven and proven[p.pid].same_process(p) and server.signal_process(p, "KILL"):
                killed.append(describe_process(p))
        time.sleep(0.5)
    remaining = [describe_process(p) for p in run_processes(server, handle)]
    return CleanupReport(tuple(terminated), tuple(killed), tuple(remaining))


# --------------------------------------------------------------------- release check


@dataclass(frozen=True)
class ReleaseReport:
    """The "released" check after a run (rule 7).

    Attributes:
        passed: no process of the run was left and every GPU it used is back to its
            pre-run memory (within :data:`GPU_RELEASE_TOLERANCE_MIB`).
        leftovers: processes of the run found alive (``describe_process`` strings).
        leftover_pids: their PIDs.
        gpu_status: ``ok``, ``no_gpu`` (then memory was not checked: "no GPU present") or ``error``.
        gpus: per GPU used: index, memory before and after (MiB), released.
        gpu_processes: compute processes still on those GPUs (``pid name MiB``).
        message: one line for humans.
        cleanup: what was signalled afterwards, when cleanup was asked for.
    """

    passed: bool
    leftovers: tuple[str, ...]
    leftover_pids: tuple[int, ...]
    gpu_status: str
    gpus: tuple[dict[str, Any], ...]
    gpu_processes: tuple[str, ...]
    message: str
    cleanup: CleanupReport | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ReleaseReport":
        values = dict(data)
        cleanup = values.pop("cleanup", None)
        for key in ("leftovers", "leftover_pids", "gpus", "gpu_processes"):
            values[key] = tuple(values.get(key, ()))
        return cls(**values, cleanup=CleanupReport(**{k: tuple(v) for k, v in cleanup.items()}) if cleanup else None)

    def metadata(self) -> dict[str, Any]:
        """Flat values for check metadata."""
        out: dict[str, Any] = {
            "leftover_processes": "; ".join(self.leftovers) or "none",
            "gpu_status": self.gpu_status,
            "gpu": "no GPU present" if self.gpu_status == "no_gpu" else (
                "; ".join(f"GPU {g['index']}: {g['before_mib']} -> {g['after_mib']} MiB" for g in self.gpus) or "none used"),
        }
        if self.gpu_processes:
            out["gpu_processes"] = "; ".join(self.gpu_processes)
        if self.cleanup is not None:
            out["cleanup_terminated"] = "; ".join(self.cleanup.terminated) or "none"
            out["cleanup_killed"] = "; ".join(self.cleanup.killed) or "none"
            out["cleanup_remaining"] = "; ".join(self.cleanup.remaining) or "none"
        return out


def check_released(
    server: GpuServer,
    handle: RunHandle,
    *,
    wait_s: float = 10.0,
    poll_s: float = 0.5,
    tolerance_mib: int = GPU_RELEASE_TOLERANCE_MIB,
    cleanup: bool = False,
) -> ReleaseReport:
    """Prove that a finished run left nothing behind (processes, GPU memory).

    Waits up to ``wait_s`` for stragglers and for the driver to release memory,
    then reports what is left. With ``cleanup``, leftovers are then ended with
    :func:`cleanup_run` (the check still fails: the run did leave them).
    """
    deadline = time.monotonic() + wait_s
    while True:
        procs = run_processes(server, handle)
        inventory = server.gpu_inventory() if handle.gpu_ids else None
        gpus_ok = True
        gpu_rows: list[dict[str, Any]] = []
        if inventory is not None and inventory.status == "ok":
            after = gpu_memory(inventory, handle.gpu_ids)
            for index in handle.gpu_ids:
                before = handle.gpu_memory_before_mib.get(index)
                now = after.get(index)
                released = now is not None and (before is None or now <= before + tolerance_mib)
                gpus_ok &= released
                gpu_rows.append({"index": index, "before_mib": before, "after_mib": now, "released": released})
        if (not procs and gpus_ok) or time.monotonic() >= deadline:
            break
        time.sleep(poll_s)

    gpu_procs: list[str] = []
    if inventory is None:
        gpu_status = "no_gpu" if handle.gpu_status != "error" else "error"
        gpu_note = (
            "no GPU present: GPU memory not checked" if gpu_status == "no_gpu"
            else "nvidia-smi failed at launch, the run used the CPU: GPU memory not checked"
        )
    else:
        gpu_status = inventory.status
        if inventory.status == "ok":
            uuids = {g.uuid: g.index for g in inventory.gpus if g.index in handle.gpu_ids}
            gpu_procs = [
                f"pid {p.pid} {p.process_name} {p.used_memory_mib} MiB on GPU {uuids[p.gpu_uuid]}"
                for p in inventory.processes if p.gpu_uuid in uuids
            ]
            gpu_note = "; ".join(
                f"GPU {r['index']} {'released' if r['released'] else 'NOT released'} ({r['before_mib']} -> {r['after_mib']} MiB)"
                for r in gpu_rows
            )
        else:
            gpus_ok = False
            gpu_note = f"nvidia-smi now: {inventory.status}: {inventory.message}"
    leftovers = tuple(describe_process(p) for p in procs)
    passed = not procs and gpus_ok
    parts = [("leftover processes: " + "; ".join(leftovers)) if leftovers else "no process of the run is left", gpu_note]
    if gpu_procs and not gpus_ok:
        parts.append("compute processes on the run's GPUs: " + "; ".join(gpu_procs))
    report = ReleaseReport(
        passed=passed, leftovers=leftovers, leftover_pids=tuple(p.pid for p in procs), gpu_status=gpu_status,
        gpus=tuple(gpu_rows), gpu_processes=tuple(gpu_procs), message="; ".join(parts),
    )
    if cleanup and procs:
        report = dataclasses.replace(report, cleanup=cleanup_run(server, handle))
    return report


def save_release_report(server: GpuServer, handle: RunHandle, report: ReleaseReport) -> str:
    """Store the report next to the launch state (``release.json``); return its path."""
    return server.write_text(posixpath.join(handle.state_dir, RELEASE_NAME), json.dumps(report.to_dict(), indent=2) + "\n")


def load_release_report(server: GpuServer, handle: RunHandle) -> ReleaseReport | None:
    """The report stored by :func:`save_release_report`, or None."""
    path = posixpath.join(handle.state_dir, RELEASE_NAME)
    if not server.size(path):
        return None
    return ReleaseReport.from_dict(json.loads(server.read_text(path)))


# ------------------------------------------------------------------------ OOM advice


def is_out_of_memory(text: str) -> bool:
    """True when a process output shows a CUDA out-of-memory error."""
    return bool(_OOM_PATTERN.search(text or ""))


def oom_advice(
    handle: RunHandle,
    *,
    batch_size: int | None = None,
    val_batch_size: int | None = None,
    gradient_accumulate_every: int | None = None,
    inventory: GpuInventory | None = None,
) -> list[str]:
    """What to try after a CUDA out-of-memory failure, in the manual's order (rule 9).

    Leftovers on the GPUs first, then a smaller per-process batch, then a smaller
    validation batch, then gradient accumulation to keep the effective batch, then
    image/model size; mixed precision last and only where the loop supports its
    scaler. Values come from the run's resolved config when given.
    """
    steps = []
    if inventory is not None and inventory.status == "ok":
        used = [g for g in inventory.gpus if g.index in handle.gpu_ids]
        others = [p for g in used for p in inventory.processes_on(g.uuid)]
        if others:
            steps.append(
                "1. Leftovers first: the run's GPUs still hold "
                + ", ".join(f"pid {p.pid} {p.process_name} ({p.used_memory_mib} MiB)" for p in others)
                + "; end those proven to be yours (the release check names them) before anything else."
            )
        else:
            steps.append("1. Leftovers first: nvidia-smi shows no other process on GPUs "
                         f"{','.join(map(str, handle.gpu_ids))} now; check that none ran there when the run failed.")
    else:
        steps.append("1. Leftovers first: check nvidia-smi for processes already on the run's GPUs before the launch.")
    b = batch_size or handle.spec.batch_size
    steps.append(
        f"2. Smaller per-process batch: dataloader.batch_size={max(1, b // 2)} (now {b})." if b
        else "2. Smaller per-process batch: halve dataloader.batch_size (it is per process)."
    )
    vb = val_batch_size or b
    steps.append(
        f"3. Smaller validation batch: val_dataloader.batch_size={max(1, vb // 2)} (now {vb})." if vb
        else "3. Smaller validation batch: halve val_dataloader.batch_size."
    )
    g = gradient_accumulate_every or 1
    steps.append(
        f"4. Keep the effective batch with gradient accumulation: training.gradient_accumulate_every={2 * g} "
        "together with the halved batch."
    )
    steps.append("5. Image or model size: convert at a smaller --image-size, or shrink policy.unet.down_dims / policy.obs_encoder.")
    steps.append(
        "6. Mixed precision last, and only where the training loop supports its grad scaler: "
        "training.mixed_precision=bf16 (the built-in trainer saves the fp16 scaler for resume)."
    )
    return steps


# -------------------------------------------------------------------------- monitor


@dataclass(frozen=True)
class MonitorResult:
    """How monitoring ended.

    Attributes:
        status: ``finished`` (exit status recorded), ``vanished`` (processes gone without
            one), ``nan`` (non-finite loss), ``stalled`` (no new log line in time),
            ``timeout`` (gave up waiting; the run may still go on).
        exit_code: the recorded exit status, if any.
        progress: the last log figures.
        message: one line for humans.
        stopped: processes ended because of nan/stall (``CleanupReport``), if any.
    """

    status: Literal["finished", "vanished", "nan", "stalled", "timeout"]
    exit_code: int | None
    progress: LogProgress
    message: str
    stopped: CleanupReport | None = None

    @property
    def ok(self) -> bool:
        return self.status == "finished" and self.exit_code == 0


ProgressCallback = Callable[[LogProgress, list[dict[str, Any]]], None]


def _connection_errors() -> tuple[type[BaseException], ...]:
    """What a dropped SSH connection raises: ours, socket errors, and Paramiko's own."""
    errors: tuple[type[BaseException], ...] = (RemoteError, OSError, EOFError)
    try:
        import paramiko

        errors += (paramiko.SSHException,)
    except ImportError:
        pass
    return errors


_CONNECTION_ERRORS = _connection_errors()


def monitor_run(
    server: GpuServer,
    handle: RunHandle,
    *,
    poll_s: float = 5.0,
    stall_timeout_s: float = 900.0,
    timeout_s: float | None = None,
    on_progress: ProgressCallback | None = None,
    stop_on_failure: bool = True,
    reconnect_attempts: int = 5,
) -> MonitorResult:
    """Follow a run until it ends: tail ``logs.json.txt``, detect NaN and stalls.

    The log is read incrementally from the start (so a re-attached monitor sees the
    whole history). A dropped SSH connection is re-opened (up to
    ``reconnect_attempts`` times in a row). With ``stop_on_failure`` a run with a
    NaN loss or a stall is ended (:func:`cleanup_run`: its own processes only).
    """
    tailer = LogTailer(server, handle.log_path)
    started = time.monotonic()
    failures = 0
    while True:
        try:
            new = tailer.poll()
            status = server.detached_status(handle.detached)
            failures = 0
        except _CONNECTION_ERRORS as exc:
            transient = not isinstance(exc, RemoteError) or exc.code in ("unreachable", "ssh_failed", "command_failed")
            if not transient or failures >= reconnect_attempts:
                raise
            failures += 1
            log.warning("lost the server while monitoring %s (%s); reconnecting (%d/%d)", handle.name, exc, failures, reconnect_attempts)
            server.close()
            time.sleep(min(30.0, poll_s * failures))
            continue
        p = tailer.progress
        if new and on_progress is not None:
            on_progress(p, new)
        if p.nonfinite is not None and not status.finished:
            stopped = cleanup_run(server, handle) if stop_on_failure else None
            return MonitorResult("nan", None, p, f"non-finite loss at global_step {p.nonfinite.get('global_step')}: {p.nonfinite}", stopped)
        if status.finished and not status.leader_alive:
            tailer.poll()
            p = tailer.progress
            return MonitorResult("finished", status.exit_code, p, describe_exit(status.exit_code))
        if status.vanished:
            tailer.poll()
            return MonitorResult("vanished", None, tailer.progress,
                                 "the run's processes are gone but no exit status was recorded (killed with the wrapper: SIGKILL, OOM killer or reboot)")
        if tailer.stalled(stall_timeout_s):
            stopped = cleanup_run(server, handle) if stop_on_failure else None
            return MonitorResult("stalled", None, p, f"no new log line for {stall_timeout_s:.0f} s after global_step {p.global_step}", stopped)
        if timeout_s is not None and time.monotonic() - started > timeout_s:
            return MonitorResult("timeout", None, p, f"still running after {timeout_s:.0f} s of monitoring")
        time.sleep(poll_s)


def describe_exit(code: int | None) -> str:
    """``exit status 0``, ``exit status 143 (killed by SIGTERM)``, ..."""
    if code is None:
        return "no exit status recorded"
    if code > 128 and code - 128 in _SIGNAL_NAMES:
        return f"exit status {code} (killed by {_SIGNAL_NAMES[code - 128]})"
    if code < 0 and -code in _SIGNAL_NAMES:
        return f"exit status {code} (killed by {_SIGNAL_NAMES[-code]})"
    return f"exit status {code}"


# ------------------------------------------------------------------------ smoke run


@dataclass(frozen=True)
class SmokeResult:
    """Outcome of :func:`run_smoke`.

    Attributes:
        handle: the launch.
        passed: exit status 0 on its own, at least one finite ``train_loss`` and no checkpoint.
        exit_code: the wrapper's record (None when it timed out or vanished).
        timed_out: the run exceeded the timeout and was ended.
        finite_losses: finite ``train_loss`` values in ``logs.json.txt``.
        checkpoints: checkpoint files found (must be none).
        problems: why it did not pass.
        release: the release check (processes, GPU memory) right after the run.
        oom_advice: steps to try when the output shows CUDA out of memory.
        output_tail: the end of the process output.
        seconds: wall-clock duration.
        progress: the last log figures.
    """

    handle: RunHandle
    passed: bool
    exit_code: int | None
    timed_out: bool
    finite_losses: int
    checkpoints: tuple[str, ...]
    problems: tuple[str, ...]
    release: ReleaseReport
    oom_advice: tuple[str, ...]
    output_tail: str
    seconds: float
    progress: LogProgress

    def metadata(self) -> dict[str, Any]:
        out = {**self.handle.metadata(), **self.progress.to_metadata()}
        out.update(
            passed=self.passed, exit_code=self.exit_code if self.exit_code is not None else -1,
            exit=describe_exit(self.exit_code), timed_out=self.timed_out, finite_losses=self.finite_losses,
            checkpoints_written=len(self.checkpoints), seconds=round(self.seconds, 2),
            released=self.release.passed, release=self.release.message,
        )
        if self.problems:
            out["problems"] = "; ".join(self.problems)
        return out


def list_checkpoints(server: GpuServer, run_dir: str) -> list[str]:
    """``*.ckpt`` file names in ``<run_dir>/checkpoints`` (temporary files excluded)."""
    return [n for n in server.listdir(posixpath.join(run_dir, CHECKPOINT_DIR)) if n.endswith(".ckpt") and not n.startswith(".")]


def run_smoke(
    server: GpuServer,
    spec: RunSpec,
    *,
    timeout_s: float = 900.0,
    release_wait_s: float = 10.0,
    cleanup: bool = True,
) -> SmokeResult:
    """Run a smoke run in the foreground and judge it (rules 6 and 7).

    The run is launched detached in its own session (PID and process group recorded
    at launch) and waited for; after ``timeout_s`` its processes are ended. Then the
    release check runs (and, with ``cleanup``, ends leftovers proven to be the
    run's); its report is stored with the launch for the blocking asset check.
    """
    if spec.kind != "smoke":
        raise RunError(f"run_smoke needs a smoke spec, got kind {spec.kind!r}", code="bad_config")
    started = time.monotonic()
    handle = launch_run(server, spec, method="setsid")
    status = server.wait_detached(handle.detached, timeout_s)
    timed_out = not status.finished and not status.vanished
    if timed_out:
        cleanup_run(server, handle)
        status = server.detached_status(handle.detached)
    records = _read_records(server, handle.log_path)
    finite = sum(1 for r in records if not r.get("epoch_summary") and is_finite_number(r.get("train_loss")))
    ckpts = tuple(list_checkpoints(server, handle.run_dir))
    output = _tail(server, handle.output_path)
    problems = []
    if timed_out:
        problems.append(f"did not finish within {timeout_s:.0f} s (its processes were ended)")
    elif status.exit_code is None:
        problems.append("no exit status recorded: the run was killed")
    elif status.exit_code != 0:
        problems.append(f"{describe_exit(status.exit_code)}: {_last_error_line(output)}")
    if finite == 0:
        problems.append(f"no finite train_loss in {handle.log_path}")
    if ckpts:
        problems.append(f"checkpoints were written although disabled: {', '.join(ckpts)}")
    release = check_released(server, handle, wait_s=release_wait_s, cleanup=cleanup)
    save_release_report(server, handle, release)
    finalize_record(server, handle)
    progress = LogTailer(server, handle.log_path)
    progress.poll()
    advice = tuple(oom_advice(handle, inventory=server.gpu_inventory() if handle.gpu_ids else None)) if is_out_of_memory(output) else ()
    return SmokeResult(
        handle=handle, passed=not problems, exit_code=status.exit_code, timed_out=timed_out, finite_losses=finite,
        checkpoints=ckpts, problems=tuple(problems), release=release, oom_advice=advice, output_tail=output[-4000:],
        seconds=time.monotonic() - started, progress=progress.progress,
    )


def _read_records(server: GpuServer, path: str) -> list[dict[str, Any]]:
    if server.size(path) is None:
        return []
    return parse_log_text(server.read_text(path))


def _tail(server: GpuServer, path: str, n_bytes: int = 16 * 1024) -> str:
    try:
        return server.tail(path, n_bytes)
    except RemoteError:
        return ""


def _last_error_line(output: str) -> str:
    lines = [ln.strip() for ln in output.replace("\r", "\n").splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("error:") or "Error" in ln or "error" in ln:
            return ln[:300]
    return lines[-1][:300] if lines else "(no output)"


# --------------------------------------------------------------- natural exit check


def read_run_config(server: GpuServer, run_dir: str) -> dict[str, Any] | None:
    """The resolved config the trainer saved in ``<run_dir>/.hydra/config.yaml`` (None when absent)."""
    import yaml

    path = posixpath.join(run_dir, ".hydra", "config.yaml")
    if server.size(path) is None:
        return None
    try:
        data = yaml.safe_load(server.read_text(path))
    except yaml.YAMLError:
        return None
    return data if isinstance(data, dict) else None


def _select(cfg: Mapping[str, Any] | None, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


@dataclass(frozen=True)
class NaturalExitReport:
    """The "natural exit" check (rule 10).

    Attributes:
        passed: exit status 0 recorded by the wrapper, last logged epoch and global step
            equal to what the config asked, ``latest.ckpt`` present and loadable.
        exit_code: from the wrapper's file (None: running, or killed with the wrapper).
        running: the run has not ended yet.
        expected_epochs, last_epoch: ``training.num_epochs`` and the last logged epoch (0-based).
        batches_per_epoch: from the trainer's output, else from the first epoch's log.
        expected_global_step, last_global_step: ``epochs x batches - 1`` and the last logged one.
        checkpoint: the probe of ``latest.ckpt``.
        problems: the evidence of each failed condition.
        oom_advice: steps to try when the output shows CUDA out of memory.
    """

    passed: bool
    exit_code: int | None
    running: bool
    expected_epochs: int | None
    last_epoch: int | None
    batches_per_epoch: int | None
    expected_global_step: int | None
    last_global_step: int | None
    checkpoint: CheckpointProbe
    problems: tuple[str, ...]
    oom_advice: tuple[str, ...] = ()
    output_tail: str = ""

    def metadata(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "exit": describe_exit(self.exit_code) if not self.running else "still running",
            "expected_epochs": self.expected_epochs if self.expected_epochs is not None else -1,
            "last_epoch": self.last_epoch if self.last_epoch is not None else -1,
            "batches_per_epoch": self.batches_per_epoch if self.batches_per_epoch is not None else -1,
            "expected_global_step": self.expected_global_step if self.expected_global_step is not None else -1,
            "last_global_step": self.last_global_step if self.last_global_step is not None else -1,
            "latest_ckpt": self.checkpoint.describe(),
        }
        if self.problems:
            out["problems"] = "; ".join(self.problems)
        if self.oom_advice:
            out["oom_advice"] = "\n".join(self.oom_advice)
        return out


def check_natural_exit(server: GpuServer, handle: RunHandle) -> NaturalExitReport:
    """Judge completion from the exit status, the config, the log and the checkpoint together."""
    status = server.detached_status(handle.detached)
    running = not status.finished and not status.vanished
    problems: list[str] = []
    output = _tail(server, handle.output_path)
    if running:
        problems.append("the run is still running")
    elif status.exit_code is None:
        problems.append("no exit status recorded: the run was killed together with its wrapper (SIGKILL, OOM killer or reboot)")
    elif status.exit_code != 0:
        problems.append(f"{describe_exit(status.exit_code)}: {_last_error_line(output)}")

    cfg = read_run_config(server, handle.run_dir)
    expected_epochs = _select(cfg, "training.num_epochs")
    if expected_epochs is None:
        expected_epochs = handle.spec.epochs
    records = _read_records(server, handle.log_path)
    steps = [r for r in records if "global_step" in r and is_finite_number(r["global_step"])]
    last_epoch = max((int(r["epoch"]) for r in records if is_finite_number(r.get("epoch"))), default=None)
    last_step = int(steps[-1]["global_step"]) if steps else None
    bpe = None
    m = list(_BATCHES_PATTERN.finditer(output)) or list(_BATCHES_PATTERN.finditer(_head(server, handle.output_path)))
    if m:
        bpe = int(m[-1].group(1))
    else:
        first = next((r for r in records if r.get("epoch_summary") and r.get("epoch") == 0), None)
        if first is not None:
            bpe = int(first["global_step"]) + 1
    expected_step = expected_epochs * bpe - 1 if expected_epochs and bpe else None
    if expected_epochs is None:
        problems.append("cannot tell how many epochs were asked (no .hydra/config.yaml, no epochs in the spec)")
    elif last_epoch != int(expected_epochs) - 1:
        problems.append(f"last logged epoch is {last_epoch}, the config asked for {expected_epochs} (last epoch {int(expected_epochs) - 1})")
    if expected_step is not None and last_step != expected_step:
        problems.append(f"last logged global_step is {last_step}, expected {expected_step} ({expected_epochs} epochs x {bpe} batches - 1)")
    elif expected_step is None and expected_epochs is not None:
        problems.append("cannot tell the batches per epoch (neither the trainer's output nor an epoch-0 summary says)")

    probe = probe_checkpoint(server, posixpath.join(handle.checkpoint_dir, LATEST_CKPT))
    if not probe.loadable:
        problems.append(f"latest.ckpt: {probe.describe()}")
    elif probe.format == "dpflow-train-checkpoint" and expected_epochs is not None and probe.epoch != int(expected_epochs):
        problems.append(f"latest.ckpt holds epoch {probe.epoch}, the config asked for {expected_epochs}")
    advice = ()
    if is_out_of_memory(output):
        advice = tuple(oom_advice(
            handle, batch_size=_select(cfg, "dataloader.batch_size"), val_batch_size=_select(cfg, "val_dataloader.batch_size"),
            gradient_accumulate_every=_select(cfg, "training.gradient_accumulate_every"),
            inventory=server.gpu_inventory() if handle.gpu_ids else None,
        ))
    return NaturalExitReport(
        passed=not problems, exit_code=status.exit_code, running=running,
        expected_epochs=int(expected_epochs) if expected_epochs is not None else None, last_epoch=last_epoch,
        batches_per_epoch=bpe, expected_global_step=expected_step, last_global_step=last_step, checkpoint=probe,
        problems=tuple(problems), oom_advice=advice, output_tail=output[-4000:],
    )


def _head(server: GpuServer, path: str, n_bytes: int = 64 * 1024) -> str:
    try:
        return server.read_from(path, 0, n_bytes).data.decode("utf-8", "replace")
    except RemoteError:
        return ""


# ---------------------------------------------------------------- resume continuity


@dataclass(frozen=True)
class ContinuityReport:
    """The resume-continuity check (rule 11).

    An uninterrupted run saves a checkpoint after each of ``epochs`` epochs (kept as
    top-k files); a second run starts from the first epoch's checkpoint with
    ``training.resume=true`` and the same overrides. The resumed log must continue
    the uninterrupted one: the same global steps and epochs, the same learning
    rates, and losses within ``loss_rtol``.

    Attributes:
        passed: every compared record agrees.
        full_run, resumed_run: the two run names.
        resume_step: global step the resumed run started from.
        compared: records compared.
        max_loss_rel_diff, max_lr_rel_diff: the largest relative differences seen.
        mismatches: the first disagreements (``step N: key a != b``).
        commit: the training repository commit both runs used.
        problems: anything that kept the check from comparing.
    """

    passed: bool
    full_run: str
    resumed_run: str
    resume_step: int | None
    compared: int
    max_loss_rel_diff: float | None
    max_lr_rel_diff: float | None
    mismatches: tuple[str, ...]
    commit: str | None
    problems: tuple[str, ...]

    def metadata(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "full_run": self.full_run, "resumed_run": self.resumed_run,
            "resume_step": self.resume_step if self.resume_step is not None else -1,
            "records_compared": self.compared,
            "max_loss_rel_diff": self.max_loss_rel_diff if self.max_loss_rel_diff is not None else -1.0,
            "max_lr_rel_diff": self.max_lr_rel_diff if self.max_lr_rel_diff is not None else -1.0,
            "commit": self.commit or "",
        }
        if self.mismatches:
            out["mismatches"] = "; ".join(self.mismatches)
        if self.problems:
            out["problems"] = "; ".join(self.problems)
        return out


def _rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def compare_logs(
    full: Sequence[Mapping[str, Any]],
    resumed: Sequence[Mapping[str, Any]],
    resume_step: int,
    *,
    loss_rtol: float = 1e-3,
    lr_rtol: float = 1e-6,
) -> tuple[int, float, float, list[str]]:
    """Compare the resumed log with the uninterrupted one from ``resume_step`` on.

    Records are matched by (``global_step``, summary or not).

    Returns:
        (records compared, max loss relative difference, max lr relative difference,
        mismatch descriptions).
    """
    def key(r):
        return int(r["global_step"]), bool(r.get("epoch_summary"))

    a = {key(r): r for r in full if is_finite_number(r.get("global_step")) and int(r["global_step"]) >= resume_step}
    b = {key(r): r for r in resumed if is_finite_number(r.get("global_step")) and int(r["global_step"]) >= resume_step}
    mismatches = []
    if set(a) != set(b):
        only_a = sorted(set(a) - set(b))[:5]
        only_b = sorted(set(b) - set(a))[:5]
        mismatches.append(f"logged steps differ: only uninterrupted {only_a}, only resumed {only_b}")
    max_loss = max_lr = 0.0
    compared = 0
    for k in sorted(set(a) & set(b)):
        ra, rb = a[k], b[k]
        compared += 1
        if ra.get("epoch") != rb.get("epoch"):
            mismatches.append(f"step {k[0]}: epoch {ra.get('epoch')} != {rb.get('epoch')}")
        for name in ("train_loss", "val_loss"):
            if name in ra or name in rb:
                va, vb = ra.get(name), rb.get(name)
                if not (is_finite_number(va) and is_finite_number(vb)):
                    mismatches.append(f"step {k[0]}: {name} {va} vs {vb}")
                    continue
                d = _rel(float(va), float(vb))
                max_loss = max(max_loss, d)
                if d > loss_rtol:
                    mismatches.append(f"step {k[0]}: {name} {va:.6g} != {vb:.6g} (rel {d:.2e})")
        if "lr" in ra or "lr" in rb:
            va, vb = ra.get("lr"), rb.get("lr")
            d = _rel(float(va), float(vb)) if is_finite_number(va) and is_finite_number(vb) else math.inf
            max_lr = max(max_lr, d)
            if d > lr_rtol:
                mismatches.append(f"step {k[0]}: lr {va} != {vb}")
    return compared, max_loss, max_lr, mismatches


def check_resume_continuity(
    server: GpuServer,
    base: RunSpec,
    *,
    epochs: int = 2,
    steps_per_epoch: int = 3,
    loss_rtol: float = 1e-3,
    timeout_s: float = 900.0,
) -> ContinuityReport:
    """Save -> resume -> continue on the same commit, compared with an uninterrupted run.

    Two runs are derived from ``base`` (its dataset, trainer, config, batch and workers):
    ``<name>-resume-full`` trains ``epochs`` epochs of ``steps_per_epoch`` batches and keeps
    every epoch's checkpoint; ``<name>-resume-cont`` gets the first epoch's checkpoint as
    its ``latest.ckpt`` and resumes to the same end. Both are released afterwards.
    """
    if epochs < 2:
        raise RunError("resume continuity needs at least 2 epochs", code="bad_config")
    ckpt_overrides = (
        "checkpoint.save_last_ckpt=true", f"checkpoint.topk.k={epochs}", "checkpoint.topk.monitor_key=train_loss",
        "checkpoint.topk.mode=min", "training.checkpoint_every=1",
    )
    common = dict(
        kind="train", dataset_path=base.dataset_path, frequency_hz=base.frequency_hz, dataset_sha256=base.dataset_sha256,
        config_name=base.config_name, epochs=epochs, max_train_steps=steps_per_epoch, max_val_steps=steps_per_epoch,
        batch_size=base.batch_size,
        num_workers=base.num_workers, num_processes=1, train_command=base.train_command, logging_mode="offline",
        save_checkpoints=True,
    )
    extra = tuple(o for o in base.extra_overrides if not o.startswith("checkpoint.")) + ckpt_overrides
    full_name = validate_name(f"{base.name}-resume-full", "run name")
    cont_name = validate_name(f"{base.name}-resume-cont", "run name")
    problems: list[str] = []

    commit_before = repo_state(server, server.config.repo_path).commit

    def finish(resume_step=None, compared=0, max_loss=None, max_lr=None, mismatches=()):
        commit_after = repo_state(server, server.config.repo_path).commit
        if commit_before != commit_after:
            problems.append(f"the repository commit changed during the check ({commit_before} -> {commit_after})")
        return ContinuityReport(
            passed=not problems and not mismatches and compared > 0, full_run=full_name, resumed_run=cont_name,
            resume_step=resume_step, compared=compared, max_loss_rel_diff=max_loss, max_lr_rel_diff=max_lr,
            mismatches=tuple(mismatches[:20]), commit=commit_before, problems=tuple(problems),
        )

    full = launch_run(server, RunSpec(name=full_name, extra_overrides=extra, **common), method="setsid", record=False)
    status = _wait_and_release(server, full, timeout_s)
    if status != 0:
        problems.append(f"uninterrupted run {full_name}: {describe_exit(status)}: {_last_error_line(_tail(server, full.output_path))}")
        return finish()
    names = list_checkpoints(server, full.run_dir)
    first = next((n for n in sorted(names) if re.search(r"epoch=0*0\b|epoch=0+-", n)), None)
    if first is None:
        problems.append(f"uninterrupted run kept no first-epoch checkpoint (found {names})")
        return finish()

    cont_dir = run_dir_for(server, cont_name)
    if not _mkdir_exclusive(server, cont_dir):
        raise RunError("the run directory exists already", path=cont_dir, code="run_exists")
    server.mkdir(posixpath.join(cont_dir, CHECKPOINT_DIR))
    server.run(["cp", "--", posixpath.join(full.checkpoint_dir, first), posixpath.join(cont_dir, CHECKPOINT_DIR, LATEST_CKPT)], check=True)
    probe = probe_checkpoint(server, posixpath.join(cont_dir, CHECKPOINT_DIR, LATEST_CKPT))
    if not probe.loadable:
        problems.append(f"first-epoch checkpoint not loadable: {probe.describe()}")
        return finish()
    cont = launch_run(server, RunSpec(name=cont_name, resume=True, extra_overrides=extra, **common), method="setsid", record=False)
    status = _wait_and_release(server, cont, timeout_s)
    if status != 0:
        problems.append(f"resumed run {cont_name}: {describe_exit(status)}: {_last_error_line(_tail(server, cont.output_path))}")
        return finish()
    resume_step = probe.global_step
    full_log = _read_records(server, full.log_path)
    cont_log = _read_records(server, cont.log_path)
    if resume_step is None:
        resume_step = min((int(r["global_step"]) for r in cont_log if is_finite_number(r.get("global_step"))), default=0)
    compared, max_loss, max_lr, mismatches = compare_logs(full_log, cont_log, resume_step, loss_rtol=loss_rtol)
    if compared == 0:
        problems.append("the resumed run logged nothing to compare")
    return finish(resume_step, compared, max_loss, max_lr, mismatches)


def _wait_and_release(server: GpuServer, handle: RunHandle, timeout_s: float) -> int | None:
    status = server.wait_detached(handle.detached, timeout_s)
    if not status.finished:
        cleanup_run(server, handle)
    elif run_processes(server, handle):
        cleanup_run(server, handle)
    return status.exit_code


__all__ = [
    "CheckpointProbe", "CleanupReport", "ContinuityReport", "MonitorResult", "NaturalExitReport", "ReleaseReport",
    "RunHandle", "RunSpec", "SmokeResult", "build_command", "check_natural_exit", "check_released",
    "check_resume_continuity", "choose_gpus", "cleanup_run", "compare_logs", "dataset_frequency", "default_run_name",
    "describe_exit", "finalize_record", "free_gpus", "launch_or_attach", "launch_run", "load_handle", "monitor_run",
    "find_active_runs", "oom_advice", "probe_checkpoint", "render_train_command", "resolve_config_name", "run_disk_usage", "run_dir_for", "run_processes", "run_smoke", "smoke_spec",
]


def resolve_config_name(config_name: str, inventory: GpuInventory) -> str:
    """``auto`` -> :data:`GPU_CONFIG_NAME` when nvidia-smi lists GPUs, else :data:`CPU_CONFIG_NAME`."""
    if config_name and config_name != "auto":
        return config_name
    return GPU_CONFIG_NAME if inventory.status == "ok" and inventory.gpus else CPU_CONFIG_NAME


def find_active_runs(server: GpuServer, prefix: str) -> list[RunHandle]:
    """Handles of runs whose name starts with ``prefix`` and whose latest launch is still running."""
    out = []
    for entry in server.listdir(runs_root(server)):
        if not entry.startswith(prefix):
            continue
        try:
            handle = load_handle(server, entry)
        except (RunError, RemoteError, ValueError, KeyError, TypeError):
            continue
        status = server.detached_status(handle.detached)
        if not status.finished and not status.vanished:
            out.append(handle)
    return out


def run_disk_usage(server: GpuServer, run_dir: str) -> dict[str, int]:
    """``{"run_dir_bytes": ..., "free_bytes": ...}``: the run directory's size and the free disk under it."""
    du = server.run(["du", "-s", "-B1", "--", server.abspath(run_dir)])
    used = int(du.stdout.split()[0]) if du.ok and du.stdout.split() and du.stdout.split()[0].isdigit() else -1
    return {"run_dir_bytes": used, "free_bytes": server.free_disk(run_dir)}

"""nvidia-smi: the GPU inventory, parsed from its CSV output.

Takes the text of ``nvidia-smi --query-gpu=... --format=csv,noheader,nounits`` and of
``--query-compute-apps=...``; gives :class:`GpuInfo` (memory in MiB, utilisation in %),
:class:`GpuProcess` and a :class:`GpuInventory` whose ``status`` says ``no_gpu`` when there is none
and ``error`` when nvidia-smi failed (with the command, its exit status and its output).
:func:`gpu_problem` says why an inventory does not satisfy a server that must have a GPU.

What the real tool does when there is no usable GPU (NVIDIA's nvidia-smi documentation, "RETURN
VALUE"): exit 9 with "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA
driver..." on stdout when the driver is not loaded, exit 6 with "No devices were found" when the
driver sees no GPU; the shell's 127 when the command does not exist.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from dpflow_core.errors import RemoteError


# --------------------------------------------------------------------------- GPUs


@dataclass(frozen=True)
class GpuInfo:
    """One row of ``nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.used,utilization.gpu``.

    Memory in MiB, utilisation in percent; ``None`` where nvidia-smi printed ``[N/A]``
    or ``[Not Supported]``.
    """

    index: int
    uuid: str
    name: str
    memory_total_mib: int | None
    memory_used_mib: int | None
    utilization_pct: int | None


@dataclass(frozen=True)
class GpuProcess:
    """One row of ``nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory,process_name``."""

    pid: int
    gpu_uuid: str
    used_memory_mib: int | None
    process_name: str


@dataclass(frozen=True)
class GpuInventory:
    """GPUs visible on a machine and the compute processes on them.

    Attributes:
        status: ``"ok"`` (nvidia-smi answered and lists GPUs), ``"no_gpu"`` (no nvidia-smi,
            or one that lists none) or ``"error"`` (nvidia-smi failed, e.g. no driver):
            only ``"ok"`` is success.
        gpus, processes: parsed rows (empty unless ``status == "ok"``).
        message: why the status is not ``"ok"`` (command, exit status and output included).
        command: the nvidia-smi command line that was run last.
        exit_code: its exit status (None when nothing ran).
        stderr: its error output (or its standard output when it printed the error there,
            as nvidia-smi does for a driver failure), at most 400 characters.
    """

    status: Literal["ok", "no_gpu", "error"]
    gpus: tuple[GpuInfo, ...] = ()
    processes: tuple[GpuProcess, ...] = ()
    message: str = ""
    command: str = ""
    exit_code: int | None = None
    stderr: str = ""

    @property
    def has_gpus(self) -> bool:
        """True when nvidia-smi answered and listed at least one GPU."""
        return self.status == "ok" and bool(self.gpus)

    def processes_on(self, gpu_uuid: str) -> tuple[GpuProcess, ...]:
        """Compute processes running on the GPU with this UUID."""
        return tuple(p for p in self.processes if p.gpu_uuid == gpu_uuid)

    def to_dict(self) -> dict:
        """Plain JSON-serialisable form."""
        return dataclasses.asdict(self)


def gpu_problem(inventory: GpuInventory, expected: bool) -> str | None:
    """Why ``inventory`` fails a server that must have a GPU, or None when it does not.

    Args:
        inventory: the current nvidia-smi inventory.
        expected: whether a GPU is required (:attr:`ServerConfig.gpu_expected`).

    Returns:
        None when GPUs are listed or none is expected; else one sentence naming the
        nvidia-smi command, its exit status and its output.
    """
    if inventory.has_gpus or not expected:
        return None
    return f"GPU expected on this server but {inventory.message or 'nvidia-smi lists no GPU'}"


GPU_QUERY_ARGS = (
    "--query-gpu=index,uuid,name,memory.total,memory.used,utilization.gpu",
    "--format=csv,noheader,nounits",
)
GPU_APPS_QUERY_ARGS = (
    "--query-compute-apps=pid,gpu_uuid,used_memory,process_name",
    "--format=csv,noheader,nounits",
)


def _csv_int(value: str) -> int | None:
    value = value.strip()
    if not value or value.startswith("[") or value.upper() in ("N/A", "NOT SUPPORTED"):
        return None
    return int(float(value))


def parse_gpu_query(text: str) -> tuple[GpuInfo, ...]:
    """Parse the output of ``nvidia-smi`` with :data:`GPU_QUERY_ARGS`.

    Each line is ``index, uuid, name, memory.total, memory.used, utilization.gpu``
    (``csv,noheader,nounits``: ``", "``-separated, MiB and percent without units).

    Raises:
        RemoteError: for a line that does not have six fields or a bad index.
    """
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 6:
            raise RemoteError(f"unexpected nvidia-smi GPU line {line!r}", code="bad_nvidia_smi")
        # A GPU name could contain a comma: everything between uuid and the last three fields.
        index, gpu_uuid, *name_parts, total, used, util = parts
        try:
            rows.append(
                GpuInfo(
                    index=int(index),
                    uuid=gpu_uuid,
                    name=", ".join(name_parts),
                    memory_total_mib=_csv_int(total),
                    memory_used_mib=_csv_int(used),
                    utilization_pct=_csv_int(util),
                )
            )
        except ValueError as exc:
            raise RemoteError(f"unexpected nvidia-smi GPU line {line!r}: {exc}", code="bad_nvidia_smi") from exc
    return tuple(rows)


def parse_compute_apps(text: str) -> tuple[GpuProcess, ...]:
    """Parse the output of ``nvidia-smi`` with :data:`GPU_APPS_QUERY_ARGS`.

    Each line is ``pid, gpu_uuid, used_memory (MiB), process_name``; the process
    name (last) may itself contain commas. ``No running processes found`` lines
    (older drivers print them) yield nothing.

    Raises:
        RemoteError: for a line that does not parse.
    """
    rows = []
    for line in text.splitlines():
        if not line.strip() or line.strip().lower().startswith("no running"):
            continue
        parts = [p.strip() for p in line.split(",", 3)]
        if len(parts) < 4:
            raise RemoteError(f"unexpected nvidia-smi process line {line!r}", code="bad_nvidia_smi")
        try:
            rows.append(GpuProcess(int(parts[0]), parts[1], _csv_int(parts[2]), parts[3]))
        except ValueError as exc:
            raise RemoteError(f"unexpected nvidia-smi process line {line!r}: {exc}", code="bad_nvidia_smi") from exc
    return tuple(rows)

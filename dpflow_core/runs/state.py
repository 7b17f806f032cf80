"""Launch state on the server: the :class:`RunHandle` of each launch under ``<run_dir>/dpflow/launch-<k>/``.

Takes a server and a run name; gives the handles of its launches (saved as ``handle.json`` at launch),
the active runs with a name prefix (and the one of a dataset to re-attach to), and a run directory's
disk use (bytes).
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
import re
from dataclasses import dataclass
from typing import Any, Mapping

from dpflow_core.errors import RemoteError, RunError
from dpflow_core.server import DetachedProcess, GpuServer
from dpflow_core.runs.spec import CHECKPOINT_DIR, CPU_RUN_NOTE, HANDLE_NAME, LOG_NAME, STATE_DIR, RunSpec, run_dir_for, runs_root


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

    @property
    def wandb_dir(self) -> str:
        """Where W&B writes (``WANDB_DIR`` is the run directory; wandb adds ``wandb/``)."""
        return posixpath.join(self.run_dir, "wandb")

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
            "wandb_dir": self.wandb_dir,
            "gpu_ids": ",".join(map(str, self.gpu_ids)) or "cpu",
            "gpu_status": self.gpu_status,
            "gpu_release": "checked after the run" if self.gpu_ids else CPU_RUN_NOTE,
            "num_processes": self.num_processes,
            "command": self.command,
            "started_at": self.started_at,
        }


def launch_state_dir(run_dir: str, index: int) -> str:
    """The folder of launch ``index`` (0, 1, ... one per start or resume) of the run in ``run_dir``:
    ``<run_dir>/dpflow/launch-<index>``, a POSIX path on the server. Holds that launch's handle."""
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
            path = posixpath.join(launch_state_dir(run_dir, index), HANDLE_NAME)
            if server.size(path):
                launch_index = index
                break
    if launch_index is None:
        raise RunError(f"run {name!r} was never launched on this server", path=run_dir, code="run_not_found")
    path = posixpath.join(launch_state_dir(run_dir, launch_index), HANDLE_NAME)
    try:
        return RunHandle.from_dict(json.loads(server.read_text(path)))
    except RemoteError as exc:
        raise RunError(f"run {name!r} has no launch record {launch_index}", path=path, code="run_not_found") from exc


def mkdir_exclusive(server: GpuServer, path: str) -> bool:
    """Create the folder ``path`` on ``server`` (parents first); False when it exists already.

    The last ``mkdir`` is atomic on POSIX, so of two launches racing for the same run folder or
    launch index exactly one gets True (the claim). Any other failure of that ``mkdir`` is also False.

    Raises:
        RemoteError: the parents could not be created.
    """
    server.mkdir(posixpath.dirname(path))
    return server.run(["mkdir", "--", path]).ok


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


def active_or_new_run_name(server: GpuServer, dataset_sha256: str, kind: str = "train") -> tuple[str, bool]:
    """The run of this dataset to follow: the running ``<kind>-<sha256[:12]>-*`` run, else a new name.

    Returns:
        (name, active): ``active`` is True when a run of this dataset is running now
        (re-attach to it), False for a fresh :func:`~dpflow_core.runs.spec.default_run_name`.

    Raises:
        RunError: ``several_active`` when more than one such run is running (name one).
    """
    from dpflow_core.runs.spec import default_run_name

    active = find_active_runs(server, f"{kind}-{(dataset_sha256 or 'nodata')[:12]}-")
    if len(active) > 1:
        raise RunError(
            f"several {kind} runs of this dataset are running: {sorted(h.name for h in active)}; name the one to follow",
            code="several_active",
        )
    if active:
        return active[0].name, True
    return default_run_name(dataset_sha256, kind), False


def run_disk_usage(server: GpuServer, run_dir: str) -> dict[str, int]:
    """``{"run_dir_bytes": ..., "free_bytes": ...}``: the run directory's size and the free disk under it."""
    du = server.run(["du", "-s", "-B1", "--", server.abspath(run_dir)])
    used = int(du.stdout.split()[0]) if du.ok and du.stdout.split() and du.stdout.split()[0].isdigit() else -1
    return {"run_dir_bytes": used, "free_bytes": server.free_disk(run_dir)}

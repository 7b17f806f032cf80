"""Preflight of the GPU server: is it ready to receive a dataset and train?

Reports the training repository's branch, commit and dirty files; the
Python, torch and CUDA of the configured interpreter; ``nproc``; free disk at
the data root against the dataset size (with margin); whether the dataset is
already there (by its content address); and the GPUs from ``nvidia-smi`` with
what already runs on them.

Problems (the report is not ``ok``): the interpreter does not run, torch
cannot be imported, the dataset does not fit, and, on a server that must have
a GPU (:attr:`~dpflow_core.server.config.ServerConfig.gpu_expected`: the SSH
transport by default, or ``expect_gpu``), a missing or failing nvidia-smi or one
listing no GPU (the command, its exit status and output named). Warnings: no
GPU on a server that need not have one (``no_gpu`` is reported as such, never as
success), CUDA unavailable, processes already on the GPUs, a dirty or missing
repository.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field

from dpflow_core.server.gpu_server import GpuServer
from dpflow_core.server.nvidia_smi import GpuInventory, gpu_problem
from dpflow_core.server.paths import disk_margin_bytes, remote_dataset_path

_PYTHON_PROBE = """\
import json, platform, sys
out = {"python_version": platform.python_version(), "executable": sys.executable}
try:
    import torch
    out["torch_version"] = torch.__version__
    out["cuda_version"] = torch.version.cuda
    out["cuda_available"] = bool(torch.cuda.is_available())
    out["cuda_device_count"] = int(torch.cuda.device_count())
except Exception as exc:
    out["torch_error"] = f"{type(exc).__name__}: {exc}"
print("DPFLOW_PROBE " + json.dumps(out))
"""


@dataclass(frozen=True)
class RepoState:
    """Git state of the training repository on the server.

    Attributes:
        path: the repository path (None when not configured).
        branch: current branch (``HEAD`` when detached), commit: full commit hash.
        dirty_files: ``git status --porcelain`` lines (modified, staged, untracked).
        error: why the state could not be read.
    """

    path: str | None
    branch: str | None = None
    commit: str | None = None
    dirty_files: tuple[str, ...] = ()
    error: str | None = None

    @property
    def dirty(self) -> bool:
        """True when the work tree has changes."""
        return bool(self.dirty_files)


@dataclass(frozen=True)
class PythonEnv:
    """The configured interpreter on the server and its torch.

    Attributes:
        command: the interpreter command as configured.
        executable, python_version: ``sys.executable`` and ``platform.python_version()``.
        torch_version, cuda_version: ``torch.__version__`` and ``torch.version.cuda`` (None for CPU builds).
        cuda_available, cuda_device_count: ``torch.cuda.is_available()``, ``torch.cuda.device_count()``.
        error: why the interpreter or torch could not be probed.
    """

    command: str
    executable: str | None = None
    python_version: str | None = None
    torch_version: str | None = None
    cuda_version: str | None = None
    cuda_available: bool | None = None
    cuda_device_count: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class DiskCheck:
    """Free disk at the data root against what the dataset needs (bytes).

    ``fits`` is None when no dataset size was given.
    """

    path: str
    free_bytes: int
    required_bytes: int | None = None
    fits: bool | None = None


@dataclass(frozen=True)
class PreflightReport:
    """Everything :func:`preflight` found. ``ok`` is False when ``problems`` is not empty.

    ``gpu_expected`` says whether the server had to have a GPU (then a GPU failure is a problem).
    """

    server: str
    transport: str
    hostname: str
    nproc: int | None
    repo: RepoState
    python: PythonEnv
    disk: DiskCheck
    gpus: GpuInventory
    dataset_remote_path: str | None = None
    dataset_present: bool | None = None
    gpu_expected: bool = False
    problems: tuple[str, ...] = ()
    warnings: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        """True when nothing blocks training."""
        return not self.problems

    def to_dict(self) -> dict:
        """Plain JSON-serialisable form."""
        data = asdict(self)
        data["ok"] = self.ok
        return data

    def gpu_markdown(self) -> str:
        """A Markdown table of the GPUs and their compute processes (or the no-GPU reason)."""
        if self.gpus.status != "ok":
            return f"**{self.gpus.status}**: {self.gpus.message}"
        lines = ["| index | name | uuid | memory used / total (MiB) | util % | processes |",
                 "|---|---|---|---|---|---|"]
        for gpu in self.gpus.gpus:
            procs = ", ".join(f"{p.pid} {p.process_name} ({p.used_memory_mib} MiB)" for p in self.gpus.processes_on(gpu.uuid))
            lines.append(
                f"| {gpu.index} | {gpu.name} | {gpu.uuid} | {gpu.memory_used_mib} / {gpu.memory_total_mib} "
                f"| {gpu.utilization_pct} | {procs or '-'} |"
            )
        return "\n".join(lines)

    def to_metadata(self) -> dict[str, object]:
        """Flat ``preflight/...`` values (str, int, float, bool) for asset metadata."""
        meta: dict[str, object] = {
            "preflight/ok": self.ok,
            "preflight/server": self.server,
            "preflight/hostname": self.hostname,
            "preflight/nproc": self.nproc if self.nproc is not None else -1,
            "preflight/repo_branch": self.repo.branch or "",
            "preflight/repo_commit": self.repo.commit or "",
            "preflight/repo_dirty_files": len(self.repo.dirty_files),
            "preflight/python": self.python.python_version or "",
            "preflight/torch": self.python.torch_version or "",
            "preflight/cuda_available": bool(self.python.cuda_available),
            "preflight/cuda_device_count": self.python.cuda_device_count or 0,
            "preflight/disk_free_bytes": self.disk.free_bytes,
            "preflight/gpu_status": self.gpus.status,
            "preflight/gpu_expected": self.gpu_expected,
            "preflight/gpu_count": len(self.gpus.gpus),
            "preflight/gpu_processes": len(self.gpus.processes),
        }
        if self.disk.required_bytes is not None:
            meta["preflight/disk_required_bytes"] = self.disk.required_bytes
        if self.problems:
            meta["preflight/problems"] = "; ".join(self.problems)
        if self.warnings:
            meta["preflight/warnings"] = "; ".join(self.warnings)
        return meta


def repo_state(server: GpuServer, repo: str | None) -> RepoState:
    """Branch, commit and dirty files of the git repository ``repo`` on the server
    (``RepoState.error`` says why when there is none)."""
    if not repo:
        return RepoState(None, error="no repository configured")
    path = server.abspath(repo)
    git = f"git -C {shlex.quote(path)}"
    head = server.run(f"{git} rev-parse --abbrev-ref HEAD && {git} rev-parse HEAD", timeout_s=60)
    if not head.ok:
        return RepoState(path, error=(head.stderr or head.stdout).strip()[-300:] or "not a git repository")
    branch, commit = (head.stdout.split() + ["", ""])[:2]
    status = server.run(f"{git} status --porcelain --untracked-files=normal", timeout_s=120)
    if not status.ok:
        return RepoState(path, branch, commit, error=status.stderr.strip()[-300:])
    return RepoState(path, branch, commit, tuple(line for line in status.stdout.splitlines() if line.strip()))


def _python_env(server: GpuServer, timeout_s: float) -> PythonEnv:
    command = server.config.python
    result = server.run(server.python_command(["-c", _PYTHON_PROBE]), timeout_s=timeout_s)
    line = next((ln for ln in reversed(result.stdout.splitlines()) if ln.startswith("DPFLOW_PROBE ")), None)
    if not result.ok or line is None:
        why = "timed out" if result.timed_out else f"exit {result.exit_code}"
        return PythonEnv(command, error=f"{command!r} did not run ({why}): {(result.stderr or result.stdout).strip()[-300:]}")
    data = json.loads(line.removeprefix("DPFLOW_PROBE "))
    return PythonEnv(
        command=command,
        executable=data.get("executable"),
        python_version=data.get("python_version"),
        torch_version=data.get("torch_version"),
        cuda_version=data.get("cuda_version"),
        cuda_available=data.get("cuda_available"),
        cuda_device_count=data.get("cuda_device_count"),
        error=data.get("torch_error"),
    )


def preflight(
    server: GpuServer,
    *,
    dataset_size_bytes: int | None = None,
    dataset_sha256: str | None = None,
    task: str | None = None,
    python_timeout_s: float = 180.0,
) -> PreflightReport:
    """Inspect the GPU server (see the module docstring for what is checked).

    Args:
        server: the GPU server (local or SSH).
        dataset_size_bytes: size of the dataset to upload; with it the free disk at the
            data root must hold it plus :func:`dpflow_core.server.paths.disk_margin_bytes`.
        dataset_sha256, task: with both, report whether the dataset is already at its
            content-addressed path (present = same size there; the upload hashes it).
        python_timeout_s: limit for the interpreter probe (importing torch), seconds.

    Returns:
        PreflightReport. Never raises for a missing GPU, repository or torch: those are
        reported. Connection errors (unknown host key, unreachable) raise RemoteError.
    """
    problems: list[str] = []
    warnings: list[str] = []
    hostname = server.run("uname -n", check=True).stdout.strip()
    # GNU nproc honours OMP_NUM_THREADS / OMP_THREAD_LIMIT (a thread setting, not the machine's CPUs):
    # without them it counts the processing units this process may run on (its CPU affinity)
    nproc_result = server.run("env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc")
    nproc = int(nproc_result.stdout.strip()) if nproc_result.ok and nproc_result.stdout.strip().isdigit() else None

    repo = repo_state(server, server.config.repo_path)
    if repo.error:
        warnings.append(f"repository: {repo.error}")
    elif repo.dirty:
        warnings.append(f"repository {repo.path} has {len(repo.dirty_files)} uncommitted change(s)")

    python = _python_env(server, python_timeout_s)
    if python.python_version is None:
        problems.append(f"python: {python.error}")
    elif python.torch_version is None:
        problems.append(f"torch: {python.error}")
    elif not python.cuda_available:
        warnings.append("CUDA not available to torch: training would run on the CPU")

    data_root = server.data_root
    free = server.free_disk(data_root)
    disk = DiskCheck(data_root, free)
    if dataset_size_bytes is not None:
        required = int(dataset_size_bytes) + disk_margin_bytes(int(dataset_size_bytes))
        disk = DiskCheck(data_root, free, required, free >= required)
        if not disk.fits:
            problems.append(
                f"disk: dataset needs {required} bytes with margin at {data_root}, only {free} free"
            )

    remote_path = present = None
    if dataset_sha256 and task:
        remote_path = remote_dataset_path(server, task, dataset_sha256)
        size_there = server.size(remote_path)
        present = size_there is not None and (dataset_size_bytes is None or size_there == dataset_size_bytes)

    gpus = server.gpu_inventory()
    gpu_failure = gpu_problem(gpus, server.config.gpu_expected)
    if gpu_failure:
        problems.append(f"gpu: {gpu_failure}")
    elif gpus.status != "ok":
        warnings.append(gpus.message)
    elif gpus.processes:
        busy = sorted({p.gpu_uuid for p in gpus.processes})
        warnings.append(f"{len(gpus.processes)} compute process(es) already on GPU(s) {', '.join(busy)}")

    return PreflightReport(
        server=server.config.describe(), transport=server.transport, hostname=hostname, nproc=nproc,
        repo=repo, python=python, disk=disk, gpus=gpus,
        dataset_remote_path=remote_path, dataset_present=present, gpu_expected=server.config.gpu_expected,
        problems=tuple(problems), warnings=tuple(warnings),
    )


__all__ = ["DiskCheck", "PreflightReport", "PythonEnv", "RepoState", "preflight"]
